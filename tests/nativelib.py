"""Helpers for the native core's tests: build its C test programs (sanitized where the compiler can) and talk to them.

``build_driver(directory)`` compiles ``capi/native/*.c`` with ``tests/capi/native_dump.c`` (with
``-fsanitize=address,undefined`` when a test program so built runs here); ``Driver`` keeps one
``native_dump serve`` process and asks it about images and entries, one JSON line each, under a timeout:
a crash, a sanitizer report or a hang fails the test that asked.

``build_program(directory, name)`` links ``tests/capi/<name>.c`` to liblazytriton_native.so beside a fake driver
(tests/fake_libcuda.py, or another fake's ``build``); ``LauncherProgram`` serves the requests of
tests/capi/native_requests.h's programs (load, launch), and ``recorded_launch`` launches the same entry through the
Python launcher on the fake, for the bytes the two must agree on. ``prewarmed_image`` builds an image with
``lazytriton prewarm`` once a session; ``native_launcher`` serves an entry natively on a GPU.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from compiled_once import shared_dir

from lazytriton.cache_format import Entry
from lazytriton.capi.native_tables import header
from lazytriton.tuning import Table

REPO = Path(__file__).resolve().parents[1]
NATIVE = REPO / "capi" / "native"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
# What a sanitized driver does on a finding: exit with a report on stderr (never hang, never go on).
SANITIZER_ENV = {"ASAN_OPTIONS": "abort_on_error=0:detect_leaks=1:allocator_may_return_null=1",
                 "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"}
STATUS = {0: "ok", 1: "absent", 2: "damaged", 3: "io", 4: "nomem", 5: "argument"}
STREAM = 0x5EA  # the stream tests/capi/native_requests.h's programs launch on
LT_OK = 0


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


def answers_of(program: Path, lines: list[str]) -> list[str]:
    """``program``'s answer to each of ``lines`` (one line each), given them all on stdin under the sanitizers'
    options with no tools on PATH; a failed exit or a missing answer fails the test."""
    done = subprocess.run([str(program)], input="".join(line + "\n" for line in lines), capture_output=True,
                          text=True, timeout=600, env=SANITIZER_ENV | {"PATH": "/usr/bin:/bin"}, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    answers = done.stdout.splitlines()
    assert len(answers) == len(lines), done.stderr[-4000:]
    return answers


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


def fake_drivers(directory: Path, build_fake: Callable[[Path], Path | None] | None = None,
                 folders: Sequence[tuple[str, str | None]] = (("driver", "libcuda.so.1"),)) -> dict[str, Path]:
    """A fake driver built into ``directory`` (``build_fake``: tests/fake_libcuda.py's ``build`` by default) and,
    for each (folder, file name) of ``folders``, a folder holding it under that name (None: an empty folder).

    Returns {"fake": the library, and each folder by its name}.
    """
    if build_fake is None:
        from fake_libcuda import build as build_fake
    fake = build_fake(directory)
    assert fake is not None  # need_toolchain found a compiler
    found = {"fake": fake}
    for folder, soname in folders:
        found[folder] = directory / folder
        found[folder].mkdir()
        if soname is not None:
            (found[folder] / soname).symlink_to(fake)
    return found


def build_program(directory: Path, name: str, build_fake: Callable[[Path], Path | None] | None = None,
                  folders: Sequence[tuple[str, str | None]] = (("driver", "libcuda.so.1"),)) -> dict[str, Path]:
    """The native library, a fake driver (``fake_drivers``: the fake libcuda as ``driver/libcuda.so.1`` by
    default) and ``tests/capi/<name>.c`` linked to the library, built into ``directory``.

    Returns {"library", "fake", "program", and each driver folder by its name}.
    """
    from lazytriton.capi import native_build

    cc = need_toolchain()
    library = native_build.build(directory / "lib")
    drivers = fake_drivers(directory, build_fake, folders)
    program = directory / name
    subprocess.run([cc, "-std=c99", "-D_POSIX_C_SOURCE=200809L", "-Wall", "-Wextra", "-Werror",
                    f"-I{REPO / 'capi'}", str(REPO / "tests" / "capi" / f"{name}.c"), f"-L{library.parent}",
                    "-llazytriton_native", f"-Wl,-rpath,{library.parent}", "-ldl", "-o", str(program)], check=True)
    return {"library": library, "program": program, **drivers}


def prewarmed_image(factory: pytest.TempPathFactory, stem: str, args: Sequence[str] = (),
                    variants: Sequence[str] = (), timeout: float = 1200) -> Path:
    """The image ``lazytriton prewarm ARGS`` builds (from a miss log of ``variants`` when given), once a session:
    the first xdist worker builds it under a file lock in compiled_once.shared_dir, the others read it."""
    from filelock import FileLock

    directory = shared_dir(factory)
    path = directory / f"{stem}.ltimg"
    with FileLock(str(directory / f"{stem}.lock")):
        if not path.exists():
            if variants:
                misses = directory / f"{stem}-misses.jsonl"
                misses.write_text("".join(json.dumps({"variant": v}) + "\n" for v in variants))
                args = ["--from-misses", str(misses), *args]
            env = {**os.environ, "LAZYTRITON_CACHE_DIR": str(directory / f"{stem}-cache")}
            done = subprocess.run([sys.executable, "-m", "lazytriton", "prewarm", *args, "--out", str(path),
                                   "-j", "1"], capture_output=True, text=True, env=env, timeout=timeout, check=False)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return path


class LauncherProgram(LineServer):
    """A program of tests/capi/native_requests.h's loop serving from ``image``, its fake found in
    ``built[driver]``. ``LOAD_TOKENS`` and ``LAUNCH_TOKENS`` name the program's own tokens of a load and a
    launch request (after the key; after SCRATCH), given to ``load`` and ``launch`` by keyword (0 when not)."""

    LOAD_TOKENS: tuple[str, ...] = ()
    LAUNCH_TOKENS: tuple[str, ...] = ()

    def __init__(self, built: dict[str, Path], image: Path, driver: str = "driver") -> None:
        env = {**os.environ, "LAZYTRITON_IMAGES": str(image), "LD_LIBRARY_PATH": str(built[driver])}
        super().__init__([str(built["program"])], env, built["program"].name)

    @staticmethod
    def own_tokens(names: tuple[str, ...], given: dict[str, int]) -> list[str]:
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise TypeError(f"this program's requests take no {', '.join(unknown)} (they take {names or 'none'})")
        return [str(given.get(name, 0)) for name in names]

    def load(self, entry: Entry, **own: int) -> dict[str, Any]:
        return self.ask(" ".join(["load", entry.key, *self.own_tokens(self.LOAD_TOKENS, own)]))

    def launch(self, grid: tuple[int, int, int], scratch: str, sizes: list[int], args: list[str],
               **own: int) -> dict[str, Any]:
        """``scratch``: "own" or "given:G:P"; ``args``: the program's tokens ("i:V", "f:V", "d:R:BASE:...")."""
        return self.ask(" ".join(["launch", *map(str, grid), scratch, *self.own_tokens(self.LAUNCH_TOKENS, own),
                                  str(len(sizes)), *map(str, sizes), str(len(args)), *args]))


def param_sizes(entry: Entry) -> list[int]:
    """Bytes of each compiled parameter: a descriptor's map, sizes (i32), strides (i64); 4 for an i32 or fp32,
    else 8; then the hidden pointers."""
    from lazytriton.driver import fastlaunch

    sizes: list[int] = []
    metas = iter(entry.tensordesc_meta)
    for kind in entry.arg_types:
        if kind.startswith("tensordesc"):
            rank = next(metas).rank
            sizes += [fastlaunch.MAP_BYTES] + [4] * rank + [8] * rank
        else:
            sizes.append(4 if kind in ("i32", "fp32") else 8)
    return sizes + [8] * len(entry.hidden_args)


class Memory:
    """What scratch_alloc returns: device memory at a made-up address."""

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def recorded_launch(kernel: Any, fake: Any, grid: tuple[int, int, int], ints: tuple[int, ...],
                    floats: tuple[float, ...], addresses: Sequence[int] = ()
                    ) -> tuple[list[str | None], dict[str, int], list[int], list[tuple[int, int]]]:
    """A Python launcher's ``kernel`` launched once on STREAM against ``fake`` (configured for it): each
    parameter's bytes (hex; None for NULL), the launch's state, each parameter's address modulo 64, and the
    launcher's scratch_alloc calls (bytes, device), given ``addresses`` in order."""
    allocs: list[tuple[int, int]] = []
    given = iter(addresses)

    def scratch_alloc(nbytes: int, device: int) -> Memory:
        allocs.append((nbytes, device))
        return Memory(next(given))

    kernel.launch(grid, STREAM, ints, floats, scratch_alloc)
    aligns: list[int] = []
    params, state = fake.last_launch(aligns)
    assert state["launches"] == 1
    return [None if p is None else p.hex() for p in params], state, aligns, allocs


# -- on a GPU: an entry launched by liblazytriton_native.so on the real driver ------------------------------------

NATIVE_CDEF = """
typedef struct { void *base; int64_t sizes[5]; int64_t strides[5]; } lt_tensor_descriptor;
typedef struct lt_kernel lt_kernel;
int lt_open_images(const char *paths);
int lt_kernel_load(const char *key, const char *variant, int32_t device_index, lt_kernel **out);
int lt_kernel_launch(const lt_kernel *kernel, const uint32_t grid[3], void *stream, void **args, size_t n_args);
void lt_kernel_destroy(lt_kernel *kernel);
const char *lt_native_last_error(void);
"""


def native_launcher(tmp_path: Path, entry: Entry) -> Any:
    """``launch(grid, args)``: liblazytriton_native.so, built now, serving ``entry`` from an image of it alone."""
    import torch
    from cffi import FFI

    from lazytriton.cache_format.image import write_image
    from lazytriton.capi import native_build

    ffi = FFI()
    ffi.cdef(NATIVE_CDEF)
    lib = ffi.dlopen(str(native_build.build(tmp_path / "lib")))
    write_image(tmp_path / "one.ltimg", [entry])
    assert lib.lt_open_images(str(tmp_path / "one.ltimg").encode()) == LT_OK, ffi.string(lib.lt_native_last_error())
    kernel = ffi.new("lt_kernel **")
    status = lib.lt_kernel_load(entry.key.encode(), ffi.NULL, torch.cuda.current_device(), kernel)
    assert status == LT_OK, ffi.string(lib.lt_native_last_error())

    def launch(grid: tuple[int, int, int], values: list[Any]) -> None:
        """values: an int (pointer or integer), a float (fp32) or a (base, sizes, strides) descriptor each."""
        keep, args = [], ffi.new("void *[]", len(values))
        for i, value in enumerate(values):
            if isinstance(value, tuple):
                base, sizes, strides = value
                cell = ffi.new("lt_tensor_descriptor *", {"base": ffi.cast("void *", base),
                                                          "sizes": list(sizes), "strides": list(strides)})
            else:
                cell = ffi.new("float *" if isinstance(value, float) else "int64_t *", value)
            keep.append(cell)
            args[i] = cell
        stream = ffi.cast("void *", torch.cuda.current_stream().cuda_stream)
        status = lib.lt_kernel_launch(kernel[0], ffi.new("uint32_t[3]", list(grid)), stream, args, len(values))
        assert status == LT_OK, ffi.string(lib.lt_native_last_error()).decode()

    return launch


def native_forward_matches_python(tmp_path: Path, variant_text: str, seqlen: int) -> Entry:
    """flash_fwd's ``variant_text`` over fp16 q, k and v (2, 4, seqlen, 64) of seed 0, launched by the Python binding
    and by liblazytriton_native.so (``native_launcher``): out and lse bit-equal, out within FlashAttention's rule of
    a float64 reference (2x a same-precision PyTorch attention's error). Returns the entry launched."""
    import torch

    from lazytriton import runtime
    from lazytriton.kernels.flash_fwd import binding
    from lazytriton.variant import Variant

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, seqlen, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    call = binding.check(q, k, v, False)
    variant = Variant.parse(variant_text)
    entry = runtime.get().kernel(variant, q.device.index).entry
    out, lse = torch.empty_like(q), torch.empty(2, 4, seqlen, device="cuda", dtype=torch.float32)
    binding.launch_gpu(q, k, v, out, lse, call, variant=variant)
    out2, lse2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    ints, floats = iter(binding.pack(q, k, v, out2, lse2, call)[0]), iter(binding.floats(call))
    values = [next(floats) if kind == "fp32" else next(ints) for kind in entry.arg_types]
    native_launcher(tmp_path, entry)(binding.grid(call.shape, int(variant.get("BLOCK_M"))), values)
    torch.cuda.synchronize()
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    err, same = attention_error(out, q, k, v, call.scale)
    assert err <= 2 * same + 1e-5, (err, same)
    return entry


def attention_error(out: Any, q: Any, k: Any, v: Any, scale: float) -> tuple[float, float]:
    """(out's error, a same-precision PyTorch attention's) against a float64 reference: the largest absolute."""
    import torch

    def attend(a: Any, b: Any, c: Any) -> Any:
        group = a.shape[1] // b.shape[1]
        b, c = b.repeat_interleave(group, 1), c.repeat_interleave(group, 1)
        return torch.softmax(a @ b.transpose(-1, -2) * scale, dim=-1) @ c

    want = attend(q.double(), k.double(), v.double())
    same = attend(q, k, v)
    return float((out.double() - want).abs().max()), float((same.double() - want).abs().max())
