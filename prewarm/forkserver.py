"""The pool's fork server: one process imports Triton once, then forks each compile worker on request.

A fresh worker interpreter spends its first second or so importing Triton
and what a compile needs (16 workers at once did it in 1.0-3.5 s on the
16-core GPU host: benchmarks/NOTES.md, "Prewarm scaling"). The fork server
does those imports once per ``compile_all`` and forks each worker from
there, ready to compile.

The parent (``ForkServer``, in the pool) and the server (``main``, run as
``python -m lazytriton.prewarm.forkserver``) talk over one Unix
``SOCK_SEQPACKET`` socket, one JSON object a message, never pickle:

- server to parent, once: ``{"ready": PID, "seconds": S}`` after its imports,
  or ``{"error": TEXT}`` before it exits;
- parent to server: ``{"fork": N}`` with three descriptors attached
  (``socket.send_fds``): the worker's task pipe (its stdin), its answer pipe
  (its stdout) and its log (its stderr); the server forks, and answers
  ``{"forked": N, "pid": PID}`` or ``{"failed": N, "error": TEXT}``;
- parent to server: ``{"kill": PID}``: the server kills that worker's process
  group (the worker and any assembler it runs). The server is the worker's
  parent and reaps it, so the pid cannot be reused under the kill;
- server to parent, whenever a worker ends: ``{"exited": PID, "status": CODE}``
  (``CODE`` as ``Popen.returncode``: negative for a signal).

A forked worker is then like a plain one (``lazytriton.prewarm.worker``): the
same ``serve`` loop on the same pipes, its own session (so a time-out kills
its group), its own limits set after the fork, and ``die_with_parent``
towards the server. The server dies with the parent (``PR_SET_PDEATHSIG``
with SIGTERM, or end of file on its socket), killing every worker's group
first (the assemblers in it too), and the workers die with the server
(SIGKILL): a killed prewarm leaves nothing compiling.

The server forks only while it has one thread (fork copies only the calling
thread, so a lock another thread held stays locked in the child), and never
imports torch; it refuses to serve otherwise. Linux only: elsewhere (no
``PR_SET_PDEATHSIG``; macOS frameworks are not fork-safe) the pool starts
plain workers, as it does when ``LAZYTRITON_PREWARM_FORK=0`` or when the
server cannot start or dies (``pool``).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

log = logging.getLogger("lazytriton.prewarm")

SERVER_MODULE = "lazytriton.prewarm.forkserver"  # tests point this at a module that cannot start
_MESSAGE_BYTES = 65536
_KILL_WAIT_S = 10.0

# What the server imports before its first fork. Measured with Triton 3.9 on
# the 2-core CPU machine (2026-12-02): triton 0.14 s; triton.compiler's code
# generator (it pulls in Gluon) 0.1 s of a worker's first compile; the kernel
# sources 0.003-0.08 s each (``kernel_modules``); lazytriton's own 0.03 s.
# After them, a forked worker's first compile takes 0.05 s CPU more than its
# second (0.83 against 0.78 s, flash_fwd fp16 head dim 16; mostly Triton's
# one ``ptxas --version``), and a forked compile as long as one in the server
# itself. Triton 3.6 on the GPU host imports in 0.5-1 s CPU.
BASE_MODULES = ("triton", "triton.language", "triton.compiler", "triton.compiler.code_generator",
                "triton.language.extra.libdevice", "lazytriton.compiler", "lazytriton.variant",
                "lazytriton.prewarm.workdir", "lazytriton.cache_format")


def supported() -> bool:
    """Whether this platform runs the fork server (Linux: fork, ``PR_SET_PDEATHSIG``, ``SOCK_SEQPACKET``)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and hasattr(socket, "SOCK_SEQPACKET")


# --- the parent's side ------------------------------------------------------------------------------------------


class ServerGone(Exception):
    """The fork server ended, or could not start; the message says why."""


class ForkServer:
    """The parent's handle on one fork server: start it, fork workers, kill them, learn how they ended."""

    def __init__(self, process: subprocess.Popen[bytes], control: socket.socket) -> None:
        self.process = process
        self.control = control
        self.exits: dict[int, int] = {}  # worker pid -> its exit status, as the server reaped it
        self.gone: str | None = None  # why the server is no longer usable; None while it is
        self.ready_seconds = 0.0
        self.serving = False  # ready, and not yet closed: losing it now is worth a warning

    @classmethod
    def start(cls, argv: Sequence[str], log: Path, env: dict[str, str], timeout: float) -> ForkServer:
        """Start a server, and wait until it has done its imports; ServerGone if it cannot.

        ``argv``: its arguments after its socket (``main``); ``log``: its
        stderr; ``timeout``: the longest its imports may take.
        """
        parent_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with open(log, "wb") as log_file:
                process = subprocess.Popen(
                    [sys.executable, "-m", SERVER_MODULE, str(server_end.fileno()), *argv],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file, env=env,
                    pass_fds=(server_end.fileno(),), start_new_session=True)
        except OSError as exc:
            parent_end.close()
            raise ServerGone(f"could not start: {exc}") from exc
        finally:
            server_end.close()
        server = cls(process, parent_end)
        started = time.perf_counter()
        message = server._next(timeout)
        if message is None or "ready" not in message:
            why = (message or {}).get("error") or server.gone or "it sent no ready message"
            server.close()
            raise ServerGone(f"{why}{_tail(log)}")
        server.ready_seconds = time.perf_counter() - started
        server.serving = True
        return server

    @property
    def usable(self) -> bool:
        return self.gone is None

    def spawn(self, number: int, log: Path) -> ForkedWorker:
        """Fork worker ``number`` (its stderr: ``log``, truncated); ServerGone if the server cannot."""
        if self.gone is not None:
            raise ServerGone(self.gone)
        tasks_read, tasks_write = os.pipe()
        answers_read, answers_write = os.pipe()
        ours, theirs = (tasks_write, answers_read), (tasks_read, answers_write)
        try:
            with open(log, "wb") as log_file:
                socket.send_fds(self.control, [json.dumps({"fork": number}).encode()],
                                [*theirs, log_file.fileno()])
        except OSError as exc:
            self._lost(f"its socket broke: {exc}")
        finally:
            for fd in theirs:  # the server holds its copies now (or never will)
                os.close(fd)
        message = self._next(None) if self.gone is None else None
        while message is not None and message.get("forked", message.get("failed")) != number:
            message = self._next(None)  # an exit report that came first
        if message is None or "pid" not in message:
            for fd in ours:
                os.close(fd)
            why = (message or {}).get("error") or self.gone or "no answer"
            if message is not None:  # it refused (threads, fork failed): fork no more from it
                self._lost(f"it could not fork a worker: {why}")
            raise ServerGone(why)
        return ForkedWorker(self, int(message["pid"]), os.fdopen(tasks_write, "w", buffering=1),
                            os.fdopen(answers_read, "r"))

    def kill(self, pid: int) -> None:
        """Have the server kill the group of its worker ``pid`` (a no-op once that worker is reaped)."""
        if self.gone is None:
            try:
                self.control.send(json.dumps({"kill": pid}).encode())
            except OSError as exc:
                self._lost(f"its socket broke: {exc}")

    def pump(self, timeout: float | None) -> None:
        """Read what the server sent (waiting up to ``timeout`` seconds for the first message; None: forever)."""
        message = self._next(timeout)
        while message is not None:
            message = self._next(0.0)

    def close(self) -> None:
        """End the server: it kills whatever worker is left, reaps it and exits."""
        self._lost("closed")
        with contextlib.suppress(OSError):
            self.control.close()
        try:
            self.process.wait(_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _next(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message (an exit report is recorded, and returned too); None on time-out or if it is gone."""
        if self.gone is not None:
            return None
        try:
            if not wait([self.control], timeout):  # poll(2): no limit on the descriptor's number
                return None
            data = self.control.recv(_MESSAGE_BYTES)
        except OSError as exc:
            self._lost(f"its socket broke: {exc}")
            return None
        if not data:
            code = self.process.wait()
            self._lost(f"it ended ({_reason(code)})")
            return None
        try:
            message: dict[str, Any] = json.loads(data)
        except ValueError:
            self._lost(f"it sent a malformed message: {data[:100]!r}")
            return None
        if "exited" in message:
            self.exits[int(message["exited"])] = int(message["status"])
        return message

    def _lost(self, why: str) -> None:
        if self.gone is None:
            self.gone = why
            if self.serving and why != "closed":
                log.warning("prewarm: the fork server is gone (%s); plain worker processes take over", why)


class ForkedWorker:
    """A forked worker seen as a ``subprocess.Popen``: its pipes, ``poll``, ``wait``, ``kill`` (of its group).

    ``returncode`` stays None if the server ended before reporting the
    worker's exit: the worker died with it (``PR_SET_PDEATHSIG``), and
    ``lost`` says so.
    """

    def __init__(self, server: ForkServer, pid: int, stdin: io.TextIOWrapper, stdout: io.TextIOWrapper) -> None:
        self.server, self.pid, self.stdin, self.stdout = server, pid, stdin, stdout
        self.returncode: int | None = None

    @property
    def lost(self) -> bool:
        return self.returncode is None and not self.server.usable

    def poll(self) -> int | None:
        """Its exit status; None while it runs. A worker lost with its server counts as killed (SIGKILL)."""
        if self.returncode is None:
            self.server.pump(0.0)
            self.returncode = self.server.exits.get(self.pid)
        if self.returncode is None and not self.server.usable:
            return -signal.SIGKILL  # PR_SET_PDEATHSIG
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for its exit (``subprocess.TimeoutExpired`` after ``timeout``); None if lost with the server."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"prewarm worker {self.pid}", timeout or 0.0)
            self.server.pump(left)
        return self.returncode

    def kill(self) -> None:
        """Kill its process group (through the server, which reaps it)."""
        self.server.kill(self.pid)


def _reason(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _tail(log: Path) -> str:
    with contextlib.suppress(OSError):
        text = log.read_bytes()[-1000:].decode(errors="replace").strip()
        if text:
            return f"; its last output: {text}"
    return ""


# --- the server's side ------------------------------------------------------------------------------------------


def kernel_modules(kernels: Iterable[str]) -> list[str]:
    """The source modules (and helper modules) of ``kernels``: what their first compile imports."""
    from lazytriton.kernels import get

    modules: list[str] = []
    for kernel in kernels:
        with contextlib.suppress(ValueError):  # an unknown kernel: its compile reports it
            spec = get(kernel)
            modules += [m for m in (spec.module, *spec.helpers) if m not in modules]
    return modules


def thread_count() -> int:
    """The threads of this process, native ones included (Linux's ``/proc``), else Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def warm_up(worker_module: str, kernels: Sequence[str]) -> None:
    """Import what a worker's compiles need, so that every worker forked afterwards has it."""
    importlib.import_module(worker_module)  # a test's fake worker patches the real one as it is imported
    for name in (*BASE_MODULES, *kernel_modules(kernels)):
        try:
            importlib.import_module(name)
        except Exception as exc:  # the compile that needs it imports it again and reports the error
            print(f"fork server: import {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    from lazytriton.kernels import source_fingerprint

    for kernel in kernels:
        with contextlib.suppress(Exception):
            source_fingerprint(kernel)  # cached per process: computed once here, for every worker
    from lazytriton.prewarm.worker import skip_triton_key

    skip_triton_key()  # a module attribute: every fork has it (each worker sets it again, harmlessly)


def unsafe_to_fork() -> str | None:
    """Why this process must not fork workers (threads, torch); None when it may."""
    threads = thread_count()
    if threads != 1:
        return f"the fork server has {threads} threads (fork would copy only one, with any lock another held)"
    if "torch" in sys.modules:
        return "the fork server imported torch (workers must not)"
    return None


class _Server:
    """The server's loop: fork on request, kill on request, reap and report every worker."""

    def __init__(self, control: socket.socket, worker_args: Sequence[str]) -> None:
        self.control = control
        self.worker_args = worker_args
        self.children: set[int] = set()
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_write, warn_on_full_buffer=False)

    def run(self) -> None:
        try:
            while True:
                ready = select.select([self.control.fileno(), self.wake_read], [], [])[0]
                if self.wake_read in ready:
                    os.read(self.wake_read, 4096)
                self._reap(block=False)
                if self.control.fileno() in ready and not self._request():
                    return
        finally:
            for pid in self.children:  # the parent is gone or done: nothing of ours keeps compiling
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
            self._reap(block=True)

    def _request(self) -> bool:
        """Serve one request; False at the end of the parent's socket."""
        data, fds, _, _ = socket.recv_fds(self.control, _MESSAGE_BYTES, 3)
        if not data:
            return False
        message = json.loads(data)
        if "kill" in message:
            if int(message["kill"]) in self.children:  # not yet reaped: the pid is still ours
                with contextlib.suppress(OSError):
                    os.killpg(int(message["kill"]), signal.SIGKILL)
            return True
        number = message.get("fork")
        try:
            why = unsafe_to_fork() or (None if len(fds) == 3 else f"expected 3 descriptors, got {len(fds)}")
            if why is not None:
                self._send({"failed": number, "error": why})
            else:
                self._send({"forked": number, "pid": self._fork(fds)})
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _fork(self, fds: Sequence[int]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        server_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = self._become_worker(fds, server_pid)
            except BaseException:
                with contextlib.suppress(BaseException):
                    traceback.print_exc()
            finally:
                with contextlib.suppress(BaseException):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)  # never back into the server's loop, nor its clean-up
        self.children.add(pid)
        return pid

    def _become_worker(self, fds: Sequence[int], server_pid: int) -> int:
        """In the forked child: its own session, its pipes on 0, 1 and 2, then the worker's loop."""
        for signum in (signal.SIGTERM, signal.SIGCHLD):  # as in a fresh interpreter
            signal.signal(signum, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.setsid()
        for fd in (self.wake_read, self.wake_write, self.control.detach()):
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the worker reads it to its end
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        from lazytriton.prewarm import worker  # its build_one as the worker module left it (a test's fake)

        work_path, created_text, _, memory = self.worker_args
        return worker.serve(work_path, created_text, server_pid, int(memory))

    def _reap(self, block: bool) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            with contextlib.suppress(OSError):  # the parent may be gone: then only the reaping matters
                self._send({"exited": pid, "status": os.waitstatus_to_exitcode(status)})

    def _send(self, message: dict[str, Any]) -> None:
        self.control.send(json.dumps(message).encode())


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    """``python -m lazytriton.prewarm.forkserver CONTROL_FD WORK_DIR CREATED PARENT_PID MEMORY MODULE [KERNEL...]``.

    The middle four are a plain worker's arguments (``lazytriton.prewarm.worker``);
    ``MODULE`` is the worker module to fork into, ``KERNEL`` the planned kernels.
    """
    control = socket.socket(fileno=int(argv[0]))
    worker_args, worker_module, kernels = argv[1:5], argv[5], argv[6:]
    from lazytriton.prewarm.worker import die_with_parent

    signal.signal(signal.SIGTERM, _stop)
    die_with_parent(int(worker_args[2]), signal.SIGTERM)  # SIGTERM: _Server.run's clean-up kills the workers' groups
    start = time.perf_counter()
    try:
        warm_up(worker_module, kernels)
        why = unsafe_to_fork()
    except Exception as exc:
        why = f"its imports failed: {type(exc).__name__}: {exc}"
    if why is not None:
        with contextlib.suppress(OSError):
            control.send(json.dumps({"error": why}).encode())
        return 1
    server = _Server(control, worker_args)
    server._send({"ready": os.getpid(), "seconds": time.perf_counter() - start})
    server.run()
    sys.stderr.flush()
    os._exit(0)  # nothing left to clean up: the interpreter's own finalisation would only delay the parent


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
