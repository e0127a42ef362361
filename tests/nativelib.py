"""Helpers for the native core's tests: build its C test driver (sanitized where the compiler can) and talk to it.

``build_driver(directory)`` compiles ``capi/native/*.c`` with ``tests/capi/native_dump.c`` (with
``-fsanitize=address,undefined`` when a test program so built runs here); ``Driver`` keeps one
``native_dump serve`` process and asks it about images and entries, one JSON line each, under a timeout:
a crash, a sanitizer report or a hang fails the test that asked.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from lazytriton.capi.native_tables import header
from lazytriton.tuning import Table

REPO = Path(__file__).resolve().parents[1]
NATIVE = REPO / "capi" / "native"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
# What a sanitized driver does on a finding: exit with a report on stderr (never hang, never go on).
SANITIZER_ENV = {"ASAN_OPTIONS": "abort_on_error=0:detect_leaks=1:allocator_may_return_null=1",
                 "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
STATUS = {0: "ok", 1: "absent", 2: "damaged", 3: "io", 4: "nomem", 5: "argument"}


def need_toolchain() -> str:
    """The C compiler; skip (fail in CI, where .ci/run installs them) without it or libzstd's header."""
    cc = shutil.which("gcc") or shutil.which("cc")
    missing = [what for what, present in (("a C compiler", cc is not None),
                                          ("zstd.h (libzstd-dev)", Path("/usr/include/zstd.h").exists()))
               if not present]
    if missing:
        message = f"the native core needs {', '.join(missing)} (.ci/run installs them)"
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    assert cc is not None
    return cc


def sanitizers_work(cc: str, directory: Path) -> bool:
    """Whether a program built with SANITIZE runs here (LeakSanitizer needs ptrace, which some sandboxes deny)."""
    source, program = directory / "probe.c", directory / "probe"
    source.write_text("#include <stdlib.h>\nint main(void) { free(malloc(8)); return 0; }\n")
    built = subprocess.run([cc, *SANITIZE, str(source), "-o", str(program)], capture_output=True, check=False)
    if built.returncode != 0:
        return False
    ran = subprocess.run([str(program)], capture_output=True, env={**os.environ, **SANITIZER_ENV}, check=False)
    return ran.returncode == 0


def build_driver(directory: Path, name: str = "native_dump", table: Table | None = None) -> tuple[Path, bool]:
    """``tests/capi/<name>.c`` built with the native core into ``directory``, and whether it is sanitized.

    ``table``: the tuning rows lt_tables.h holds (None: the attention kernels' tables, as a build takes them).
    """
    cc = need_toolchain()
    sanitized = sanitizers_work(cc, directory)
    program = directory / name
    (directory / "lt_tables.h").write_text(header(table))
    sources = [str(path) for path in sorted(NATIVE.glob("*.c"))]
    command = [cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-g", "-O1", *(SANITIZE if sanitized else []),
               f"-I{NATIVE}", f"-I{directory}", *sources, str(REPO / "tests" / "capi" / f"{name}.c"), "-lzstd",
               "-lpthread", "-o", str(program)]
    built = subprocess.run(command, capture_output=True, text=True, check=False)
    assert built.returncode == 0, f"{' '.join(command)}\n{built.stderr}"
    return program, sanitized


class LineServer:
    """A test program that answers each request line with one JSON line; a hang or a death fails the test."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str, timeout: float = 120) -> None:
        self.name, self.timeout = name, timeout
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=env)

    def ask(self, request: str) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(request + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        if not ready:
            self.process.kill()
            pytest.fail(f"{self.name} hung on {request[:200]!r} (no answer in {self.timeout} s)")
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=30)
            stderr = self.process.stderr.read() if self.process.stderr else ""
            pytest.fail(f"{self.name} died on {request[:200]!r} (exit {self.process.returncode}):\n{stderr[-4000:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        code = self.process.wait(timeout=60)
        stderr = self.process.stderr.read() if self.process.stderr else ""
        assert code == 0, f"{self.name} exited {code} at the end (a leak report?):\n{stderr[-4000:]}"


class Driver(LineServer):
    """One ``native_dump serve`` process; each request answered within ``timeout`` seconds or the test fails."""

    def __init__(self, program: Path, timeout: float = 120) -> None:
        super().__init__([str(program), "serve"], {**os.environ, **SANITIZER_ENV}, "native reader", timeout)

    def image(self, path: Path) -> dict[str, Any]:
        """What the C reader makes of the image at ``path``: {"open": status, "reads": [status...], ...}."""
        return self.ask(f"image {path}")

    def entry(self, path: Path, key: str | None) -> dict[str, Any]:
        """The C decoder's status (and entry) for the entry bytes at ``path`` (at most 1 MiB) under ``key``."""
        return self.ask(f"entry {path} {key or '-'}")


def build_program(directory: Path, name: str) -> dict[str, Path]:
    """The native library, the fake libcuda (``driver/libcuda.so.1``) and ``tests/capi/<name>.c`` linked to it.

    Built into ``directory``: {"library", "driver", "program"}.
    """
    from fake_libcuda import build as build_fake

    from lazytriton.capi import native_build

    cc = need_toolchain()
    library = native_build.build(directory / "lib")
    fake = build_fake(directory)
    assert fake is not None
    driver = directory / "driver"
    driver.mkdir()
    (driver / "libcuda.so.1").symlink_to(fake)
    program = directory / name
    subprocess.run([cc, "-std=c99", "-D_POSIX_C_SOURCE=200809L", "-Wall", "-Wextra", "-Werror",
                    f"-I{REPO / 'capi'}", str(REPO / "tests" / "capi" / f"{name}.c"), f"-L{library.parent}",
                    "-llazytriton_native", f"-Wl,-rpath,{library.parent}", "-ldl", "-o", str(program)], check=True)
    return {"library": library, "driver": driver, "program": program}
