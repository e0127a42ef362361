"""Prewarm's fork server: workers forked from one process that imported Triton, and every way back to plain ones.

Most tests run the pool with a probe worker written into the test's folder
(``PROBE``): it reports, for each variant it is handed, what its process
looks like (session, parent, limits, the address layout of what it execs,
Triton's key) instead of compiling, and on chosen keys hangs with a child
process in its group, or kills its fork server. One test builds real
variants with and without the server and compares the images.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from lazytriton import float8_lowering
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.prewarm import forkserver, pool
from lazytriton.prewarm.enumeration import Planned
from lazytriton.prewarm.workdir import WorkDir
from lazytriton.target import Target

forking = pytest.mark.skipif(not forkserver.supported(), reason="the fork server runs on Linux only")

SM90 = Target.parse("sm_90")
ADDR_NO_RANDOMIZE = 0x0040000

PROBE = '''
import json, os, resource, signal, subprocess, sys, threading
from pathlib import Path
from lazytriton.prewarm import worker

def keys(name):
    return os.environ.get(name, "").split(",")

def build_one(text, key, work_path, created):
    import triton.runtime.cache as cache
    facts = {"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
             "personality": int(subprocess.run(["cat", "/proc/self/personality"], capture_output=True,
                                               text=True, check=True).stdout, 16),
             "triton_key": cache.triton_key(), "memory": resource.getrlimit(resource.RLIMIT_AS)[0],
             "torch": "torch" in sys.modules, "threads": len(os.listdir("/proc/self/task"))}
    if key in keys("PROBE_HANG_KEYS"):  # a compile that never ends, with an assembler running in its group
        facts["child"] = subprocess.Popen(["sleep", "600"]).pid
    if key in keys("PROBE_KILL_SERVER_KEYS") and os.getppid() != int(os.environ["PROBE_PARENT"]):
        os.kill(os.getppid(), signal.SIGKILL)  # its fork server (a plain worker's parent is the test)
        facts["killed_server"] = True
    out = Path(os.environ["PROBE_DIR"]) / f"{key}.json"
    out.with_suffix(".tmp").write_text(json.dumps(facts))
    out.with_suffix(".tmp").replace(out)
    if "child" in facts or facts.get("killed_server"):
        threading.Event().wait()

worker.build_one = build_one
{extra}
if __name__ == "__main__":
    sys.exit(worker.main(sys.argv[1:]))
'''
# What makes a fork server refuse to serve, as a line the probe runs when it is imported (the server imports it).
UNSAFE = {"threads": "threading.Thread(target=threading.Event().wait, daemon=True).start()",
          "torch": "import types; sys.modules.setdefault('torch', types.ModuleType('torch'))"}


def variants(n: int) -> list[Planned]:
    """``n`` distinct small variants (the probe compiles none of them)."""
    found = [fwd_dispatch.flash_fwd_variant(SM90, "fp16", 16, causal, True, seqlen)
             for causal in (False, True) for seqlen in (16, 64, 4096)]
    assert len({v.key() for v in found}) == len(found) >= n
    return [Planned(v, v.key(), "test") for v in found[:n]]


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The probe as the pool's worker module; yields the folder its reports go to."""
    modules = tmp_path / "modules"
    modules.mkdir()
    for name, extra in (("prewarm_probe", ""), *((f"prewarm_probe_{k}", line) for k, line in UNSAFE.items())):
        (modules / f"{name}.py").write_text(PROBE.replace("{extra}", extra))
    reports = tmp_path / "reports"
    reports.mkdir()
    monkeypatch.syspath_prepend(str(modules))  # the pool passes sys.path on to its workers and server
    monkeypatch.setattr(pool, "WORKER_MODULE", "prewarm_probe")
    monkeypatch.setenv("PROBE_DIR", str(reports))
    monkeypatch.setenv("PROBE_PARENT", str(os.getpid()))
    yield reports


def facts(reports: Path, key: str) -> dict[str, Any]:
    return json.loads((reports / f"{key}.json").read_text())


def run_pool(todo: list[Planned], jobs: int, work: Path, fork: bool | None = True,
             limits: pool.Limits | None = None) -> tuple[pool.Started, dict[str, pool.Result]]:
    results: dict[str, pool.Result] = {}
    started = pool.compile_all(todo, jobs, WorkDir(work).create(), None, lambda p, r: results.__setitem__(p.key, r),
                               limits, fork=fork)
    return started, results


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie has: only its parent's reaping is left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def wait_until(condition: Callable[[], bool], what: str, limit: float = 120.0) -> None:
    """Poll ``condition`` until it holds; the limit only stops a test that would hang."""
    import time

    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.02)


# --- the switch (pure) ------------------------------------------------------------------------------------------


def test_the_switch_takes_yes_and_no_and_names_a_bad_value() -> None:
    assert pool.fork_server_wanted({}, True) and not pool.fork_server_wanted({}, False)
    for yes in ("1", "true", "Yes", " on "):
        assert pool.fork_server_wanted({"LAZYTRITON_PREWARM_FORK": yes}, True)
        assert not pool.fork_server_wanted({"LAZYTRITON_PREWARM_FORK": yes}, False), "no fork: never"
    for no in ("0", "false", "NO", "off"):
        assert not pool.fork_server_wanted({"LAZYTRITON_PREWARM_FORK": no}, True)
    with pytest.raises(ValueError, match=r"LAZYTRITON_PREWARM_FORK must be one of .*'maybe'"):
        pool.fork_server_wanted({"LAZYTRITON_PREWARM_FORK": "maybe"}, True)


def test_a_bad_switch_is_a_usage_error_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main as cli_main

    monkeypatch.setenv("LAZYTRITON_PREWARM_FORK", "maybe")
    out = tmp_path / "never.ltimg"
    assert cli_main(["prewarm", "--target", "sm_90", "--kernel", "flash_fwd", "--dtype", "fp16", "--head-dim", "16",
                     "--out", str(out)]) == 2
    assert "LAZYTRITON_PREWARM_FORK must be one of 1/0/true/false/yes/no/on/off, got 'maybe'" in capsys.readouterr().err
    assert not out.exists() and not Path(f"{out}.work").exists()


# --- forked workers ---------------------------------------------------------------------------------------------


@forking
def test_a_forked_worker_is_set_up_like_a_plain_one(probe: Path, tmp_path: Path) -> None:
    """Own session, its limit, no address randomisation for what it execs, Triton's key skipped, one thread, no
    torch; forked from the server (whose children they are), and all of them reaped at the end."""
    todo = variants(4)
    limits = pool.Limits(memory=3 << 30)
    seen = {}
    for fork in (True, False):
        started, results = run_pool(todo, 2, tmp_path / f"work-{fork}", fork, limits)
        assert started.forked == (2 if fork else 0) and started.plain == (0 if fork else 2)
        assert (started.server_ready is not None) == fork
        assert all(r.error is None for r in results.values()) and set(results) == {p.key for p in todo}
        seen[fork] = [facts(probe, p.key) for p in todo]
        for report in seen[fork]:
            assert report["sid"] == report["pgid"] == report["pid"], "its own session: a time-out kills its group"
            assert report["memory"] == 3 << 30
            assert int(report["personality"]) & ADDR_NO_RANDOMIZE
            assert str(report["triton_key"]).startswith("lazytriton-prewarm-worker-")
            assert report["torch"] is False and report["threads"] == 1
        pids = {r["pid"] for r in seen[fork]}
        assert len(pids) == 2 and all(gone(int(pid)) for pid in pids)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(int(pid), 0)  # reaped, not a zombie
    parents = {r["ppid"] for r in seen[True]}
    assert len(parents) == 1 and os.getpid() not in parents, "forked by the one server"
    assert {r["ppid"] for r in seen[False]} == {os.getpid()}


@forking
def test_a_timed_out_forked_worker_is_killed_with_its_group(probe: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    [hung] = variants(1)
    monkeypatch.setenv("PROBE_HANG_KEYS", hung.key)
    work = WorkDir(tmp_path / "work").create()
    limits = pool.Limits(timeout=1.0)
    # The server's imports get the default limit (a loaded machine may take seconds); the variant gets 1 s
    server = pool._start_server([hung], work, None, pool.Limits())
    assert server is not None
    try:
        worker = pool._Worker(0, work, None, limits, server)
        assert worker.forked and worker.assign(hung)
        wait_until(lambda: (probe / f"{hung.key}.json").exists(), "the probe's report")
        report = facts(probe, hung.key)
        result = worker.time_out()  # what compile_all does once the variant is overdue
        assert result.key == hung.key and "timed out" in str(result.error) and "--variant-timeout" in str(result.error)
        assert gone(int(report["pid"])) and worker.process.returncode == -signal.SIGKILL
        wait_until(lambda: gone(int(report["child"])), "the worker's child")
        assert server.usable, "the server goes on forking"
    finally:
        server.close()
    assert server.process.returncode == 0


@forking
def test_a_forked_worker_killed_mid_variant_is_that_variants_failure(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """prewarm_fake_worker's compile kills its worker (SIGKILL) on one key: that variant fails with the cause, and a
    worker forked again from the server takes the rest."""
    todo = variants(3)
    monkeypatch.setattr(pool, "WORKER_MODULE", "prewarm_fake_worker")
    monkeypatch.setenv("FAKE_KILL_KEYS", todo[0].key)  # the others are compiled for real
    work = WorkDir(tmp_path / "work").create()
    results: dict[str, pool.Result] = {}
    started = pool.compile_all(todo, 1, work, None, lambda p, r: results.__setitem__(p.key, r), fork=True)
    assert started.forked == 2 and started.plain == 0, "the replacement was forked from the same server"
    assert "worker process killed by SIGKILL while compiling it" in str(results[todo[0].key].error)
    assert [results[p.key].error for p in todo[1:]] == [None, None]
    assert set(work.keys()) == {p.key for p in todo[1:]}


@forking
def test_a_server_that_dies_mid_build_hands_its_variants_to_plain_workers(
        probe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    todo = variants(4)
    monkeypatch.setenv("PROBE_KILL_SERVER_KEYS", todo[0].key)
    with caplog.at_level(logging.WARNING, logger="lazytriton.prewarm"):
        started, results = run_pool(todo, 2, tmp_path / "work")
    assert {key: r.error for key, r in results.items()} == {p.key: None for p in todo}, "nothing failed"
    # The second worker is forked only if the server lives until it is asked for it: on a loaded machine the first
    # one may get todo[0] and kill the server before that (1 in ~8 runs beside busy loops, 12-02)
    assert 1 <= started.forked <= 2 and started.plain >= 1
    assert facts(probe, todo[0].key)["ppid"] == os.getpid(), "the variant was built again, by a plain worker"
    assert "the fork server is gone" in caplog.text and "plain worker processes take over" in caplog.text


@forking
@pytest.mark.parametrize("why", ["cannot start", *UNSAFE])
def test_a_server_that_cannot_serve_leaves_plain_workers(why: str, probe: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    if why == "cannot start":
        monkeypatch.setattr(forkserver, "SERVER_MODULE", "lazytriton.prewarm.no_such_server")
    else:
        monkeypatch.setattr(pool, "WORKER_MODULE", f"prewarm_probe_{why}")
    todo = variants(3)
    with caplog.at_level(logging.WARNING, logger="lazytriton.prewarm"):
        started, results = run_pool(todo, 2, tmp_path / "work")
    assert started == pool.Started(forked=0, plain=2, server_ready=None)
    assert all(r.error is None for r in results.values()) and len(results) == 3
    expected = {"cannot start": "No module named lazytriton.prewarm.no_such_server", "threads": "has 2 threads",
                "torch": "imported torch"}[why]
    assert "the fork server could not start" in caplog.text and expected in caplog.text, caplog.text


KILLED_PARENT = """
import sys
from lazytriton.prewarm import pool
from lazytriton.prewarm.enumeration import Planned
from lazytriton.prewarm.workdir import WorkDir
from lazytriton.variant import Variant
pool.WORKER_MODULE = "prewarm_probe"
v = Variant.parse(sys.argv[2])
pool.compile_all([Planned(v, v.key(), "test")], 1, WorkDir(sys.argv[1]).create(), None, lambda p, r: None, fork=True)
"""


@forking
def test_killing_the_parent_leaves_no_worker_server_or_assembler_running(probe: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    [hung] = variants(1)
    monkeypatch.setenv("PROBE_HANG_KEYS", hung.key)
    parent = subprocess.Popen([sys.executable, "-c", KILLED_PARENT, str(tmp_path / "work"), str(hung.variant)],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    try:
        wait_until(lambda: (probe / f"{hung.key}.json").exists() or parent.poll() is not None, "the probe's report")
        assert parent.poll() is None, "the build ended before it could be killed"
        report = facts(probe, hung.key)
        assert report["ppid"] != parent.pid, "a forked worker: its parent is the server"
    finally:
        parent.kill()
        parent.wait()
    pids = {what: int(report[what]) for what in ("ppid", "pid", "child")}  # server, worker, assembler in its group
    wait_until(lambda: all(gone(pid) for pid in pids.values()), f"all of {pids} to end")


# --- a worker bound to one target's float8 lowering (Triton 3.6: lazytriton.float8_lowering) ---------------------


def float8_plan() -> list[Planned]:
    """kv_append's float8 variants of three CUDA targets, interleaved with variants that bind nothing (bf16, HIP)."""
    found = [dispatch.kernel_variant("kv_append", Target.parse(target), "bf16", head_dim, False, True, 4, 4096,
                                     kv_fp8=kv)
             for head_dim in (64, 128, 256)
             for target, kv in (("sm_90", "e4m3"), ("sm_80", "e5m2"), ("sm_90", "none"), ("gfx942", "e4m3"),
                                ("sm_86", "e5m2"))]
    assert len({v.key() for v in found}) == len(found)
    return [Planned(v, v.key(), "test") for v in found]


@pytest.mark.parametrize(("fork", "jobs"), [pytest.param(True, 2, marks=forking), (False, 2), (False, 1)])
def test_where_triton_fixes_the_float8_lowering_a_worker_compiles_one_cuda_targets_float8(
        probe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fork: bool, jobs: int) -> None:
    """Under a Triton that fixes it (3.6, said here to the pool), no worker process gets two CUDA targets' float8
    variants: it takes the next variant its target allows, and gives way to a fresh worker when none is left."""
    monkeypatch.setattr(pool, "triton_version", lambda: "3.6.0")
    todo = float8_plan()
    started, results = run_pool(todo, jobs, tmp_path / "work", fork)
    assert set(results) == {p.key for p in todo} and all(r.error is None for r in results.values())
    bound: dict[int, set[str]] = {}
    for p in todo:
        if float8_lowering.converts_float8(p.variant) and p.variant.target.startswith("sm_"):
            bound.setdefault(facts(probe, p.key)["pid"], set()).add(p.variant.target)
    assert all(len(targets) == 1 for targets in bound.values()), bound
    assert {t for targets in bound.values() for t in targets} == {"sm_90", "sm_80", "sm_86"}
    assert started.rebound >= 3 - jobs and started.forked + started.plain == jobs + started.rebound
    if jobs == 1:  # one worker a target: it kept the first and took the others' only when nothing else was left
        assert started.rebound == 2
    assert all(gone(int(pid)) for pid in bound)


def test_where_triton_lowers_each_compile_for_its_target_no_worker_is_rebound(
        probe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool, "triton_version", lambda: "3.9.0")
    started, results = run_pool(float8_plan(), 1, tmp_path / "work", fork=False)
    assert started == pool.Started(plain=1) and all(r.error is None for r in results.values())
    assert len({facts(probe, key)["pid"] for key in results}) == 1


# --- real compiles ----------------------------------------------------------------------------------------------

BUILD = """
import io, json, sys
from pathlib import Path
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.prewarm import Planned, build
from lazytriton.target import Target
plan = [fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 16, causal, True, 64) for causal in (False, True)]
report = build([Planned(v, v.key(), "test") for v in plan], Path(sys.argv[1]), 2, created=0.0, stream=io.StringIO())
print(json.dumps({"compiled": report.compiled, "failures": [e for _, e in report.failures],
                  "forked": report.workers.forked, "plain": report.workers.plain,
                  "parent": sorted(m for m in ("triton", "torch") if m in sys.modules)}))
"""


@forking
def test_forked_and_plain_workers_build_the_same_image_and_the_parent_imports_neither(tmp_path: Path) -> None:
    """A real build of two small variants with the fork server and with ``LAZYTRITON_PREWARM_FORK=0``: the same
    image bytes; the parent imported neither triton nor torch either way."""
    images = {}
    for switch, forked in (("1", 2), ("0", 0)):
        images[switch] = tmp_path / f"fork-{switch}.ltimg"
        proc = subprocess.run([sys.executable, "-", str(images[switch])], input=BUILD, capture_output=True, text=True,
                              timeout=600, check=False, cwd=REPO,
                              env={**os.environ, "LAZYTRITON_PREWARM_FORK": switch})
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout.splitlines()[-1])
        assert report == {"compiled": 2, "failures": [], "forked": forked, "plain": 2 - forked, "parent": []}
    assert images["1"].read_bytes() == images["0"].read_bytes()
