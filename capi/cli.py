"""``lazytriton capi``: build, install or uninstall the C API, or say where it is."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from lazytriton.capi import default_prefix

DESCRIPTION = ("Build liblazytriton.so (the C API) and install it with its header, pkg-config and CMake files, "
               "remove them again, or say where they go.")


def _usage_lines(prefix: Path) -> list[str]:
    return [
        f"  pkg-config: PKG_CONFIG_PATH={prefix / 'lib' / 'pkgconfig'} pkg-config --cflags --libs lazytriton",
        f"  CMake:      cmake -DCMAKE_PREFIX_PATH={prefix} ...  (find_package(lazytriton), lazytriton::lazytriton)",
    ]


def cmd_build(args: argparse.Namespace) -> int:
    from lazytriton.capi import build

    prefix = Path(args.prefix) if args.prefix else default_prefix()
    start = time.perf_counter()
    installed = build.build(prefix, verbose=args.verbose)
    print(f"built {installed.library} in {time.perf_counter() - start:.1f} s")
    for path in (installed.header, installed.pkg_config, installed.cmake_config, *build.installed_files(prefix)[5:]):
        print(f"installed {path}")
    print("\n".join(_usage_lines(installed.prefix)))
    return 0


def cmd_uninstall(args: argparse.Namespace) -> int:
    from lazytriton.capi import build

    prefix = Path(args.prefix) if args.prefix else default_prefix()
    removed = build.uninstall(prefix, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    if not removed:
        print(f"nothing to remove: no C API files under {prefix}")
    return 0


def cmd_where(args: argparse.Namespace) -> int:
    prefix = default_prefix()
    if args.prefix:
        print(prefix)
        return 0
    library = prefix / "lib" / "liblazytriton.so"
    state = "installed" if library.exists() else "not built yet: run `lazytriton capi build`"
    print(f"prefix      {prefix}\nlibrary     {library} ({state})")
    print("\n".join(_usage_lines(prefix)))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lazytriton capi", description=DESCRIPTION)
    parser.add_argument("--prefix", action="store_true", help="print the default install prefix and exit")
    parser.set_defaults(fn=cmd_where)
    sub = parser.add_subparsers(dest="command")
    build_parser = sub.add_parser("build", help="compile liblazytriton.so and install it with its header, "
                                  "pkg-config and CMake files")
    build_parser.add_argument("--prefix", dest="prefix", metavar="DIR",
                              help=f"install under DIR (default: {_default_text()})")
    build_parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    build_parser.set_defaults(fn=cmd_build)
    uninstall_parser = sub.add_parser("uninstall", help="remove the files `lazytriton capi build` installed "
                                      "(pip uninstall leaves them)")
    uninstall_parser.add_argument("--prefix", dest="prefix", metavar="DIR",
                                  help=f"the prefix it was built with (default: {_default_text()})")
    uninstall_parser.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    uninstall_parser.set_defaults(fn=cmd_uninstall)
    args = parser.parse_args(argv)
    return int(args.fn(args))


def _default_text() -> str:
    return "the venv's prefix, else CACHE_DIR/capi/<python>"
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
