"""The runtime: Variant -> verified Entry -> loaded kernel, with JIT fallback.

Resolution order for a key: the process's loaded kernels (memory), then the
store chain (images, the local disk tier, then the shared tier when
``LAZYTRITON_SHARED`` names one), then the compiler. A compile runs under a
file lock on the key, and the chain is read again once the lock is held, so
processes that miss the same key at once compile it once and all get the
result. With a shared tier, the lock holder then takes the shared tier's
compile lease too (or waits for the node that holds it to publish), so all
nodes compile a key once; the result is published to the shared tier.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from lazytriton.cache_format import Entry
from lazytriton.config import Settings, settings
from lazytriton.record import record
from lazytriton.store import Chain
from lazytriton.store.image import ImageTier
from lazytriton.store.local import LocalTier
from lazytriton.variant import Variant

log = logging.getLogger("lazytriton.runtime")

MISS_LOG = "misses.jsonl"

# A compile of the largest attention variant takes about 10 s on a 2-core CI
# machine; a lock held ten times longer belongs to a hung process.
_LOCK_TIMEOUT_S = 300.0


class KernelNotFound(LookupError):
    """No tier holds the variant and JIT compilation is off."""


@record
class Resolved:
    """An entry and where it came from: ``memory``, a tier's name, or ``jit``."""

    entry: Entry
    key: str
    source: str
    seconds: float


class Runtime:
    """One process's view of the cache: tiers, loaded kernels, counters."""

    def __init__(self, config: Settings) -> None:
        self.settings = config
        self.images = ImageTier(config.images)
        self.local = LocalTier(config.cache_dir / "entries", size_limit=config.cache_max_bytes)
        # Refusals of shared entries are counted with the local tier's persistent counters.
        self.shared = None
        if config.shared:  # imported only then: a node without a shared tier never loads that code
            from lazytriton.store.shared import open_shared

            self.shared = open_shared(config, count=self.local.count)
        self.chain = Chain([self.images, self.local, *([self.shared] if self.shared is not None else [])])
        self.plans: dict[tuple[Any, ...], Any] = {}  # the hot path's memo, filled by callers
        self.served: Counter[str] = Counter()
        self.compiles = 0
        self._pending: Counter[str] = Counter()
        self._entries: dict[str, Entry] = {}
        self._kernels: dict[tuple[str, int], Any] = {}
        self._lock = threading.RLock()

    def resolve(self, variant: Variant) -> Resolved:
        """The verified entry for ``variant``, compiling it if no tier has it."""
        start = time.perf_counter()
        key = variant.key()
        with self._lock:
            if key in self._entries:
                return self._done(Resolved(self._entries[key], key, "memory", time.perf_counter() - start))
            found = self.chain.get(key)
            if found is None:
                found = self._compile_once(variant, key)
            entry, source = found
            self._entries[key] = entry
            return self._done(Resolved(entry, key, source, time.perf_counter() - start))

    def _done(self, resolved: Resolved) -> Resolved:
        self.served[resolved.source] += 1
        if resolved.source not in ("memory", "jit"):
            # Counted in memory and written at exit: a process served from an
            # image never has to open the local tier's database.
            if not self._pending:
                atexit.register(self.flush_counters)
            self._pending["hits"] += 1
        return resolved

    def flush_counters(self) -> None:
        """Write the counts kept in memory (hits) to the local tier's persistent counters."""
        pending, self._pending = self._pending, Counter()
        for name, amount in pending.items():
            self.local.count(name, amount)

    def _compile_once(self, variant: Variant, key: str) -> tuple[Entry, str]:
        if not self.settings.jit:
            raise KernelNotFound(f"no cache tier holds {variant} (key {key}) and LAZYTRITON_JIT=0; "
                                 "prewarm it or enable JIT")
        from filelock import Timeout  # imported here: 100+ ms that a cache-served process never pays

        lock = self._file_lock(key)
        try:
            if lock is not None:
                lock.acquire(timeout=_LOCK_TIMEOUT_S)
        except Timeout:
            log.warning("compile lock for %s held for over %.0f s; compiling without it", key, _LOCK_TIMEOUT_S)
            lock = None
        try:
            found = self.chain.get(key)  # another process may have compiled it while we waited
            if found is not None:
                return found
            return self._compile_under_lease(variant, key)
        finally:
            if lock is not None:
                lock.release()

    def _compile_under_lease(self, variant: Variant, key: str) -> tuple[Entry, str]:
        """Compile once across nodes: hold the shared tier's lease, or take what its holder published."""
        lease = None
        if self.shared is not None:
            from lazytriton.store.lease import lease_or_entry

            lease, published = lease_or_entry(self.shared, key, _LOCK_TIMEOUT_S)
            if published is not None:
                self.local.put(key, published)
                return published, self.shared.name
        try:
            if lease is not None:
                found = self.chain.get(key)  # published between our last look and taking the lease
                if found is not None:
                    return found
            from lazytriton import compiler

            log.info("compiling %s", variant)
            start = time.perf_counter()
            entry = compiler.compile_variant(variant, key)
            self.compiles += 1
            self.local.count("compiles")
            self.chain.put(key, entry)  # the local tier and, before the lease is let go, the shared one
            self._log_miss(variant, key, time.perf_counter() - start)
            return entry, "jit"
        finally:
            if lease is not None:
                lease.release()

    @property
    def miss_log(self) -> Path:
        """The JSON-lines file where each JIT compile records its variant (``prewarm --from-misses`` reads it)."""
        return self.settings.cache_dir / MISS_LOG

    def _log_miss(self, variant: Variant, key: str, seconds: float) -> None:
        if not self.local.usable:
            return  # the cache dir is unusable and the local tier has said so, once
        line = json.dumps({"variant": str(variant), "key": key, "compile_s": round(seconds, 3),
                           "time": round(time.time(), 3)}, sort_keys=True) + "\n"
        try:
            self.settings.cache_dir.mkdir(parents=True, exist_ok=True)
            # One write of a short line to an O_APPEND file: concurrent processes never interleave within a line.
            fd = os.open(self.miss_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as exc:  # a full disk fails the entry, the counters and this line: one warning says so
            self.local.warn_once("write", f"could not record the miss of {key} in {self.miss_log}: {exc}")

    def _file_lock(self, key: str) -> Any:
        if not self.local.usable:
            # Nothing is stored, so there is nothing to compile once for; the local
            # tier has already warned that the cache dir is unusable (once, not per miss).
            return None
        lock_dir = self.settings.cache_dir / "locks"
        try:
            lock_dir.mkdir(parents=True, exist_ok=True)
            from filelock import FileLock

            lock = FileLock(str(lock_dir / f"{key}.lock"))
            return lock
        except OSError as exc:
            log.warning("cannot create compile locks in %s (%s); compiling without a lock", lock_dir, exc)
            return None

    def kernel(self, variant: Variant, device_index: int) -> Any:
        """The entry for ``variant`` loaded on GPU ``device_index`` (memory tier of handles)."""
        key = variant.key()
        loaded = self._kernels.get((key, device_index))
        if loaded is None:
            with self._lock:
                loaded = self._kernels.get((key, device_index))
                if loaded is None:
                    from lazytriton import driver

                    loaded = driver.load(self.resolve(variant).entry, device_index)
                    self._kernels[(key, device_index)] = loaded
        return loaded

    def loaded(self, variant: Variant, device_index: int) -> Any:
        """The kernel for ``variant`` if it is already loaded on GPU ``device_index``, else None (no I/O)."""
        return self._kernels.get((variant.key(), device_index))

    def loaded_kernels(self) -> list[Any]:
        """The kernels this process has loaded on its devices."""
        return list(self._kernels.values())

    def counters(self) -> dict[str, int]:
        """Persistent counters of the local tier (compiles, hits, corrupt, ...)."""
        self.flush_counters()
        return self.local.counters()


_runtime: Runtime | None = None
_runtime_lock = threading.Lock()


def get() -> Runtime:
    """The process's runtime, built from the settings on first use."""
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                _runtime = Runtime(settings())
    return _runtime


def current() -> Runtime | None:
    """The process's runtime if one has been built, else None (builds nothing)."""
    return _runtime


def reset() -> None:
    """Drop the runtime (its loaded kernels and memo); the next call builds a new one."""
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            _runtime.flush_counters()
            atexit.unregister(_runtime.flush_counters)
            _runtime.local.close()
            _runtime.images.close()
            if _runtime.shared is not None:
                _runtime.shared.close()
        _runtime = None
