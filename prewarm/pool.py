"""Compile variants in N worker processes; a variant that fails costs only itself.

Each worker runs ``lazytriton.prewarm.worker``'s loop (see there), fed one
variant at a time over its stdin. It is forked from the call's fork server
(``forkserver``: one process that imported Triton and the planned kernels'
sources once), or, without fork (not Linux, ``LAZYTRITON_PREWARM_FORK=0``),
is a fresh interpreter. A server that cannot start, refuses to fork (a
thread, torch) or dies leaves fresh interpreters for the rest of the call, and
a variant whose worker died with the server is handed out again, not failed:
a build never fails because of the fork server. Plain subprocesses, not
``multiprocessing``: a spawned multiprocessing child re-imports the caller's
``__main__``, which breaks a build started from a notebook, stdin or an
unguarded script.

Why not ``concurrent.futures``: a compiler that crashes the process (LLVM
aborts on a target it cannot select for) breaks a ProcessPoolExecutor and
every future in it. Here each worker holds one variant at a time, so a dead
worker is that variant's failure, recorded with the last lines the compiler
printed, and a fresh worker takes its place.

Each variant also has limits (``Limits``): the worker's address space is
capped (``RLIMIT_AS``, set by the worker itself before it imports anything
heavy, or right after its fork, inherited by the assemblers it runs), and a
variant still compiling after ``timeout`` seconds has its worker's whole
process group killed and a fresh worker started. Either is that variant's
failure, recorded like any other. One poisoned variant (a 1024 x 1024 tile
once ran six minutes at 7.8 GiB) then costs a bounded slice of the build, not
the machine.

Where the installed Triton fixes a process's float8 lowering for the first
target it lowers one for (3.6: ``lazytriton.float8_lowering``), each worker
is bound to the CUDA target of its first float8 variant: it takes the first
variant in the order that its binding allows, and one whose every variant
left is another target's float8 one is replaced by a fresh worker (forked
from the fork server: no imports to redo). Its compiles are then those of a
fresh process, and the image the same bytes at -j 1 and -j N, without
``compile_variant`` falling back to a fresh interpreter a compile.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import wait
from typing import Any

from lazytriton import float8_lowering
from lazytriton.compiler import triton_version
from lazytriton.config import bool_env
from lazytriton.prewarm import forkserver
from lazytriton.prewarm.enumeration import Planned
from lazytriton.prewarm.forkserver import ForkedWorker, ForkServer, ServerGone
from lazytriton.prewarm.workdir import WorkDir
from lazytriton.record import record, replace

log = logging.getLogger("lazytriton.prewarm")

_LOG_TAIL_BYTES = 2000
_STOP_TIMEOUT_S = 10.0
WORKER_MODULE = "lazytriton.prewarm.worker"  # tests point this at a worker with a fake compile

# Defaults for one variant: the largest real variants (fp32, head dim 256)
# compiled in 8-14 s at under 300 MiB resident, 240 MiB of address space
# (Triton 3.5, sm_80/sm_90/gfx942, on a loaded 2-core machine, 2026-11-30);
# these leave 40x and 15x of room and still stop a runaway compile.
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MEMORY_BYTES = 4 << 30


@record
class Limits:
    """Per-variant limits of a build: wall-clock seconds, and bytes of address space per worker (0: none)."""

    timeout: float = DEFAULT_TIMEOUT_S
    memory: int = DEFAULT_MEMORY_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"variant timeout must be a positive number of seconds, got {self.timeout!r}")
        if isinstance(self.memory, bool) or not isinstance(self.memory, int) or self.memory < 0:
            raise ValueError(f"variant memory must be a number of bytes >= 0 (0: no limit), got {self.memory!r}")


def describe_bytes(n: int) -> str:
    """``4 GiB``, ``512 MiB``."""
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):g} MiB"


@record
class Result:
    """How one variant's build ended: ``error`` is None when its entry was written.

    ``worker``, ``began`` and ``ended``: which worker held it, and when (the
    parent's ``time.perf_counter``) it was handed out and its answer read.
    """

    key: str
    error: str | None
    seconds: float
    worker: int = -1
    began: float = 0.0
    ended: float = 0.0


def _collapse(text: str) -> str:
    """Repeated lines once, with a count (a compiler may print one warning hundreds of times)."""
    out: list[list[Any]] = []
    for line in text.strip().splitlines():
        if out and out[-1][0] == line:
            out[-1][1] += 1
        else:
            out.append([line, 1])
    return "\n".join(line if n == 1 else f"{line} (x{n})" for line, n in out)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _worker_args(work: WorkDir, created: float | None, limits: Limits) -> list[str]:
    """A worker's arguments (``lazytriton.prewarm.worker``): WORK_DIR CREATED PARENT_PID MEMORY."""
    return [str(work.path), "" if created is None else repr(created), str(os.getpid()), str(limits.memory)]


def _child_env() -> dict[str, str]:
    """The environment of a worker: this one, with this process's import path (as multiprocessing passes it)."""
    path = [p for p in sys.path if p]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def take_for(queue: deque[Planned], fixed_for: str | None, version: str | None) -> Planned | None:
    """The first variant of ``queue``, taken out, that a worker bound to ``fixed_for`` compiles as a fresh process.

    ``fixed_for``: the target its float8 lowering is fixed for (None: not
    yet); ``version``: the installed Triton's
    (``float8_lowering.needs_fresh_process``). None when no variant left is
    one. Pure but for ``queue``. Where ``version`` lowers each compile for its
    own target, or nothing is fixed yet, it is the first variant.
    """
    for index, planned in enumerate(queue):
        if not float8_lowering.needs_fresh_process(planned.variant, fixed_for, version):
            del queue[index]
            return planned
    return None


class _Worker:
    """One worker process, its pipes, its log and the variant it holds.

    Forked from ``server`` when there is one still usable, else a fresh
    interpreter; either way the same loop (``worker.serve``) on the same pipes.
    """

    def __init__(self, number: int, work: WorkDir, created: float | None, limits: Limits,
                 server: ForkServer | None = None, triton: str | None = None) -> None:
        self.number = number
        self.log = work.worker_log(number)
        self.limits = limits
        self.process: subprocess.Popen[str] | ForkedWorker = self._fork_from(server) or self._started(work, created)
        self.task: Planned | None = None
        self.started = 0.0
        self.triton = triton  # the installed Triton's version: whether float8 variants bind the worker
        self.float8_fixed_for: str | None = None  # the target its float8 lowering is fixed for, as its variants say

    def _fork_from(self, server: ForkServer | None) -> ForkedWorker | None:
        if server is None or not server.usable:
            return None
        try:
            return server.spawn(self.number, self.log)
        except ServerGone:  # logged by the server's handle: plain workers from now on
            return None

    def _started(self, work: WorkDir, created: float | None) -> subprocess.Popen[str]:
        # Its own session: a timeout kills the worker and the assembler it may be running, as one group.
        with open(self.log, "wb") as log_file:
            return subprocess.Popen(
                [sys.executable, "-m", WORKER_MODULE, *_worker_args(work, created, self.limits)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True, bufsize=1,
                env=_child_env(), start_new_session=True)

    @property
    def answers(self) -> Any:
        return self.process.stdout

    def take(self, queue: deque[Planned]) -> Planned | None:
        """The next variant of ``queue`` this worker compiles as a fresh process would (``take_for``)."""
        return take_for(queue, self.float8_fixed_for, self.triton)

    def assign(self, planned: Planned) -> bool:
        self.task, self.started = planned, time.perf_counter()
        if float8_lowering.fixed_per_process(self.triton):
            self.float8_fixed_for = float8_lowering.fixed_after(self.float8_fixed_for, planned.variant, None)
        try:
            self.process.stdin.write(json.dumps({"variant": str(planned.variant), "key": planned.key}) + "\n")  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]
            return True
        except OSError:
            return False

    def collect(self) -> Result | None:
        """The answer for the held variant; a failure naming the cause if the worker died.

        None if the worker was lost with its fork server (not the variant's
        doing): the variant is handed out again, to a plain worker.
        """
        assert self.task is not None
        line = ""
        with contextlib.suppress(OSError, ValueError):
            line = self.answers.readline()
        if line:
            answer = json.loads(line)
            return Result(answer["key"], answer["error"], answer["seconds"])
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(_STOP_TIMEOUT_S)
        if isinstance(self.process, ForkedWorker) and self.process.lost:
            return None  # it died with its fork server, whatever the variant would have done
        tail = ""
        with contextlib.suppress(OSError):
            tail = _collapse(self.log.read_bytes()[-_LOG_TAIL_BYTES:].decode(errors="replace"))
        reason = f"worker process {_exit_reason(self.process.returncode)} while compiling it"
        if self.limits.memory:
            reason += f" (its memory limit: {describe_bytes(self.limits.memory)}, --variant-memory)"
        return Result(self.task.key, reason + (f"; its last output: {tail}" if tail else ""),
                      time.perf_counter() - self.started)

    @property
    def forked(self) -> bool:
        return isinstance(self.process, ForkedWorker)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def overdue(self, now: float) -> bool:
        return self.task is not None and now - self.started >= self.limits.timeout

    def time_out(self) -> Result:
        """Kill the worker (and its children) over its held variant's time limit: that variant's failure."""
        assert self.task is not None
        seconds = time.perf_counter() - self.started
        self.stop(kill=True)
        return Result(self.task.key, f"timed out: still compiling after {seconds:.0f} s (the limit is "
                                     f"{self.limits.timeout:g} s, --variant-timeout); its worker was killed", seconds)

    def end_tasks(self) -> None:
        """Close its task pipe: it exits once it has answered what it holds."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # type: ignore[union-attr]

    def stop(self, kill: bool) -> None:
        self.end_tasks()
        if not kill:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(_STOP_TIMEOUT_S)
        if self.process.poll() is None:
            if isinstance(self.process, subprocess.Popen):
                with contextlib.suppress(OSError):  # the group: the worker and any assembler it started
                    os.killpg(self.process.pid, signal.SIGKILL)
            self.process.kill()  # a forked one: its server kills the group, then reaps it
            self.process.wait()
        with contextlib.suppress(OSError):
            self.answers.close()


def fork_server_wanted(environ: Mapping[str, str], platform_supported: bool) -> bool:
    """Whether the pool forks its workers from a fork server.

    ``LAZYTRITON_PREWARM_FORK`` (default on) and the platform
    (``forkserver.supported``) decide; ValueError naming the variable for a
    value that is not a yes or a no.
    """
    return bool_env("LAZYTRITON_PREWARM_FORK", True, environ) and platform_supported


@record
class Started:
    """How ``compile_all`` started its workers: ``forked`` from its fork server, or ``plain`` interpreters.

    ``server_ready``: the seconds from its start until the server had done its
    imports (None: no server). ``rebound``: how many of them replaced a worker
    bound to another target's float8 lowering (module docstring).
    """

    forked: int = 0
    plain: int = 0
    server_ready: float | None = None
    rebound: int = 0  # workers replaced because every variant left was another target's float8 one


def _start_server(todo: Sequence[Planned], work: WorkDir, created: float | None, limits: Limits) -> ForkServer | None:
    """A fork server that has imported what ``todo``'s compiles need; None (logged) if it cannot start."""
    kernels = sorted({p.variant.kernel for p in todo})
    try:
        return ForkServer.start([*_worker_args(work, created, limits), WORKER_MODULE, *kernels],
                                work.fork_server_log(), _child_env(), limits.timeout)
    except ServerGone as exc:
        log.warning("prewarm: the fork server could not start (%s); starting plain worker processes", exc)
        return None


def compile_all(todo: Sequence[Planned], jobs: int, work: WorkDir, created: float | None,
                on_result: Callable[[Planned, Result], None], limits: Limits | None = None,
                fork: bool | None = None) -> Started:
    """Build every variant of ``todo`` in ``jobs`` workers, calling ``on_result`` as each one ends.

    ``fork``: fork the workers from a fork server (None: ``fork_server_wanted``).
    """
    begun = time.perf_counter()
    limits = limits or Limits()
    queue = deque(todo)
    count = max(1, min(jobs, len(todo))) if todo else 0
    if fork is None:
        fork = fork_server_wanted(os.environ, forkserver.supported())
    server = _start_server(todo, work, created, limits) if count and fork else None
    ready = None if server is None else time.perf_counter() - begun
    workers: list[_Worker] = []
    started: list[bool] = []
    rebound = 0
    triton = triton_version()

    def fresh(number: int) -> _Worker:
        worker = _Worker(number, work, created, limits, server, triton)
        started.append(worker.forked)
        return worker

    finished = False
    try:
        for number in range(count):  # each worker takes its first variant as it comes, not after the last one
            workers.append(fresh(number))
            if queue and not workers[-1].assign(queue.popleft()):
                _finish(workers[-1], on_result, queue)  # its pipe broke: it died before taking the variant
        while queue or any(w.task is not None for w in workers):
            rebound += _hand_out(workers, queue, on_result, fresh)
            busy = [w for w in workers if w.task is not None]
            now = time.perf_counter()
            left = min((w.started + limits.timeout - now for w in busy), default=0.0)
            ready_answers = set(wait([w.answers for w in busy], timeout=max(0.0, left))) if busy else set()
            now = time.perf_counter()
            for i, worker in enumerate(workers):
                if worker.task is not None and worker.answers in ready_answers:
                    _finish(worker, on_result, queue, hand_out=True)
                elif worker.overdue(now):
                    _finish(worker, on_result, queue, worker.time_out())
                if worker.task is None and not worker.alive and queue:  # one holding a variant: its answer first
                    worker.stop(kill=True)
                    workers[i] = fresh(worker.number)
        finished = True
    finally:
        # All at once: a fresh interpreter takes 0.05-0.06 s to exit after its last compile (Triton 3.9, this
        # 2-core machine, idle), which one stop after the other would add up at -j 16.
        for worker in workers:
            worker.end_tasks()
        for worker in workers:
            worker.stop(kill=not finished)
        if server is not None:
            server.close()
    return Started(forked=sum(started), plain=len(started) - sum(started), server_ready=ready, rebound=rebound)


def _hand_out(workers: list[_Worker], queue: deque[Planned], on_result: Callable[[Planned, Result], None],
              fresh: Callable[[int], _Worker]) -> int:
    """Give each idle worker its next variant (``_Worker.take``); how many were replaced by a ``fresh`` one.

    A worker none of whose variants left it may take (each another target's
    float8 one) gives its place to a fresh worker, which takes the first.
    """
    rebound = 0
    for i, worker in enumerate(workers):
        if worker.task is not None or not queue:
            continue
        planned = worker.take(queue)
        if planned is None:
            worker.stop(kill=True)  # idle: its last answer is read, its entry written
            workers[i] = worker = fresh(worker.number)
            rebound += 1
            planned = queue.popleft()
        if not worker.assign(planned):
            _finish(worker, on_result, queue)  # its pipe broke: it died before taking the variant
    return rebound


def _finish(worker: _Worker, on_result: Callable[[Planned, Result], None], queue: deque[Planned],
            result: Result | None = None, hand_out: bool = False) -> None:
    """Read the held variant's answer (or take ``result``), hand the worker its next variant, then report.

    The next variant comes from ``queue`` (with ``hand_out``, if the worker is
    alive and may take one of them: ``_Worker.take``), so the parent's
    bookkeeping (reading the entry, the image's packer) runs while the worker
    already compiles. A variant whose worker was lost with the fork server
    goes back to the front of ``queue``.
    """
    result = result or worker.collect()
    planned, worker.task = worker.task, None
    assert planned is not None
    if result is None:
        queue.appendleft(planned)
        return
    result = replace(result, worker=worker.number, began=worker.started, ended=time.perf_counter())
    following = worker.take(queue) if hand_out and queue and worker.alive else None
    if following is not None and not worker.assign(following):
        _finish(worker, on_result, queue)  # its pipe broke: it died before taking the variant
    on_result(planned, result)
