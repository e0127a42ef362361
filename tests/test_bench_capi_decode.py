"""benchmarks/bench_capi.py --kernel kvcache: the decoding call's host time, on CPU with the fake libcuda.

``--fake-driver`` end to end with a few rounds: its table, its target lines, its CSV rows. The GPU mode's pieces
(benchmarks/capi_decode.py) on the fake libcuda, in a child process that loads liblazytriton_native.so and the
timing loops (capi_decode_bench.c) as the GPU mode loads liblazytriton.so: the bare launches it builds from the
binding's arguments are the launches lt_attn_kvcache makes (grid, block, shared memory, programmatic or not, and
the last launch's parameter bytes), and its loops time both. Bad arguments are refused by name. No timing
threshold: only that the times exist and are positive. The GPU mode itself runs under ``-m gpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from benchlib import bench_module, run_bench
from conftest import REPO, gpu
from nativelib import need_toolchain

from lazytriton.kernels.flash_decode import DEPENDENT_SPLIT

BENCH = REPO / "benchmarks" / "bench_capi.py"
PROVIDERS = ["bare_launches", "lt_attn_kvcache", "bare_launches_paged", "lt_attn_kvcache_paged"]


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "tests"))  # the fake image's entries: tests/test_native_front.py's
        yield bench_module(patch, BENCH)


def test_the_fake_driver_mode_writes_a_row_a_provider(tmp_path: Path) -> None:
    need_toolchain()
    rows, out = run_bench(BENCH, tmp_path / "capi.csv", "--fake-driver", "--kernel", "kvcache", "--rounds", "3")
    assert [row["provider"] for row in rows] == PROVIDERS
    for row in rows:
        assert (row["kernel"], row["mode"], row["dtype"], row["gpu"]) == (
            "flash_decode", "host_per_call_fake_driver", "bf16", "fake libcuda (CPU)"), row
        assert row["shape"] == "b1 hq32 hk8 d128 cache4096 new1" + (" paged256" if "paged" in row["provider"] else "")
        assert 0 < float(row["min_us"]) <= float(row["p50_us"]) and float(row["mean_us"]) > 0, row
        assert row["target_us"] == ("" if row["provider"].startswith("bare") else "0.5"), row
    for call in ("lt_attn_kvcache", "lt_attn_kvcache_paged"):
        dependents = "2 programmatic dependents" if DEPENDENT_SPLIT else "1 programmatic dependent"
        assert f"{call}: 3 launches a call ({dependents}), its bare launches the same" in out
        assert f"this: {call} over bare_launches" in out and "µs target)" in out
    assert "1 run(s) of 3 rounds" in out


@pytest.mark.parametrize("argv, message", [
    (["--kernel", "kvcache", "--shape", "1", "2", "3", "4"], "--shape is the GPU forward's"),
    (["--fake-driver", "--shape", "1", "2", "3", "4"], "--shape is the GPU forward's"),
    (["--shape", "1", "0", "3", "4"], "expected four sizes >= 1"),
    (["--fake-driver", "--kernel", "kvcache", "--rounds", "0"], "--rounds is 0; expected >= 1"),
    (["--kernel", "kvcache", "--runs", "3"], "go with --fake-driver"),
    (["--rounds", "5"], "--rounds goes with --fake-driver or --kernel kvcache"),
    (["--kernel", "decode"], "invalid choice: 'decode'"),
])
def test_bad_arguments_are_refused_by_name(bench: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_capi.py", *argv])
    with pytest.raises(SystemExit) as exited:
        bench.main()
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_python_host_time_is_rounds_of_calls(bench: ModuleType) -> None:
    calls, settles = [], []
    p50, mean, low = bench.decode.python_host_us(lambda: calls.append(1), lambda: settles.append(1), 5, calls=7)
    assert (len(calls), len(settles)) == (35, 6)
    assert 0 <= low <= p50 and mean >= low


# In a child process on the fake libcuda (LD_LIBRARY_PATH): liblazytriton_native.so (argv[1]) serving the image
# (LAZYTRITON_IMAGES), the loops library (argv[2]); SHAPE's call on host memory described as device memory (the fake
# reads nothing but the parameters), with or without its new keys (argv[4]: 1 or 0), num_splits argv[5] (0: the
# heuristic's), the cache argv[6]. Each side's launches recorded: the log and the last launch's parameter bytes
# (the fake reads as many from every launch: the last launch takes the fewest); then each side timed, light.
FAKE_SCRIPT = r"""
import ctypes, json, sys
from pathlib import Path
sys.path[:0] = sys.argv[7:9]
fake = ctypes.CDLL("libcuda.so.1")
import torch
import capi_decode as decode
from fake_libcuda import FAKE_SMS
from lazytriton.kernels import dependent_launch
from lazytriton.kernels.flash_decode import binding

api = decode.CApi(*map(Path, sys.argv[1:4]))
api.check(api.lib.lt_init(None), "lt_init")
torch.manual_seed(0)
tensors = decode.decode_tensors(decode.SHAPE, sys.argv[6] == "paged", "cpu")
if sys.argv[4] == "0":
    del tensors["k"], tensors["v"]
p, workspace = api.params(tensors, "cpu")
t, call = decode.checked_call(tensors)
p.num_splits = int(sys.argv[5])
call = call._replace(num_splits=int(sys.argv[5]))
variants = decode.plan_variants(t, call, tensors["out"], 90)
arguments = decode.bare_arguments(t, call, tensors["out"], tensors["lse"], workspace, variants,
                                  FAKE_SMS * binding.PROGRAMS_PER_SM)
# The fake's function, and the block, shared memory and hidden arguments of the image's entries (fake_entry's).
loaded = {v.key(): decode.Loaded(0xF000, int(v.get("num_warps")) * 32, 49152, dependent_launch(v), 2)
          for v in variants}
table, keep = decode.launch_table([(loaded[a.variant.key()], a) for a in arguments])
last = arguments[-1]
sizes = [8] * len(last.ints) + [4] * len(last.floats) + [8] * 2
SIZES = (ctypes.c_int * len(sizes))(*sizes)

def record(launch):
    fake.fake_configure(len(sizes), SIZES, 0)
    status = launch()
    log = (ctypes.c_int64 * 512)()
    n = fake.fake_launch_log(log)
    seen, nulls = (ctypes.c_ubyte * (128 * 1024))(), (ctypes.c_int * 1024)()
    fake.fake_read(seen, nulls, (ctypes.c_int64 * 16)(), (ctypes.c_int * 1024)())
    launches = [[log[8 * i + j] for j in (0, 1, 2, 3, 4, 5, 7)] for i in range(n)]
    params = [bytes(seen[128 * i:128 * i + size]).hex() for i, size in enumerate(sizes)]
    return {"status": status, "launches": launches, "params": params}

stream = ctypes.c_void_p(0x5EA)
report = {"kernels": [a.variant.kernel for a in arguments], "splits": binding.splits_for(
              call, int(variants[-2].get("BLOCK_M")), int(variants[-2].get("BLOCK_N")),
              FAKE_SMS * binding.PROGRAMS_PER_SM, binding.min_split_keys(call.head_dim)),
          "c": record(lambda: api.lib.lt_attn_kvcache(api.address(p), stream)),
          "bare": record(lambda: api.loops.decode_bench_launch(table, len(table), stream))}
fake.fake_set_light(1)
report["times"] = [api.time(provider, table, p, 0x5EA, 2) for provider in (0, 1)]
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def fake_build(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """liblazytriton_native.so, the loops library linked to it, the fake libcuda as libcuda.so.1, the image."""
    need_toolchain()
    from fake_libcuda import build as build_fake

    from lazytriton.cache_format.image import write_image
    from lazytriton.capi import native_build

    work = tmp_path_factory.mktemp("capi-decode")
    library = native_build.build(work / "lib")
    loops = bench.decode.compile_loops(REPO / "capi", library, work / "libcapi_decode_bench.so")
    driver = work / "driver"
    driver.mkdir()
    fake = build_fake(work)
    assert fake is not None  # need_toolchain found a compiler
    (driver / "libcuda.so.1").symlink_to(fake)
    image = work / "decode.ltimg"
    write_image(image, bench.fake_entries("kvcache"))
    return {"library": library, "loops": loops, "driver": driver, "image": image, "work": work}


def fake_run(built: dict[str, Path], new_keys: bool, splits: int, layout: str) -> dict[str, Any]:
    env = {**os.environ, "LD_LIBRARY_PATH": str(built["driver"]), "LAZYTRITON_IMAGES": str(built["image"]),
           "LAZYTRITON_CACHE_DIR": str(built["work"] / "cache")}
    done = subprocess.run([sys.executable, "-c", FAKE_SCRIPT, str(built["library"]), str(built["loops"]),
                           str(REPO / "capi" / "lazytriton.h"), str(int(new_keys)), str(splits), layout,
                           str(REPO / "benchmarks"), str(REPO / "tests")], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return report


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("new_keys, splits, kernels", [
    (True, 0, ["kv_append", "flash_decode_split", "flash_decode_combine"]),  # the combine kernel's parameters last
    (False, 1, ["flash_decode_split"]),  # the split kernel's, its two fp32 among them
])
def test_the_gpu_modes_bare_launches_are_the_calls_launches(fake_build: dict[str, Path], layout: str,
                                                            new_keys: bool, splits: int, kernels: list[str]) -> None:
    """The same launches on both sides: grid, block, shared memory, function, programmatic dependent (on sm_90 the
    combine kernel, and the split kernel with DEPENDENT_SPLIT), and the last launch's parameter bytes."""
    report = fake_run(fake_build, new_keys, splits, layout)
    assert report["kernels"] == kernels and (report["splits"] > 1) == (splits == 0), report
    c, bare = report["c"], report["bare"]
    assert (c["status"], bare["status"]) == (0, 0), report
    assert bare["launches"] == c["launches"] and len(c["launches"]) == len(kernels), report
    dependents = {"flash_decode_split": DEPENDENT_SPLIT, "flash_decode_combine": True}
    assert [launch[-1] for launch in c["launches"]] == [int(dependents.get(k, False)) for k in kernels]
    assert bare["params"] == c["params"]
    for p50, mean, low in report["times"]:
        assert 0 < low <= p50 and mean > 0, report["times"]


@gpu
@pytest.mark.gpu
def test_on_a_gpu_the_decode_mode_times_every_provider(tmp_path: Path) -> None:
    rows, out = run_bench(BENCH, tmp_path / "capi.csv", "--kernel", "kvcache", "--rounds", "5", timeout=1200)
    assert [row["provider"] for row in rows] == [
        "bare_launches", "lt_attn_kvcache", "flash_attn_with_kvcache", "flash_attn_with_kvcache_trusted",
        "bare_launches_paged", "lt_attn_kvcache_paged", "flash_attn_with_kvcache_paged",
        "flash_attn_with_kvcache_trusted_paged"]
    assert all(float(row["p50_us"]) > 0 and row["mode"] == "host_per_call" for row in rows), rows
    assert out.count("their out equals lt_attn_kvcache's") == 2, out
