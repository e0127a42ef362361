"""The Redis tier against a real redis-server on loopback: entries, leases, hostile values, timeouts, the
circuit breaker, and Redis killed and restarted in the middle of 1000 calls."""

from __future__ import annotations

import json
import logging
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sharedlib
import zstandard
from conftest import run_python
from sharedlib import SIGNING_KEY, RedisServer, count_renewals, make_entry, numbered, redis_client, stub_compile

from lazytriton import compiler, config, runtime
from lazytriton.cache_format.envelope import MAX_ENVELOPE_BYTES, seal
from lazytriton.store import redis_tier
from lazytriton.store.lease import LockUnavailable, lease_or_entry
from lazytriton.store.redis_tier import RedisTier

redis_server = sharedlib.redis_server
redis_url = sharedlib.redis_url

KEY, OTHER = "c3" * 16, "d4" * 16


def tier_at(url: str, **kwargs: Any) -> RedisTier:
    """A Redis tier with a 1 s timeout: these tests are about entries and leases, not about a starved CI machine
    (where redis-server can miss the 5 ms default and open the breaker)."""
    kwargs.setdefault("timeout_s", 1.0)
    return RedisTier(url, **kwargs)


def counted() -> tuple[list[str], Callable[..., None]]:
    seen: list[str] = []
    return seen, lambda name, amount=1: seen.append(name)


def test_put_get_round_trip_and_listing(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    tier = tier_at(redis_url)
    entry = make_entry(KEY)
    assert tier.get(KEY) is None
    assert tier.put(KEY, entry) and tier.get(KEY) == entry
    client = redis_client(redis_url)
    assert client.get(f"lazytriton:entry:{KEY}")[:8] == b"LTSHARE\0"
    client.set("lazytriton:entry:../../etc/passwd", b"x")  # what a hostile writer could add
    client.set("lazytriton:entry:" + "E" * 32, b"x")
    with caplog.at_level(logging.WARNING, "lazytriton"):
        assert list(tier.keys()) == [KEY]
    assert "../../etc/passwd" in caplog.text and "cache key must be 32 lowercase hex digits" in caplog.text
    assert tier.stats().entries == 1 and tier.stats().bytes == len(client.get(f"lazytriton:entry:{KEY}"))
    other = tier_at(redis_url, prefix="team-b")
    assert other.get(KEY) is None, "prefixes keep deployments apart"


def test_bad_keys_raise_before_any_command(redis_url: str) -> None:
    tier = tier_at(redis_url)
    for call in (lambda: tier.get("../x"), lambda: tier.put("../x", make_entry(KEY)), lambda: tier.try_lease("..")):
        with pytest.raises(ValueError, match="cache key must be 32 lowercase hex digits"):
            call()
    assert tier.calls == 0


def test_a_signed_tier_refuses_unsigned_foreign_and_hostile_values(redis_url: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    seen, count = counted()
    tier = tier_at(redis_url, signing_key=SIGNING_KEY, count=count)
    tier_at(redis_url).put(KEY, make_entry(KEY))
    tier_at(redis_url, signing_key=b"another-deployment-0000").put(OTHER, make_entry(OTHER))
    with caplog.at_level(logging.WARNING, "lazytriton"):
        assert tier.get(KEY) is None and tier.get(OTHER) is None and tier.get(KEY) is None
    assert seen == ["rejected", "rejected"]
    assert "carries no signature" in caplog.text and "HMAC-SHA256 does not match" in caplog.text


def test_hostile_values_are_refused_with_a_reason(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    seen, count = counted()
    tier = tier_at(redis_url, timeout_s=2.0, count=count)
    client = redis_client(redis_url)
    keys = {"oversized": "e5" * 16, "bomb": "f6" * 16, "garbage": "a7" * 16, "wrong type": "b8" * 16}
    client.setrange(tier.entry_key(keys["oversized"]), MAX_ENVELOPE_BYTES + 10, b"x")  # 64 MiB of zeros and more
    bomb = zstandard.ZstdCompressor().compress(bytes(100 << 20))
    client.set(tier.entry_key(keys["bomb"]), seal(b"x" * 2000)[:12] + len(bomb).to_bytes(4, "little")
               + (2000).to_bytes(4, "little") + bytes(32) + bomb)
    client.set(tier.entry_key(keys["garbage"]), b"\x00" * 100)
    client.lpush(tier.entry_key(keys["wrong type"]), b"x")
    with caplog.at_level(logging.WARNING, "lazytriton"):
        for key in keys.values():
            assert tier.get(key) is None
    text = caplog.text
    assert "oversized" in text and "bomb" in text and "not a shared envelope" in text and "WRONGTYPE" in text
    assert seen == ["rejected", "rejected", "corrupt"]
    assert not tier.breaker.is_open, "an error reply is not an outage"


def _bytes_sent(client: Any) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def test_a_60_mib_value_is_a_bad_entry_refused_unread_not_an_outage(
        redis_url: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    variant = numbered(60)
    key = variant.key()
    client = redis_client(redis_url)
    client.setrange(f"lazytriton:entry:{key}", (60 << 20) - 1, b"x")  # 60 MiB of junk under one entry key
    monkeypatch.setattr(compiler, "compile_variant", stub_compile)
    # The default 5 ms timeout: the value is never fetched, so nothing can time out on it (a starved machine
    # may still miss 5 ms on any command: then the breaker opens and this test fails for the other reason).
    config.configure(shared=redis_url, shared_timeout_ms=1000)
    rt = runtime.get()
    assert isinstance(rt.shared, RedisTier)
    before = _bytes_sent(client)
    with caplog.at_level(logging.WARNING, "lazytriton"):
        resolved = rt.resolve(variant)
    sent = _bytes_sent(client) - before
    assert resolved.source == "jit" and rt.compiles == 1, "a bad entry is rebuilt"
    rt.flush_counters()
    assert rt.counters().get("rejected") == 1, caplog.text
    assert "oversized" in caplog.text and key in caplog.text
    assert not rt.shared.breaker.is_open and rt.shared.breaker.opened == 0, "a big value is not an outage"
    assert "unreachable" not in caplog.text
    assert sent < 1 << 20, f"Redis sent {sent} bytes: the value was fetched"
    assert tier_at(redis_url).get(key) == stub_compile(variant, key), "the rebuilt entry replaced the junk"
    runtime.reset()


def test_an_entry_over_the_bound_is_not_published(redis_url: str) -> None:
    tier = tier_at(redis_url, max_value_bytes=1000)
    assert not tier.put(KEY, make_entry(KEY, size=5000))
    assert redis_client(redis_url).exists(tier.entry_key(KEY)) == 0
    with pytest.raises(ValueError, match="max_value_bytes"):
        tier_at(redis_url, max_value_bytes=0)


# --- leases -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("planted", ["no expiry", "expiry past the lease time", "wrong type, no expiry"])
def test_a_lease_that_never_expires_is_capped_and_taken_over(redis_url: str, planted: str,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    # Leases are unsigned: a signing key changes nothing, the cap alone protects the waiters.
    tier = tier_at(redis_url, lease_s=1, signing_key=SIGNING_KEY)
    client = redis_client(redis_url)
    name = tier.lease_key(KEY)
    if planted == "no expiry":
        client.set(name, "hostile")
    elif planted.startswith("expiry past"):
        client.set(name, "hostile", px=10**12)
    else:
        client.lpush(name, "hostile")
    with caplog.at_level(logging.WARNING, "lazytriton"):
        assert tier.try_lease(KEY) is None, "a lease is respected for one lease time from first sight"
    assert 0 < client.pttl(name) <= 1000 and "capped" in caplog.text
    start = time.monotonic()
    lease, entry = lease_or_entry(tier_at(redis_url, lease_s=1, signing_key=SIGNING_KEY), KEY, timeout_s=120)
    waited = time.monotonic() - start
    assert lease is not None and entry is None, f"the planted lease held the waiter for {waited:.1f} s"
    assert client.get(name).decode() == lease.owner
    lease.release()
    assert client.exists(name) == 0


def test_a_live_lease_is_never_capped(redis_url: str) -> None:
    holder, waiter = tier_at(redis_url, lease_s=5), tier_at(redis_url, lease_s=5)
    lease = holder.try_lease(KEY)
    assert lease is not None
    ttl = redis_client(redis_url).pttl(holder.lease_key(KEY))
    assert waiter.try_lease(KEY) is None
    assert redis_client(redis_url).pttl(holder.lease_key(KEY)) <= ttl, "only a TTL past the lease time is touched"
    lease.release()



def test_a_lease_is_set_nx_px_renewed_and_released_only_by_its_owner(redis_url: str) -> None:
    tier = tier_at(redis_url, lease_s=2)
    client = redis_client(redis_url)
    lease = tier.try_lease(KEY)
    assert lease is not None and client.get(tier.lease_key(KEY)).decode() == lease.owner
    assert 0 < client.pttl(tier.lease_key(KEY)) <= 2000
    assert tier.try_lease(KEY) is None and tier_at(redis_url).try_lease(KEY) is None
    renewals = count_renewals(lease, 4)  # every 0.67 s: over a lease time in all
    assert renewals == 4 and client.get(tier.lease_key(KEY)).decode() == lease.owner and not lease.lost
    lease._stop.set()  # the holder dies
    lease._thread.join()
    deadline = time.monotonic() + 60
    while client.get(tier.lease_key(KEY)) is not None:  # PX lets it expire
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.05)
    taken = tier_at(redis_url).try_lease(KEY)
    assert taken is not None
    lease._release()  # the dead holder's compare-and-delete leaves the new lease alone
    assert client.get(tier.lease_key(KEY)).decode() == taken.owner
    taken.release()
    assert client.get(tier.lease_key(KEY)) is None


def test_lease_or_entry_takes_what_the_holder_published(redis_url: str) -> None:
    holder, waiter = tier_at(redis_url), tier_at(redis_url)
    lease = holder.try_lease(KEY)
    assert lease is not None

    def publish() -> None:
        time.sleep(0.3)
        holder.put(KEY, make_entry(KEY))
        lease.release()

    threading.Thread(target=publish).start()
    assert lease_or_entry(waiter, KEY, timeout_s=30) == (None, make_entry(KEY))


# --- timeouts and the breaker ----------------------------------------------------------------------------------


def test_a_server_that_stops_answering_times_out_and_opens_the_breaker(
        redis_server: RedisServer, redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # Counts and events, not timings: the server is stopped (SIGSTOP) until the test continues it, so the first
    # call returned on its timeout (nothing could answer it); while the breaker is open no command is sent;
    # once the server runs again the probe closes the breaker.
    assert tier_at(redis_url).put(KEY, make_entry(KEY))  # a 1 s timeout: published even on a starved machine
    tier = tier_at(redis_url, timeout_s=0.005)
    assert tier.breaker.opened == 0
    assert redis_server.process is not None
    redis_server.process.send_signal(signal.SIGSTOP)  # the kernel still accepts connections; nothing answers
    try:
        with caplog.at_level(logging.WARNING, "lazytriton"):
            start = time.perf_counter()
            assert tier.get(KEY) is None
            first = time.perf_counter() - start
            calls = tier.calls
            start = time.perf_counter()
            for _ in range(100):
                assert tier.get(KEY) is None
                with pytest.raises(LockUnavailable):
                    tier.try_lease(KEY)
            open_each = (time.perf_counter() - start) / 100
            assert tier.breaker.is_open and tier.breaker.opened == 1
            assert tier.calls == calls, "an open breaker sends nothing"
            assert caplog.text.count("unreachable") == 1
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 60
    while tier.get(KEY) != make_entry(KEY):  # the probe closes the breaker; a starved get may open it again
        assert time.monotonic() < deadline, "the breaker never closed after the pause"
        time.sleep(0.05)
    print(f"\nRedis paused: first call {first * 1000:.1f} ms (timeout 5 ms), then {open_each * 1e6:.1f} us a call")


def test_a_process_forked_while_the_breaker_is_open_probes_for_itself(redis_url: str) -> None:
    import os

    tier = tier_at(redis_url, timeout_s=0.005)
    redis_client(redis_url).execute_command("CLIENT", "PAUSE", "600", "ALL")
    assert tier.get(KEY) is None and tier.breaker.is_open
    pid = os.fork()
    if pid == 0:  # the child inherits an open breaker, not the thread that would close it
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # a starved 5 ms put may open it again: the probe closes it again
            tier.get(KEY)
            if not tier.breaker.is_open and tier.put(KEY, make_entry(KEY)):
                os._exit(0)
            time.sleep(0.05)
        os._exit(1)
    assert os.waitpid(pid, 0)[1] == 0, "the forked process never reconnected"
    assert tier_at(redis_url).get(KEY) == make_entry(KEY)


def test_without_the_redis_package_lazytriton_imports_and_runs_locally(cache_dir: Path) -> None:
    code = """
import importlib.abc, json, sys
class BlockRedis(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "redis" or name.startswith("redis."):
            raise ImportError("redis is blocked in this test")
sys.meta_path.insert(0, BlockRedis())
import lazytriton, sharedlib
from lazytriton import compiler, runtime
compiler.compile_variant = sharedlib.stub_compile
rt = runtime.get()
print(json.dumps({"source": rt.resolve(sharedlib.numbered(1)).source, "shared": rt.shared is None,
                  "redis": "redis" in sys.modules}))
"""
    result = run_python(code, {"LAZYTRITON_SHARED": "redis://127.0.0.1:1/0", "PYTHONPATH": str(sharedlib.TESTS)})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"source": "jit", "shared": True, "redis": False}
    assert "redis package is not installed" in result.stderr


# --- Redis killed and restarted in the middle of 1000 calls -----------------------------------------------------


def _timed(tier: RedisTier, spent: list[float]) -> None:
    """Add the wall and CPU time spent inside the tier's get/put/try_lease to ``spent[0]`` and ``spent[1]``."""
    for name in ("get", "put", "try_lease"):
        method = getattr(tier, name)

        def timed(*args: Any, _method: Any = method) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return _method(*args)
            finally:
                spent[0] += time.perf_counter() - start
                spent[1] += time.thread_time() - cpu

        setattr(tier, name, timed)


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000


def _misses_without_a_shared_tier(tmp_path: Path, n: int) -> list[float]:
    config.configure(cache_dir=tmp_path / "baseline", shared="")
    rt = runtime.get()
    times = []
    for i in range(-20, n):  # 20 to warm up (first opens of the local tier, imports), not counted
        start = time.perf_counter()
        rt.resolve(numbered(100_000 + i))
        if i >= 0:
            times.append(time.perf_counter() - start)
    return times


def test_redis_killed_and_restarted_in_the_middle_of_1000_calls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    sharedlib.need("redis-server", sharedlib.REDIS_SERVER is not None)
    sharedlib.need("the redis Python package", redis_tier.redis_available())
    server = RedisServer(tmp_path)
    server.start()
    monkeypatch.setattr(compiler, "compile_variant", stub_compile)
    try:
        baseline = _misses_without_a_shared_tier(tmp_path, 300)
        # A killed Redis refuses connections at once on loopback, so the timeout plays no part in what is
        # measured; 100 ms instead of 5 keeps a CPU-starved CI machine from opening the breaker while Redis is up.
        # Misses without a shared tier, timed beside the breaker's (the same minutes of the machine's load).
        config.configure(cache_dir=tmp_path / "beside", shared="")
        beside_rt, beside = runtime.Runtime(config.settings()), []
        config.configure(cache_dir=tmp_path / "node", shared=server.url, shared_timeout_ms=100)
        rt = runtime.get()
        hits_rt = runtime.Runtime(config.settings())  # same cache dir, empty memory: its lookups hit the local tier
        assert rt.shared is not None and hits_rt.shared is not None and beside_rt.shared is None
        spent = [0.0, 0.0]
        _timed(rt.shared, spent)
        rows = []
        with caplog.at_level(logging.WARNING, "lazytriton"):
            for i in range(1000):
                if i == 300:
                    server.kill()
                if i == 700:
                    server.start()
                was_open, outages, spent[:] = rt.shared.breaker.is_open, rt.shared.breaker.opened, [0.0, 0.0]
                commands = rt.shared.calls
                start = time.perf_counter()
                resolved = hits_rt.resolve(numbered(i - 1)) if i % 4 == 3 else rt.resolve(numbered(i))
                elapsed = time.perf_counter() - start
                assert resolved.entry.key == numbered(i - 1 if i % 4 == 3 else i).key()
                # "open": the breaker was open from the call's start to its end (not closed by the probe meanwhile)
                is_open = was_open and rt.shared.breaker.is_open and rt.shared.breaker.opened == outages
                rows.append({"i": i, "hit": i % 4 == 3, "source": resolved.source, "open": is_open,
                             "s": elapsed, "shared_s": spent[0], "shared_cpu_s": spent[1],
                             "commands": rt.shared.calls - commands})
                if 300 <= i < 700 and i % 4 == 1:
                    start = time.perf_counter()
                    beside_rt.resolve(numbered(200_000 + i))
                    beside.append(time.perf_counter() - start)
        deadline = time.monotonic() + 10
        while rt.shared.breaker.is_open:
            assert time.monotonic() < deadline, "the breaker never closed after Redis came back"
            time.sleep(0.05)
        assert rt.resolve(numbered(5000)).source == "jit"
        assert redis_client(server.url).exists(f"lazytriton:entry:{numbered(5000).key()}"), "publishing again"
    finally:
        server.kill()
        runtime.reset()
    _report_and_check(rows, baseline, beside, hits_rt, caplog.text)


def _report_and_check(rows: list[dict[str, Any]], baseline: list[float], beside: list[float],
                      hits_rt: runtime.Runtime, log_text: str) -> None:
    misses = [r for r in rows if not r["hit"]]
    up = [r["s"] for r in misses if not r["open"] and (r["i"] < 300 or r["i"] >= 700)]
    down = [r["s"] for r in misses if r["open"]]
    detect = [r for r in misses if 300 <= r["i"] < 700 and not r["open"]]
    hits = {phase: [r["s"] for r in rows if r["hit"] and cond(r["i"])]
            for phase, cond in (("up", lambda i: i < 300 or i >= 700), ("down", lambda i: 300 <= i < 700))}
    report = {
        "calls": len(rows), "failed": 0,
        "miss_ms_no_shared_tier_p50_p95": (_pct(baseline, 0.5), _pct(baseline, 0.95)),
        "miss_ms_redis_up_p50_p95": (_pct(up, 0.5), _pct(up, 0.95)),
        "miss_ms_breaker_open_p50_p95_max": (_pct(down, 0.5), _pct(down, 0.95), _pct(down, 1.0)),
        "miss_ms_no_shared_tier_beside_open_p50": _pct(beside, 0.5),
        "added_ms_while_open_p50": _pct(down, 0.5) - _pct(beside, 0.5),
        "shared_tier_ms_while_open_p50_p99_max": tuple(_pct([r["shared_s"] for r in misses if r["open"]], q)
                                                       for q in (0.5, 0.99, 1.0)),
        "redis_commands_sent_while_open": sum(r["commands"] for r in misses if r["open"]),
        "shared_tier_cpu_ms_while_open_max": max(r["shared_cpu_s"] for r in misses if r["open"]) * 1000,
        "detecting_calls_ms": [round(r["s"] * 1000, 2) for r in detect],
        "slowest_miss_ms_redis_up": _pct(up, 1.0),
        "local_hit_ms_p50_up_down": (_pct(hits["up"], 0.5), _pct(hits["down"], 0.5)),
        "redis_commands_sent_by_hits": hits_rt.shared.calls if hits_rt.shared is not None else None,
    }
    print("\nRedis killed at call 300, restarted at 700:\n" + json.dumps(
        {k: [round(x, 3) for x in v] if isinstance(v, tuple) else (round(v, 3) if isinstance(v, float) else v)
         for k, v in report.items()}, indent=1), file=sys.stderr)
    assert len(down) >= 250, "the breaker opened at the kill and stayed open while Redis was down"
    # An open breaker sends nothing and waits for nothing: what it adds is CPU time (every call under 5 ms).
    # Wall time is reported; asserted at the median only, since on a 2-core CI machine running 30 other
    # processes a preemption can land in any microsecond of any call.
    assert report["redis_commands_sent_while_open"] == 0
    # CPU time of the worst of ~400 calls: bounded generously (a loaded 2-core machine measured 7.3 ms once);
    # what matters, that an open breaker sends and waits for nothing, is asserted by count and at the median.
    assert report["shared_tier_cpu_ms_while_open_max"] <= 50.0, "an open breaker adds no real work to a miss"
    assert report["shared_tier_ms_while_open_p50_p99_max"][0] <= 5.0
    assert report["added_ms_while_open_p50"] <= 5.0
    # Held up: waiting on Redis (a timeout, retries) 100 ms past the slowest of the hundreds of misses while Redis
    # was up, which bounds what the machine's load alone makes of a call (a few ms on an idle machine).
    assert all(ms <= 100 + report["slowest_miss_ms_redis_up"] for ms in report["detecting_calls_ms"]), (
        "the call that found Redis down was held up")
    assert report["redis_commands_sent_by_hits"] == 0, "a local hit never touches Redis"
    assert statistics.median(hits["down"]) <= statistics.median(hits["up"]) + 0.005
    assert "unreachable" in log_text and "answers again" in log_text
