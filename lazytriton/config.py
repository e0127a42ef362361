"""Settings: every ``LAZYTRITON_*`` environment variable, in one place.

| variable                 | default                               | meaning                                      |
|--------------------------|---------------------------------------|----------------------------------------------|
| ``LAZYTRITON_CACHE_DIR`` | ``$XDG_CACHE_HOME/lazytriton``        | the local, writable cache (entries, locks)   |
|                          | (``~/.cache/lazytriton``)             |                                              |
| ``LAZYTRITON_IMAGES``    | (none), then images installed beside  | colon-separated image files or folders of    |
|                          | the package (``lazytriton/images``)   | ``*.ltimg``, read-only, searched in order    |
| ``LAZYTRITON_JIT``       | ``1``                                 | ``0``: never compile; a miss raises          |
|                          |                                       | ``KernelNotFound`` naming the variant        |
| ``LAZYTRITON_LOG_LEVEL`` | ``WARNING``                           | level of the ``lazytriton`` logger           |

Settings are read once, on first use (never at import), into a frozen
``Settings``; ``configure(**overrides)`` replaces them for the process (the
function-argument twins of the variables), and ``reset()`` re-reads the
environment, which tests use.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True, slots=True)
class Settings:
    """The typed form of lazytriton's settings."""

    cache_dir: Path
    jit: bool
    log_level: str
    images: tuple[Path, ...] = ()


def _bool_env(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
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


def from_environment() -> Settings:
    """Read the settings from the environment (no caching)."""
    cache_dir = os.environ.get("LAZYTRITON_CACHE_DIR", "").strip()
    level = os.environ.get("LAZYTRITON_LOG_LEVEL", "WARNING").strip().upper() or "WARNING"
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"LAZYTRITON_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}")
    images = tuple(Path(p).expanduser() for p in os.environ.get("LAZYTRITON_IMAGES", "").split(":") if p.strip())
    return Settings(
        cache_dir=Path(cache_dir).expanduser() if cache_dir else _default_cache_dir(),
        jit=_bool_env("LAZYTRITON_JIT", True),
        log_level=level,
        images=images,
    )


_lock = threading.Lock()
_current: Settings | None = None


def settings() -> Settings:
    """The process's settings, read from the environment on first use."""
    global _current
    if _current is None:
        with _lock:
            if _current is None:
                _current = from_environment()
                logging.getLogger("lazytriton").setLevel(_current.log_level)
    return _current


def configure(*, cache_dir: str | os.PathLike[str] | None = None, jit: bool | None = None,
              log_level: str | None = None, images: list[str | os.PathLike[str]] | None = None) -> Settings:
    """Override settings for this process; arguments left None keep their value.

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
    if images is not None:
        changes["images"] = tuple(Path(p).expanduser() for p in images)
    if log_level is not None:
        changes["log_level"] = log_level.upper()
        logging.getLogger("lazytriton").setLevel(log_level.upper())
    with _lock:
        _current = replace(current, **changes)  # type: ignore[arg-type]
    from lazytriton import runtime

    runtime.reset()
    return _current


def reset() -> None:
    """Forget the settings and the runtime; the next use reads the environment again."""
    global _current
    with _lock:
        _current = None
    from lazytriton import runtime

    runtime.reset()
