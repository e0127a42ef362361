"""Build the compiled helpers into the cache dir: the background builder, and the foreground build.

``python -m lazytriton.driver.helpers_build child HELPER CACHE_DIR --key KEY --lock-fd FD``
is what ``helpers.on_first_use`` starts, detached, holding the key's lock
(inherited as FD): it builds one helper into ``<cache dir>/helpers/<KEY>/``
at low priority, checks that the module loads, and on failure writes the
``failed`` marker (the error's tail) that stops further attempts for that key.

``build`` (``lazytriton prewarm --helpers``, or ``... helpers_build build [CACHE_DIR]``)
does the same in the foreground for every helper this Python and torch can
use: it waits for a background builder of the same key, and retries a key
that failed. ``wait`` (``... helpers_build wait``) returns when no
background build of this Python and torch is running, and prints where each
helper stands.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

from lazytriton import fsutil
from lazytriton.driver import fastlaunch, fastlaunch_build, helpers


class Result(NamedTuple):
    """One helper's build: built or not, the module (or the failure marker), and what happened, in words."""

    helper: str
    ok: bool
    path: str
    message: str


def fastlaunch_into(where: Path) -> Path:
    """Build the launch helper into ``where`` and check that it loads as the runtime will load it; its path."""
    path = fastlaunch_build.build(where, mode=helpers.DIR_MODE)
    module = fastlaunch.import_file(str(path), path)  # as the runtime loads it
    loads = module is not None and getattr(module, "PLAN_VERSION", None) == fastlaunch.PLAN_VERSION
    return loaded_or_removed(path, loads)


def loaded_or_removed(path: Path, loads: bool) -> Path:
    """``path`` if the module built there loads as the runtime loads it; else removed, and a RuntimeError."""
    if not loads:
        with contextlib.suppress(OSError):
            path.unlink()
        raise RuntimeError(f"{path} was built but does not load in this Python (see the lines above)")
    return path


def compile_into(helper: str, where: Path, torch_version: str | None) -> Path:
    """Build ``helper`` into ``where`` (the launch helper here, another by its description's ``compile_into``)."""
    build = helpers.described(helper).compile_into
    return fastlaunch_into(where) if build is None else build(where, torch_version)


def build_locked(helper: str, cache_dir: Path, torch_version: str | None) -> Result:
    """Build one helper into its key's folder, whose lock the caller holds; a failure leaves the marker."""
    where = helpers.folder(cache_dir, helper, torch_version)
    started = time.perf_counter()
    print(f"building the {helper} helper into {where} (python {sys.version.split()[0]}, torch {torch_version})",
          flush=True)
    try:
        path = compile_into(helper, where, torch_version)
    except Exception as exc:  # the compiler's message, a missing header, a module that will not load
        text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[-helpers.MAX_FAILURE_BYTES:]
        print(text.decode("utf-8", "replace"), flush=True)
        fsutil.write_atomically(where / helpers.FAILED, [text], mode=0o644)
        first = next((line for line in text.decode("utf-8", "replace").splitlines() if line.strip()), "")
        return Result(helper, False, str(where / helpers.FAILED), first.strip())
    for name in (helpers.FAILED, helpers.REPORTED):
        with contextlib.suppress(FileNotFoundError):
            (where / name).unlink()
    print(f"built {path} in {time.perf_counter() - started:.1f} s", flush=True)
    return Result(helper, True, str(path), "built")


def child(helper: str, cache_dir: Path, key: str, lock_fd: int) -> int:
    """The background builder: ``helpers._start`` took the lock, this process holds it (``lock_fd``) until it exits."""
    del lock_fd  # held by inheritance: nothing to do with it but keep it open until this process exits
    if helper not in helpers.registry() or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", key):
        print(f"bad arguments: helper {helper!r}, key {key!r}", file=sys.stderr)
        return 2
    torch_version = None
    if helpers.described(helper).needs_torch:
        import torch

        torch_version = torch.__version__
    mine = helpers.key(helper, torch_version)
    if mine != key:  # another lazytriton or torch on this interpreter's path than the process that started it
        where = Path(cache_dir) / helpers.FOLDER / key
        text = (f"RuntimeError: the builder imports a lazytriton and torch whose key is {mine}, not {key}: "
                f"the starting process's sys.path differs from a fresh interpreter's ({sys.executable})")
        print(text, flush=True)
        fsutil.write_atomically(where / helpers.FAILED, [text.encode()], mode=0o644)
        return 1
    return 0 if build_locked(helper, Path(cache_dir), torch_version).ok else 1


def build(cache_dir: Path, torch_version: str | None) -> list[Result]:
    """Build every helper this Python (and torch) can use that the cache dir lacks, in the foreground.

    Waits for a background build of the same key; a key that failed is built
    again. A helper in the package folder, or already in the cache dir, is left as it is.
    """
    results = []
    for helper in helpers.wanted(torch_version):
        state = helpers.status(helper, cache_dir, torch_version, probe_lock=False)
        if state.state in (helpers.PACKAGE, helpers.CACHE):
            results.append(Result(helper, True, str(state.path), f"already built ({state.state})"))
            continue
        problem = helpers.make_folder(cache_dir, helper, torch_version)
        if problem is not None:
            results.append(Result(helper, False, str(cache_dir), problem))
            continue
        lock_fd = helpers.take_lock(helpers.folder(cache_dir, helper, torch_version), blocking=True)
        assert lock_fd is not None  # a blocking lock is taken or raises
        try:
            state = helpers.status(helper, cache_dir, torch_version, probe_lock=False)
            if state.state == helpers.CACHE:  # a background builder finished it while we waited
                results.append(Result(helper, True, str(state.path), "already built (cache dir)"))
            elif state.state == helpers.REFUSED:
                results.append(Result(helper, False, str(state.path), state.detail))
            else:
                results.append(build_locked(helper, cache_dir, torch_version))
        finally:
            os.close(lock_fd)
    return results


def wait(cache_dir: Path, torch_version: str | None, timeout: float) -> bool:
    """Return once no builder holds a lock of this Python's (and torch's) keys; False when ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    for helper in helpers.wanted(torch_version):
        while helpers.status(helper, cache_dir, torch_version).state == helpers.BUILDING:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)  # a script's wait, not a test's: tests wait on the lock itself
    return True


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lazytriton.driver.helpers_build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)
    started = sub.add_parser("child", help="the background builder (started by the runtime)")
    started.add_argument("helper", choices=tuple(helpers.registry()))
    started.add_argument("cache_dir", type=Path)
    started.add_argument("--key", required=True)
    started.add_argument("--lock-fd", type=int, required=True)
    foreground = sub.add_parser("build", help="build the helpers into the cache dir now (retries a failed key)")
    foreground.add_argument("cache_dir", type=Path, nargs="?", help="default: LAZYTRITON_CACHE_DIR's")
    waiting = sub.add_parser("wait", help="wait for the background builds, then print where each helper stands")
    waiting.add_argument("--timeout", type=float, default=900.0, help="seconds (default 900)")
    args = parser.parse_args(argv)
    if args.action == "child":
        with contextlib.suppress(OSError):
            os.nice(10)  # behind the work of the process that started it
        return child(args.helper, args.cache_dir, args.key, args.lock_fd)
    from lazytriton import config

    cache_dir = getattr(args, "cache_dir", None) or config.settings().cache_dir
    torch_version = _torch_version()
    if args.action == "build":
        results = build(cache_dir, torch_version)
        for result in results:
            print(f"{result.helper}: {result.message}: {result.path}")
        return 0 if all(result.ok for result in results) else 1
    done = wait(cache_dir, torch_version, args.timeout)
    for helper in helpers.wanted(torch_version):
        state = helpers.status(helper, cache_dir, torch_version)
        print(f"{helper}: {state.state}: {state.detail}" + (f" ({state.path})" if state.path else ""))
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
