"""Helpers for the shared-tier and fault tests: a real redis-server on loopback, entries, node processes.

Test modules bind the fixtures by assignment (``redis_server = sharedlib.redis_server``). Child
processes import this module too (``PYTHONPATH`` points at tests/), so a node can swap in a stub
compiler, and ``kill_trials`` runs the SIGKILL writer trials in a single-threaded process.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from lazytriton import record
from lazytriton.cache_format import Entry, Provenance
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.store.redis_tier import redis_available
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

TESTS = Path(__file__).resolve().parent
REDIS_SERVER = shutil.which("redis-server")
# The small sm_90 variant of test_cache.py: a real compile takes about a second.
VARIANT = fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, False, True, 4096,
                                         config=Config(64, 32, 4, 2))
SIGNING_KEY = b"deployment-key-0123456789abcdef"


def need(what: str, present: bool) -> None:
    """Skip when a tool is missing on a developer's machine; fail in CI, where .ci/run installs it."""
    if present:
        return
    message = f"{what} is not installed (.ci/run installs it: apt-get install redis-server; pip install '.[test]')"
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


def numbered(i: int) -> Variant:
    """A variant of its own key for each ``i`` (an extra tuned field the compiler never sees)."""
    return record.replace(VARIANT, tuned=(*VARIANT.tuned, ("SEED", i)))


def make_entry(key: str, variant: str | None = None, size: int = 50_000, seed: int = 0) -> Entry:
    """An entry of ``size`` bytes of pseudo-random binary (a cubin's worth of entropy); never launched."""
    binary = b"\x7fELF" + random.Random(f"{key}{seed}").randbytes(size)
    return Entry(
        key=key, variant=variant or str(VARIANT), target="sm_90", kind="cubin", binary=binary, name="k",
        num_warps=4, num_ctas=1, warp_size=32, shared=0, global_scratch_size=0, global_scratch_align=1,
        profile_scratch_size=0, profile_scratch_align=1, arg_types=("i32",), hidden_args=(),
        provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1),
    )


def stub_compile(variant: Variant, key: str | None = None) -> Entry:
    """Stands in for ``compiler.compile_variant`` where the test is about the cache, not Triton."""
    return make_entry(key or variant.key(), str(variant))


def count_renewals(lease: Any, wanted: int, deadline_s: float = 60) -> int:
    """Wait for ``wanted`` successful renewals of ``lease`` (its background thread); how many were seen."""
    seen = threading.Semaphore(0)
    renew = lease._renew

    def counting() -> bool:
        still_ours = bool(renew())
        if still_ours:
            seen.release()
        return still_ours

    lease._renew = counting
    return sum(1 for _ in range(wanted) if seen.acquire(timeout=deadline_s))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server of this test run only: loopback, a free port, no persistence, in a temp dir."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_SERVER is not None
        log = open(self.directory / "redis.log", "ab")
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory), "--daemonize", "no"], stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while not self.answers():
            assert self.process.poll() is None, (self.directory / "redis.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "redis-server did not answer within 10 s"
            time.sleep(0.01)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash, with everything it held."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def flush(self) -> None:
        redis_client(self.url).flushall()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server per test module (and xdist worker)."""
    need("redis-server", REDIS_SERVER is not None)
    need("the redis Python package", redis_available())
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The module's redis-server, emptied for this test."""
    if not redis_server.answers():  # a test killed it: bring it back
        redis_server.start()
    redis_server.flush()
    return redis_server.url


def redis_client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=5)


def xxh(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def child_env(cache_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a node process: its own local cache, this module importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYTRITON_")}
    env.update(LAZYTRITON_CACHE_DIR=str(cache_dir), PYTHONPATH=str(TESTS), **extra)
    return env


# A node: resolves VARIANT (or $VARIANT) once, after an optional barrier, and prints one JSON line.
# STUB=fake swaps in stub_compile; STUB=hang marks $MARK and hangs in the compiler (a holder to kill).
NODE = """
import json, os, sys, time, xxhash
from pathlib import Path
from lazytriton import compiler, runtime
from lazytriton.variant import Variant
stub = os.environ.get("STUB", "")
if stub == "fake":
    import sharedlib
    compiler.compile_variant = sharedlib.stub_compile
elif stub == "hang":
    def hang(variant, key=None):
        Path(os.environ["MARK"]).touch()
        time.sleep(3600)
    compiler.compile_variant = hang
variant = Variant.parse(os.environ["VARIANT"])
rt = runtime.get()
if os.environ.get("GO"):
    Path(os.environ["READY"]).touch()
    while not Path(os.environ["GO"]).exists():
        time.sleep(0.005)
start = time.time()
resolved = rt.resolve(variant)
print(json.dumps({"source": resolved.source, "compiles": rt.compiles, "counters": rt.counters(),
                  "binary": xxhash.xxh3_64_hexdigest(resolved.entry.binary), "start": start, "end": time.time()}))
"""


def start_node(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", NODE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def node_result(process: subprocess.Popen[str], timeout: float = 300) -> dict[str, Any]:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-4000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


# --- SIGKILL writer trials -------------------------------------------------------------------------------------

KEYS = [f"{i:x}" * 32 for i in range(4)]


def make_tier(kind: str, location: str) -> Any:
    """A fresh tier object of ``kind`` (local, dir, redis) at ``location`` (path or URL)."""
    if kind == "local":
        from lazytriton.store.local import LocalTier

        return LocalTier(location)
    if kind == "dir":
        from lazytriton.store.shared_dir import SharedDirTier

        return SharedDirTier(location)
    from lazytriton.store.redis_tier import RedisTier

    return RedisTier(location, timeout_s=1.0)


def _write_forever(kind: str, location: str, versions: dict[str, list[Entry]], done: int) -> None:
    """A writer child: overwrite every key with alternating versions until killed; a byte to ``done`` per put."""
    tier = make_tier(kind, location)
    i = 0
    while True:
        key = KEYS[i % len(KEYS)]
        if tier.put(key, versions[key][(i // len(KEYS)) % 2]):
            os.write(done, b".")
        i += 1


def _wait_for_puts(done: int, count: int, pid: int, deadline_s: float = 120) -> None:
    """Block until the writer has finished ``count`` puts (it starts slowly on a loaded machine: an event, not
    a delay, decides when the random kill delay starts)."""
    deadline = time.monotonic() + deadline_s
    while count > 0:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            raise TimeoutError(f"the writer finished fewer puts than expected in {deadline_s} s")
        if select.select([done], [], [], min(left, 1.0))[0]:
            got = os.read(done, count)
            if not got:
                raise RuntimeError("the writer exited before it was killed (its stderr says why)")
            count -= len(got)


def kill_trials(kind: str, location: str, trials: int, max_delay_s: float, seed: int) -> dict[str, Any]:
    """Fork a writer, SIGKILL it at a random point, read every key back; ``trials`` times. Single-threaded.

    The writer is killed a random 0..``max_delay_s`` after a random number of its puts completed (every key's,
    in the first trial, so that there is something to read back however slow the machine is).
    """
    rng = random.Random(seed)
    versions = {key: [make_entry(key, size=200_000, seed=v) for v in (0, 1)] for key in KEYS}
    report: dict[str, Any] = {"kind": kind, "trials": 0, "hits": 0, "misses": 0, "wrong": 0, "refused": 0}
    for trial in range(trials):
        done, signalled = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer
            try:
                os.close(done)
                _write_forever(kind, location, versions, signalled)
            finally:
                os._exit(1)
        os.close(signalled)
        try:
            _wait_for_puts(done, len(KEYS) if trial == 0 else rng.randint(0, len(KEYS)), pid)
            time.sleep(rng.uniform(0, max_delay_s))  # a random point of a write, not a wait for anything
            os.kill(pid, signal.SIGKILL)
        finally:
            os.waitpid(pid, 0)
            os.close(done)
        refused: list[str] = []
        reader = make_tier(kind, location)
        if kind != "local":
            reader.gate.count = lambda name, amount=1, seen=refused: seen.append(name)
        for key in KEYS:
            entry = reader.get(key)
            if entry is None:
                report["misses"] += 1
            elif entry in versions[key]:
                report["hits"] += 1
            else:
                report["wrong"] += 1
        report["refused"] += len(refused) + (reader.counters().get("corrupt", 0) if kind == "local" else 0)
        if kind == "local":
            reader.close()
        report["trials"] += 1
    # The cache keeps working: a new key is written and read back.
    tier = make_tier(kind, location)
    fresh = make_entry("f" * 32)
    report["works_after"] = bool(tier.put(fresh.key, fresh)) and tier.get(fresh.key) == fresh
    return report


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    print(json.dumps(kill_trials(**args)))
