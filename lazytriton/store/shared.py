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

from lazytriton.store import Tier
from lazytriton.store.gate import Counter
from lazytriton.store.lease import Lease
from lazytriton.store.shared_url import SCHEMES as SCHEMES  # re-exported: store.shared.SCHEMES
from lazytriton.store.shared_url import SharedURL as SharedURL  # re-exported: store.shared.SharedURL
from lazytriton.store.shared_url import parse_url

if TYPE_CHECKING:
    from lazytriton.config import Settings

log = logging.getLogger("lazytriton.store.shared")


class SharedTier(Tier, Protocol):
    """A tier other nodes write too: the Tier protocol, compile leases (of ``lease_s`` seconds), and a close."""

    lease_s: float

    def try_lease(self, key: str) -> Lease | None: ...

    def close(self) -> None: ...


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
