"""Compile variants in N worker processes; a variant that fails costs only itself.

Each worker is a spawned process (no fork of a parent that holds threads) that
imports the compiler once and then takes one variant at a time over a pipe:
it compiles it with ``lazytriton.compiler.compile_variant``, writes the entry
into the work directory itself (atomically, so a parent killed a moment later
loses nothing) and answers with the key, the error if any, and the seconds.

Why not ``concurrent.futures``: a compiler that crashes the process (LLVM
aborts on a target it cannot select for) breaks a ProcessPoolExecutor and
every future in it. Here each worker holds one variant at a time, so a dead
worker is that variant's failure, recorded with the last lines the compiler
printed, and a fresh worker takes its place. Workers ask the kernel to kill
them when the parent dies (Linux), so a killed prewarm leaves no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from lazytriton.prewarm.enumeration import Planned
from lazytriton.prewarm.workdir import WorkDir

_PR_SET_PDEATHSIG = 1
_LOG_TAIL_BYTES = 2000
_JOIN_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Result:
    """How one variant's build ended: ``error`` is None when its entry was written."""

    key: str
    error: str | None
    seconds: float


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the request above took effect
        os._exit(1)


def _build_one(text: str, key: str, work: WorkDir, created: float | None, compile_variant: Callable[..., Any]) -> None:
    from lazytriton.variant import Variant

    entry = compile_variant(Variant.parse(text), key)
    if created is not None:  # SOURCE_DATE_EPOCH: the one field that would differ between two builds
        entry = replace(entry, provenance=replace(entry.provenance, created=created))
    work.write(entry)


def worker_main(conn: Connection, work_path: str, log_path: str, created: float | None, parent_pid: int) -> None:
    """A worker's loop: take ``(variant, key)``, build it, answer a Result; stop on None or a closed pipe."""
    _die_with_parent(parent_pid)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 1)  # compiler chatter (and an LLVM abort message) goes to the worker's log
    os.dup2(log_fd, 2)
    work = WorkDir(work_path)
    from lazytriton.compiler import compile_variant

    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        text, key = task
        sys.stdout.flush()
        sys.stderr.flush()
        os.ftruncate(log_fd, 0)  # the log holds the current variant's output only
        os.lseek(log_fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        error = None
        try:
            _build_one(text, key, work, created, compile_variant)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        conn.send(Result(key, error, time.perf_counter() - start))


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


class _Worker:
    """One worker process, its pipe and the variant it holds."""

    def __init__(self, ctx: Any, number: int, work: WorkDir, created: float | None) -> None:
        self.number = number
        self.log = work.worker_log(number)
        parent_end, child_end = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, name=f"lazytriton-prewarm-{number}", daemon=True,
                                   args=(child_end, str(work.path), str(self.log), created, os.getpid()))
        self.process.start()
        child_end.close()
        self.conn: Connection = parent_end
        self.task: Planned | None = None
        self.started = 0.0

    def assign(self, planned: Planned) -> bool:
        self.task, self.started = planned, time.perf_counter()
        try:
            self.conn.send((str(planned.variant), planned.key))
            return True
        except OSError:
            return False

    def collect(self) -> Result:
        """The answer for the held variant; a failure naming the cause if the worker died."""
        assert self.task is not None
        try:
            if self.conn.poll():
                result = self.conn.recv()
                if isinstance(result, Result):
                    return result
        except (EOFError, OSError):
            pass
        self.process.join(_JOIN_TIMEOUT_S)
        tail = ""
        with contextlib.suppress(OSError):
            tail = _collapse(self.log.read_bytes()[-_LOG_TAIL_BYTES:].decode(errors="replace"))
        reason = f"worker process {_exit_reason(self.process.exitcode)} while compiling it"
        return Result(self.task.key, reason + (f"; its last output: {tail}" if tail else ""),
                      time.perf_counter() - self.started)

    def stop(self, kill: bool) -> None:
        if not kill:
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(_JOIN_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(_JOIN_TIMEOUT_S)
        self.conn.close()


def compile_all(todo: Sequence[Planned], jobs: int, work: WorkDir, created: float | None,
                on_result: Callable[[Planned, Result], None]) -> None:
    """Build every variant of ``todo`` in ``jobs`` workers, calling ``on_result`` as each one ends."""
    if not todo:
        return
    ctx = multiprocessing.get_context("spawn")
    queue = deque(todo)
    workers = [_Worker(ctx, n, work, created) for n in range(min(jobs, len(todo)))]
    finished = False
    try:
        while queue or any(w.task is not None for w in workers):
            for i, worker in enumerate(workers):
                if worker.task is None and queue and not worker.assign(queue.popleft()):
                    workers[i] = _replace(ctx, worker, work, created, on_result)
            busy = [w for w in workers if w.task is not None]
            ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy]))
            for i, worker in enumerate(workers):
                if worker.task is not None and (worker.conn in ready or worker.process.sentinel in ready):
                    result = worker.collect()
                    planned, worker.task = worker.task, None
                    on_result(planned, result)
                    if not worker.process.is_alive() and queue:
                        workers[i] = _Worker(ctx, worker.number, work, created)
        finished = True
    finally:
        for worker in workers:
            worker.stop(kill=not finished)


def _replace(ctx: Any, worker: _Worker, work: WorkDir, created: float | None,
             on_result: Callable[[Planned, Result], None]) -> _Worker:
    """A worker whose pipe broke before it took its variant: report that variant and start a fresh worker."""
    result = worker.collect()
    planned, worker.task = worker.task, None
    assert planned is not None
    on_result(planned, result)
    worker.stop(kill=True)
    return _Worker(ctx, worker.number, work, created)

