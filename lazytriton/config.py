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
|                          |                                       | ``2G``, bytes; 1M to 1024T): writes past it  |
|                          |                                       | evict the least recently used entries        |
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
| ``LAZYTRITON_HELPERS``   | ``1``                                 | ``0``: the compiled launch helpers are not   |
|                          |                                       | built in the cache dir on first GPU use nor  |
|                          |                                       | loaded from it (read by driver/helpers.py;   |
|                          |                                       | builds in the package folder still load)     |
| ``LAZYTRITON_CODEPACK``  | ``1``                                 | ``0``: a regular install imports its modules |
|                          |                                       | from their files, not its code pack, and     |
|                          |                                       | builds none (read at import, codepack.py)    |

Settings are read once, on first use (never at import), into a frozen
``Settings``; ``configure(**overrides)`` replaces them for the process (the
function-argument twins of the variables), and ``reset()`` re-reads the
environment, which tests use. A bad value raises ``SettingsError`` (a
``ValueError``) naming the variable, the value and what was expected; the
``lazytriton`` command reports it in one line, exit status 2. A path whose
``~user`` cannot be expanded (no such user, no home) is such an error too.
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
# The largest bound accepted: 1024T (2**50 bytes). diskcache keeps sizes in SQLite's signed 64-bit integers,
# and a bound of 2**63 or more made the local tier unusable (an overflow); 2**50 leaves sums of sizes far
# below that, and is past any disk.
MAX_CACHE_MAX_BYTES = 1 << 50
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
    from fractions import Fraction

    match = re.fullmatch(r"(\d{1,30}(?:\.\d{1,30})?)\s*([kmgt]?)(?:i?b)?", text.strip(), re.I)
    if match is None:
        raise ValueError(f"{what} must be a size such as 500M or 2G, got {text[:80]!r}")
    return int(Fraction(match.group(1)) * _UNITS[match.group(2).lower()])  # exact: no float overflow


def _cache_max_bytes(value: object, what: str) -> int:
    if isinstance(value, str):
        value = parse_size(value, what)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be a byte count (int) or a size string such as '2G', got {type(value).__name__}")
    if value < 1 << 20:
        raise ValueError(f"{what} must be at least 1M (one entry is up to a few hundred KiB), got {value}")
    if value > MAX_CACHE_MAX_BYTES:
        raise ValueError(f"{what} must be at most 1024T ({MAX_CACHE_MAX_BYTES} bytes: the local tier's index counts "
                         f"sizes in 64-bit integers), got {value}")
    return value


def expand_path(value: str | os.PathLike[str], what: str) -> Path:
    """``value`` as a Path with ``~``/``~user`` expanded; ValueError naming ``what`` when that cannot be done."""
    try:
        return Path(value).expanduser()
    except RuntimeError:  # no such user, or no home directory to expand ~ to
        head = os.fspath(value).split(os.sep, 1)[0]
        raise ValueError(f"{what}: cannot expand {head!r} in {os.fspath(value)[:200]!r}: no home directory found "
                         "for it; give an absolute path") from None


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
    if xdg:
        return Path(xdg) / "lazytriton"
    try:
        return Path.home() / ".cache" / "lazytriton"
    except RuntimeError:  # no HOME and no home directory for this user
        raise ValueError("LAZYTRITON_CACHE_DIR is not set and there is no home directory for its default "
                         "(~/.cache/lazytriton): set LAZYTRITON_CACHE_DIR or XDG_CACHE_HOME") from None


def _shared_env() -> tuple[str | None, bytes | None, float]:
    """LAZYTRITON_SHARED (validated), LAZYTRITON_SIGNING_KEY and LAZYTRITON_SHARED_TIMEOUT_MS."""
    shared = os.environ.get("LAZYTRITON_SHARED", "").strip() or None
    if shared is not None:  # the shared-tier code is imported only when a shared tier is named
        from lazytriton.store.shared_url import parse_url

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
    images = tuple(expand_path(p, "LAZYTRITON_IMAGES") for p in os.environ.get("LAZYTRITON_IMAGES", "").split(":")
                   if p.strip())
    shared, signing_key, timeout_s = _shared_env()
    raw_max = os.environ.get("LAZYTRITON_CACHE_MAX_BYTES", "").strip()
    return Settings(
        cache_dir=expand_path(cache_dir, "LAZYTRITON_CACHE_DIR") if cache_dir else _default_cache_dir(),
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
        changes["cache_dir"] = expand_path(cache_dir, "cache_dir")
    if jit is not None:
        if not isinstance(jit, bool):
            raise TypeError(f"jit must be a bool, got {type(jit).__name__}")
        changes["jit"] = jit
    if cache_max_bytes is not None:
        changes["cache_max_bytes"] = _cache_max_bytes(cache_max_bytes, "cache_max_bytes")
    if images is not None:
        changes["images"] = tuple(expand_path(p, "images") for p in images)
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
    from lazytriton.store.shared_url import parse_url

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
