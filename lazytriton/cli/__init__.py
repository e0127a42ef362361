"""The ``lazytriton`` command and its subcommands (``info``, ``demo``, ``cache``, ``tune``, ``prewarm``, ``capi``).

``main`` is the one place that turns an exception into what a user reads:
one line on stderr (and maybe a hint line), exit status 2 for a usage or
configuration error and 1 for a failure of the work; the traceback only with
``--traceback`` or ``LAZYTRITON_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import lazytriton
from lazytriton import codepack, codepack_build
from lazytriton.cli.report import plural as plural  # re-exported as lazytriton.cli.plural

DESCRIPTION = """\
Triton FlashAttention kernels served from a persistent cache, compiled ahead
of time (prewarm) or just in time when a kernel is missing.

Start with `lazytriton demo` (one attention call, cold then warm) and
`lazytriton info` (versions, device, target, cache)."""

EPILOG = """\
exit status: 0 done, 1 the work failed, 2 a usage or configuration error.
Errors are one line; --traceback (before the command) or LAZYTRITON_DEBUG=1
shows the traceback. Settings are LAZYTRITON_* environment variables (see
README.md)."""

JIT_EXTRA_HINT = "hint: install the compiler with: pip install 'lazytriton[jit]'"
_MAX_MESSAGE = 600  # characters of an error message shown on its one line


def _version_of(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _device() -> tuple[str | None, str | None, str]:
    """(device, its target, a note when there is none), without importing triton."""
    try:
        import torch
    except ImportError:
        return None, None, "none (torch not installed)"
    if not torch.cuda.is_available():
        return None, None, "none (CPU only: calls on CPU tensors run through Triton's interpreter)"
    from lazytriton.machine import target_of_device

    index = torch.cuda.current_device()
    return f"cuda:{index} {torch.cuda.get_device_name(index)}", str(target_of_device(index)), ""


def info_fields() -> dict[str, Any]:
    """What ``lazytriton info`` reports, as plain values (``--json`` prints exactly this)."""
    from lazytriton import runtime

    rt = runtime.get()
    device, target, _ = _device()
    stats = rt.local.stats()
    return {
        "lazytriton": lazytriton.__version__,
        "python": platform.python_version(),
        "torch": _version_of("torch"),
        "triton": _version_of("triton"),
        "device": device,
        "target": target,
        "cache_dir": str(rt.settings.cache_dir),
        "entries": stats.entries,
        "bytes": stats.bytes,
        "max_bytes": rt.local.size_limit,
        "local_problem": rt.local.problem,
        "compiles": rt.counters().get("compiles", 0),
        "images": [str(i.path) for i in rt.images.images],
        "shared": _redact(rt.settings.shared) if rt.settings.shared else None,
        "signing": bool(rt.settings.signing_key),
        "jit": rt.settings.jit,
        **launch_fields(rt.settings.cache_dir),
        "code_pack": dict(zip(("state", "detail"), codepack_build.state(codepack.package_dir()), strict=True)),
    }


HELPER_NAMES = {"fastlaunch": "launch helper", "hotpath": "C++ warm path", "decode_hotpath": "decoding's C++ warm path"}


def launch_fields(cache_dir: Any) -> dict[str, Any]:
    """Which launch path a GPU call takes in this Python and why, and where each compiled helper stands."""
    import importlib

    from lazytriton.driver import fastlaunch, helpers
    from lazytriton.kernels import COMPILED_HELPERS

    torch_version = helpers.running_torch()
    states = {name: helpers.status(name, cache_dir, torch_version) for name in helpers.registry()}
    built = (helpers.PACKAGE, helpers.CACHE)
    loads = {"fastlaunch": states["fastlaunch"].state in built and fastlaunch.available()}
    for described in map(importlib.import_module, COMPILED_HELPERS):  # each family's: its module() loads it or not
        name = described.HELPER.name
        loads[name] = states[name].state in built and described.module() is not None
    found = {name: {"state": state.state, "path": state.path, "detail": state.detail, "loads": loads[name]}
             for name, state in states.items()}
    torch = sys.modules.get("torch")
    fast = states["fastlaunch"]
    if torch is not None and getattr(torch.version, "hip", None):
        path, why = "cffi ABI mode", "a HIP device: the compiled helpers launch through the CUDA driver only"
    elif loads["fastlaunch"]:
        path = "compiled helper" + "".join(f" + {HELPER_NAMES.get(name, name)}" for name, loaded in loads.items()
                                           if loaded and name != "fastlaunch")
        why = f"the launch helper from the {fast.state} ({fast.path})"
    elif fast.state in (helpers.PACKAGE, helpers.CACHE):
        path = "cffi ABI mode"
        why = (f"the launch helper {fast.path} is not loaded by this process (built after its first launch: the "
               "next process loads it; or a warning above says why it does not load)")
    else:
        path = "cffi ABI mode"
        why = {helpers.BUILDING: f"the launch helper is building in the background (log: {fast.path})",
               helpers.FAILED_STATE: f"the launch helper's build failed: {fast.detail} (see {fast.path})",
               helpers.DISABLED: "LAZYTRITON_HELPERS=0: the compiled helpers are neither built nor loaded from the "
                                 "cache dir",
               helpers.REFUSED: f"the launch helper in the cache dir is refused: {fast.detail}",
               }.get(fast.state, "the launch helper is not built yet: the first GPU use builds it in the background "
                                 "for the next process (or: lazytriton prewarm --helpers)")
    return {"launch_path": path, "launch_why": why, "helpers": found}


def _helper_row(name: str, found: dict[str, Any]) -> str:
    where = f" ({found['path']})" if found["path"] else ""
    unusable = "; does not load" if found["state"] in ("package", "cache dir") and not found["loads"] else ""
    return f"{HELPER_NAMES.get(name, name)}: {found['state']}: {found['detail']}{where}{unusable}"


def cmd_info(args: argparse.Namespace) -> int:
    fields = info_fields()
    if args.json:
        print(json.dumps(fields, sort_keys=True))
        return 0
    _, _, no_device = _device()
    rows = [
        ("lazytriton", fields["lazytriton"]),
        ("python", fields["python"]),
        ("torch", fields["torch"] or "not installed"),
        ("triton", fields["triton"] or "not installed (compiling needs it: pip install 'lazytriton[jit]')"),
        ("device", fields["device"] or no_device),
        ("target", fields["target"] or "none detected"),
        ("cache dir", fields["cache_dir"]),
        ("entries", f"{fields['entries']} ({_human(fields['bytes'])} on disk, bound {_human(fields['max_bytes'])})"
                    if fields["local_problem"] is None else "none: the local cache database cannot be opened "
                    f"({fields['local_problem']}); running from memory only (lazytriton cache clear resets it)"),
        ("compiles", f"{fields['compiles']} (since the cache was created)"),
        ("images", ", ".join(fields["images"]) or "none (LAZYTRITON_IMAGES)"),
        ("shared", fields["shared"] or "none (LAZYTRITON_SHARED)"),
        ("signing", "on" if fields["signing"] else "off (LAZYTRITON_SIGNING_KEY)"),
        ("jit", "on" if fields["jit"] else "off (LAZYTRITON_JIT=0)"),
        ("launch", f"{fields['launch_path']}: {fields['launch_why']}" + ("" if fields["device"] else
                                                                            " (on a CUDA GPU; none here)")),
        *((("helpers" if i == 0 else ""), _helper_row(name, found)) for i, (name, found) in
          enumerate(fields["helpers"].items())),
        ("code pack", f"{fields['code_pack']['state']}: {fields['code_pack']['detail']}"),
    ]
    for name, value in rows:
        print(f"{name:<11} {value}")
    return 0


def _redact(url: str) -> str:
    """A shared-tier URL without its password (redis://user:secret@host -> redis://user:***@host)."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{host}"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from lazytriton.cli import demo

    start = time.perf_counter()
    status = demo.run_gpu() if torch.cuda.is_available() and not args.cpu else demo.run_cpu()
    print(f"done in {time.perf_counter() - start:.1f} s")
    return status


def build_parser() -> argparse.ArgumentParser:
    """The ``lazytriton`` parser (``tune`` and ``capi`` parse their own arguments)."""
    parser = argparse.ArgumentParser(prog="lazytriton", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"lazytriton {lazytriton.__version__}")
    parser.add_argument("--traceback", action="store_true", help="show the traceback of an error (before the command)")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, device, target, cache dir, entries and compiles")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    info.set_defaults(fn=cmd_info)
    demo_parser = sub.add_parser("demo", help="run attention through the cache: cold, then warm")
    demo_parser.add_argument("--cpu", action="store_true", help="use the CPU path even when a GPU is present")
    demo_parser.set_defaults(fn=cmd_demo)
    from lazytriton.prewarm.cli import add_parser as add_prewarm_parser

    add_prewarm_parser(sub)
    from lazytriton.cli.cache import add_parser as add_cache_parser

    add_cache_parser(sub)
    sub.add_parser("tune", add_help=False, help="time configs on this GPU and update the tuning table "
                   "(lazytriton tune --help)")
    sub.add_parser("capi", add_help=False, help="build, install or uninstall the C API, liblazytriton.so "
                   "(lazytriton capi --help)")
    return parser


def _run(argv: list[str]) -> int:
    if argv[:1] and argv[0] in ("tune", "capi"):
        from lazytriton import config

        config.settings()  # a bad LAZYTRITON_* variable is a configuration error before any work
        if argv[0] == "tune":
            from lazytriton.cli import tune

            return tune.main(argv[1:])
        from lazytriton.capi import cli as capi_cli

        return capi_cli.main(argv[1:])
    args = build_parser().parse_args(argv)
    from lazytriton import config

    config.settings()
    return int(args.fn(args))


def describe_error(exc: BaseException) -> tuple[int, str, str | None]:
    """(exit status, one-line message, hint or None) for an exception that ended a command (pure)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if len(text) > _MAX_MESSAGE:
        text = text[:_MAX_MESSAGE] + " ... (--traceback shows all)"
    from lazytriton.config import SettingsError

    if isinstance(exc, SettingsError):
        return 2, f"lazytriton: configuration error: {text}", None
    runtime = sys.modules.get("lazytriton.runtime")  # not imported: the error cannot be one of its classes
    if runtime is not None and isinstance(exc, runtime.KernelNotFound):
        return 1, f"lazytriton: {text}", ("hint: build it ahead of time (lazytriton prewarm --help) and name the "
                                         "image in LAZYTRITON_IMAGES, or unset LAZYTRITON_JIT to compile it now")
    if isinstance(exc, ImportError):
        hints = {"triton": JIT_EXTRA_HINT, "torch": "hint: install torch first (README.md: a CPU build where there is "
                 "no GPU)"}
        hint = hints.get(exc.name or "") if "lazytriton[jit]" not in text else None
        return 1, f"lazytriton: {text}", hint
    compiler = sys.modules.get("lazytriton.compiler")
    if isinstance(exc, OSError) or (compiler is not None and isinstance(exc, compiler.CompileError)):
        return 1, f"lazytriton: {text}", None
    return 1, f"lazytriton: error: {type(exc).__name__}: {text}", "hint: --traceback or LAZYTRITON_DEBUG=1 shows where"


def _debug_env() -> bool:
    return os.environ.get("LAZYTRITON_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def main(argv: list[str] | None = None) -> int:
    """Run the ``lazytriton`` command; the exit status (errors become one line, see ``describe_error``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = _debug_env()
    while argv[:1] == ["--traceback"]:
        show_traceback = True
        argv.pop(0)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        if show_traceback:
            traceback.print_exc()
        print("lazytriton: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lazytriton cache ls | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as exc:
        if show_traceback:
            traceback.print_exc()
        status, message, hint = describe_error(exc)
        print(message, file=sys.stderr)
        if hint and not show_traceback:
            print(hint, file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
