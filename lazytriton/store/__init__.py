"""Cache tiers behind one small protocol, and the chain that stacks them.

A tier maps keys to entries. ``get`` returns a verified Entry or None, never
raises for a missing, corrupt or unreadable entry (it logs and drops it);
``put`` stores an entry or logs why it could not. The chain reads through the
tiers in order and writes a hit from a lower tier back into the writable tiers
above it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from lazytriton.cache_format import Entry
from lazytriton.record import record


@record
class TierStats:
    """What a tier holds: entry count and bytes on disk."""

    name: str
    entries: int
    bytes: int


@runtime_checkable
class Tier(Protocol):
    """The protocol every cache tier keeps."""

    name: str
    writable: bool

    def get(self, key: str) -> Entry | None: ...

    def put(self, key: str, entry: Entry) -> bool: ...

    def keys(self) -> Iterator[str]: ...

    def stats(self) -> TierStats: ...


class Chain:
    """Tiers read in order; a hit is written back into the writable tiers above it."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.tiers = tuple(tiers)

    def get(self, key: str) -> tuple[Entry, str] | None:
        """The first tier's entry for ``key`` and that tier's name, or None."""
        for depth, tier in enumerate(self.tiers):
            entry = tier.get(key)
            if entry is not None:
                for upper in self.tiers[:depth]:
                    if upper.writable:
                        upper.put(key, entry)
                return entry, tier.name
        return None

    def put(self, key: str, entry: Entry) -> bool:
        """Store in every writable tier; True if at least one kept it."""
        return any([tier.put(key, entry) for tier in self.tiers if tier.writable])
