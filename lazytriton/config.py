"""Settings: every ``LAZYTRITON_*`` environment variable, in one place.

| variable                 | default                               | meaning                                      |
|--------------------------|---------------------------------------|----------------------------------------------|
| ``LAZYTRITON_CACHE_DIR`` | ``$XDG_CACHE_HOME/lazytriton``        | the local, writable cache (entries, locks)   |
|                          | (``~/.cache/lazytriton``)             |                                              |
| ``LAZYTRITON_IMAGES``    | (none), then images installed beside  | colon-separated image files or folders of    |
|                          | the package (``lazytriton/images``)   | ``*.ltimg``, read-only, searched in order    |
| ``LAZYTRITON_JIT``       | ``1``                                 | ``0``: never compile; a miss raises          |
|                          |                                       | ``KernelNotFound`` naming the variant        |
| ``LAZYTRITON_CACHE_MAX_BYTES`` | ``4G``                        | bound on the local cache's size (``500M``,   |
|                          |                                       | ``2G``, bytes): writes past it evict the     |
|                          |                                       | least recently used entries                  |
| ``LAZYTRITON_LOG_LEVEL`` | (none: the application's logging     | level of the ``lazytriton`` logger (DEBUG,   |
|                          | decides; Python's default shows       | INFO, WARNING, ERROR, CRITICAL); with no     |
|                          | WARNING and up)                       | logging configured, it logs to stderr        |
| ``LAZYTRITON_SHARED``    | (none)                                | a tier shared across nodes, after the local  |
|                          |                                       | one: ``file:///dir`` (network filesystem) or |
|                          |                                       | ``redis://host:port/db``; ``?lease_s=30``    |
|                          |                                       | sets the compile lease (store/shared.py)     |
| ``LAZYTRITON_SIGNING_KEY`` | (none)                              | HMAC-SHA256 key (16+ bytes): entries         |
|                          |                                       | published are signed; unsigned or badly      |
|                          |                                       | signed shared entries are refused, rebuilt   |
| ``LAZYTRITON_SHARED_TIMEOUT_MS`` | ``5``                         | timeout of each Redis command; past it, the  |
|                          |                                       | breaker opens and calls go on locally        |
| ``LAZYTRITON_DEBUG``     | (none)                                | ``1``: the ``lazytriton`` command shows an   |
|                          |                                       | error's traceback (read by the command only) |
| ``LAZYTRITON_PREWARM_FORK`` | ``1`` (Linux; elsewhere never)     | ``0``: prewarm's compile workers start as    |
|                          |                                       | fresh interpreters, not forked from its fork |
|                          |                                       | server (read by each build, prewarm/pool.py) |

Settings are read once, on first use (never at import), into a frozen
``Settings``; ``configure(**overrides)`` replaces them for the process (the
function-argument twins of the variables), and ``reset()`` re-reads the
environment, which tests use. A bad value raises ``SettingsError`` (a
``ValueError``) naming the variable, the value and what was expected; the
``lazytriton`` command reports it in one line, exit status 2.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from lazytriton.record import field, record, replace

DEFAULT_CACHE_MAX_BYTES = 4 << 30
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class SettingsError(ValueError):
    """A ``LAZYTRITON_*`` variable with a bad value: a configuration error, not a failure of the work."""


@record
class Settings:
    """The typed form of lazytriton's settings."""

    cache_dir: Path
    jit: bool
    log_level: str | None  # None: not given, the application's logging configuration decides
    images: tuple[Path, ...] = ()
    shared: str | None = None
    signing_key: bytes | None = field(default=None, repr=False)
    shared_timeout_s: float = 0.005
    cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES


def parse_size(text: str, what: str) -> int:
    """A byte count such as ``1048576``, ``500M``, ``2G`` or ``1.5GiB`` (binary units); ValueError naming ``what``."""
    import re

    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", text.strip(), re.I)
    if match is None:
        raise ValueError(f"{what} must be a size such as 500M or 2G, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _cache_max_bytes(value: object, what: str) -> int:
    if isinstance(value, str):
        value = parse_size(value, what)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be a byte count (int) or a size string such as '2G', got {type(value).__name__}")
    if value < 1 << 20:
        raise ValueError(f"{what} must be at least 1M (one entry is up to a few hundred KiB), got {value}")
    return value


def bool_env(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """A yes/no variable of ``environ`` (None: ``os.environ``): ``default`` if unset or blank; ValueError naming it."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be one of 1/0/true/false/yes/no/on/off, got {raw!r}")


def _default_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "lazytriton"


def _shared_env() -> tuple[str | None, bytes | None, float]:
    """LAZYTRITON_SHARED (validated), LAZYTRITON_SIGNING_KEY and LAZYTRITON_SHARED_TIMEOUT_MS."""
    shared = os.environ.get("LAZYTRITON_SHARED", "").strip() or None
    if shared is not None:  # the shared-tier code is imported only when a shared tier is named
        from lazytriton.store.shared import parse_url

        parse_url(shared)
    raw_key = os.environ.get("LAZYTRITON_SIGNING_KEY", "")
    signing_key = None
    if raw_key:
        from lazytriton.cache_format.envelope import check_signing_key

        try:
            signing_key = check_signing_key(raw_key.encode())
        except ValueError as exc:
            raise ValueError(f"LAZYTRITON_SIGNING_KEY: {exc}") from None
    raw_timeout = os.environ.get("LAZYTRITON_SHARED_TIMEOUT_MS", "").strip() or "5"
    try:
        timeout_ms = float(raw_timeout)
    except ValueError:
        timeout_ms = -1.0
    if not 0 < timeout_ms <= 60_000:
        raise ValueError(f"LAZYTRITON_SHARED_TIMEOUT_MS must be a number of milliseconds in (0, 60000], "
                         f"got {raw_timeout!r}")
    return shared, signing_key, timeout_ms / 1000


def check_log_level(value: object, what: str) -> str:
    """``value`` as a logging level name (any case, spaces stripped); ValueError/TypeError naming ``what``."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a level name ({', '.join(LOG_LEVELS)}), got {type(value).__name__}")
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"{what} must be one of {', '.join(LOG_LEVELS)} (any case), got {value!r}")
    return level


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr for the ``lazytriton`` logger while the application has configured no logging.

    Python's last-resort handler shows only WARNING and up, so without this
    ``LAZYTRITON_LOG_LEVEL=DEBUG`` would show nothing. Once the root logger
    has a handler (the application set logging up later), records reach it
    through propagation and this one stays quiet, so nothing prints twice;
    so it does once the ``lazytriton`` logger has a handler of its own.
    """

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger("lazytriton")
        if (logging.getLogger().handlers and logger.propagate) or len(logger.handlers) > 1:
            return
        self.stream = sys.stderr  # the current one (tests and applications swap it)
        super().emit(record)


_stderr_handler: _StderrHandler | None = None


def apply_log_level(level: str | None) -> None:
    """Set the ``lazytriton`` logger's level only when asked (an application's own setting wins otherwise)."""
    global _stderr_handler
    if level is None:
        return
    logger = logging.getLogger("lazytriton")
    logger.setLevel(level)
    if _stderr_handler is None and not logger.hasHandlers():
        _stderr_handler = _StderrHandler()
        _stderr_handler.setFormatter(logging.Formatter("lazytriton: %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(_stderr_handler)


def from_environment() -> Settings:
    """Read the settings from the environment (no caching); SettingsError naming a bad variable."""
    try:
        return _read_environment()
    except (ValueError, TypeError) as exc:
        raise SettingsError(str(exc)) from None


def _read_environment() -> Settings:
    cache_dir = os.environ.get("LAZYTRITON_CACHE_DIR", "").strip()
    raw_level = os.environ.get("LAZYTRITON_LOG_LEVEL", "").strip()
    level = check_log_level(raw_level, "LAZYTRITON_LOG_LEVEL") if raw_level else None
    images = tuple(Path(p).expanduser() for p in os.environ.get("LAZYTRITON_IMAGES", "").split(":") if p.strip())
    shared, signing_key, timeout_s = _shared_env()
    raw_max = os.environ.get("LAZYTRITON_CACHE_MAX_BYTES", "").strip()
    return Settings(
        cache_dir=Path(cache_dir).expanduser() if cache_dir else _default_cache_dir(),
        jit=bool_env("LAZYTRITON_JIT", True),
        log_level=level,
        images=images,
        shared=shared,
        signing_key=signing_key,
        shared_timeout_s=timeout_s,
        cache_max_bytes=_cache_max_bytes(raw_max, "LAZYTRITON_CACHE_MAX_BYTES") if raw_max else DEFAULT_CACHE_MAX_BYTES,
    )


_lock = threading.Lock()
_current: Settings | None = None
# Bumped by configure() and reset(): the runtime compares it with the generation it was built
# for and rebuilds itself (config never imports the runtime; the runtime imports config).
generation = 0


def settings() -> Settings:
    """The process's settings, read from the environment on first use."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = from_environment()
                apply_log_level(_current.log_level)
    return _current


def configure(*, cache_dir: str | os.PathLike[str] | None = None, jit: bool | None = None,
              log_level: str | None = None, images: list[str | os.PathLike[str]] | None = None,
              shared: str | None = None, signing_key: str | bytes | None = None,
              shared_timeout_ms: float | None = None, cache_max_bytes: int | str | None = None) -> Settings:
    """Override settings for this process; arguments left None keep their value.

    ``shared=""`` and ``signing_key=""`` turn the shared tier and signing off.

    Call it before the first attention call: the runtime built from the old
    settings is dropped, so its loaded kernels are reloaded on next use.
    """
    global _current
    current = settings()
    changes: dict[str, object] = {}
    if cache_dir is not None:
        changes["cache_dir"] = Path(cache_dir).expanduser()
    if jit is not None:
        if not isinstance(jit, bool):
            raise TypeError(f"jit must be a bool, got {type(jit).__name__}")
        changes["jit"] = jit
    if cache_max_bytes is not None:
        changes["cache_max_bytes"] = _cache_max_bytes(cache_max_bytes, "cache_max_bytes")
    if images is not None:
        changes["images"] = tuple(Path(p).expanduser() for p in images)
    changes.update(_shared_changes(shared, signing_key, shared_timeout_ms))
    if log_level is not None:
        level = check_log_level(log_level, "log_level")
        changes["log_level"] = level
        apply_log_level(level)
    global generation
    with _lock:
        _current = replace(current, **changes)  # type: ignore[arg-type]
        generation += 1
    return _current


def _shared_changes(shared: str | None, signing_key: str | bytes | None,
                    shared_timeout_ms: float | None) -> dict[str, object]:
    from lazytriton.cache_format.envelope import check_signing_key
    from lazytriton.store.shared import parse_url

    changes: dict[str, object] = {}
    if shared is not None:
        if shared:
            parse_url(shared)
        changes["shared"] = shared or None
    if signing_key is not None:
        key = signing_key.encode() if isinstance(signing_key, str) else signing_key
        changes["signing_key"] = check_signing_key(key) if key else None
    if shared_timeout_ms is not None:
        if isinstance(shared_timeout_ms, bool) or not 0 < shared_timeout_ms <= 60_000:
            raise ValueError(f"shared_timeout_ms must be in (0, 60000] milliseconds, got {shared_timeout_ms!r}")
        changes["shared_timeout_s"] = shared_timeout_ms / 1000
    return changes


def reset() -> None:
    """Forget the settings and the runtime; the next use reads the environment again."""
    global _current, generation
    with _lock:
        _current = None
        generation += 1
