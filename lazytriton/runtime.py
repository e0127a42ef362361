"""The runtime: Variant -> verified Entry -> loaded kernel, with JIT fallback.

Resolution order for a key: the process's loaded kernels (memory), then the
store chain (images, the local disk tier, then the shared tier when
``LAZYTRITON_SHARED`` names one), then the compiler. A compile runs under a
file lock on the key, and the chain is read again once the lock is held, so
processes that miss the same key at once compile it once and all get the
result. With a shared tier, the lock holder then takes the shared tier's
compile lease too (or waits for the node that holds it to publish), so all
nodes compile a key once; the result is published to the shared tier.

Locks are per key. A memory hit takes no lock at all. A miss goes through a
single flight for its key: the first thread to miss it reads the tiers (and
compiles, takes the file lock, waits on a lease), while the others missing the
same key wait for that thread's result, or its error, which is not remembered
(the next call tries again). Nothing one key does (a 10 s compile, a lease
wait) delays a lookup of another key, in memory, an image or the local tier.
Compiles of different keys run one at a time all the same, inside the compiler
(Triton's global state, ``triton_lock.TRITON_LOCK``).

The runtime follows the settings: ``config.configure()`` and ``config.reset()``
bump ``config.generation``, and ``get()`` builds a new runtime when the one it
holds was built for another generation (an int compare on the hot path).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from lazytriton import config
from lazytriton.cache_format import Entry
from lazytriton.config import Settings
from lazytriton.record import record
from lazytriton.store import Chain, Deferred
from lazytriton.store.image import ImageTier
from lazytriton.variant import Variant

if TYPE_CHECKING:
    from lazytriton.store.local import LocalTier

log = logging.getLogger("lazytriton.runtime")

MISS_LOG = "misses.jsonl"

# A compile of the largest attention variant takes about 10 s on a 2-core CI
# machine; a lock held ten times longer belongs to a hung process.
_LOCK_TIMEOUT_S = 300.0

T = TypeVar("T")


class KernelNotFound(LookupError):
    """No tier holds the variant and JIT compilation is off."""


@record
class Resolved:
    """An entry and where it came from: ``memory``, a tier's name, or ``jit``."""

    entry: Entry
    key: str
    source: str
    seconds: float


class _Flight(Generic[T]):
    """One thread's work on a key, which the other threads asking for that key wait for."""

    __slots__ = ("done", "error", "owner", "value", "waiters")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.owner = threading.get_ident()
        self.waiters = 0
        self.value: T | None = None
        self.error: BaseException | None = None


class SingleFlight(Generic[T]):
    """At most one producer per key at a time; the threads asking meanwhile share its value or its error.

    A lock per key would make each waiter redo a failed 10 s compile in turn;
    here one failure is raised to every thread that waited for it, and not
    kept: the next call after it tries again. The lock guards the dict only.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flights: dict[Hashable, _Flight[T]] = {}

    def run(self, key: Hashable, produce: Callable[[], T]) -> tuple[T, bool]:
        """``produce()``'s value for ``key``, and whether this thread produced it (False: it waited)."""
        while True:
            with self._lock:
                flight = self._flights.get(key)
                if flight is None:
                    flight = self._flights[key] = _Flight()
                    break
                if flight.owner == threading.get_ident():
                    raise RuntimeError(f"{key!r} is already being resolved by this thread (a re-entrant lookup)")
                flight.waiters += 1
            flight.done.wait()
            if isinstance(flight.error, Exception):
                raise flight.error
            if flight.error is None:
                return flight.value, False  # type: ignore[return-value]
            # The producer was interrupted (KeyboardInterrupt, SystemExit): not our error; try ourselves.
        try:
            flight.value = produce()
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()
        return flight.value, True

    def waiting(self, key: Hashable) -> int:
        """How many threads wait for the producer of ``key`` now."""
        with self._lock:
            flight = self._flights.get(key)
            return 0 if flight is None else flight.waiters


class Runtime:
    """One process's view of the cache: tiers, loaded kernels, counters."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.generation = -1  # the settings generation it was built for (``get()`` sets it)
        self.images = ImageTier(settings.images)
        self._local: LocalTier | None = None  # ``local`` makes it
        self._local_lock = threading.Lock()
        # Refusals of shared entries are counted with the local tier's persistent counters.
        self.shared = None
        if settings.shared:  # imported only then: a node without a shared tier never loads that code
            from lazytriton.store.shared import open_shared

            self.shared = open_shared(settings, count=self.local.count)
        local = Deferred("local", True, lambda: self.local)  # an image hit never makes it
        self.chain = Chain([self.images, local, *([self.shared] if self.shared is not None else [])])
        self.plans: dict[tuple[Any, ...], Any] = {}  # the hot path's memo, filled by callers
        self.served: Counter[str] = Counter()
        self.compiles = 0
        self._pending: Counter[str] = Counter()
        self._entries: dict[str, Entry] = {}
        self._kernels: dict[tuple[str, int], Any] = {}
        self._resolving: SingleFlight[tuple[Entry, str]] = SingleFlight()
        self._loading: SingleFlight[Any] = SingleFlight()
        self._counts_lock = threading.Lock()  # counters only: held for a dict update, never across I/O

    @property
    def local(self) -> LocalTier:
        """The local disk tier, made (and its module imported) on first use.

        An image hit never needs it; a process served from images makes it at exit, to write its hit counts.
        """
        tier = self._local
        if tier is None:
            with self._local_lock:
                tier = self._local
                if tier is None:
                    from lazytriton.store.local import LocalTier

                    tier = self._local = LocalTier(self.settings.cache_dir / "entries",
                                                   size_limit=self.settings.cache_max_bytes)
        return tier

    def resolve(self, variant: Variant) -> Resolved:
        """The verified entry for ``variant``, compiling it if no tier has it.

        A memory hit takes no lock; a miss waits only for other threads missing the same key.
        """
        start = time.perf_counter()
        key = variant.key()
        entry = self._entries.get(key)
        if entry is not None:
            return self._done(Resolved(entry, key, "memory", time.perf_counter() - start))
        (entry, source), fetched = self._resolving.run(key, lambda: self._fetch(variant, key))
        # A thread that waited for another's fetch got the entry from this process's memory.
        return self._done(Resolved(entry, key, source if fetched else "memory", time.perf_counter() - start))

    def waiting(self, key: str) -> int:
        """Threads waiting now for another thread's fetch (or compile) of ``key``."""
        return self._resolving.waiting(key)

    def _fetch(self, variant: Variant, key: str) -> tuple[Entry, str]:
        entry = self._entries.get(key)  # another thread's fetch may have ended since our look
        if entry is not None:
            return entry, "memory"
        found = self.chain.get(key)
        if found is None:
            found = self._compile_once(variant, key)
        self._entries[key] = found[0]
        return found

    def _done(self, resolved: Resolved) -> Resolved:
        with self._counts_lock:
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
        with self._counts_lock:
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
        except OSError as exc:  # ELOOP, EISDIR...: what sits at the lock's path is not ours to fix
            log.warning("cannot take the compile lock %s (%s); compiling without it", lock.lock_file, exc)
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
            with self._counts_lock:
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
            # Never through a symlink (ELOOP), never blocking on a FIFO (ENXIO).
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(self.miss_log, flags, 0o644)
        except OSError as exc:  # a full disk fails the entry, the counters and this line: one warning says so
            self.local.warn_once("miss log", f"could not record the miss of {key} in {self.miss_log} "
                                             f"(not a regular file?): {exc}; misses are not recorded")
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                self.local.warn_once("miss log", f"{self.miss_log} is not a regular file; misses are not recorded")
                return
            # One write of a short line to an O_APPEND file: concurrent processes never interleave within a line.
            os.write(fd, line.encode())
        except OSError as exc:
            self.local.warn_once("write", f"could not record the miss of {key} in {self.miss_log}: {exc}")
        finally:
            os.close(fd)

    def _file_lock(self, key: str) -> Any:
        if not self.local.usable:
            # Nothing is stored, so there is nothing to compile once for; the local
            # tier has already warned that the cache dir is unusable (once, not per miss).
            return None
        lock_dir = self.settings.cache_dir / "locks"
        path = lock_dir / f"{key}.lock"
        try:
            lock_dir.mkdir(parents=True, exist_ok=True)
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = stat.S_IFREG  # created by the lock itself
        except OSError as exc:
            log.warning("cannot create compile locks in %s (%s); compiling without a lock", lock_dir, exc)
            return None
        if not stat.S_ISREG(mode):  # a symlink (never followed) or a folder in the lock's place
            log.warning("compile lock %s is not a regular file; compiling without it", path)
            return None
        from filelock import FileLock

        return FileLock(str(path))

    def kernel(self, variant: Variant, device_index: int) -> Any:
        """The entry for ``variant`` loaded on GPU ``device_index`` (memory tier of handles)."""
        key = variant.key()
        loaded = self._kernels.get((key, device_index))
        if loaded is None:  # one load per (key, device); other keys and devices go on meanwhile
            loaded, _ = self._loading.run((key, device_index), lambda: self._load(variant, key, device_index))
        return loaded

    def _load(self, variant: Variant, key: str, device_index: int) -> Any:
        loaded = self._kernels.get((key, device_index))
        if loaded is None:
            from lazytriton import driver
            from lazytriton.kernels import dependent_launch

            loaded = driver.load(self.resolve(variant).entry, device_index, dependent_launch(variant))
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


_built: Runtime | None = None
_built_lock = threading.Lock()


def get() -> Runtime:
    """The process's runtime, built from the settings on first use and again after they change."""
    rt = _built
    if rt is not None and rt.generation == config.generation:
        return rt
    return _rebuild()


def _rebuild() -> Runtime:
    global _built
    with _built_lock:
        generation = config.generation  # read before the settings: a change in between rebuilds again
        if _built is None or _built.generation != generation:
            rt = Runtime(config.settings())  # first: bad settings raise here and leave the old one as it was
            rt.generation = generation
            old, _built = _built, rt
            if old is not None:
                _close(old)
        return _built


def current() -> Runtime | None:
    """The process's runtime if one has been built, else None (builds nothing; it may be of older settings)."""
    return _built


def _close(rt: Runtime) -> None:
    """Flush and close what ``rt`` holds open; a thread still using it reopens its tiers on next use."""
    rt.flush_counters()
    atexit.unregister(rt.flush_counters)
    if rt._local is not None:  # one never made holds nothing open
        rt.local.close()
    rt.images.close()
    if rt.shared is not None:
        rt.shared.close()


def reset() -> None:
    """Drop the runtime (its loaded kernels and memo); the next call builds a new one."""
    global _built
    with _built_lock:
        if _built is not None:
            _close(_built)
        _built = None


def __getattr__(name: str) -> Any:
    """``runtime._runtime``, read by code written before settings generations, follows them too."""
    if name == "_runtime":
        return None if _built is None else get()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
