"""Compile leases: one compile per key across every node that shares a tier.

A lease is a lock with an expiry. Its holder renews it in the background
while it compiles; if the holder dies, renewals stop, the lease expires and
another node takes it over. Both shared tiers (directory and Redis) hand out
leases through the same two calls, ``try_lease(key)`` and ``Lease.release()``.

A lease is an economy, never a safety device: two nodes that both end up
compiling a key (a lease lost to a network partition, a shared tier that was
down) publish the same bytes, atomically, and every read is verified. The
worst a broken lease costs is a second compile.

Leases are unsigned, so a renewal cannot be told from a co-tenant rewriting
a lease forever: a miss waits on one key's leases for at most
``WAIT_LEASES`` lease times in all (``WAIT_FLOOR_S`` at least), then
compiles without one.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lazytriton.cache_format import Entry

log = logging.getLogger("lazytriton.store.lease")

# A compile of the largest attention variant takes ~10 s on a 2-core machine;
# a 30 s lease renewed every 10 s survives a stalled second or two, and a dead
# holder delays the others by at most 30 s.
DEFAULT_LEASE_S = 30.0
# How often a node waiting for another's lease looks again (jittered +-50%).
POLL_S = 0.05
# The most a miss waits on one key's leases: WAIT_LEASES lease times, but at least WAIT_FLOOR_S (60 s at
# the default 30 s lease). A holder killed mid-compile is taken over within one lease time of the wait's
# start (its last renewal came before it), so that path still serves, with a margin the floor keeps for
# short leases on a loaded machine; an honest compile that takes longer costs a second compile, nothing
# worse; a lease rewritten forever costs this much, not the caller's timeout (300 s).
WAIT_LEASES = 2
WAIT_FLOOR_S = 10.0


class LockUnavailable(Exception):
    """The shared tier cannot answer (down, unreachable): compile without its lease."""


def owner_token() -> str:
    """A name for this lease holder that no other process on any node shares: host, pid and a random part."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


class Lease:
    """A held compile lease, renewed every third of its time until released.

    ``renew()`` returns True while the lease is still this holder's, False once
    someone else holds it (it is then ``lost``), and raises when the tier
    cannot answer (the next renewal tries again).
    """

    def __init__(self, key: str, owner: str, ttl_s: float, renew: Callable[[], bool],
                 release: Callable[[], None]) -> None:
        self.key = key
        self.owner = owner
        self.ttl_s = ttl_s
        self.lost = False
        self._renew = renew
        self._release = release
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name=f"lazytriton-lease-{key[:8]}", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                still_ours = self._renew()
            except Exception as exc:  # the tier is unreachable: try again next time
                log.debug("renewing the compile lease for %s failed: %s", self.key, exc)
                continue
            if not still_ours:
                self.lost = True
                log.warning("compile lease for %s was taken over by another node; both may compile it "
                            "(harmless: the same bytes are published atomically)", self.key)
                return

    def release(self) -> None:
        """Stop renewing and give the lease back if it is still ours; never raises."""
        self._stop.set()
        self._thread.join()
        if self.lost:
            return
        try:
            self._release()
        except Exception as exc:  # it expires by itself
            log.debug("releasing the compile lease for %s failed (it will expire): %s", self.key, exc)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LeaseTier(Protocol):
    """What a shared tier offers for compiling once across nodes."""

    name: str
    lease_s: float

    def try_lease(self, key: str) -> Lease | None: ...

    def get(self, key: str) -> Entry | None: ...


def lease_or_entry(tier: LeaseTier, key: str, timeout_s: float) -> tuple[Lease | None, Entry | None]:
    """Take ``key``'s compile lease, or wait for its holder to publish the entry.

    Returns ``(lease, None)`` when this node is to compile, ``(None, entry)``
    when another node published it meanwhile, and ``(None, None)`` when the
    tier cannot answer or the wait ran past ``timeout_s`` or the bound on a
    wait for leases (``WAIT_LEASES``), whichever is shorter (compile anyway).
    """
    wait_s = min(timeout_s, max(WAIT_LEASES * tier.lease_s, WAIT_FLOOR_S))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lease = tier.try_lease(key)
        except LockUnavailable as exc:
            log.debug("no compile lease for %s from %s (%s); compiling without it", key, tier.name, exc)
            return None, None
        if lease is not None:
            return lease, None
        if time.monotonic() > deadline:
            log.warning("compile lease for %s on %s held for over %.0f s (%s); compiling without it", key,
                        tier.name, wait_s, "the wait's bound" if wait_s == timeout_s else
                        "the bound on a wait for leases: they are unsigned, anyone may rewrite one")
            return None, None
        time.sleep(POLL_S * random.uniform(0.5, 1.5))
        # Look for the holder's entry before asking for the lease again: once it is published, the
        # waiters take it without writing a lease of their own.
        entry = tier.get(key)
        if entry is not None:
            return None, entry
