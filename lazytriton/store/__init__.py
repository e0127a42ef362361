"""Cache tiers behind one small protocol, and the chain that stacks them.

A tier maps keys to entries. ``get`` returns a verified Entry or None, never
raises for a missing, corrupt or unreadable entry (it logs and drops it);
``put`` stores an entry or logs why it could not. The chain reads through the
tiers in order and writes a hit from a lower tier back into the writable tiers
above it. A tier that a process may never reach (the local tier, below the
images) goes in the chain as ``Deferred``: made, and its module imported, on
its first use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

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


class Deferred:
    """A tier made by ``make()`` on its first use; its ``name`` and ``writable`` are known before.

    A process served from an image never reads the local tier below it, so
    it never imports that tier's module (its import is ~0.3 ms of a cold
    start). Every other attribute (``directory``, ``peek``, ``usable``...)
    is the made tier's.
    """

    def __init__(self, name: str, writable: bool, make: Callable[[], Tier]) -> None:
        self.name = name
        self.writable = writable
        self._make = make

    @functools.cached_property
    def tier(self) -> Tier:
        """The tier itself, made now if it is not yet."""
        return self._make()

    def get(self, key: str) -> Entry | None:
        """The tier's entry for ``key``, or None."""
        return self.tier.get(key)

    def put(self, key: str, entry: Entry) -> bool:
        """Store in the tier; True if it kept the entry."""
        return self.tier.put(key, entry)

    def keys(self) -> Iterator[str]:
        """The tier's keys."""
        return self.tier.keys()

    def stats(self) -> TierStats:
        """What the tier holds."""
        return self.tier.stats()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("tier", "_make"):
            raise AttributeError(name)
        return getattr(self.tier, name)
