"""The gate every read from a shared tier passes: verified bytes in, or a refusal logged and counted.

A leaf module (standard library only), so that the shared tiers and their
factory (``store.shared``) import it without importing each other. What
"verified" means is handed in: the tiers give ``cache_format.envelope.unseal``
and its ``Rejected``.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("lazytriton.store.shared")

# A node's local counters: ``count("rejected", 1)``.
Counter = Callable[[str, int], None]

E = TypeVar("E")


class Gate(Generic[E]):
    """Verify what a shared tier read, or refuse it with a logged reason and a count.

    ``verify(data, key)`` returns the verified value or raises ``refusal``; a
    refusal whose ``trust`` attribute is true (signature, size, policy) is
    counted ``rejected``, any other (damage) ``corrupt``.

    The same refused bytes are logged and counted once per process (a resolve
    looks a key up to three times: the chain, again under the file lock, again
    under the lease); new bytes under that key are judged afresh.
    """

    def __init__(self, tier: str, verify: Callable[[bytes | memoryview, str], E],
                 refusal: type[Exception], count: Counter | None) -> None:
        self.tier = tier
        self.verify = verify
        self.refusal = refusal
        self.count = count
        self._refused: dict[str, int] = {}  # key -> crc32 of what was refused under it

    def admit(self, key: str, data: bytes | memoryview) -> E | None:
        """The verified value in ``data``, read under ``key``, or None (refused)."""
        try:
            value = self.verify(data, key)
        except self.refusal as exc:
            counter = "rejected" if getattr(exc, "trust", False) else "corrupt"
            self.refuse_once(key, counter, str(exc), zlib.crc32(data))
            return None
        self._refused.pop(key, None)
        return value

    def refuse_once(self, key: str, counter: str, reason: str, fingerprint: int) -> None:
        """Refuse what ``fingerprint`` identifies under ``key``, unless that very thing was refused last time."""
        if self._refused.get(key) == fingerprint:
            return
        if len(self._refused) >= 4096:  # a bound on memory, whatever a hostile tier holds
            self._refused.clear()
        self._refused[key] = fingerprint
        self.refuse(key, counter, reason)

    def refuse(self, key: str, counter: str, reason: str) -> None:
        """Log and count one refusal (``counter`` is ``rejected`` or ``corrupt``)."""
        log.warning("%s entry %s from the %s tier refused (%s); it will be rebuilt locally",
                    counter, key, self.tier, reason)
        if self.count is not None:
            self.count(counter, 1)
