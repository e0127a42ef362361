"""The Redis tier: entries and compile leases on a Redis server that many nodes share.

Keys (``prefix`` defaults to ``lazytriton``)::

    <prefix>:entry:<key>    a sealed envelope (cache_format.envelope), set in one command
    <prefix>:lease:<key>    a compile lease: SET NX PX, renewed while compiling, released by compare-and-delete

Redis applies a command whole or not at all, so a writer killed mid-send
leaves the old value or the new. Reads are bounded: one script returns a
value's size instead of the value when it is over ``MAX_VALUE_BYTES``, so a
hostile large value is refused unread as a bad entry (counted ``rejected``,
rebuilt), never fetched into a timeout that would read as an outage. What is
read is verified (``store.gate.Gate``). A lease key without an expiry, or
with one past the lease time, is capped at the lease time when first seen.

Redis being slow or down must never fail or stall a call. Every command runs
under a socket timeout (``LAZYTRITON_SHARED_TIMEOUT_MS``, 5 ms by default)
with no retries, and a circuit breaker opens on the first connection error or
timeout: while it is open no call touches the network (a lookup answers
"miss" in well under a microsecond) and a background thread probes Redis,
closing the breaker when it answers again. A hit in memory, an image or the
local tier never reaches this tier at all.

The ``redis`` package is optional (``pip install 'lazytriton[shared]'``): it is
imported on first use, and ``import lazytriton`` never needs it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit

from lazytriton.cache_format import Entry
from lazytriton.cache_format.envelope import MAX_ENVELOPE_BYTES, Rejected, check_signing_key, seal, unseal
from lazytriton.keys import check_key
from lazytriton.store import TierStats
from lazytriton.store.gate import Counter, Gate
from lazytriton.store.lease import DEFAULT_LEASE_S, Lease, LockUnavailable, owner_token

log = logging.getLogger("lazytriton.store.redis")

DEFAULT_TIMEOUT_S = 0.005
# The breaker's probe: first after 0.25 s, then doubling up to 5 s between
# pings, so a Redis that comes back is used again within a few seconds and a
# long outage costs one ping every 5 s.
PROBE_FIRST_S = 0.25
PROBE_MAX_S = 5.0

# Compare-and-renew and compare-and-delete: only the holder named in ARGV[1] touches its lease.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Take the lease (1), or leave a live holder's alone (0). A lease key without an expiry, or with one further
# than a lease time away (planted, or written by a broken client), is capped at one lease time from now (2):
# whatever a lease claims, every waiter takes it over within a lease time. Leases are not signed.
_TAKE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
local ttl = redis.call('PTTL', KEYS[1])
if ttl == -1 or ttl > tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 2
end
return 0
"""
# A value's size first, and the value only if it is within the bound: an oversized value is never sent.
_READ = """
local size = redis.call('STRLEN', KEYS[1])
if size > tonumber(ARGV[1]) then return size end
return redis.call('GET', KEYS[1])
"""
# What a read may fetch. Sealed sm_90 entries measure 27 KiB (head dim 64, 97 KiB cubin) and 33 KiB (head dim
# 256, 141 KiB cubin), Triton 3.9 on CPU: 8 MiB leaves 250x room. Anything larger is refused unread as a bad
# entry, never fetched into a timeout that would read as an outage (a 60 MiB value did, and switched sharing off).
MAX_VALUE_BYTES = 8 << 20

T = TypeVar("T")


def redis_available() -> bool:
    """Whether the optional ``redis`` package is installed (checked without importing it)."""
    try:
        return importlib.util.find_spec("redis") is not None
    except (ImportError, ValueError):
        return False


class Down(Exception):
    """Redis did not answer (or the breaker is open): the caller goes on without it."""


class CircuitBreaker:
    """Open after a failure; while open, callers skip Redis and a background thread probes it."""

    def __init__(self, where: str, probe: Callable[[], object], on_close: Callable[[], None]) -> None:
        self.where = where
        self.is_open = False
        self.opened = 0  # how many outages were seen (tests and ``stats`` read it)
        self._probe = probe
        self._on_close = on_close
        self._lock = threading.Lock()
        self._prober = 0  # pid of the process whose thread probes (a fork inherits is_open, not the thread)
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _reset_lock(ref))

    def trip(self, exc: BaseException) -> None:
        """Open the breaker (once per outage) and start probing."""
        with self._lock:
            if self.is_open:
                return
            self.is_open = True
            self.opened += 1
        log.warning("Redis at %s unreachable (%s: %s); going on with the local tiers, probing it in the background",
                    self.where, type(exc).__name__, exc)
        self.keep_probing()

    def keep_probing(self) -> None:
        """Start the probe thread unless this process has one (called on every call while open: cheap)."""
        if self._prober != os.getpid():
            with self._lock:
                if self._prober != os.getpid() and self.is_open:
                    self._prober = os.getpid()
                    threading.Thread(target=self._probe_loop, name="lazytriton-redis-probe", daemon=True).start()

    def _probe_loop(self) -> None:
        delay = PROBE_FIRST_S
        while True:
            time.sleep(delay)
            try:
                self._probe()
            except Exception:
                delay = min(delay * 2, PROBE_MAX_S)
                continue
            self._on_close()
            with self._lock:
                self.is_open = False
                self._prober = 0
            log.warning("Redis at %s answers again; sharing entries through it", self.where)
            return


def _reset_lock(ref: weakref.ref[CircuitBreaker]) -> None:
    """In a forked child: a lock the parent's probe thread held at the fork would never be released."""
    breaker = ref()
    if breaker is not None:
        breaker._lock = threading.Lock()


class RedisTier:
    """Entries and compile leases on a Redis server, behind timeouts and a circuit breaker."""

    writable = True

    def __init__(self, url: str, name: str = "shared", signing_key: bytes | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, lease_s: float = DEFAULT_LEASE_S,
                 prefix: str = "lazytriton", count: Counter | None = None,
                 max_value_bytes: int = MAX_VALUE_BYTES) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not 0 < max_value_bytes <= MAX_ENVELOPE_BYTES:
            raise ValueError(f"max_value_bytes must be within 1..{MAX_ENVELOPE_BYTES}, got {max_value_bytes}")
        self.max_value_bytes = max_value_bytes
        self.name = name
        self.url = url
        self.signing_key = check_signing_key(signing_key)
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        self.prefix = prefix
        self.calls = 0  # commands sent to Redis (tests show that hits send none)
        self.gate: Gate[Entry] = Gate(name, partial(unseal, signing_key=self.signing_key), Rejected, count)
        self._client: Any = None
        self._scripts: dict[str, Any] = {}
        self._client_lock = threading.Lock()
        self._warned: set[str] = set()
        parts = urlsplit(url)
        where = f"{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"  # never the password
        self.breaker = CircuitBreaker(where, probe=self._ping, on_close=self._drop_connections)

    def _redis(self) -> Any:
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    import redis
                    from redis.backoff import NoBackoff
                    from redis.retry import Retry

                    client = redis.Redis.from_url(
                        self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                        retry=Retry(NoBackoff(), 0), health_check_interval=0, socket_keepalive=True,
                    )
                    self._scripts = {name: client.register_script(script) for name, script in
                                     (("renew", _RENEW), ("release", _RELEASE), ("take", _TAKE), ("read", _READ))}
                    self._client = client
        return self._client

    def _call(self, op: Callable[[Any], T]) -> T:
        """``op(client)``; raise Down at once while the breaker is open, or when Redis fails to answer."""
        if self.breaker.is_open:
            self.breaker.keep_probing()
            raise Down(f"breaker open for Redis at {self.breaker.where}")
        import redis

        self.calls += 1
        try:
            return op(self._redis())
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            self._drop_connections()
            self.breaker.trip(exc)
            raise Down(str(exc)) from exc

    def _ping(self) -> object:
        return self._redis().ping()

    def _drop_connections(self) -> None:
        """Close pooled connections: after an outage they point at a server that is gone."""
        if self._client is not None:
            try:
                self._client.connection_pool.disconnect()
            except Exception:
                pass

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def entry_key(self, key: str) -> str:
        return f"{self.prefix}:entry:{check_key(key)}"

    def lease_key(self, key: str) -> str:
        return f"{self.prefix}:lease:{check_key(key)}"

    # --- entries ------------------------------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The verified entry for ``key``; Redis down, a miss, or a refused value all read as None."""
        name = self.entry_key(key)
        try:
            data = self._call(lambda r: self._scripts["read"]([name], [self.max_value_bytes]))
        except Down:
            return None
        except Exception as exc:  # a wrong-type key, an error reply: a miss, not a failed call
            self._warn_once("read", f"Redis read of {name} failed ({exc}); treated as a miss")
            return None
        if isinstance(data, int):  # only its size came back
            self.gate.refuse_once(key, "rejected", f"oversized: {data} bytes exceed the Redis tier's "
                                  f"{self.max_value_bytes} byte bound; not fetched", data + (1 << 32))
            return None
        if not data:
            return None
        return self.gate.admit(key, data)

    def put(self, key: str, entry: Entry) -> bool:
        """Publish ``entry`` (one SET: all or nothing); False if Redis is down or refuses it."""
        name = self.entry_key(key)
        if self.breaker.is_open:
            return False  # before sealing: compressing an entry for a Redis that is down is wasted time
        data = seal(entry.encode(), self.signing_key)
        if len(data) > self.max_value_bytes:  # every reader would refuse it unread
            self._warn_once("size", f"entry {key} of {len(data)} bytes sealed exceeds the Redis tier's "
                                    f"{self.max_value_bytes} byte bound; not shared")
            return False
        try:
            return bool(self._call(lambda r: r.set(name, data)))
        except Down:
            return False
        except Exception as exc:  # out of memory (maxmemory), read-only replica, ...
            self._warn_once("write", f"Redis write of {name} failed ({exc}); entries are not shared")
            return False

    def keys(self) -> Iterator[str]:
        """Keys of the published entries; names that are not keys are skipped with a logged reason."""
        pattern = f"{self.prefix}:entry:*"
        try:
            names = self._call(lambda r: list(r.scan_iter(match=pattern, count=1000)))
        except Exception:
            return
        start = len(pattern) - 1
        for raw in sorted(names):
            key = raw[start:].decode("ascii", "replace")
            try:
                yield check_key(key)
            except ValueError as exc:
                log.warning("Redis key %r skipped: %s", raw[:200], exc)

    def stats(self) -> TierStats:
        keys = list(self.keys())

        def sizes_of(r: Any) -> list[int]:
            pipe = r.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(self.entry_key(key))
            return list(pipe.execute())

        try:
            sizes = self._call(sizes_of)
        except Exception:
            return TierStats(self.name, len(keys), 0)
        return TierStats(self.name, len(keys), int(sum(sizes)))

    def close(self) -> None:
        self._drop_connections()

    # --- compile leases -----------------------------------------------------------------------------------------

    def try_lease(self, key: str) -> Lease | None:
        """SET NX PX: the lease, or None while a live holder has it; LockUnavailable when Redis is down."""
        name, owner = self.lease_key(key), owner_token()
        renew_ms = str(int(self.lease_s * 1000))
        try:
            taken = self._call(lambda r: self._scripts["take"]([name], [owner, renew_ms]))
        except Down as exc:
            raise LockUnavailable(str(exc)) from exc
        except Exception as exc:
            raise LockUnavailable(f"Redis refused SET NX on {name}: {exc}") from exc
        if taken == 2:
            log.warning("compile lease %s had no expiry or one past the lease time; capped at %.1f s from now",
                        name, self.lease_s)
        if taken != 1:
            return None
        return Lease(key, owner, self.lease_s,
                     renew=lambda: bool(self._call(lambda r: self._scripts["renew"]([name], [owner, renew_ms]))),
                     release=lambda: self._call(lambda r: self._scripts["release"]([name], [owner])))
