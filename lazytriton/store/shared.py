"""Shared tiers: what ``LAZYTRITON_SHARED`` names, and the policy every shared read follows.

``LAZYTRITON_SHARED`` is one URL:

| form                                | tier                                                   |
|-------------------------------------|--------------------------------------------------------|
| ``file:///path/to/dir``             | a directory on a network filesystem (``SharedDirTier``) |
| ``redis://[:password@]host:port/db`` | a Redis server (``RedisTier``; ``rediss://`` for TLS)  |

Query parameters: ``lease_s`` (compile lease time, default 30) for both,
``prefix`` (key prefix, default ``lazytriton``) for Redis; e.g.
``redis://10.0.0.5:6379/0?lease_s=60``.

A shared tier is untrusted input. Every read goes through a ``store.gate.Gate``: the
envelope (``cache_format.envelope``) is checked (bounds, signature when a
signing key is set, bounded decompression, the entry's checksum and key),
and whatever is refused is logged with its reason and counted (``rejected``
for policy refusals, ``corrupt`` for damage) in the node's local counters,
then treated as a miss, so the runtime rebuilds it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import SplitResult, parse_qsl, urlsplit, urlunsplit

from lazytriton.record import record
from lazytriton.store import Tier
from lazytriton.store.gate import Counter
from lazytriton.store.lease import DEFAULT_LEASE_S, Lease

if TYPE_CHECKING:
    from lazytriton.config import Settings

log = logging.getLogger("lazytriton.store.shared")

SCHEMES = ("file", "redis", "rediss")
_PARAMS = {"file": ("lease_s",), "redis": ("lease_s", "prefix"), "rediss": ("lease_s", "prefix")}


class SharedTier(Tier, Protocol):
    """A tier other nodes write too: the Tier protocol, compile leases (of ``lease_s`` seconds), and a close."""

    lease_s: float

    def try_lease(self, key: str) -> Lease | None: ...

    def close(self) -> None: ...


@record
class SharedURL:
    """A parsed ``LAZYTRITON_SHARED``: scheme, where (a path or a Redis URL without our parameters), options."""

    scheme: str
    location: str
    lease_s: float = DEFAULT_LEASE_S
    prefix: str = "lazytriton"


def parse_url(url: str) -> SharedURL:
    """Parse a ``LAZYTRITON_SHARED`` value; raise ValueError naming the variable, the value and what is expected."""
    if not isinstance(url, str):
        raise TypeError(f"LAZYTRITON_SHARED must be a str, got {type(url).__name__}")
    parts = urlsplit(url.strip())
    url = _redacted(parts)  # what error messages show: never a password
    if parts.scheme not in SCHEMES:
        raise ValueError(f"LAZYTRITON_SHARED must start with file://, redis:// or rediss://, got {url!r}")
    if parts.fragment:
        raise ValueError(f"LAZYTRITON_SHARED: no #fragment is expected, got {url!r}")
    options = _options(url, parts.scheme, parts.query)
    lease_s = _lease_s(options.get("lease_s"))
    prefix = options.get("prefix", "lazytriton")
    if not 1 <= len(prefix) <= 64 or not all(c in _PREFIX_CHARS for c in prefix):
        raise ValueError(f"LAZYTRITON_SHARED: prefix must be 1-64 characters of [A-Za-z0-9_-.:], got {prefix!r}")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"LAZYTRITON_SHARED: a shared directory is file:///absolute/path, got {url!r}")
        return SharedURL("file", parts.path, lease_s)
    _check_redis_location(url, parts)
    location = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    return SharedURL(parts.scheme, location, lease_s, prefix)


def _redacted(parts: SplitResult) -> str:
    """The URL with any password replaced by ``***``."""
    if "@" not in parts.netloc:
        return parts.geturl()
    user, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{user.partition(':')[0]}:***@{host}").geturl()


_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.:")
# Redis' own bound on ``databases`` (an int in its config).
_MAX_DB = 2**31 - 1


def _options(url: str, scheme: str, query: str) -> dict[str, str]:
    """The query parameters: each known for ``scheme``, each given once, each ``name=value``."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"LAZYTRITON_SHARED: the query must be name=value pairs joined by &, got {url!r}") from None
    options: dict[str, str] = {}
    for name, value in pairs:
        if name not in _PARAMS[scheme]:
            raise ValueError(f"LAZYTRITON_SHARED: unknown parameter {name!r} in {url!r} "
                             f"(known for {scheme}: {', '.join(_PARAMS[scheme])})")
        if name in options:
            raise ValueError(f"LAZYTRITON_SHARED: parameter {name!r} given twice in {url!r}")
        options[name] = value
    return options


def _lease_s(value: str | None) -> float:
    """The ``lease_s`` parameter: seconds within 0.05..3600 (NaN and infinities are not)."""
    if value is None:
        return DEFAULT_LEASE_S
    try:
        lease_s = float(value)
    except ValueError:
        raise ValueError(f"LAZYTRITON_SHARED: lease_s must be a number of seconds, got {value!r}") from None
    if not 0.05 <= lease_s <= 3600:
        raise ValueError(f"LAZYTRITON_SHARED: lease_s must be within 0.05..3600 seconds, got {value!r}")
    return lease_s


def _check_redis_location(url: str, parts: SplitResult) -> None:
    """A host, a port within 1..65535 (or none: 6379) and a database number (``/0``, or none)."""
    if not parts.hostname:
        raise ValueError(f"LAZYTRITON_SHARED: a Redis URL needs a host, got {url!r}")
    host_port = parts.netloc.rpartition("@")[2]
    port = host_port.rpartition("]")[2].partition(":")[2] if ":" in host_port.rpartition("]")[2] else "6379"
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"LAZYTRITON_SHARED: a Redis port must be a number within 1..65535, got {port!r} in {url!r}")
    db = parts.path[1:] if parts.path.startswith("/") else parts.path
    if db and not (db.isascii() and db.isdigit() and int(db) <= _MAX_DB):
        raise ValueError(f"LAZYTRITON_SHARED: a Redis database is a number, as in redis://host:6379/0, "
                         f"got {parts.path!r} in {url!r}")


def open_shared(config: Settings, count: Counter | None = None) -> SharedTier | None:
    """The shared tier the settings name, or None when there is none (or it cannot be used: warned)."""
    if not config.shared:
        return None
    where = parse_url(config.shared)
    if where.scheme == "file":
        from lazytriton.store.shared_dir import SharedDirTier

        if not os.path.isdir(where.location):  # never created here: an empty mount point would hide the real one
            what = "is not a directory" if os.path.exists(where.location) else "does not exist (not mounted?)"
            log.warning("LAZYTRITON_SHARED names the directory %s, which %s; it is not created; going on with "
                        "the local tiers only", where.location, what)
            return None
        return SharedDirTier(Path(where.location), signing_key=config.signing_key, lease_s=where.lease_s,
                             count=count)
    from lazytriton.store.redis_tier import RedisTier, redis_available

    if not redis_available():
        log.warning("LAZYTRITON_SHARED names Redis but the redis package is not installed "
                    "(pip install 'lazytriton[shared]'); going on with the local tiers only")
        return None
    return RedisTier(where.location, signing_key=config.signing_key, timeout_s=config.shared_timeout_s,
                     lease_s=where.lease_s, prefix=where.prefix, count=count)
