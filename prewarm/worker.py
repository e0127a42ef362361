"""A prewarm worker process: ``python -m lazytriton.prewarm.worker WORK_DIR CREATED PARENT_PID MEMORY``.

Or the same loop (``serve``) in a process forked from the pool's fork server
(``forkserver``), with Triton already imported.

It reads one JSON task per line on stdin (``{"variant", "key"}``), compiles
it with ``lazytriton.compiler.compile_variant``, writes the entry into the
work directory itself (atomically: a parent killed a moment later loses
nothing) and answers one JSON line (``{"key", "error", "seconds"}``). It exits
at the end of stdin.

Its stderr is a log file the parent gave it; the compiler's own output
(stdout included) goes there too, and the log is emptied at each task, so
that after a crash it holds what the compiler printed for that variant. The
answers go to a private copy of the original stdout, which nothing else
writes to. ``CREATED`` is SOURCE_DATE_EPOCH (or empty): the provenance time
every entry gets, so that builds from the same inputs give the same bytes.
``MEMORY`` caps the worker's address space in bytes (``RLIMIT_AS``; 0: no
cap), set first thing (in a forked worker, first thing after the fork, with
Triton already imported), so a compile that runs away fails with
MemoryError (or LLVM aborts, and the pool records the dead worker and starts
another) instead of taking the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import time

from lazytriton.record import replace

_PR_SET_PDEATHSIG = 1
_ADDR_NO_RANDOMIZE = 0x0040000  # personality(2): a process exec'd from here gets a fixed address layout


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """Ask Linux to kill this process when its parent dies: a killed prewarm leaves no compiler running.

    ``signum``: the signal it gets then (the fork server takes SIGTERM, to kill its workers' groups first).
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def limit_memory(max_bytes: int) -> None:
    """Cap this process's address space (and its children's: rlimits are inherited) at ``max_bytes``."""
    if max_bytes > 0:
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        if hard != resource.RLIM_INFINITY:
            max_bytes = min(max_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, hard))


def fixed_layout_for_compilers() -> bool:
    """Have the compilers this worker runs (ptxas) start with a fixed address layout; whether it took effect.

    ptxas 12.8 and 12.9 (Triton 3.6's and 3.9's) compile Triton 3.6's PTX of
    flash_bwd_fused_gluon at head dim 256 (``setmaxnreg``, warp-specialised)
    to one of two cubins, by where their heap lands: 2 outputs in 8 runs
    each, and one in 8 with address randomisation off (2026-12-01). A prewarm's
    bytes must follow its inputs alone (the same image at -j 1 and -j 16), so
    its workers turn randomisation off for what they exec (Linux's
    personality flag, kept across fork and exec); the worker itself and
    everything outside prewarm keep theirs. Elsewhere it does nothing.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        personality = ctypes.CDLL(None, use_errno=True).personality
        personality.argtypes, personality.restype = [ctypes.c_ulong], ctypes.c_int
        current = personality(0xFFFFFFFF)  # query
        if current == -1:
            return False
        return personality(current | _ADDR_NO_RANDOMIZE) != -1
    except (AttributeError, OSError):
        return False


def skip_triton_key() -> None:
    """Give Triton's own cache key a constant where it would hash Triton's whole install, once per worker.

    ``triton.compile`` keys its cache with ``triton_key()``: a sha256 of
    Triton's sources and of ``libtriton.so`` (500 MB), 0.7-1.6 s per process
    on this 2-core machine, paid again by every worker at its first compile.
    Here the key is never used: ``compile_variant`` gives every compile its
    own empty, throwaway Triton cache, so nothing is looked up or kept under
    it (the compiled bytes are the same: tests/test_prewarm_scaling.py, 3.6 checked by hand).
    Triton's own parallel warm-up pool replaces the same function in its
    workers (3.9's ``triton/_compile_warmup_pool.py``); 3.6 and 3.9 both read
    it through ``triton.runtime.cache``. Where that is not so, nothing changes.
    """
    try:
        import triton
        import triton.runtime.cache as triton_cache
    except Exception:  # no triton: the first compile reports it
        return
    if callable(getattr(triton_cache, "triton_key", None)):
        constant = f"lazytriton-prewarm-worker-{triton.__version__}"
        triton_cache.triton_key = lambda: constant  # type: ignore[attr-defined]


def build_one(text: str, key: str, work_path: str, created: float | None) -> None:
    """Compile one variant and write its entry into the work directory."""
    from lazytriton.compiler import compile_variant
    from lazytriton.prewarm.workdir import WorkDir
    from lazytriton.variant import Variant

    entry = compile_variant(Variant.parse(text), key)
    if created is not None:  # the one field that would differ between two builds
        entry = replace(entry, provenance=replace(entry.provenance, created=created))
    WorkDir(work_path).write(entry)


def serve(work_path: str, created_text: str, parent_pid: int, memory: int) -> int:
    """The worker's life: its limits, then one answer per task line on stdin until stdin ends.

    Both kinds of worker run it: a fresh interpreter (``main``) and a process
    forked from the pool's fork server (``forkserver``), whose parent is the
    server. Stdin carries the tasks, stdout the answers, stderr is the log.
    """
    die_with_parent(parent_pid)
    limit_memory(memory)
    created = float(created_text) if created_text else None
    fixed_layout_for_compilers()
    skip_triton_key()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the compiler's stdout joins stderr in the log
    for line in sys.stdin:
        task = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        with contextlib.suppress(OSError):  # the log holds the current variant's output only
            os.ftruncate(2, 0)
            os.lseek(2, 0, os.SEEK_SET)
        start = time.perf_counter()
        error = None
        try:
            build_one(task["variant"], task["key"], work_path, created)
        except MemoryError:  # the allocation that failed was never made: this worker can go on
            error = f"MemoryError: over the worker's memory limit of {memory >> 20} MiB (--variant-memory)"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        answers.write(json.dumps({"key": task["key"], "error": error, "seconds": time.perf_counter() - start}) + "\n")
    return 0


def main(argv: list[str]) -> int:
    work_path, created_text, parent_pid, memory = argv
    return serve(work_path, created_text, int(parent_pid), int(memory))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
