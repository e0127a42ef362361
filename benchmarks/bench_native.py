"""From nothing to the first launch of one kernel of a 200-entry image: the native library against Python.

CPU (default): native: a fresh process runs tests/capi/native_front.c against liblazytriton_native.so and the fake
libcuda (tests/fake_libcuda.py): lt_init (opening the image) and one lt_attn_fwd (the variant and key computed in
C, the entry read, checked, loaded and launched); the program's own clock from lt_init to lt_attn_fwd's return.
python: a fresh interpreter imports lazytriton, computes the same call's variant and key and reads the entry
from the same image (lazytriton.cache_format.image); timed inside the process (import to entry) and as the
whole process (interpreter start included). The image: the call's entry (a made-up binary) and synthetic ones.

``--gpu`` (a CUDA host with a C compiler and zstd.h): the image holds the call's variant for device 0's target,
compiled here by ``lazytriton prewarm --from-misses``, and synthetic entries (200 in its index, the lookup real).
native: a fresh process runs benchmarks/native_first_launch.c against liblazytriton_native.so (built now) and the
real libcuda: first the application's CUDA context (cuInit, the primary context: timed apart), then from lt_init
to the first lt_attn_fwd's return and to the kernel's completion (cuCtxSynchronize). python: a fresh interpreter
imports torch and makes the inputs on the GPU (torch's CUDA init, timed apart), then imports lazytriton and calls
flash_attn_func once from the same image (LAZYTRITON_IMAGES, LAZYTRITON_JIT=0, an empty cache dir,
LAZYTRITON_HELPERS=0 as a fresh install's first process), to its return and its completion. Both also from the
process's start (the parent's clock) to the completion. The first run of each writes its output, checked against
the float32 reference of the same inputs (kernels/flash_fwd/reference.py): the times are a correct launch's.

p50, min and max of ``--runs`` fresh processes each. Rows are appended to ``benchmarks/results/native.csv``.

Usage: python benchmarks/bench_native.py [--gpu] [--runs 15] [--csv PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
TESTS = REPO / "tests"  # the fake libcuda, the tests' fake entry (importable once ``with_tests``), C headers (capi/)
sys.path.insert(0, str(HERE))

ENTRIES = 200
# native_front.c's and native_first_launch.c's call: bf16, not causal, q (BATCH, HEADS_Q, SEQLEN_Q, HEAD_DIM)
BATCH, HEADS_Q, HEADS_K, SEQLEN_Q, SEQLEN_K, HEAD_DIM = 1, 4, 2, 300, 500, 128
TARGET_MS = 2.0  # the native core's target: lt_init to the first launch returned
NATIVE_RETURNED = "native: lt_init to first lt_attn_fwd returned"
PYTHON_LOOKUP = """
import sys, time
t0 = time.perf_counter()
from lazytriton.capi import embedded
from lazytriton.cache_format.image import Image
variant = embedded.plan_variant("flash_fwd", 90, 2, 128, False, True, False, 300, 500, head_dim_v=128)
entry = Image(sys.argv[1]).read(variant.key())
assert entry is not None
print((time.perf_counter() - t0) * 1e3)
"""
# --gpu's Python side; argv: DEVICE [OUT] ("cpu": Triton's interpreter, for the tests). Times in s (perf_counter)
# and the monotonic time of the completion.
PYTHON_FIRST_CALL = """
import json, sys, time
start = time.perf_counter()
import torch
sys.path.insert(0, {here!r})
from bench_native import inputs
torch_imported = time.perf_counter()
device = sys.argv[1]
synchronize = torch.cuda.synchronize if device == "cuda" else lambda: None
q, k, v = (t.to(device).transpose(1, 2) for t in inputs())  # flash_attn_func's (batch, seqlen, heads, head_dim)
synchronize()
inputs_ready = time.perf_counter()
from lazytriton import flash_attn_func, runtime
out = flash_attn_func(q, k, v)
returned = time.perf_counter()
synchronize()
completed, completed_at = time.perf_counter(), time.monotonic()
if len(sys.argv) > 2:
    with open(sys.argv[2], "wb") as f:
        f.write(bytes(out.transpose(1, 2).contiguous().cpu().untyped_storage()))
rt = runtime.get()
print(json.dumps({{"torch_import": torch_imported - start, "cuda_init": inputs_ready - torch_imported,
                  "returned": returned - inputs_ready, "completed": completed - inputs_ready,
                  "completed_at": completed_at, "compiles": rt.compiles, "served": dict(rt.served)}}))
"""


def filler_entries(count: int, size: int = 3000) -> list[Any]:
    """``count`` synthetic cubin entries of ``size`` bytes under keys no variant has: the rest of an index."""
    import xxhash

    from lazytriton.cache_format import Entry
    from lazytriton.cache_format.entry import Provenance

    return [Entry(key=xxhash.xxh3_128_hexdigest(f"bench-native:{i}".encode()), variant="flash_fwd:sm_90:fp16:::",
                  target="sm_90", kind="cubin", binary=b"\x7fELF" + bytes((j * 7 + i) % 251 for j in range(size)),
                  name="flash_fwd_kernel", num_warps=4, num_ctas=1, warp_size=32, shared=1024, global_scratch_size=0,
                  global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1, arg_types=("*fp16", "i32"),
                  hidden_args=("global_scratch", "profile_scratch"),
                  provenance=Provenance("triton", "3.9.0", "0123456789abcdef", 1.5e9, 1)) for i in range(count)]


def write_bench_image(path: Path, served: Sequence[Any]) -> Path:
    """The image at ``path``: the ``served`` entries, then synthetic ones up to ENTRIES in all."""
    from lazytriton.cache_format.image import write_image

    if not 1 <= len(served) <= ENTRIES or len({entry.key for entry in served}) != len(served):
        raise ValueError(f"served: 1 to {ENTRIES} entries of distinct keys expected, got {len(served)}")
    write_image(path, [*served, *filler_entries(ENTRIES - len(served))])
    return path


def link(source: Path, library: Path, program: Path) -> Path:
    """``source`` (a C front of lazytriton.h) compiled and linked to ``library`` (liblazytriton_native.so), with
    the headers of benchmarks/ and tests/capi/ (the CUDA driver's entry points, the JSON it prints) to include."""
    from lazytriton.capi import native_build

    subprocess.run([native_build.compiler(), "-O2", "-std=c99", "-D_POSIX_C_SOURCE=200809L", f"-I{REPO / 'capi'}",
                    f"-I{HERE}", f"-I{TESTS / 'capi'}", str(source), f"-L{library.parent}", "-llazytriton_native",
                    f"-Wl,-rpath,{library.parent}", "-ldl", "-o", str(program)], check=True)
    return program


def summary_rows(meta: Mapping[str, str], results: Mapping[str, Sequence[float]]) -> list[dict[str, object]]:
    """One row a case: ``meta`` (csvlog.run_meta's columns), the case, and p50, min and max of its runs in ms."""
    return [{**meta, "case": case, "entries": ENTRIES, "runs": len(values),
             "p50_ms": round(statistics.median(values), 3), "min_ms": round(min(values), 3),
             "max_ms": round(max(values), 3)} for case, values in results.items()]


def report(title: str, rows: Sequence[Mapping[str, object]], csv: Path) -> None:
    """Print ``rows`` under ``title`` and append them to ``csv``."""
    from csvlog import append_rows

    print(title)
    for row in rows:
        print(f"  {row['case']:58s} p50 {row['p50_ms']:9.3f} ms  (min {row['min_ms']:.3f}, max {row['max_ms']:.3f})")
    append_rows(csv, [*rows[0].keys()], rows)


# -- CPU: the fake libcuda -----------------------------------------------------------------------------------------

def with_tests() -> None:
    """The tests' helpers importable (not at import: --gpu's child imports this module, and tests/ stays off its
    path)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))


def build(directory: Path) -> tuple[Path, Path, Path]:
    """(native_front, the folder holding the fake libcuda.so.1, the 200-entry image)."""
    with_tests()
    from fake_libcuda import build as build_fake
    from test_native_front import call_variant, fake_entry

    from lazytriton.capi import native_build

    library = native_build.build(directory / "lib")
    driver = directory / "driver"
    driver.mkdir()
    fake = build_fake(directory)
    if fake is None:
        raise SystemExit("bench_native needs a C compiler")
    (driver / "libcuda.so.1").symlink_to(fake)
    program = link(TESTS / "capi" / "native_front.c", library, directory / "native_front")
    image = write_bench_image(directory / "bench.ltimg", [fake_entry(call_variant(False))])
    return program, driver, image


def native_ms(program: Path, driver: Path, image: Path, cache: Path) -> float:
    with_tests()
    from test_native_front import FWD_INTS

    env = {"LAZYTRITON_IMAGES": str(image), "LD_LIBRARY_PATH": str(driver), "LAZYTRITON_CACHE_DIR": str(cache),
           "PATH": "/usr/bin:/bin", "NATIVE_FRONT_INTS": str(FWD_INTS)}
    done = subprocess.run([str(program), "0", "cuda", "0"], capture_output=True, text=True, env=env, check=True)
    found = json.loads(done.stdout)
    if found["fwd"] != 0:
        raise SystemExit(f"native_front failed: {found}")
    return float(found["first_launch_us"]) / 1e3


def python_ms(image: Path, cache: Path) -> tuple[float, float]:
    """(import to entry inside the process, the whole process), in ms."""
    env = {**os.environ, "LAZYTRITON_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PYTHON_LOOKUP, str(image)], capture_output=True, text=True,
                          env=env, check=True)
    return float(done.stdout.strip()), (time.perf_counter() - start) * 1e3


def cpu_main(runs: int, csv: Path) -> None:
    from csvlog import run_meta

    with tempfile.TemporaryDirectory(prefix="bench-native-") as tmp:
        program, driver, image = build(Path(tmp))
        cache = Path(tmp) / "cache"
        native = [native_ms(program, driver, image, cache) for _ in range(runs)]
        python = [python_ms(image, cache) for _ in range(runs)]
    results = {"native: lt_init to first lt_attn_fwd launch": native,
               "python: import to entry read": [p[0] for p in python],
               "python: process start to entry read": [p[1] for p in python]}
    report(f"{ENTRIES}-entry image, {runs} fresh processes each, CPU (fake libcuda for the native launch)",
           summary_rows(run_meta("flash_fwd", "cpu"), results), csv)


# -- --gpu: a real sm_XY entry, the real libcuda -------------------------------------------------------------------

def inputs() -> tuple[Any, Any, Any]:
    """q, k and v on the CPU, bf16 (batch, heads, seqlen, head_dim): native_first_launch.c's formula, in the same
    float32 steps and rounding (v's column j gets j / 256 more: out is far from 0, and each column its own)."""
    import torch

    def filled(t: int, heads: int, seqlen: int) -> torch.Tensor:
        i = torch.arange(BATCH * heads * seqlen * HEAD_DIM, dtype=torch.int64)
        x = ((i * (t + 3) * 7919) % 97).float() / 97.0 - 0.5
        if t == 2:
            x = x + (i % HEAD_DIM).float() / 256.0
        return x.to(torch.bfloat16).view(BATCH, heads, seqlen, HEAD_DIM)

    return filled(0, HEADS_Q, SEQLEN_Q), filled(1, HEADS_K, SEQLEN_K), filled(2, HEADS_K, SEQLEN_K)


def output_error(path: Path) -> float:
    """The largest error of the bf16 out (batch, heads_q, seqlen_q, head_dim) at ``path`` against the float32
    reference of ``inputs()``; SystemExit where it breaks the tests' rule (atol and rtol 2e-2)."""
    import torch

    from lazytriton.kernels.flash_fwd import reference

    q, k, v = inputs()
    got = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.bfloat16).float().view(q.shape)
    want, _ = reference.attention_reference(q.float(), k.float(), v.float(), causal=False)
    error = float((got - want).abs().max())
    if not bool(((got - want).abs() <= 2e-2 + 2e-2 * want.abs()).all()):
        raise SystemExit(f"{path.name}: out differs from the reference (largest error {error:.4f}): no timing of a "
                         "wrong launch is reported")
    return error


def served_variant(capability: int) -> Any:
    """The variant the C choice gives native_first_launch.c's call on a device of ``capability`` (90: sm_90):
    ``embedded.plan_variant``, which tests/test_native_choice.py holds the C choice to."""
    from lazytriton.capi import embedded

    return embedded.plan_variant("flash_fwd", capability, 2, HEAD_DIM, False, True, False, SEQLEN_Q, SEQLEN_K,
                                 head_dim_v=HEAD_DIM)


def prewarmed(variants: Sequence[str], directory: Path) -> list[Any]:
    """The entries of ``variants``, compiled now by ``lazytriton prewarm --from-misses`` (an empty cache dir)."""
    from lazytriton.cache_format.image import Image

    misses, out = directory / "misses.jsonl", directory / "served.ltimg"
    misses.write_text("".join(json.dumps({"variant": variant}) + "\n" for variant in variants))
    env = {**os.environ, "LAZYTRITON_CACHE_DIR": str(directory / "prewarm-cache")}
    done = subprocess.run([sys.executable, "-m", "lazytriton", "prewarm", "--from-misses", str(misses), "--out",
                           str(out), "-j", "1"], capture_output=True, text=True, env=env, timeout=1200, check=False)
    if done.returncode != 0:
        raise SystemExit(f"prewarm failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    with Image(out) as image:
        entries = [image.read(key) for key in image.keys()]
    return [entry for entry in entries if entry is not None]


def gpu_build(directory: Path, capability: int) -> tuple[Path, Path, Any]:
    """(native_first_launch linked to liblazytriton_native.so built now, the 200-entry image, its served variant)."""
    from lazytriton.capi import native_build

    library = native_build.build(directory / "lib")
    program = link(HERE / "native_first_launch.c", library, directory / "native_first_launch")
    variant = served_variant(capability)
    served = prewarmed([str(variant)], directory)
    if [entry.key for entry in served] != [variant.key()]:
        raise SystemExit(f"prewarm of {variant} gave {[entry.variant for entry in served]}, not its entry alone")
    return program, write_bench_image(directory / "bench.ltimg", served), variant


def native_gpu_run(program: Path, image: Path, cache: Path, files: Sequence[Path] = (),
                   driver: Path | None = None) -> dict[str, Any]:
    """One fresh native_first_launch process, given ``files`` ([OUT [INPUTS]]; ``driver``: a folder holding the
    libcuda.so.1 to use, else the system's): its report, with ``process_ms`` from before its start to the kernel's
    completion."""
    env = {**os.environ, "LAZYTRITON_IMAGES": str(image), "LAZYTRITON_CACHE_DIR": str(cache),
           **({"LD_LIBRARY_PATH": str(driver)} if driver is not None else {})}
    start = time.monotonic()
    done = subprocess.run([str(program), *map(str, files)], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    lines = done.stdout.strip().splitlines()
    found: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    if (done.returncode != 0 or (found.get("init"), found.get("fwd"), found.get("synchronize")) != (0, 0, 0)
            or found.get("image_entries") != ENTRIES):
        raise SystemExit(f"native_first_launch failed (exit {done.returncode}): {found or done.stderr[-2000:]}")
    return {**found, "process_ms": (found["completed_at_us"] / 1e3 - start * 1e3)}


def python_gpu_run(image: Path, cache: Path, out: Path | None = None, device: str = "cuda") -> dict[str, Any]:
    """One fresh interpreter's first flash_attn_func from ``image`` (PYTHON_FIRST_CALL) on ``device``: its report
    (seconds), with ``process_ms`` from before its start to the kernel's completion."""
    env = {**os.environ, "LAZYTRITON_IMAGES": str(image), "LAZYTRITON_JIT": "0", "LAZYTRITON_CACHE_DIR": str(cache),
           "LAZYTRITON_HELPERS": "0"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", PYTHON_FIRST_CALL.format(here=str(HERE)), device,
                           *([str(out)] if out is not None else [])], capture_output=True, text=True, env=env,
                          timeout=600, check=False, cwd=cache.parent)  # lazytriton as installed, not the checkout's
    if done.returncode != 0:
        raise SystemExit(f"the Python first call failed:\n{done.stderr[-4000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if found["compiles"] != 0:
        raise SystemExit(f"the Python first call compiled: {found}")
    return {**found, "process_ms": (found["completed_at"] - start) * 1e3}


def gpu_results(native: Sequence[Mapping[str, Any]], python: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """The cases' times in ms, from each run's report (``native_gpu_run``'s, ``python_gpu_run``'s)."""
    return {
        "native: cuInit + primary context (the application's, apart)": [r["context_us"] / 1e3 for r in native],
        NATIVE_RETURNED: [r["returned_us"] / 1e3 for r in native],
        "native: lt_init to first lt_attn_fwd completed": [r["completed_us"] / 1e3 for r in native],
        "native: process start to first lt_attn_fwd completed": [r["process_ms"] for r in native],
        "python: import torch (apart)": [r["torch_import"] * 1e3 for r in python],
        "python: torch CUDA init, inputs on the GPU (apart)": [r["cuda_init"] * 1e3 for r in python],
        "python: import + first flash_attn_func returned": [r["returned"] * 1e3 for r in python],
        "python: import + first flash_attn_func completed": [r["completed"] * 1e3 for r in python],
        "python: process start to first flash_attn_func completed": [r["process_ms"] for r in python],
    }


def gpu_main(runs: int, csv: Path) -> None:
    import torch
    from csvlog import run_meta

    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability(0)
    with tempfile.TemporaryDirectory(prefix="bench-native-gpu-") as tmp:
        work = Path(tmp)
        program, image, variant = gpu_build(work, 10 * major + minor)
        native = [native_gpu_run(program, image, work / f"cache-native-{i}", [work / "native.out"] if i == 0 else [])
                  for i in range(runs)]
        python = [python_gpu_run(image, work / f"cache-python-{i}", work / "python.out" if i == 0 else None)
                  for i in range(runs)]
        errors = {side: output_error(work / f"{side}.out") for side in ("native", "python")}
    results = gpu_results(native, python)
    rows = summary_rows(run_meta("flash_fwd", torch.device("cuda", 0)), results)
    report(f"{ENTRIES}-entry image, {runs} fresh processes each, {rows[0]['gpu']}, the real libcuda; served: "
           f"{variant}; out's largest error: native {errors['native']:.4f}, python {errors['python']:.4f}", rows, csv)
    returned = statistics.median(results[NATIVE_RETURNED])
    print(f"target: lt_init to the first launch returned, p50 {returned:.3f} ms against {TARGET_MS} ms: "
          f"{'met' if returned <= TARGET_MS else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="a real entry on device 0, the real libcuda")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "native.csv")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    (gpu_main if args.gpu else cpu_main)(args.runs, args.csv)


if __name__ == "__main__":
    main()
