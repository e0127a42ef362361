"""The ``lazytriton`` command and its subcommands (``info``, ``demo``, ``cache``, ``tune``, ``prewarm``, ``capi``)."""

from __future__ import annotations

import argparse
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version

import lazytriton


def _version_of(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _device_line() -> tuple[str, str | None]:
    """The detected GPU and its target, without importing triton."""
    try:
        import torch
    except ImportError:
        return "none (torch not installed)", None
    if not torch.cuda.is_available():
        return "none (CPU only: calls on CPU tensors run through Triton's interpreter)", None
    from lazytriton.dispatch import target_of_device

    index = torch.cuda.current_device()
    return f"cuda:{index} {torch.cuda.get_device_name(index)}", str(target_of_device(index))


def cmd_info(_: argparse.Namespace) -> int:
    from lazytriton import runtime

    rt = runtime.get()
    device, target = _device_line()
    stats = rt.local.stats()
    counters = rt.counters()
    rows = [
        ("lazytriton", lazytriton.__version__),
        ("python", platform.python_version()),
        ("torch", _version_of("torch")),
        ("triton", _version_of("triton")),
        ("device", device),
        ("target", target or "none detected"),
        ("cache dir", str(rt.settings.cache_dir)),
        ("entries", f"{stats.entries} ({_human(stats.bytes)} on disk, bound {_human(rt.local.size_limit)})"
                    if rt.local.problem is None else f"none: the local cache database cannot be opened "
                    f"({rt.local.problem}); running from memory only (lazytriton cache clear resets it)"),
        ("compiles", f"{counters.get('compiles', 0)} (since the cache was created)"),
        ("images", ", ".join(str(i.path) for i in rt.images.images) or "none (LAZYTRITON_IMAGES)"),
        ("shared", _redact(rt.settings.shared) if rt.settings.shared else "none (LAZYTRITON_SHARED)"),
        ("signing", "on" if rt.settings.signing_key else "off (LAZYTRITON_SIGNING_KEY)"),
        ("jit", "on" if rt.settings.jit else "off (LAZYTRITON_JIT=0)"),
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

    if torch.cuda.is_available() and not args.cpu:
        return demo.run_gpu()
    return demo.run_cpu()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazytriton", description=lazytriton.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, device, target, cache dir, entries and compiles").set_defaults(fn=cmd_info)
    demo_parser = sub.add_parser("demo", help="run attention through the cache: cold, then warm")
    demo_parser.add_argument("--cpu", action="store_true", help="use the CPU path even when a GPU is present")
    demo_parser.set_defaults(fn=cmd_demo)
    from lazytriton.prewarm.cli import add_parser as add_prewarm_parser

    add_prewarm_parser(sub)
    from lazytriton.cli.cache import add_parser as add_cache_parser

    add_cache_parser(sub)
    sub.add_parser("tune", add_help=False, help="time configs on this GPU and update the tuning table "
                   "(lazytriton tune --help)")
    sub.add_parser("capi", add_help=False, help="build and install the C API, liblazytriton.so "
                   "(lazytriton capi --help)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tune"]:
        from lazytriton.cli import tune

        return tune.main(argv[1:])
    if argv[:1] == ["capi"]:
        from lazytriton.capi import cli as capi_cli

        return capi_cli.main(argv[1:])
    args = parser.parse_args(argv)
    start = time.perf_counter()
    status = int(args.fn(args))
    if args.command == "demo":
        print(f"done in {time.perf_counter() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
