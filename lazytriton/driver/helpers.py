"""The compiled helpers in the cache dir: found there, trusted or refused, and built there in the background.

Compiled helpers make a warm call cheaper: the driver's launch helper ``_fastlaunch`` (plain C, fastlaunch.py), and
those a family registers (``kernels.COMPILED_HELPERS``: flash_fwd's and flash_decode's C++ warm-path tails, each
bound to its torch). Each is described by a ``Helper`` (``registry``). A helper built into its package folder
(``python -m lazytriton.driver.fastlaunch_build``, the family's build command) takes precedence.
Otherwise the first time a process sets up the CUDA driver (``gpu.cuda()``) ``on_first_use`` looks for each helper
in the cache dir (a few ``stat`` calls) and, for one that is missing, starts its build in a detached background
process (``helpers_build``, its own session, its output to a log file). No call waits for it: this process keeps
the slower path, the next one loads the helper. The build recipes are imported only to build or to hash a source.

The cache dir holds ``helpers/<key>/`` per helper, where the key names the helper, the Python ABI (the extension
suffix), for the C++ tail the torch version, and a hash of the source text it is compiled from (``key``). In that
folder: the module; ``build.lock``, held by the builder for its whole run (one builder per key: a process that
cannot take it builds nothing); ``build.log``, the builder's output; and after a failure ``failed`` (the error,
bounded), which stops further attempts for that key. A new torch, Python or source is a new key and builds again;
``lazytriton prewarm --helpers`` builds (and retries) in the foreground.

Loading a helper runs code from disk, so the cache dir is trusted only as far as the user's own files: the module is
loaded only when it is a regular file (no symlink) and it and every folder from the cache dir down to it are owned
by the user or by root (a deployment image built as root, run as another user) and writable by nobody else. The
checks and the load go through one chain of file descriptors (``openat`` without following links), so nothing can be
swapped in between. Anything else is refused, with one log line. ``LAZYTRITON_HELPERS=0`` turns the cache dir's
helpers off (neither built nor loaded); the package's own builds still load.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import importlib.machinery
import importlib.util
import logging
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lazytriton import codepack, config
from lazytriton.driver import trusted
from lazytriton.record import NamedTuple

log = logging.getLogger("lazytriton.driver")

FASTLAUNCH = "fastlaunch"
FOLDER = "helpers"  # under the cache dir
LOCK, LOG, FAILED, REPORTED = "build.lock", "build.log", "failed", "failed.reported"
MAX_FAILURE_BYTES = 16 << 10  # of the error kept in ``failed`` (its tail: a compiler's last lines say most)
VARIABLE = "LAZYTRITON_HELPERS"
RECIPE = 1  # the build commands' version (fastlaunch_build.command and the families'): part of every key
PACKAGE_DIR = Path(os.path.dirname(os.path.abspath(__file__)))  # the package's own launch helper: one stat there
BUILDER = "lazytriton.driver.helpers_build"
DIR_MODE = 0o755  # folders and modules the builder makes: never writable by group or others, whatever the umask

# States of one helper, as ``status`` and ``lazytriton info`` report them.
PACKAGE, CACHE, REFUSED, BUILDING, FAILED_STATE, NOT_BUILT, DISABLED = (
    "package", "cache dir", "refused", "building", "build failed", "not built", "disabled")


class Status(NamedTuple):
    """Where a helper stands: its state, the file it concerns (module, marker, log) or None, and why, in words."""

    state: str
    path: str | None
    detail: str


Spawn = Callable[[Sequence[str], str, int, int], None]  # (argv, cwd, log fd, lock fd): starts the builder


class Helper(NamedTuple):
    """A compiled helper: how its file is named, what it is compiled from, and how it is built and checked.

    ``needs_torch``: bound to the torch it is built against (its file name and key carry torch's version; a process
    without torch neither builds nor loads it). ``package_dir``: where its package build is looked for.
    ``file_name(torch_version)``; ``source()``: the bytes it is compiled from (its key's hash);
    ``compile_into(folder, torch_version)``: build it there and check that it loads as the runtime loads it, its
    path (an exception says why not; None for the launch helper, which ``helpers_build`` builds itself). The builder
    imports the module that describes it.
    """

    name: str
    needs_torch: bool
    package_dir: Path
    file_name: Callable[[str | None], str]
    source: Callable[[], bytes]
    compile_into: Callable[[Path, str | None], Path] | None


FASTLAUNCH_FILE = "_fastlaunch" + importlib.machinery.EXTENSION_SUFFIXES[0]  # fastlaunch_build.FILE_NAME (tested)


def _fastlaunch_source() -> bytes:
    from lazytriton.driver import fastlaunch_build  # the build recipe: read only for a helper the package lacks

    return fastlaunch_build.C_SOURCE.encode()


FASTLAUNCH_HELPER = Helper(FASTLAUNCH, False, PACKAGE_DIR, lambda torch_version: FASTLAUNCH_FILE, _fastlaunch_source,
                           None)


@functools.cache
def registry() -> dict[str, Helper]:
    """Every compiled helper by name: the driver's launch helper, then each family's (``kernels.COMPILED_HELPERS``).

    A family's helper is described by the ``HELPER`` of the module its entry
    names, imported here (on first GPU use, by ``lazytriton info``, by the builder).
    """
    from lazytriton.kernels import COMPILED_HELPERS

    found = {FASTLAUNCH: FASTLAUNCH_HELPER}
    for module in COMPILED_HELPERS:
        helper: Helper = importlib.import_module(module).HELPER
        found[helper.name] = helper
    return found


def described(helper: str) -> Helper:
    """The description of ``helper`` by name (ValueError: no such helper)."""
    found = registry().get(helper)
    if found is None:
        raise ValueError(f"helper must be one of {', '.join(registry())}, got {helper!r}")
    return found


_setting: list[Any] = [True, -1]  # LAZYTRITON_HELPERS's value and the config generation it was read under


def enabled() -> bool:
    """``LAZYTRITON_HELPERS`` (default on), read on first use and again after ``config.reset()``/``configure()``.

    A bad value raises ``config.SettingsError`` naming the variable.
    """
    if _setting[1] != config.generation:
        try:
            value = config.bool_env(VARIABLE, True)
        except ValueError as exc:
            raise config.SettingsError(str(exc)) from None
        _setting[:] = [value, config.generation]
    return bool(_setting[0])


def abi_tag() -> str:
    """The running Python's extension ABI, e.g. ``cpython-312-x86_64-linux-gnu`` (from its extension suffix)."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return suffix.removeprefix(".").removesuffix(".so").removesuffix(".pyd") or "plain"


_TAG_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.+-")


def torch_tag(torch_version: str) -> str:
    """A torch version as a file-name part (its odd characters as ``_``; no regex: this runs on first GPU use)."""
    return "".join(c if c in _TAG_CHARACTERS else "_" for c in torch_version)


def extension_file(stem: str, torch_version: str) -> str:
    """A C++ tail's file for one torch: ``<stem>.torch-<version><suffix>`` (``TorchExtension.file_name``)."""
    return f"{stem}.torch-{torch_tag(torch_version)}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def all_in_package(torch_version: str | None, package_dir: Path = PACKAGE_DIR, kernels: Path | None = None) -> bool:
    """Whether the package holds its own build of each helper this process can use (stat calls, nothing imported).

    ``kernels.COMPILED_EXTENSIONS`` names the families' builds, under ``kernels`` (default: ``lazytriton.kernels``'s
    folder, imported by any launching process); the launch helper's is in ``package_dir``.
    """
    from lazytriton.kernels import COMPILED_EXTENSIONS

    kernels = kernels or Path(sys.modules["lazytriton.kernels"].__file__ or "").parent
    files = [package_dir / FASTLAUNCH_FILE]
    for module in COMPILED_EXTENSIONS if torch_version else ():
        *package, stem = module.split(".")[2:]
        files.append(kernels.joinpath(*package, extension_file(stem, torch_version or "")))
    return all(path.is_file() for path in files)


def module_file(helper: str, torch_version: str | None = None) -> str:
    """The built module's file name: ``_fastlaunch<suffix>``, ``_hotpath.torch-<version><suffix>``."""
    found = described(helper)
    if found.needs_torch and not torch_version:
        raise ValueError(f"the {helper} helper's file name needs a torch version")
    return found.file_name(torch_version)


@functools.cache
def source_hash(helper: str) -> str:
    """A hash of the text ``helper`` is compiled from (with ``RECIPE``): a changed source is a new key."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(f"recipe {RECIPE}\n".encode() + described(helper).source())


def key(helper: str, torch_version: str | None = None) -> str:
    """The helper's folder under ``<cache dir>/helpers``: helper, Python ABI, [torch version,] source hash."""
    parts = [helper, abi_tag()]
    if described(helper).needs_torch:
        parts.append("torch" + torch_tag(torch_version or ""))
    return "-".join([*parts, source_hash(helper)])


def running_torch() -> str | None:
    """The version of the torch this process has imported, or None (nothing here imports it)."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", None)
    return str(version) if version else None


def wanted(torch_version: str | None) -> tuple[str, ...]:
    """The helpers this process can use: one bound to torch only with torch (what it serves imports torch)."""
    return tuple(name for name, helper in registry().items() if torch_version or not helper.needs_torch)


def folder(cache_dir: Path, helper: str, torch_version: str | None = None) -> Path:
    """``<cache dir>/helpers/<key>``."""
    return Path(cache_dir) / FOLDER / key(helper, torch_version)


def in_package(helper: str, torch_version: str | None = None) -> Path | None:
    """The package's own build of ``helper`` (one ``stat``), or None."""
    path = described(helper).package_dir / module_file(helper, torch_version)
    return path if path.is_file() else None


@functools.cache
def _say_once(message: str) -> None:
    log.warning("%s", message)


def load_cached(helper: str, torch_version: str | None, load: Callable[[str, Path], Any]) -> Any:
    """``load(where, path)`` on the cache dir's build of ``helper`` when it is there and trusted; else None.

    ``where`` is the path to hand the dynamic loader: ``/proc/self/fd/N`` of the descriptor the checks were made on
    (kept open for the life of the process, so that no other file is ever loaded under that name), or the plain path
    where /proc is missing. None, and one log line, when the file is refused; None, silently, when it is not there
    or the setting is off.
    """
    if not enabled():
        return None
    try:
        cache_dir = config.settings().cache_dir
        name = module_file(helper, torch_version)
        parts = (FOLDER, key(helper, torch_version), name)
    except (ValueError, OSError) as exc:  # no torch version, an unreadable source: nothing to look for
        log.debug("no cache-dir %s helper to look for (%s)", helper, exc)
        return None
    fds, problem = trusted.walk(cache_dir, parts, last_is_file=True)
    path = Path(cache_dir, *parts)
    if problem is not None:
        trusted.close_all(fds)
        if problem != trusted.ABSENT:
            _say_once(f"not loading the compiled helper {path}: {problem} (only the user's own files, writable by "
                      f"nobody else, are loaded from the cache dir)")
        return None
    trusted.close_all(fds[:-1])
    proc = f"/proc/self/fd/{fds[-1]}"
    where = proc if os.path.exists(proc) else str(path)
    if where != proc:
        trusted.close_all(fds[-1:])
    return load(where, path)


# -- state -----------------------------------------------------------------------------------------------------------

def _lock_held(path: Path) -> bool:
    """Whether a builder holds ``path``'s lock now (a try, released at once); False if there is no lock file."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def failure_text(marker: Path) -> str:
    """The first line of a failure marker, at most 200 characters (a bounded read; one that will not open says so)."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return f"(unreadable: {exc.strerror})"
    try:
        from lazytriton.fsutil import read_fd_bounded

        text = read_fd_bounded(fd, MAX_FAILURE_BYTES).decode("utf-8", "replace") if stat.S_ISREG(
            os.fstat(fd).st_mode) else "(not a regular file)"
    finally:
        os.close(fd)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "(no message)")
    return first if len(first) <= 200 else first[:200] + "..."


def status(helper: str, cache_dir: Path, torch_version: str | None = None, probe_lock: bool = True) -> Status:
    """Where ``helper`` stands for this Python (and torch), from the files alone (stat calls and a lock probe).

    ``probe_lock=False``: the caller holds the key's lock itself (a probe would see it taken).
    """
    if described(helper).needs_torch and not torch_version:
        return Status(NOT_BUILT, None, "needs torch, which this process has not imported")
    packaged = in_package(helper, torch_version)
    if packaged is not None:
        return Status(PACKAGE, str(packaged), "built into the package folder (takes precedence)")
    if not enabled():
        return Status(DISABLED, None, f"{VARIABLE}=0: not built or loaded from the cache dir")
    where = folder(cache_dir, helper, torch_version)
    name = module_file(helper, torch_version)
    fds, problem = trusted.walk(cache_dir, (FOLDER, where.name, name), last_is_file=True)
    trusted.close_all(fds)
    if problem is None:
        return Status(CACHE, str(where / name), "built for this Python and torch")
    if problem != trusted.ABSENT:
        return Status(REFUSED, str(where / name), problem)
    if probe_lock and _lock_held(where / LOCK):
        return Status(BUILDING, str(where / LOG), "building in the background")
    if os.path.lexists(where / FAILED):
        return Status(FAILED_STATE, str(where / FAILED), failure_text(where / FAILED))
    return Status(NOT_BUILT, None, "the first GPU use builds it in the background")


# -- the build on first use ------------------------------------------------------------------------------------------

_started: set[str] = set()  # keys whose build this process started (or found taken): never started twice
_first_use = threading.Lock()


def on_first_use(spawn: Spawn | None = None) -> list[str]:
    """Start the background build of each helper this process could use and nobody has built; the keys started.

    Called once, when the CUDA driver is first set up (``gpu.cuda()``). Where the package holds every helper, stat
    calls alone (``all_in_package``); else, for each one it lacks, the key (its source read and hashed, once a
    process) and a few ``stat`` calls when it is there or settled (built, failed, refused, building); never waits.
    ``spawn`` starts the builder (tests count its calls); by default a detached process.
    """
    torch_version = running_torch()
    if not enabled() or all_in_package(torch_version):  # a deployment's builds: no family's description imported
        return []
    cache_dir = config.settings().cache_dir
    started = []
    with _first_use:
        for helper in wanted(torch_version):
            try:
                if in_package(helper, torch_version) is not None:
                    continue  # the package's own build (one stat): its source is neither read nor hashed
                built = os.path.join(cache_dir, FOLDER, key(helper, torch_version), module_file(helper, torch_version))
                if os.path.lexists(built):
                    continue  # there (a stat): loading it checks whether it is trusted
                state = status(helper, cache_dir, torch_version)
            except OSError as exc:  # its source cannot be read: no key to build under
                log.debug("not building the %s helper: %s", helper, exc)
                continue
            if state.state == FAILED_STATE:
                report_failure(Path(str(state.path)), state.detail)
            if state.state != NOT_BUILT:
                continue
            name = key(helper, torch_version)
            try:
                if name not in _started and _start(helper, cache_dir, torch_version, spawn or _spawn):
                    started.append(name)
            except OSError as exc:  # the lazy build is optional: a call never fails for it
                _say_once(f"not building the compiled {helper} helper: {exc}")
            _started.add(name)
    return started


def report_failure(marker: Path, detail: str) -> None:
    """Log a failed build once: a warning from the first process that sees its marker, later only debug."""
    try:
        os.close(os.open(marker.with_name(REPORTED), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
    except OSError:
        log.debug("compiled helper build failed earlier: %s (%s)", detail, marker)
        return
    log.warning("building a compiled helper failed: %s; the slower launch path is used (not retried for this "
                "torch, Python and source; the whole error: %s; lazytriton prewarm --helpers tries again)",
                detail, marker)


def make_folder(cache_dir: Path, helper: str, torch_version: str | None) -> str | None:
    """Create ``helpers/<key>`` (mode 0755 less the umask); None when it and the folders above are trusted."""
    target = folder(cache_dir, helper, torch_version)
    try:
        Path(cache_dir).mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        for path in (target.parent, target):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, DIR_MODE)
    except OSError as exc:
        return f"cannot create {target} ({exc.strerror})"
    fds, problem = trusted.walk(cache_dir, (FOLDER, target.name), last_is_file=False)
    trusted.close_all(fds)
    return problem or None


def take_lock(where: Path, blocking: bool) -> int | None:
    """The fd of ``where/build.lock`` with its exclusive lock held, or None when another process holds it."""
    import fcntl

    fd = os.open(where / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{where / LOCK} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _start(helper: str, cache_dir: Path, torch_version: str | None, spawn: Spawn) -> bool:
    """Take the key's lock and hand it, with the log, to a builder; False when there is nothing to start."""
    executable = codepack.python_executable()
    if executable is None:
        log.debug("not building the %s helper: this process is not a Python interpreter (%r)", helper, sys.executable)
        return False
    problem = make_folder(cache_dir, helper, torch_version)
    if problem is not None:
        _say_once(f"not building the compiled {helper} helper in the cache dir: {problem}")
        return False
    where = folder(cache_dir, helper, torch_version)
    try:
        lock_fd = take_lock(where, blocking=False)
    except OSError as exc:
        _say_once(f"not building the compiled {helper} helper: {where / LOCK}: {exc}")
        return False
    if lock_fd is None:
        return False  # another process is building it
    if status(helper, cache_dir, torch_version, probe_lock=False).state != NOT_BUILT:  # built or failed since we looked
        os.close(lock_fd)
        return False
    try:
        log_fd = os.open(where / LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        os.close(lock_fd)
        _say_once(f"not building the compiled {helper} helper: {where / LOG}: {exc}")
        return False
    argv = [executable, "-m", BUILDER, "child", helper, str(cache_dir), "--key", where.name,
            "--lock-fd", str(lock_fd)]
    log.info("building the compiled %s helper in the background into %s (log: %s); this process keeps the slower "
             "path, the next one loads it", helper, where, where / LOG)
    spawn(argv, str(where), log_fd, lock_fd)
    return True


_spawned: list[threading.Event] = []  # set once each builder has been started (or failed to start)


def _spawn(argv: Sequence[str], cwd: str, log_fd: int, lock_fd: int) -> None:
    """Start the builder detached (its own session, stdio to the log) from a daemon thread, which then reaps it.

    The builder inherits the lock's descriptor, so the lock is held until it exits; this process closes its copies.
    The start (~10 ms: fork, exec) happens off the caller's thread; a process that exits at once waits for the start
    alone (``atexit``), so its build still runs.
    """
    env = dict(os.environ, **{VARIABLE: "0", "PYTHONUNBUFFERED": "1"})  # the builder never starts builds itself
    started = threading.Event()

    def run() -> None:
        try:
            process = subprocess.Popen(list(argv), cwd=cwd, stdin=subprocess.DEVNULL, stdout=log_fd,  # noqa: S603
                                       stderr=subprocess.STDOUT, pass_fds=(lock_fd,), start_new_session=True,
                                       env=env)
        except OSError as exc:
            log.warning("could not start the compiled helper's build (%s): %s", " ".join(argv), exc)
            return
        finally:
            os.close(log_fd)
            os.close(lock_fd)
            started.set()
        process.wait()

    if not _spawned:
        atexit.register(_wait_for_starts)
    _spawned.append(started)
    threading.Thread(target=run, name="lazytriton-helper-build", daemon=True).start()


def _wait_for_starts() -> None:
    for started in _spawned:
        started.wait(10.0)  # bounded: an exit never hangs on it


def reset() -> None:
    """Forget what this process started and logged (tests: a fresh process, in this one)."""
    _started.clear()
    _say_once.cache_clear()
    _setting[:] = [True, -1]
