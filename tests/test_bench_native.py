"""benchmarks/bench_native.py on CPU: its CPU mode end to end, and ``--gpu``'s pieces on the fake libcuda.

``--gpu`` itself needs a CUDA GPU (``gpu_round.sh native``). Here: its image (the call's sm_90 flash_fwd variant
compiled now by prewarm, beside synthetic entries: 200 in all), the variant Python's call takes (the same: the
Python side is served from that image too), the Python side's child on the CPU (Triton's interpreter), its C
front (benchmarks/native_first_launch.c) on the fake libcuda (host memory as device memory: the call served from
the image and launched once, the inputs the bench's formula byte for byte), the output check (it takes the
reference and refuses what a launch that computed nothing leaves) and its rows.
"""

from __future__ import annotations

import csv
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from benchlib import bench_module, run_bench
from conftest import gpu
from nativelib import need_toolchain

from lazytriton.cache_format.image import Image, write_image
from lazytriton.kernels.flash_fwd import binding, reference
from lazytriton.target import Target

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench_native.py"
LT_MISS = 16


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        yield bench_module(patch, BENCH)


@pytest.fixture(scope="module")
def built(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """--gpu's build for sm_90 (the front, the 200-entry image, the served variant) and the fake libcuda."""
    need_toolchain()
    from fake_libcuda import build as build_fake

    work = tmp_path_factory.mktemp("bench-native-gpu")
    program, image, variant = bench.gpu_build(work, 90)
    driver = work / "driver"
    driver.mkdir()
    fake = build_fake(work)
    assert fake is not None  # need_toolchain found a compiler
    (driver / "libcuda.so.1").symlink_to(fake)
    return {"program": program, "image": image, "variant": variant, "driver": driver}


def test_the_cpu_mode_writes_a_row_a_case(tmp_path: Path) -> None:
    need_toolchain()
    rows, out = run_bench(BENCH, tmp_path / "native.csv", "--runs", "1")
    assert [row["case"] for row in rows] == ["native: lt_init to first lt_attn_fwd launch",
                                             "python: import to entry read", "python: process start to entry read"]
    for row in rows:
        assert (row["gpu"], row["entries"], row["runs"]) == ("cpu", "200", "1"), row
        assert 0 < float(row["min_ms"]) == float(row["p50_ms"]) == float(row["max_ms"]), row
    assert "fake libcuda" in out


def test_the_image_holds_the_calls_sm_90_entry_among_200(built: dict[str, Any]) -> None:
    variant = built["variant"]
    with Image(built["image"]) as image:
        assert len(image) == 200
        entry = image.read(variant.key())
    assert entry is not None and entry.variant == str(variant)
    assert (entry.target, entry.kind, entry.binary[:4]) == ("sm_90", "cubin", b"\x7fELF")
    assert len(entry.binary) > 10_000  # a compiled kernel, not a synthetic entry's 3 KB


def test_pythons_call_takes_the_served_variant(bench: ModuleType, built: dict[str, Any]) -> None:
    """The Python side's flash_attn_func is served from the same image (LAZYTRITON_JIT=0): its variant is the C one."""
    q, k, v = bench.inputs()
    call = binding.check(q, k, v, False)
    key = binding.memo_key(0, q.dtype, call.shape, False, True, False, offset=call.offset, scale=call.scale)
    chosen = binding.variant(Target.parse("sm_90"), q.dtype, call.shape, False, True, False,
                             gluon=binding.gluon_key(key))
    assert str(chosen) == str(built["variant"])


def test_the_front_serves_the_call_on_the_fake_driver(bench: ModuleType, built: dict[str, Any],
                                                     tmp_path: Path) -> None:
    out, given = tmp_path / "native.out", tmp_path / "inputs.bin"
    found = bench.native_gpu_run(built["program"], built["image"], tmp_path / "cache", [out, given], built["driver"])
    assert (found["plans"], found["image_entries"], found["fake_launches"]) == (1, 200, 1), found
    assert 0 <= found["context_us"] and 0 < found["returned_us"] <= found["completed_us"], found
    assert found["process_ms"] * 1e3 >= found["completed_us"], found
    assert given.read_bytes() == b"".join(bytes(t.untyped_storage()) for t in bench.inputs())
    with pytest.raises(SystemExit, match="differs from the reference"):
        bench.output_error(out)  # the fake launched nothing: out is the zeros it was given


def test_the_front_reports_a_miss_and_refuses_extra_arguments(bench: ModuleType, built: dict[str, Any],
                                                              tmp_path: Path) -> None:
    image = tmp_path / "other.ltimg"
    write_image(image, bench.filler_entries(1))
    with pytest.raises(SystemExit, match=f"'fwd': {LT_MISS}"):
        bench.native_gpu_run(built["program"], image, tmp_path / "cache", driver=built["driver"])
    done = subprocess.run([str(built["program"]), "a", "b", "c"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 2 and "usage" in done.stderr


def test_the_python_side_writes_a_checked_output_and_its_times(bench: ModuleType, built: dict[str, Any],
                                                               tmp_path: Path) -> None:
    """The Python child on the CPU (Triton's interpreter: no entry read), as --gpu runs it on the GPU."""
    out = tmp_path / "python.out"
    found = bench.python_gpu_run(built["image"], tmp_path / "cache", out, device="cpu")
    assert bench.output_error(out) < 0.02
    assert 0 < found["returned"] <= found["completed"] and found["process_ms"] >= found["completed"] * 1e3, found
    assert found["torch_import"] > 0 and found["cuda_init"] >= 0 and found["compiles"] == 0, found


def test_the_output_check_takes_the_reference_only(bench: ModuleType, tmp_path: Path) -> None:
    q, k, v = bench.inputs()
    want = reference.attention_reference(q.float(), k.float(), v.float(), causal=False)[0].to(torch.bfloat16)
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(want.untyped_storage()))
    assert bench.output_error(path) < 0.01
    wrong = want.clone()
    wrong[0, 3, 299, 127] += 0.25
    path.write_bytes(bytes(wrong.untyped_storage()))
    with pytest.raises(SystemExit, match="largest error 0.2"):
        bench.output_error(path)


def test_the_rows_name_the_device_with_p50_min_and_max(bench: ModuleType, tmp_path: Path) -> None:
    native = [{"context_us": c, "returned_us": r, "completed_us": r + 50.0, "process_ms": 30.0 + c / 1e3}
              for c, r in ((90e3, 900.0), (110e3, 1100.0), (100e3, 1000.0))]
    python = [{"torch_import": 1.0, "cuda_init": 0.5, "returned": 0.02 * i, "completed": 0.03 * i,
               "process_ms": 2000.0 * i} for i in (1, 2, 3)]
    results = bench.gpu_results(native, python)
    assert len(results) == 9 and all(len(values) == 3 for values in results.values())
    meta = {"kernel": "flash_fwd", "gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6.0", "lazytriton": "0.1.0",
            "timestamp": "2026-12-06T00:00:00+00:00"}
    rows = bench.summary_rows(meta, results)
    by_case = {row["case"]: row for row in rows}
    returned = by_case[bench.NATIVE_RETURNED]
    assert (returned["p50_ms"], returned["min_ms"], returned["max_ms"], returned["runs"]) == (1.0, 0.9, 1.1, 3)
    assert by_case["python: import + first flash_attn_func completed"]["p50_ms"] == 60.0
    path = tmp_path / "native.csv"
    bench.report("title", rows, path)
    with path.open() as f:
        header = next(csv.reader(f))
    with (REPO / "benchmarks" / "results" / "native.csv").open() as f:
        assert header == next(csv.reader(f))  # the rows append to the kept CSV under its own header
    with path.open() as f:
        assert {row["gpu"] for row in csv.DictReader(f)} == {"NVIDIA H200"}


@gpu
@pytest.mark.gpu
def test_on_a_gpu_the_gpu_mode_times_a_checked_launch_of_each_side(tmp_path: Path) -> None:
    need_toolchain()
    rows, out = run_bench(BENCH, tmp_path / "native.csv", "--gpu", "--runs", "1")
    assert len(rows) == 9 and all(row["gpu"] != "cpu" and row["runs"] == "1" for row in rows), rows
    assert "target: lt_init" in out and "out's largest error" in out
