"""Locks are per key: a compile (or a lease wait) for one key never delays another key's lookup.

Issue 9: the runtime held one lock across the whole resolve, so a 10 s compile
of one key stalled every other thread's lookup, even an image hit for another
key. Here a fake compile blocks on an event for up to 30 s while other threads
resolve other keys from memory, an image and the local tier; each must finish
while the compile is still blocked. The deadlines are generous (2 s against a
30 s block): they cannot flake on a loaded machine, yet a lock shared across
keys, which would make them wait out the blocked compile, fails them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from compiled_once import small_variant

import lazytriton.driver
from lazytriton import compiler, config, runtime
from lazytriton.cache_format import Entry, Provenance
from lazytriton.cache_format.image import write_image
from lazytriton.variant import Variant

BLOCK_S = 30.0  # how long the fake compile may stay blocked
FAST_S = 2.0  # the issue asks for 50 ms; 2 s cannot flake and still catches a lock that waits out BLOCK_S
DEADLINE_S = 60.0

COMPILING = small_variant("sm_90")
MEMORY = small_variant("sm_90", causal=True)
IMAGE = small_variant("sm_80")
LOCAL = small_variant("gfx942")


def fake_entry(variant: Variant) -> Entry:
    return Entry(
        key=variant.key(), variant=str(variant), target=variant.target, kind="cubin",
        binary=b"\x7fELF" + bytes(4000), name="k", num_warps=4, num_ctas=1, warp_size=32, shared=0,
        global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
        arg_types=("i32",), hidden_args=(), provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1),
    )


class BlockingCompile:
    """A stand-in for ``compiler.compile_variant`` that blocks until released (or BLOCK_S)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.calls: list[str] = []
        self.error = error

    def __call__(self, variant: Variant, key: str | None = None) -> Entry:
        self.calls.append(str(variant))
        self.started.set()
        self.release.wait(BLOCK_S)
        if self.error is not None:
            raise self.error
        return fake_entry(variant)


@pytest.fixture
def blocking(monkeypatch: pytest.MonkeyPatch) -> Iterator[BlockingCompile]:
    fake = BlockingCompile()
    monkeypatch.setattr(compiler, "compile_variant", fake)
    yield fake
    fake.release.set()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a daemon thread; the dict gets its ``value`` or ``error`` and the ``seconds`` it took."""
    out: dict[str, Any] = {}

    def run() -> None:
        start = time.perf_counter()
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc
        out["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def hold(blocker: str, blocking: BlockingCompile, cache_dir: Path) -> Callable[[], None]:
    """Make resolving COMPILING block on ``blocker``; returns what releases it."""
    if blocker == "compile":
        return blocking.release.set
    blocking.release.set()  # the compile itself is quick; the wait is for the file lock or the lease
    if blocker == "file_lock":  # as another process holding the key's compile lock
        from filelock import FileLock

        lock = FileLock(str(cache_dir / "locks" / f"{COMPILING.key()}.lock"))
        (cache_dir / "locks").mkdir(parents=True, exist_ok=True)
        lock.acquire()
        return lock.release
    from lazytriton.store.shared import open_shared

    other_node = open_shared(config.settings())  # another node on the same shared directory
    assert other_node is not None
    lease = other_node.try_lease(COMPILING.key())
    assert lease is not None
    return lease.release


@pytest.mark.parametrize("blocker", ["compile", "file_lock", "lease"])
def test_a_blocked_key_delays_no_lookup_of_another_key(tmp_path: Path, cache_dir: Path, blocking: BlockingCompile,
                                                       blocker: str) -> None:
    write_image(tmp_path / "one.ltimg", [fake_entry(IMAGE)], codec="zstd")
    config.configure(images=[tmp_path / "one.ltimg"],
                     shared=f"file://{tmp_path / 'shared'}" if blocker == "lease" else None)
    (tmp_path / "shared").mkdir()
    rt = runtime.get()
    rt.local.put(LOCAL.key(), fake_entry(LOCAL))
    rt.local.put(MEMORY.key(), fake_entry(MEMORY))
    assert rt.resolve(MEMORY).source == "local"  # now in memory
    release = hold(blocker, blocking, cache_dir)

    try:
        compiling, compiled = in_thread(lambda: rt.resolve(COMPILING))
        same_key, _ = in_thread(lambda: rt.resolve(COMPILING))
        wait_for(lambda: rt.waiting(COMPILING.key()) == 1, "a second thread waiting for the blocked key")
        lookups = {name: in_thread(lambda v=variant: rt.resolve(v))  # type: ignore[misc]
                   for name, variant in (("memory", MEMORY), ("image", IMAGE), ("local", LOCAL))}
        for name, (thread, out) in lookups.items():
            thread.join(DEADLINE_S)
            assert "error" not in out, out.get("error")
            assert out["value"].source == name
            assert compiling.is_alive(), f"the {blocker} ended before the lookups"
            assert out["seconds"] < FAST_S, f"a {name} hit took {out['seconds']:.2f} s behind another key's {blocker}"
        if blocker != "compile":
            assert not blocking.calls, "compiled while another process held the key"
    finally:
        release()
    compiling.join(DEADLINE_S)
    same_key.join(DEADLINE_S)
    assert compiled["value"].source == "jit" and rt.compiles == 1 and len(blocking.calls) == 1


def test_a_blocked_kernel_load_delays_no_load_of_another_key(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = runtime.get()
    for variant in (COMPILING, LOCAL):
        rt.local.put(variant.key(), fake_entry(variant))
    started, release = threading.Event(), threading.Event()

    def load(entry: Entry, device_index: int, dependent: bool = False) -> tuple[str, int]:
        if entry.key == COMPILING.key():
            started.set()
            release.wait(BLOCK_S)
        return entry.key, device_index

    monkeypatch.setattr(lazytriton.driver, "load", load)
    slow, slow_out = in_thread(lambda: rt.kernel(COMPILING, 0))
    assert started.wait(DEADLINE_S)
    fast, fast_out = in_thread(lambda: rt.kernel(LOCAL, 0))
    fast.join(DEADLINE_S)
    assert fast_out.get("value") == (LOCAL.key(), 0), fast_out
    assert fast_out["seconds"] < FAST_S and slow.is_alive()
    release.set()
    slow.join(DEADLINE_S)
    assert slow_out["value"] == (COMPILING.key(), 0)
    assert rt.kernel(COMPILING, 0) is slow_out["value"]


def _same_key_threads(rt: runtime.Runtime, blocking: BlockingCompile,
                      n: int = 4) -> list[tuple[threading.Thread, dict[str, Any]]]:
    """``n`` threads resolving COMPILING; returns once the first is compiling and the others wait for it."""
    threads = [in_thread(lambda: rt.resolve(COMPILING))]
    assert blocking.started.wait(DEADLINE_S)
    threads += [in_thread(lambda: rt.resolve(COMPILING)) for _ in range(n - 1)]
    wait_for(lambda: rt.waiting(COMPILING.key()) == n - 1, f"{n - 1} threads waiting for the compile")
    blocking.release.set()
    for thread, _ in threads:
        thread.join(DEADLINE_S)
        assert not thread.is_alive()
    return threads


def test_threads_missing_the_same_key_compile_it_once(blocking: BlockingCompile) -> None:
    rt = runtime.get()
    threads = _same_key_threads(rt, blocking)
    entries = [out["value"].entry for _, out in threads]
    assert len(blocking.calls) == 1 and rt.compiles == 1
    assert all(entry == entries[0] for entry in entries)
    assert sorted(out["value"].source for _, out in threads) == ["jit", "memory", "memory", "memory"]


def test_a_failed_compile_is_raised_to_every_waiting_thread_and_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    failing = BlockingCompile(error=compiler.CompileError("boom"))
    monkeypatch.setattr(compiler, "compile_variant", failing)
    rt = runtime.get()
    threads = _same_key_threads(rt, failing)
    assert len(failing.calls) == 1
    assert all(isinstance(out.get("error"), compiler.CompileError) for _, out in threads), threads
    # Not cached: the next call compiles again.
    fixed = BlockingCompile()
    fixed.release.set()
    monkeypatch.setattr(compiler, "compile_variant", fixed)
    assert rt.resolve(COMPILING).source == "jit" and len(fixed.calls) == 1
