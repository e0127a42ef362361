"""lt_attn_kvcache and lt_flash_combine served by liblazytriton_native.so from an image, with no Python.

A C program (tests/capi/native_kvcache.c) calls them on made-up device pointers against the fake libcuda, the JIT
fallback off and no Python reachable. With no image, each call is LT_MISS naming a variant Python would choose and
the prewarm command, and the miss log names every kernel the call lacks; ``lazytriton prewarm --from-misses``
builds the image of them (real sm_90 compiles); with that image the same calls launch those kernels natively:
kv_append, the split and the combine kernel of Python's choice (each told by its entry's block and shared
memory), the grid and split count Python's binding gives (the fake device's 132 SMs), the arguments of
``binding.c_initializer``'s layout.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, gpu
from fake_libcuda import FAKE_SMS
from nativelib import build_program

from lazytriton.cache_format.image import Image
from lazytriton.capi import embedded_combine, embedded_kvcache
from lazytriton.kernels import dependent_launch, flash_combine
from lazytriton.kernels.flash_decode import DEPENDENT_SPLIT, FLASH_DECODE_SPLIT, binding, checks

LT_OK, LT_MISS = 0, 16
BASE = 0x7F0000000000
B, HQ, HK, D, PAGE, BLOCKS_PER_SEQ, CAPACITY = 2, 8, 2, 64, 64, 8, 1024


def address(i: int) -> int:
    return BASE + (i << 20)  # native_kvcache.c's ADDRESS(i)


def decode_variants(paged: bool, rotary: bool = False) -> tuple[Any, Any]:
    """(split, combine) Python chooses for native_kvcache's call (bf16, aligned, one query, 4 rows a head; with
    ``rotary`` its interleaved rotary tables, the C API's default)."""
    capacity = BLOCKS_PER_SEQ * PAGE if paged else CAPACITY
    return embedded_kvcache.plan_variants(90, 2, D, False, True, False, HQ // HK, capacity, PAGE if paged else 0,
                                          False, False, False, D, rotary=rotary, rotary_interleaved=rotary)


def append_variant(paged: bool, rotary: bool = False) -> Any:
    return embedded_kvcache.append_variant(90, 2, D, D, paged, True, False, rotary=rotary, rotary_interleaved=rotary)


def combine_variant() -> Any:
    return embedded_combine.plan_variant(90, 2, D, True, False)


def run(built: dict[str, Path], tmp_path: Path, images: str, *args: str, sizes: tuple[int, ...] = (),
        driver_version: int | None = None) -> dict[str, Any]:
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    env = {"LAZYTRITON_IMAGES": images, "LD_LIBRARY_PATH": str(built["driver"]), "PYTHONHOME": "/nonexistent",
           "PATH": str(empty), "LAZYTRITON_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path),
           "NATIVE_SIZES": ",".join(map(str, sizes))}
    if driver_version is not None:
        env["NATIVE_DRIVER_VERSION"] = str(driver_version)
    done = subprocess.run([str(built["program"]), "0", *args], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return report


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_program(tmp_path_factory.mktemp("native-decode"), "native_kvcache")


@pytest.fixture(scope="module")
def prewarmed(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The calls' misses with no image, then the image prewarm builds from their miss log."""
    where = tmp_path_factory.mktemp("decode-misses")
    misses = {"paged": run(built, where, "", "kvcache", "1", "1", "0"),
              "contiguous": run(built, where, "", "kvcache", "0", "0", "1"),
              "combine": run(built, where, "", "combine"),
              "rotary": run(built, where, "", "kvcache", "0", "2", "0", "1")}  # rotary, no new key
    log = where / "cache" / "misses.jsonl"
    image = where / "decode.ltimg"
    done = subprocess.run([sys.executable, "-m", "lazytriton", "prewarm", "--from-misses", str(log), "--out",
                           str(image), "-j", "2"], capture_output=True, text=True, timeout=900, check=False,
                          env={"LAZYTRITON_CACHE_DIR": str(where / "prewarm-cache"), "PATH": "/usr/bin:/bin",
                               "HOME": str(where)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    entries = Image(image)
    return {"misses": misses, "log": log, "image": image,
            "entries": {key: entries.read(key) for key in entries.keys()}}


def test_without_an_image_each_call_is_a_miss_naming_python_s_variants(prewarmed: dict[str, Any]) -> None:
    misses, log = prewarmed["misses"], prewarmed["log"]
    for name in misses:
        assert misses[name]["status"] == LT_MISS and misses[name]["launches"] == [], misses[name]
        assert f"lazytriton prewarm --from-misses {log} --out IMAGE" in misses[name]["error"]
        assert "LAZYTRITON_JIT=1" in misses[name]["error"]
    split, combine = decode_variants(True)
    assert str(append_variant(True)) in misses["paged"]["error"]  # the first kernel looked up: kv_append
    assert "and 2 more of this call's kernels" in misses["paged"]["error"]
    assert str(decode_variants(False)[0]) in misses["contiguous"]["error"]
    assert str(combine_variant()) in misses["combine"]["error"]
    wanted = [append_variant(True), split, combine, *decode_variants(False), combine_variant(),
              append_variant(False, rotary=True), *decode_variants(False, rotary=True)]
    logged = [json.loads(line)["key"] for line in log.read_text().splitlines()]
    assert logged == [v.key() for v in wanted]
    assert set(prewarmed["entries"]) == {v.key() for v in wanted}


def launched(entry: Any, grid: tuple[int, int, int], dependent: bool = False) -> list[int]:
    """A launch log line: the grid, the entry's block threads and shared memory, the fake's function, and 1 for a
    programmatic dependent's launch (cuLaunchKernelEx with programmatic stream serialization)."""
    return [*grid, entry.num_warps * entry.warp_size, entry.shared, 0xF000, int(dependent)]


def test_a_paged_call_with_new_keys_launches_python_s_three_kernels(built: dict[str, Path], tmp_path: Path,
                                                                   prewarmed: dict[str, Any]) -> None:
    split, combine = decode_variants(True)
    entries = prewarmed["entries"]
    e_append, e_split, e_combine = (entries[v.key()] for v in (append_variant(True), split, combine))
    hidden = len(e_combine.hidden_args)
    report = run(built, tmp_path, str(prewarmed["image"]), "kvcache", "1", "1", "0",
                 sizes=(8,) * (len(binding.COMBINE_INT_PARAMS) + hidden))
    assert (report["init"], report["status"]) == (LT_OK, LT_OK), report
    call = checks.Call(B, HQ, HK, 1, D, 1, BLOCKS_PER_SEQ * PAGE, PAGE, B * BLOCKS_PER_SEQ, -1, False, 0.125)
    block_m, block_n = int(split.get("BLOCK_M")), int(split.get("BLOCK_N"))
    splits = binding.splits_for(call, block_m, block_n, FAKE_SMS * binding.PROGRAMS_PER_SM,
                                binding.min_split_keys(D))
    assert splits > 1  # the combine kernel runs
    assert report["launches"] == [
        launched(e_append, (1, B, 1)),
        launched(e_split, (math.ceil(call.rows / block_m) * splits, HK, B), dependent=dependent_launch(split)),
        launched(e_combine, (math.ceil(call.lse_rows / int(combine.get("BLOCK_M"))), 1, 1),
                 dependent=dependent_launch(combine))]
    assert dependent_launch(split) == DEPENDENT_SPLIT and dependent_launch(combine), "sm_90's combine: a dependent"
    workspace = address(100)
    part_lse = workspace + 4 * call.lse_rows * splits * D
    fake = {"part_out": workspace, "part_lse": part_lse, "out": address(80), "lse": address(81)}
    out = _Strided((HQ * D, HQ * D, D, 1))  # out (B, 1, HQ, D), contiguous
    expected = binding.combine_ints("part_out", "part_lse", out, "lse", call, splits,  # type: ignore[arg-type]
                                    pointers=lambda x: fake["out"] if x is out else fake[x])
    assert report["params"] == [*expected, *[0] * hidden]


@pytest.mark.parametrize("version", [12020, 12030])
def test_dependents_launch_so_only_where_a_graph_can_capture_one(
        built: dict[str, Path], tmp_path: Path, prewarmed: dict[str, Any], version: int) -> None:
    """Before CUDA 12.3 a CUDA graph cannot capture a programmatic launch: the kernels then launch plainly (their
    waits return at once, the stream ordering the kernels)."""
    report = run(built, tmp_path, str(prewarmed["image"]), "kvcache", "1", "1", "0", driver_version=version)
    assert (report["init"], report["status"]) == (LT_OK, LT_OK), report
    capturable = int(version >= 12030)
    assert [launch[-1] for launch in report["launches"]] == [0, capturable * DEPENDENT_SPLIT, capturable]


def test_a_rotary_call_launches_kv_append_then_its_split_kernel_as_kv_appends_dependent(
        built: dict[str, Path], tmp_path: Path, prewarmed: dict[str, Any]) -> None:
    """A rotary call's split kernel waits for kv_append only before its first key, so kv_append runs right before
    it, also with no new key (one block a sequence that writes nothing); with one new key the same launches."""
    split, combine = decode_variants(False, rotary=True)
    entries = prewarmed["entries"]
    e_append, e_split, e_combine = (entries[v.key()] for v in (append_variant(False, rotary=True), split, combine))
    assert dependent_launch(split) and dependent_launch(decode_variants(False)[0]) == DEPENDENT_SPLIT
    for new in ("2", "1"):
        report = run(built, tmp_path, str(prewarmed["image"]), "kvcache", "0", new, "0", "1")
        assert (report["init"], report["status"]) == (LT_OK, LT_OK), report
        launches = report["launches"]
        assert len(launches) == 3 and launches[0] == launched(e_append, (1, B, 1)), launches
        assert launches[1][3:] == launched(e_split, (0, 0, 0), dependent=True)[3:], launches
        assert launches[2][3:] == launched(e_combine, (0, 0, 0), dependent=True)[3:], launches


class _Strided:
    """A stand-in for a tensor whose strides are all the binding reads of it."""

    def __init__(self, strides: tuple[int, ...]) -> None:
        self._strides = strides

    def stride(self) -> tuple[int, ...]:
        return self._strides


def test_one_split_launches_only_the_split_kernel_with_its_arguments(built: dict[str, Path], tmp_path: Path,
                                                                   prewarmed: dict[str, Any]) -> None:
    split, _ = decode_variants(False)
    entry = prewarmed["entries"][split.key()]
    kinds = FLASH_DECODE_SPLIT.signature("bf16")
    sizes = [4 if kind == "fp32" else 8 for kind in kinds.values() if kind != "constexpr"]
    report = run(built, tmp_path, str(prewarmed["image"]), "kvcache", "0", "0", "1",
                 sizes=(*sizes, *[8] * len(entry.hidden_args)))
    assert (report["init"], report["status"]) == (LT_OK, LT_OK), report
    block_m = int(split.get("BLOCK_M"))
    assert report["launches"] == [launched(entry, (math.ceil(HQ // HK / block_m), HK, B),
                                           dependent=DEPENDENT_SPLIT)]
    params = dict(zip(binding.SPLIT_INT_PARAMS, report["params"], strict=False))
    assert (params["Q"], params["K"], params["V"], params["Out"]) == tuple(map(address, (1, 2, 40, 80)))
    assert (params["num_splits"], params["seqlen_q"], params["group_size"], params["page_size"]) == (1, 1, 4, 0)
    assert (params["stride_kb"], params["stride_ks"], params["stride_kh"]) == (CAPACITY * HK * D, HK * D, D)


def test_lt_flash_combine_launches_python_s_kernel(built: dict[str, Path], tmp_path: Path,
                                                  prewarmed: dict[str, Any]) -> None:
    chosen = combine_variant()
    entry = prewarmed["entries"][chosen.key()]
    hidden = len(entry.hidden_args)
    report = run(built, tmp_path, str(prewarmed["image"]), "combine",
                 sizes=(8,) * (len(flash_combine.INT_PARAMS) + hidden))
    assert (report["init"], report["status"]) == (LT_OK, LT_OK), report
    rows = 3 * 8
    grid = (math.ceil(rows / int(chosen.get("BLOCK_M"))), math.ceil(D / int(chosen.get("BLOCK_D"))), 1)
    assert report["launches"] == [launched(entry, grid)]
    values = dict(zip(flash_combine.INT_PARAMS, report["params"], strict=False))
    assert [values[name] for name in flash_combine.INT_PARAMS[:4]] == [address(i) for i in (1, 2, 3, 4)]
    assert report["params"][len(flash_combine.INT_PARAMS):] == [0] * hidden


# On the GPU: lt_attn_kvcache (contiguous; paged with GQA, new keys and a forced split count) and lt_flash_combine
# through liblazytriton_native.so in a process whose LAZYTRITON_IMAGES is argv[3] (no JIT fallback), each result
# against the float64 reference, within 2x a same-precision (bf16) PyTorch reference's error (FlashAttention's rule).
GPU_SCRIPT = r"""
import ctypes, json, sys
import torch
from cffi import FFI
from lazytriton.capi import build
from lazytriton.kernels.flash_decode.reference import kvcache_reference

dll = ctypes.CDLL(sys.argv[1])
dll.lt_last_error.restype = ctypes.c_char_p
assert dll.lt_init(None) == 0, dll.lt_last_error()
ffi = FFI()
ffi.cdef(build.header_cdef(open(sys.argv[2]).read()))
CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.int32: 4}

def call(name, *args):
    return getattr(dll, name)(*(ctypes.c_void_p(int(ffi.cast("uintptr_t", a))) if isinstance(a, ffi.CData) else a
                                for a in args))

def describe(view, t):
    view.data = ffi.cast("void *", t.data_ptr())
    view.dtype, view.ndim, view.device_type, view.device_index = CODES[t.dtype], t.dim(), 2, 0
    for i in range(t.dim()):
        view.sizes[i], view.strides[i] = t.shape[i], t.stride(i)

def err(got, want):
    finite = torch.isfinite(want)
    return float((got.double().cpu() - want.double())[finite].abs().max())

report = {}
torch.manual_seed(0)
for name, paged, new, splits in (("contiguous", False, 0, 0), ("paged-append-split3", True, 2, 3)):
    batch, hq, hk, d, length = 3, 16, 4, 128, 1500
    q = torch.randn(batch, 1, hq, d, device="cuda").bfloat16()
    if paged:
        kc = torch.randn(batch * 8, 256, hk, d, device="cuda").bfloat16()
        table = torch.randperm(batch * 8, device="cuda").reshape(batch, 8).int()
    else:
        kc, table = torch.randn(batch, 2048, hk, d, device="cuda").bfloat16(), None
    vc = torch.randn_like(kc)
    lens = torch.tensor([length, 7, 1999 - new][:batch], dtype=torch.int32, device="cuda")
    k = torch.randn(batch, new, hk, d, device="cuda").bfloat16() if new else None
    v = torch.randn_like(k) if new else None
    before = (kc.cpu(), vc.cpu())
    out, lse = torch.empty_like(q), torch.empty(batch, hq, 1, device="cuda")
    p = ffi.new("lt_attn_kvcache_params *")
    call("lt_attn_kvcache_params_init", p)
    tensors = {"q": q, "k_cache": kc, "v_cache": vc, "cache_seqlens": lens, "out": out, "lse": lse,
               "block_table": table, "k": k, "v": v}
    for field, t in tensors.items():
        if t is not None:
            describe(getattr(p, field), t)
    p.num_splits = splits
    size = ctypes.c_size_t(0)
    assert call("lt_attn_kvcache_workspace_size", p, ctypes.byref(size)) == 0
    ws = torch.empty(max(size.value // 4, 1), device="cuda")
    describe(p.workspace, ws)
    status = call("lt_attn_kvcache", p, ffi.NULL)
    torch.cuda.synchronize()
    cpu = {n: (t.cpu() if t is not None else None) for n, t in (("k", k), ("v", v), ("lens", lens), ("table", table))}
    args = dict(cache_seqlens=cpu["lens"], block_table=cpu["table"])
    want, want_lse, want_kc, _ = kvcache_reference(q.cpu().double(), before[0].double(), before[1].double(),
                                                  None if k is None else cpu["k"].double(),
                                                  None if v is None else cpu["v"].double(), **args)
    same, same_lse, _, _ = kvcache_reference(q.cpu(), before[0], before[1], cpu["k"], cpu["v"], **args)
    report[name] = {"status": status, "error": dll.lt_last_error().decode() if status else "",
                    "out": [err(out, want), err(same, want)], "lse": [err(lse, want_lse), err(same_lse, want_lse)],
                    "appended": bool(new == 0 or torch.equal(kc.cpu().double(), want_kc))}
splits_n, rows, heads, d = 5, 7, 8, 96
out_partial = torch.randn(splits_n, rows, heads, d, device="cuda")
lse_partial = torch.randn(splits_n, rows, heads, device="cuda") * 3
lse_partial[1, 0, 0] = float("-inf")
out, lse = torch.empty(rows, heads, d, device="cuda").bfloat16(), torch.empty(rows, heads, device="cuda")
p = ffi.new("lt_flash_combine_params *")
call("lt_flash_combine_params_init", p)
for field, t in (("out_partial", out_partial), ("lse_partial", lse_partial), ("out", out), ("lse", lse)):
    describe(getattr(p, field), t)
status = call("lt_flash_combine", p, ffi.NULL)
torch.cuda.synchronize()
lp, op = lse_partial.cpu().double(), out_partial.cpu().double()
want_lse = torch.logsumexp(lp, dim=0)
want = (torch.exp(lp - want_lse)[..., None] * op).sum(0)
same_lse = torch.logsumexp(lse_partial.cpu(), dim=0)
same = (torch.exp(lse_partial.cpu() - same_lse)[..., None] * out_partial.cpu()).sum(0).bfloat16()
report["combine"] = {"status": status, "error": dll.lt_last_error().decode() if status else "",
                     "out": [err(out, want), err(same, want)], "lse": [err(lse, want_lse), err(same_lse, want_lse)],
                     "appended": True}
print(json.dumps(report))
"""


@gpu
@pytest.mark.gpu
def test_on_a_gpu_the_decoding_misses_prewarmed_are_served_natively(tmp_path: Path) -> None:
    """No image: every call is LT_MISS; prewarmed from the miss log, served by the native core and within 2x bf16."""
    from lazytriton.capi import native_build

    library = native_build.build(tmp_path / "lib")
    header = REPO / "capi" / "lazytriton.h"
    env = {**os.environ, "LAZYTRITON_CACHE_DIR": str(tmp_path / "cache"), "LAZYTRITON_IMAGES": ""}
    env.pop("LAZYTRITON_JIT", None)

    def calls() -> dict[str, Any]:
        done = subprocess.run([sys.executable, "-c", GPU_SCRIPT, str(library), str(header)], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-4000:]
        report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
        return report

    missed = calls()
    assert all(case["status"] == LT_MISS for case in missed.values()), missed
    image = tmp_path / "decode.ltimg"
    prewarm = subprocess.run([sys.executable, "-m", "lazytriton", "prewarm", "--from-misses",
                              str(tmp_path / "cache" / "misses.jsonl"), "--out", str(image)], capture_output=True,
                             text=True, timeout=1200, check=False, env=env)
    assert prewarm.returncode == 0, prewarm.stderr[-4000:]
    env["LAZYTRITON_IMAGES"] = str(image)
    logged = (tmp_path / "cache" / "misses.jsonl").read_text()
    for name, case in calls().items():
        assert case["status"] == LT_OK, (name, case["error"], "miss log:", logged[-3000:], "prewarm:",
                                         prewarm.stdout[-2000:], prewarm.stderr[-2000:])
        (out_err, out_same), (lse_err, lse_same) = case["out"], case["lse"]
        assert out_err <= 2 * out_same + 1e-6 and lse_err <= 2 * lse_same + 1e-5, (name, case)
        assert case["appended"], name
