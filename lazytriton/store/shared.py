"""Shared tiers: what ``LAZYTRITON_SHARED`` names, and the policy every shared read follows.

``LAZYTRITON_SHARED`` is one URL:

| form                                | tier                                                   |
|-------------------------------------|--------------------------------------------------------|
| ``file:///path/to/dir``             | a directory on a network filesystem (``SharedDirTier``) |
| ``redis://[:password@]host:port/db`` | a Redis server (``RedisTier``; ``rediss://`` for TLS)  |

Query parameters: ``lease_s`` (compile lease time, default 30) for both,
``prefix`` (key prefix, default ``lazytriton``) for Redis; e.g.
``redis://10.0.0.5:6379/0?lease_s=60``.

A shared tier is untrusted input. Every read goes through a ``Gate``: the
envelope (``cache_format.envelope``) is checked (bounds, signature when a
signing key is set, bounded decompression, the entry's checksum and key),
and whatever is refused is logged with its reason and counted (``rejected``
for policy refusals, ``corrupt`` for damage) in the node's local counters,
then treated as a miss, so the runtime rebuilds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import xxhash

from lazytriton.cache_format import Entry
from lazytriton.cache_format.envelope import Rejected, unseal
from lazytriton.record import record
from lazytriton.store import Tier
from lazytriton.store.lease import DEFAULT_LEASE_S, Lease

if TYPE_CHECKING:
    from lazytriton.config import Settings

log = logging.getLogger("lazytriton.store.shared")

Counter = Callable[[str, int], None]
SCHEMES = ("file", "redis", "rediss")
_PARAMS = {"file": ("lease_s",), "redis": ("lease_s", "prefix"), "rediss": ("lease_s", "prefix")}


class SharedTier(Tier, Protocol):
    """A tier other nodes write too: the Tier protocol, compile leases, and a close."""

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
    """Parse a ``LAZYTRITON_SHARED`` value; raise ValueError naming what is wrong."""
    if not isinstance(url, str):
        raise TypeError(f"LAZYTRITON_SHARED must be a str, got {type(url).__name__}")
    parts = urlsplit(url.strip())
    if parts.scheme not in SCHEMES:
        raise ValueError(f"LAZYTRITON_SHARED must start with file://, redis:// or rediss://, got {url!r}")
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in _PARAMS[parts.scheme]:
            raise ValueError(f"LAZYTRITON_SHARED: unknown parameter {name!r} in {url!r} "
                             f"(known for {parts.scheme}: {', '.join(_PARAMS[parts.scheme])})")
        options[name] = value
    try:
        lease_s = float(options.get("lease_s", DEFAULT_LEASE_S))
    except ValueError:
        raise ValueError(f"LAZYTRITON_SHARED: lease_s must be a number of seconds, "
                         f"got {options['lease_s']!r}") from None
    if not 0.05 <= lease_s <= 3600:
        raise ValueError(f"LAZYTRITON_SHARED: lease_s must be within 0.05..3600 seconds, got {lease_s}")
    prefix = options.get("prefix", "lazytriton")
    if not prefix or not all(c.isalnum() or c in "_-.:" for c in prefix) or len(prefix) > 64:
        raise ValueError(f"LAZYTRITON_SHARED: prefix must be 1-64 characters of [A-Za-z0-9_-.:], got {prefix!r}")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"LAZYTRITON_SHARED: a shared directory is file:///absolute/path, got {url!r}")
        return SharedURL("file", parts.path, lease_s)
    if not parts.hostname:
        raise ValueError(f"LAZYTRITON_SHARED: a Redis URL needs a host, got {url!r}")
    location = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    return SharedURL(parts.scheme, location, lease_s, prefix)


def open_shared(config: Settings, count: Counter | None = None) -> SharedTier | None:
    """The shared tier the settings name, or None when there is none (or it cannot be used: warned)."""
    if not config.shared:
        return None
    where = parse_url(config.shared)
    if where.scheme == "file":
        from lazytriton.store.shared_dir import SharedDirTier

        return SharedDirTier(Path(where.location), signing_key=config.signing_key, lease_s=where.lease_s,
                             count=count)
    from lazytriton.store.redis_tier import RedisTier, redis_available

    if not redis_available():
        log.warning("LAZYTRITON_SHARED names Redis but the redis package is not installed "
                    "(pip install 'lazytriton[shared]'); going on with the local tiers only")
        return None
    return RedisTier(where.location, signing_key=config.signing_key, timeout_s=config.shared_timeout_s,
                     lease_s=where.lease_s, prefix=where.prefix, count=count)


class Gate:
    """Every read from a shared tier passes here: verified, or refused with a logged reason and counted.

    The same refused bytes are logged and counted once per process (a resolve
    looks a key up to three times: the chain, again under the file lock, again
    under the lease); new bytes under that key are judged afresh.
    """

    def __init__(self, tier: str, signing_key: bytes | None, count: Counter | None) -> None:
        self.tier = tier
        self.signing_key = signing_key
        self.count = count
        self._refused: dict[str, int] = {}  # key -> xxh3-64 of the bytes refused under it

    def admit(self, key: str, data: bytes | memoryview) -> Entry | None:
        """The verified entry in ``data``, read under ``key``, or None."""
        try:
            entry = unseal(data, key, self.signing_key)
        except Rejected as exc:
            digest = xxhash.xxh3_64_intdigest(data)
            if self._refused.get(key) != digest:
                self._refused[key] = digest
                self.refuse(key, "rejected" if exc.trust else "corrupt", str(exc))
            return None
        self._refused.pop(key, None)
        return entry

    def refuse(self, key: str, counter: str, reason: str) -> None:
        """Log and count one refusal (``counter`` is ``rejected`` or ``corrupt``)."""
        log.warning("%s entry %s from the %s tier refused (%s); it will be rebuilt locally",
                    counter, key, self.tier, reason)
        if self.count is not None:
            self.count(counter, 1)
