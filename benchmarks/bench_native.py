"""From nothing to the first launch of one kernel of a 200-entry image: the native library against Python.

native: a fresh process runs tests/capi/native_front.c against liblazytriton_native.so and the fake libcuda
(tests/fake_libcuda.py): lt_init (opening the image) and one lt_attn_fwd (the variant and key computed in C,
the entry read, checked, loaded and launched); the program's own clock from lt_init to lt_attn_fwd's return.
python: a fresh interpreter imports lazytriton, computes the same call's variant and key and reads the entry
from the same image (lazytriton.cache_format.image); timed inside the process (import to entry) and as the
whole process (interpreter start included). CPU only; p50 of ``--runs`` fresh processes each. Rows are appended
to ``benchmarks/results/native.csv``.

Usage: python benchmarks/bench_native.py [--runs 15] [--csv PATH]
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the fake libcuda and the synthetic entries the tests use
sys.path.insert(0, str(Path(__file__).resolve().parent))

ENTRIES = 200
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


def build(directory: Path) -> tuple[Path, Path, Path]:
    """(native_front, the folder holding the fake libcuda.so.1, the 200-entry image)."""
    import test_decoders_property as props
    from fake_libcuda import build as build_fake
    from test_native_front import call_variant, fake_entry

    from lazytriton.cache_format.image import write_image
    from lazytriton.capi import native_build

    library = native_build.build(directory / "lib")
    driver = directory / "driver"
    driver.mkdir()
    fake = build_fake(directory)
    if fake is None:
        raise SystemExit("bench_native needs a C compiler")
    (driver / "libcuda.so.1").symlink_to(fake)
    program = directory / "native_front"
    subprocess.run([native_build.compiler(), "-O2", "-std=c99", "-D_POSIX_C_SOURCE=200809L",
                    f"-I{REPO / 'capi'}", str(REPO / "tests" / "capi" / "native_front.c"), f"-L{library.parent}",
                    "-llazytriton_native", f"-Wl,-rpath,{library.parent}", "-ldl", "-o", str(program)], check=True)
    image = directory / "bench.ltimg"
    write_image(image, [fake_entry(call_variant(False)), *(props.make_entry(i, 3000) for i in range(ENTRIES - 1))])
    return program, driver, image


def native_ms(program: Path, driver: Path, image: Path, cache: Path) -> float:
    env = {"LAZYTRITON_IMAGES": str(image), "LD_LIBRARY_PATH": str(driver), "LAZYTRITON_CACHE_DIR": str(cache),
           "PATH": "/usr/bin:/bin"}
    done = subprocess.run([str(program), "0", "cuda", "0"], capture_output=True, text=True, env=env, check=True)
    report = json.loads(done.stdout)
    if report["fwd"] != 0:
        raise SystemExit(f"native_front failed: {report}")
    return float(report["first_launch_us"]) / 1e3


def python_ms(image: Path, cache: Path) -> tuple[float, float]:
    """(import to entry inside the process, the whole process), in ms."""
    env = {**os.environ, "LAZYTRITON_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PYTHON_LOOKUP, str(image)], capture_output=True, text=True,
                          env=env, check=True)
    return float(done.stdout.strip()), (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "native.csv")
    args = parser.parse_args()
    from csvlog import append_rows, run_meta

    with tempfile.TemporaryDirectory(prefix="bench-native-") as tmp:
        program, driver, image = build(Path(tmp))
        cache = Path(tmp) / "cache"
        native = [native_ms(program, driver, image, cache) for _ in range(args.runs)]
        python = [python_ms(image, cache) for _ in range(args.runs)]
    results = {"native: lt_init to first lt_attn_fwd launch": native,
               "python: import to entry read": [p[0] for p in python],
               "python: process start to entry read": [p[1] for p in python]}
    meta = run_meta("flash_fwd", "cpu")
    rows = []
    print(f"{ENTRIES}-entry image, {args.runs} fresh processes each, CPU (fake libcuda for the native launch)")
    for case, values in results.items():
        p50 = statistics.median(values)
        print(f"  {case:48s} p50 {p50:8.2f} ms  (min {min(values):.2f})")
        rows.append({**meta, "case": case, "entries": ENTRIES, "runs": args.runs, "p50_ms": round(p50, 3),
                     "min_ms": round(min(values), 3)})
    append_rows(args.csv, [*meta, "case", "entries", "runs", "p50_ms", "min_ms"], rows)


if __name__ == "__main__":
    main()
