"""``lt_attn_kvcache``: the C API's decoding call (capi/lt_kvcache.c), on CPU through the library.

The library is built once (module fixture, as tests/test_capi.py does); a
Python process loads it with ctypes, lays the params struct out with cffi from
the header, and compares the C call on host memory (Triton's interpreter)
with ``lazytriton.flash_attn_with_kvcache`` on copies of the same tensors:
the same out, lse and appended caches, bit for bit (a left-padded cache
too, rotary embeddings with and without rotary_seqlens, and a version 1
struct, which has no cache_leftpad, and a version 2 one, which has no rotary
tables, as the same call without them). Bad input gets a status and a message naming the argument, and
leaves the caches untouched. The C
launcher's arguments, its split count (lt_splits.c, compiled alone) and the
planner's variants are checked against the binding's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from capilib import CUDA_DESCRIBE, IN_PROCESS_PRELUDE, KVCACHE_PRELUDE, assert_statuses, exit_ok, report_of, run_program
from conftest import REPO, gpu

from lazytriton.capi import embedded_kvcache

KVCACHE_SOURCE = REPO / "capi" / "lt_kvcache.c"


IN_PROCESS = KVCACHE_PRELUDE + r"""
torch.manual_seed(0)
report = {}

def case(name, dtype, tensors, py, before_call=None, **options):
    # C on the tensors, Python on clones: the same out, lse and caches afterwards, bit for bit.
    clones = {n: t.clone() for n, t in tensors.items()}
    b, sq, hq, d = tensors["q"].shape
    out = torch.full((b, sq, hq, tensors["v_cache"].shape[-1]), 7.0, dtype=tensors["q"].dtype)  # v's head dim
    lse = torch.full((b, hq, sq), 7.0)
    p = params({**tensors, "out": out, "lse": lse}, **options)
    if before_call is not None:
        before_call(p)
    status = call("lt_attn_kvcache", p, ffi.NULL)
    want, want_lse = lazytriton.flash_attn_with_kvcache(clones["q"], clones["k_cache"], clones["v_cache"],
                                                        clones.get("k"), clones.get("v"), return_softmax_lse=True,
                                                        block_table=clones.get("block_table"),
                                                        cache_batch_idx=clones.get("cache_batch_idx"),
                                                        alibi_slopes=clones.get("alibi_slopes"),
                                                        cache_leftpad=clones.get("cache_leftpad"),
                                                        rotary_cos=clones.get("rotary_cos"),
                                                        rotary_sin=clones.get("rotary_sin"),
                                                        rotary_seqlens=clones.get("rotary_seqlens"),
                                                        cache_seqlens=clones.get("cache_seqlens", py.get("lens")),
                                                        **{k: v for k, v in py.items() if k != "lens"})
    report[name] = {"status": status, "error": error() if status else "",
                    "out": torch.equal(out, want), "lse": torch.equal(lse, want_lse),
                    "caches": all(torch.equal(tensors[n], clones[n]) for n in ("k_cache", "v_cache")),
                    "appended": "k" not in tensors or not torch.equal(tensors["k_cache"], k_before[name])}

k_before = {}
# Paged, GQA 4/2, new keys appended at per-sequence lengths, ALiBi per head, a forced split count.
pages = torch.randn(12, 16, 2, 32), torch.randn(12, 16, 2, 32)
table = torch.randperm(12, dtype=torch.int32)[:8].reshape(2, 4).contiguous()
paged = {"q": torch.randn(2, 3, 4, 32), "k_cache": pages[0], "v_cache": pages[1], "k": torch.randn(2, 3, 2, 32),
         "v": torch.randn(2, 3, 2, 32), "cache_seqlens": torch.tensor([5, 40], dtype=torch.int32),
         "block_table": table, "alibi_slopes": torch.rand(4)}
k_before["paged"] = pages[0].clone()
case("paged", torch.float32, paged, {"causal": True, "num_splits": 3}, causal=1, num_splits=3)
# Paged with cache_batch_idx (FlashAttention-3's): each sequence's row of a 5-row table, new keys appended there.
wide_table = torch.randperm(12, dtype=torch.int32)[:10].reshape(5, 2).contiguous()
picked_pages = torch.randn(12, 16, 2, 32), torch.randn(12, 16, 2, 32)
picked = {"q": torch.randn(2, 2, 4, 32), "k_cache": picked_pages[0], "v_cache": picked_pages[1],
          "k": torch.randn(2, 2, 2, 32), "v": torch.randn(2, 2, 2, 32),
          "cache_seqlens": torch.tensor([20, 3], dtype=torch.int32), "block_table": wide_table,
          "cache_batch_idx": torch.tensor([3, 0], dtype=torch.int32)}
k_before["paged_batch_idx"] = picked_pages[0].clone()
case("paged_batch_idx", torch.float32, picked, {"causal": True, "num_splits": 2}, causal=1, num_splits=2)
# Contiguous with cache_batch_idx, one query, a window, softcap, an int length for every sequence, bf16.
cache = torch.randn(3, 50, 1, 64).bfloat16(), torch.randn(3, 50, 1, 64).bfloat16()
contiguous = {"q": torch.randn(2, 1, 2, 64).bfloat16(), "k_cache": cache[0], "v_cache": cache[1],
              "cache_batch_idx": torch.tensor([2, 0], dtype=torch.int32)}
case("contiguous", torch.bfloat16, contiguous, {"lens": 37, "window_size": (8, -1), "softcap": 5.0,
                                                 "softmax_scale": 0.3},
     cache_seqlen=37, window_left=8, softcap=5.0, sm_scale=0.3)
# The whole cache, the heuristic's split count.
whole = {"q": torch.randn(1, 1, 4, 16), "k_cache": torch.randn(1, 64, 4, 16), "v_cache": torch.randn(1, 64, 4, 16)}
case("whole", torch.float32, whole, {})
# head_dim_v: v's head dim differs from q's and k's (64 and 32), paged with new keys; 96 and 64 contiguous.
pages_v = torch.randn(12, 16, 2, 64), torch.randn(12, 16, 2, 32)
mla = {"q": torch.randn(2, 2, 4, 64), "k_cache": pages_v[0], "v_cache": pages_v[1], "k": torch.randn(2, 2, 2, 64),
       "v": torch.randn(2, 2, 2, 32), "cache_seqlens": torch.tensor([0, 62], dtype=torch.int32),
       "block_table": table}
k_before["head_dim_v_paged"] = pages_v[0].clone()
case("head_dim_v_paged", torch.float32, mla, {"causal": True, "num_splits": 2}, causal=1, num_splits=2)
wide = {"q": torch.randn(2, 1, 2, 96).half(), "k_cache": torch.randn(2, 40, 2, 96).half(),
        "v_cache": torch.randn(2, 40, 2, 64).half(), "cache_seqlens": torch.tensor([40, 7], dtype=torch.int32)}
case("head_dim_v_contiguous", torch.float16, wide, {})
# A left-padded cache (version 2's cache_leftpad): contiguous and paged, new keys, causal, several splits; one
# sequence's pad at its cached length (it sees only its new keys).
lp_cache = torch.randn(2, 50, 2, 32), torch.randn(2, 50, 2, 32)
leftpad = {"q": torch.randn(2, 2, 4, 32), "k_cache": lp_cache[0], "v_cache": lp_cache[1],
           "k": torch.randn(2, 2, 2, 32), "v": torch.randn(2, 2, 2, 32),
           "cache_seqlens": torch.tensor([30, 12], dtype=torch.int32),
           "cache_leftpad": torch.tensor([25, 12], dtype=torch.int32), "alibi_slopes": torch.rand(2, 4)}
k_before["leftpad"] = lp_cache[0].clone()
case("leftpad", torch.float32, leftpad, {"causal": True, "num_splits": 2}, causal=1, num_splits=2)
lp_pages = torch.randn(12, 16, 2, 32), torch.randn(12, 16, 2, 32)
lp_paged = {"q": torch.randn(2, 1, 4, 32), "k_cache": lp_pages[0], "v_cache": lp_pages[1],
            "k": torch.randn(2, 1, 2, 32), "v": torch.randn(2, 1, 2, 32),
            "cache_seqlens": torch.tensor([5, 50], dtype=torch.int32), "block_table": table,
            "cache_leftpad": torch.tensor([0, 37], dtype=torch.int32)}
k_before["leftpad_paged"] = lp_pages[0].clone()
case("leftpad_paged", torch.float32, lp_paged, {"window_size": (20, 0), "num_splits": 3}, window_left=20,
     window_right=0, num_splits=3)
# A version 1 struct (no cache_leftpad field): taken, and a left pad described past its end is not read.
unread_pads = torch.tensor([40, 40], dtype=torch.int32)
def as_version_1(p):
    describe(p.cache_leftpad, unread_pads)
    p.struct_size, p.version = ffi.offsetof("lt_attn_kvcache_params", "cache_leftpad"), 1
case("version_1", torch.bfloat16, {n: t.clone() for n, t in contiguous.items()}, {"lens": 37}, as_version_1,
     cache_seqlen=37)
# Rotary embeddings (version 3): the new keys rotated by kv_append, q by the split kernel. Paged, causal, halves of
# a part of the head dim; contiguous, pairs, FlashAttention-3's rotary_seqlens and a left pad.
angles = torch.rand(80, 12) * 6.28
ro_pages = torch.randn(12, 16, 2, 32), torch.randn(12, 16, 2, 32)
rotary = {**paged, "k_cache": ro_pages[0], "v_cache": ro_pages[1], "rotary_cos": angles.cos(),
          "rotary_sin": angles.sin()}
k_before["rotary"] = ro_pages[0].clone()
case("rotary", torch.float32, rotary, {"causal": True, "num_splits": 2, "rotary_interleaved": False}, causal=1,
     num_splits=2, rotary_interleaved=0)
ro_cache = torch.randn(2, 50, 2, 32).half(), torch.randn(2, 50, 2, 32).half()
rotary_bases = {**{n: t.half() for n, t in leftpad.items() if n not in ("cache_seqlens", "cache_leftpad",
                                                                        "alibi_slopes")},
                "k_cache": ro_cache[0], "v_cache": ro_cache[1], "cache_seqlens": leftpad["cache_seqlens"],
                "cache_leftpad": leftpad["cache_leftpad"], "rotary_cos": torch.rand(70, 16).half(),
                "rotary_sin": torch.rand(70, 16).half(), "rotary_seqlens": torch.tensor([60, 3], dtype=torch.int32)}
k_before["rotary_seqlens"] = ro_cache[0].clone()
case("rotary_seqlens", torch.float16, rotary_bases, {"window_size": (6, -1)}, window_left=6)
# A version 2 struct (no rotary fields): taken, and rotary tables described past its end are not read.
def as_version_2(p):
    describe(p.rotary_cos, angles)
    describe(p.rotary_sin, angles)
    p.struct_size, p.version = ffi.offsetof("lt_attn_kvcache_params", "rotary_cos"), 2
version_2 = {**{n: t.clone() for n, t in leftpad.items()}, "cache_seqlens": torch.tensor([20, 8], dtype=torch.int32),
             "cache_leftpad": torch.tensor([3, 0], dtype=torch.int32)}
k_before["version_2"] = version_2["k_cache"].clone()
case("version_2", torch.float32, version_2, {"causal": True}, as_version_2, causal=1)

# The workspace a GPU call needs for its splits.
size = ctypes.c_size_t(0)
p = params({**whole, "out": torch.empty(1, 1, 4, 16), "lse": torch.empty(1, 4, 1)}, num_splits=5)
report["workspace"] = [call("lt_attn_kvcache_workspace_size", p, ctypes.byref(size)), size.value]

# Bad input: a status and a message naming the argument, the caches untouched.
def bad(change, base=paged):
    tensors = {n: t.clone() for n, t in base.items()}
    b, sq, hq, d = tensors["q"].shape
    out = torch.empty(b, sq, hq, tensors["v_cache"].shape[-1], dtype=tensors["q"].dtype)
    return refused({**tensors, "out": out, "lse": torch.empty(b, hq, sq)}, lambda p: change(p, tensors), causal=1)

narrow = torch.randn(12, 16, 2, 16)
pads_int64, pads_3 = torch.tensor([1, 2]), torch.zeros(3, dtype=torch.int32)
pads_past = torch.tensor([1, 41], dtype=torch.int32)
cos16, sin16, wide_cos = angles.cos().half(), angles.sin()[:, :8].contiguous(), torch.ones(80, 20)
bases_past = torch.tensor([0, 79], dtype=torch.int32)
def tables(p, cos, sin):
    describe(p.rotary_cos, cos)
    describe(p.rotary_sin, sin)
int64_table = table.long()
past = table.clone(); past[0, 0] = 99
report["errors"] = [
    bad(lambda p, t: setattr(p, "version", 99)),
    bad(lambda p, t: setattr(p.k_cache, "dtype", 1)),
    bad(lambda p, t: describe(p.v_cache, narrow)),
    bad(lambda p, t: describe(p.block_table, int64_table)),
    bad(lambda p, t: describe(p.cache_batch_idx, torch.zeros(3, dtype=torch.int32))),
    bad(lambda p, t: setattr(p, "window_left", -2)),
    bad(lambda p, t: setattr(p, "num_splits", 257)),
    bad(lambda p, t: setattr(p, "softcap", -1.0)),
    bad(lambda p, t: (setattr(p.v, "data", ffi.NULL), setattr(p.v, "ndim", 0))),
    bad(lambda p, t: setattr(p.lse, "dtype", 2)),
    bad(lambda p, t: p.q.sizes.__setitem__(2, 3)),
    bad(lambda p, t: describe(p.block_table, past)),
    bad(lambda p, t: setattr(p, "causal", 2)),
    bad(lambda p, t: (setattr(p.k, "device_type", 2), setattr(p.v, "device_type", 2))),
    bad(lambda p, t: setattr(p, "cache_seqlen", 3)),
    bad(lambda p, t: describe(p.out, torch.empty(2, 3, 4, 16))),
    bad(lambda p, t: describe(p.v_cache, torch.randn(12, 16, 1, 32))),
    bad(lambda p, t: describe(p.v_cache, torch.randn(12, 16, 2, 520))),
    bad(lambda p, t: describe(p.cache_leftpad, pads_int64)),
    bad(lambda p, t: describe(p.cache_leftpad, pads_3)),
    bad(lambda p, t: describe(p.cache_leftpad, pads_past)),
    bad(lambda p, t: setattr(p, "struct_size", ffi.offsetof("lt_attn_kvcache_params", "cache_leftpad"))),
    bad(lambda p, t: describe(p.rotary_cos, angles)),
    bad(lambda p, t: tables(p, cos16, angles)),
    bad(lambda p, t: tables(p, angles, sin16)),
    bad(lambda p, t: tables(p, wide_cos, wide_cos)),
    bad(lambda p, t: (tables(p, angles, angles), setattr(p.k, "data", ffi.NULL), setattr(p.k, "ndim", 0),
                      setattr(p.v, "data", ffi.NULL), setattr(p.v, "ndim", 0))),
    bad(lambda p, t: (tables(p, angles, angles), setattr(p, "rotary_interleaved", 2))),
    bad(lambda p, t: (tables(p, angles[:41], angles[:41]))),
    bad(lambda p, t: (tables(p, angles, angles), describe(p.rotary_seqlens, bases_past))),
    bad(lambda p, t: describe(p.rotary_seqlens, bases_past)),
    bad(lambda p, t: setattr(p, "reserved3", 1)),
]
# New keys on a GPU: checked like host memory, then planned (kv_append first); on a device that does not exist
# (here, and on a GPU host alike) the plan fails after the checks, and nothing is touched.
def on_gpu(p, t):
    for name in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table", "alibi_slopes", "out", "lse"):
        getattr(p, name).device_type, getattr(p, name).device_index = 2, 99
report["gpu_new_keys"] = bad(on_gpu)
print(json.dumps(report))
"""


def test_the_c_call_is_the_python_call_on_the_cpu(prefix: Path, cache_dir: Path) -> None:
    report = report_of(IN_PROCESS, prefix)
    for name in ("paged", "paged_batch_idx", "contiguous", "whole", "head_dim_v_paged", "head_dim_v_contiguous",
                 "leftpad", "leftpad_paged", "version_1", "rotary", "rotary_seqlens", "version_2"):
        r = report[name]
        assert r["status"] == 0, (name, r["error"])
        assert r["out"] and r["lse"] and r["caches"] and r["appended"], (name, r)
    assert report["workspace"] == [0, 4 * 1 * 4 * 1 * 17 * 5]
    expected = [(3, "version is 99"), (4, "k_cache.dtype is fp16 but q.dtype is fp32"),
                (5, "v must have shape (2, 3, 2, 16) (k's batch, seqlen_new and heads, and v_cache's head dim), "
                    "got (2, 3, 2, 32)"), (4, "block_table.dtype is 5"),
                (5, "cache_batch_idx must have shape (batch,)"), (1, "window sizes must be -1"),
                (1, "num_splits must be in 0..256"), (1, "softcap must be a finite value >= 0"),
                (1, "k and v must be given together"), (4, "lse.dtype is 2"),
                (5, "multiple of k_cache heads"), (1, "block_table[0, 0] = 99 points past the cache"),
                (1, "causal is 2"), (1, "k is on cuda:0 but q is on cpu:0"),
                (1, "cache_seqlens (a tensor) and cache_seqlen (3) are both given"),
                (5, "out must have shape (2, 3, 4, 32) (q's, with v_cache's head dim), got (2, 3, 4, 16)"),
                (5, "v_cache must have k_cache's first three dims (12, 16, 2)"),
                (6, "v_cache's head dim (head_dim_v, v_cache.sizes[3]) must be in 1..512, got 520"),
                (4, "cache_leftpad.dtype is 5"), (5, "cache_leftpad must have shape (batch,)"),
                (1, "cache_leftpad[1] = 41: must be in 0..40"), (3, "params->struct_size is"),
                (1, "rotary_cos and rotary_sin must be given together, got only rotary_cos"),
                (4, "rotary_cos.dtype is fp16 but q.dtype is fp32"),
                (5, "rotary_sin must have rotary_cos's shape (80, 12) (seqlen_ro, rotary_dim / 2), got (80, 8)"),
                (5, "rotary_dim (2 x rotary_cos.sizes[1]) must be in 2..32 (q's head dim), got 40"),
                (1, "rotary_cos and rotary_sin need new keys (k and v)"), (1, "rotary_interleaved must be 0 or 1"),
                (1, "rotary_cos has 41 positions (seqlen_ro) but sequence 1 rotates positions 40..42"),
                (1, "rotary_seqlens[1] = 79: must be in 0..77"), (1, "rotary_seqlens needs rotary_cos and rotary_sin"),
                (1, "flags, reserved and reserved3 must be 0")]
    assert_statuses(report["errors"], expected)
    status, message, untouched = report["gpu_new_keys"]
    assert status == 8 and "new keys" not in message and untouched, (status, message)  # LT_ERROR_NO_GPU


# ---------------------------------------------------------------------------
# The C launcher against the binding (pure: reads lt_kvcache.c)


def _initializer(name: str, macro: str) -> list[str]:
    body = re.search(rf"int64_t {name}\[{macro}[^\]]*\] = \{{(.*?)\}};", KVCACHE_SOURCE.read_text(), re.S)
    assert body, f"{name}'s initializer was not found in lt_kvcache.c"
    return [" ".join(item.split()) for item in body[1].split(",")]


@pytest.mark.parametrize(("kernel", "name", "macro"), [
    ("flash_decode_split", "split_ints", "LT__DECODE_SPLIT_PARAMS"),
    ("flash_decode_combine", "combine_ints", "LT__DECODE_COMBINE_PARAMS"),
    ("kv_append", "ints", "LT__APPEND_PARAMS")])
def test_the_c_launcher_passes_each_description_field_by_field(kernel: str, name: str, macro: str) -> None:
    from lazytriton.kernels import get
    from lazytriton.kernels.flash_decode import binding
    from lazytriton.kernels.kv_append import binding as append_binding

    spec = get(kernel)
    c_items = _initializer(name, macro)
    expected = (append_binding.c_initializer() if kernel == "kv_append" else binding.c_initializer(kernel)).split(", ")
    assert len(c_items) == len(expected) == len([k for _, k in spec.params if not k.startswith("fp")])
    for param, c_item, want in zip((n for n, k in spec.params if not k.startswith("fp")), c_items, expected,
                                   strict=True):
        assert c_item == want, f"lt_kvcache.c passes {c_item!r} as {kernel}'s {param}; the binding says {want!r}"
    defined = re.search(rf"#define {macro} (\d+)", KVCACHE_SOURCE.read_text())
    assert defined and int(defined[1]) == len(spec.params)
    assert [k for _, k in spec.params[len(c_items):]] == (["fp32", "fp32"] if kernel == "flash_decode_split" else [])


SPLITS_MAIN = r"""
#include <stdio.h>
#include "lt_splits.c"
int main(void) {
    long long v[16];
    while (scanf("%lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld %lld", &v[0], &v[1],
                 &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13], &v[14],
                 &v[15]) == 16)
        printf("%lld\n", (long long)lt__splits_for(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9],
                                                   v[10], v[11], v[12], v[13], v[14], v[15]));
    return 0;
}
"""


def test_the_c_split_count_is_the_bindings(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    from lazytriton.kernels.flash_decode import binding, checks

    source = tmp_path / "splits.c"
    source.write_text(SPLITS_MAIN)
    program = tmp_path / "splits"
    exit_ok(run_program(["gcc", "-O1", "-Wall", "-Werror", "-std=c99", f"-I{REPO / 'capi'}", "-o", program, source]))
    rows, calls = [], []
    for batch in (1, 3, 8, 16, 64):
        for heads in ((32, 8), (4, 4), (64, 1)):
            for sq in (1, 3):
                for capacity in (16, 1000, 4096, 32768):
                    for window, chunk in (((-1, -1), 0), ((100, 0), 0), ((-1, -1), 300), ((100, 0), 50)):
                        for forced in (0, 7):
                            for block_n, slots, min_keys in ((64, 264, 128), (16, 4, 0), (128, 228, 256)):
                                call = checks.Call(batch, heads[0], heads[1], sq, 128, 0, capacity, 0, batch,
                                                   capacity, False, 1.0, window[0], window[1], num_splits=forced,
                                                   attention_chunk=chunk)
                                # packed queries: fewer partial rows (total_q) than batch x seqlen_q
                                packed = call._replace(varlen_q=True, total_q=batch * sq - 1, num_splits=0)
                                for c in (call, packed):
                                    calls.append(binding.splits_for(c, 16, block_n, slots, min_keys))
                                    rows.append(f"{batch} {heads[0]} {heads[1]} {sq} 128 {capacity} {window[0]} "
                                                f"{window[1]} {chunk} {c.num_splits} 16 {block_n} {slots} "
                                                f"{min_keys} {c.lse_rows} "
                                                f"{-1 if c.packed_rows is None else c.packed_rows}")
    result = subprocess.run([str(program)], input="\n".join(rows) + "\n", capture_output=True, text=True,
                            timeout=60, check=True)
    got = [int(x) for x in result.stdout.split()]
    assert got == calls
    assert len(set(calls)) > 5, "the grid exercises the heuristic, not one answer"


def test_the_planners_variants_are_a_python_calls() -> None:
    import torch

    from lazytriton.kernels import kv_append
    from lazytriton.kernels.flash_decode import binding, checks
    from lazytriton.target import Target

    sm90 = Target("cuda", "90", 32)
    q = torch.empty(2, 3, 8, 64, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(10, 32, 2, 64, dtype=torch.bfloat16, device="meta")
    table = torch.empty(2, 5, dtype=torch.int32, device="meta")
    slopes = torch.empty(8, dtype=torch.float32, device="meta")
    v_cache = torch.empty(10, 32, 2, 32, dtype=torch.bfloat16, device="meta")  # head_dim_v 32
    for causal, window, softcap, paged, alibi, dv in ((False, (-1, -1), 0.0, True, None, 64),
                                                      (True, (16, -1), 2.0, True, slopes, 64),
                                                      (True, (-1, -1), 0.0, False, slopes, 64),
                                                      (False, (-1, -1), 0.0, True, None, 32),
                                                      (True, (-1, -1), 0.0, False, slopes, 32)):
        values = cache if dv == 64 else v_cache
        t = checks.Inputs(q, cache if paged else cache[:2], values if paged else values[:2], None, None, None, None,
                          table if paged else None, alibi)
        call = checks.check(t, None, causal, window, softcap)
        want = binding.variants(sm90, torch.bfloat16, call, True, False)
        got = embedded_kvcache.plan_variants(90, 2, 64, call.causal, True, False, call.rows, call.capacity,
                                             call.page_size, call.windowed, softcap > 0, alibi is not None, dv)
        assert got == want, (causal, window, softcap, paged, dv)
        assert ("BLOCK_DV=32" in str(got[0])) == (dv == 32) and got[1].get("BLOCK_D") == dv
        for aligned, index64 in ((True, False), (False, True)):
            appended = embedded_kvcache.append_variant(90, 2, 64, dv, paged, aligned, index64)
            assert appended == kv_append.variant(sm90, "bf16", 64, call.head_dim_v, paged, aligned, index64)


@pytest.mark.parametrize("paged", [False, True])
def test_the_compiled_entries_take_what_the_c_launcher_passes(paged: bool,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    # Real sm_90 entries of both kernels (compiled here, cross-target): their parameter kinds are what
    # lt_kvcache.c passes (the binding's integers, then two fp32 for the split kernel), no scratch memory.
    from compiled_once import compiled, shared_dir

    from lazytriton.capi.embedded import CapiError

    split, combine = embedded_kvcache.plan_variants(90, 1, 64, False, True, False, 4, 4096, 256 if paged else 0,
                                                    False, False, False, 32 if paged else 64)
    appended = embedded_kvcache.append_variant(90, 1, 64, 32 if paged else 64, paged, True, False)
    for variant in (appended, split, combine):
        entry = compiled(variant, shared_dir(tmp_path_factory))
        embedded_kvcache.check_launch_layout(entry, variant.kernel)
    with pytest.raises(CapiError, match="the C launcher takes"):
        embedded_kvcache.check_launch_layout(entry, split.kernel)  # the combine entry is not a split kernel


GPU_IN_PROCESS = IN_PROCESS_PRELUDE + CUDA_DESCRIBE + r"""
report = {}
torch.manual_seed(0)
for paged in (False, True):
    for batch, length in ((1, 4000), (16, 8192)):
        for workspace in (False, True):
            q = torch.randn(batch, 1, 32, 128, device="cuda").bfloat16()
            if paged:
                kc = torch.randn(batch * 32, 256, 8, 128, device="cuda").bfloat16()
                table = torch.randperm(batch * 32, device="cuda").reshape(batch, 32).int()
            else:
                kc, table = torch.randn(batch, 8192, 8, 128, device="cuda").bfloat16(), None
            vc = torch.randn_like(kc)
            lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            out, lse = torch.empty_like(q), torch.empty(batch, 32, 1, device="cuda")
            p = ffi.new("lt_attn_kvcache_params *")
            call("lt_attn_kvcache_params_init", p)
            for name, t in (("q", q), ("k_cache", kc), ("v_cache", vc), ("cache_seqlens", lens), ("out", out),
                            ("lse", lse)) + ((("block_table", table),) if paged else ()):
                describe(getattr(p, name), t)
            if workspace:
                size = ctypes.c_size_t(0)
                assert call("lt_attn_kvcache_workspace_size", p, ctypes.byref(size)) == 0
                ws = torch.empty(size.value // 4, device="cuda")
                describe(p.workspace, ws)
            status = call("lt_attn_kvcache", p, ffi.NULL)
            torch.cuda.synchronize()
            want, want_lse = lazytriton.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                                return_softmax_lse=True,
                                                                num_splits=0 if workspace else 1)
            name = f"{'paged' if paged else 'contiguous'}-b{batch}-{length}-ws{int(workspace)}"
            report[name] = [status, dll.lt_last_error().decode(), float((out.float() - want.float()).abs().max()),
                            float((lse - want_lse).abs().max())]
# New keys appended by kv_append from C (contiguous with cache_batch_idx, and paged), v's head dim 64 or 128:
# the caches after the call equal Python's bit for bit, out and lse within rounding.
for paged, dv in ((False, 128), (True, 64), (False, 64)):
    batch, hk, new = 4, 8, 3
    q = torch.randn(batch, 2, 32, 128, device="cuda").bfloat16()
    if paged:
        kc = torch.randn(batch * 8, 64, hk, 128, device="cuda").bfloat16()
        vc = torch.randn(batch * 8, 64, hk, dv, device="cuda").bfloat16()
        index = {"block_table": torch.randperm(batch * 8, device="cuda").reshape(batch, 8).int()}
    else:
        kc = torch.randn(batch + 2, 512, hk, 128, device="cuda").bfloat16()
        vc = torch.randn(batch + 2, 512, hk, dv, device="cuda").bfloat16()
        index = {"cache_batch_idx": torch.randperm(batch + 2, device="cuda")[:batch].int()}
    k = torch.randn(batch, new, hk, 128, device="cuda").bfloat16()
    v = torch.randn(batch, new, hk, dv, device="cuda").bfloat16()
    lens = torch.tensor([0, 100, 509, 7], dtype=torch.int32, device="cuda")
    out, lse = torch.empty(batch, 2, 32, dv, device="cuda").bfloat16(), torch.empty(batch, 32, 2, device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    p = ffi.new("lt_attn_kvcache_params *")
    call("lt_attn_kvcache_params_init", p)
    p.causal = 1
    for name, t in (("q", q), ("k_cache", kc), ("v_cache", vc), ("k", k), ("v", v), ("cache_seqlens", lens),
                    ("out", out), ("lse", lse), *index.items()):
        describe(getattr(p, name), t)
    status = call("lt_attn_kvcache", p, ffi.NULL)
    torch.cuda.synchronize()
    want, want_lse = lazytriton.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=lens, causal=True,
                                                        return_softmax_lse=True, num_splits=1, **index)
    name = f"append-{'paged' if paged else 'batch_idx'}-dv{dv}"
    report[name] = [status, dll.lt_last_error().decode(), float((out.float() - want.float()).abs().max()),
                    float((lse - want_lse).abs().max()), torch.equal(kc, kc2) and torch.equal(vc, vc2)]
    # The same call with rotary (version 3): the keys rotated by kv_append, q by the split kernel, in C as in Python.
    angles = torch.rand(520, 32 if paged else 64, device="cuda") * 6.28
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    describe(p.rotary_cos, cos)
    describe(p.rotary_sin, sin)
    p.rotary_interleaved = int(paged)
    status = call("lt_attn_kvcache", p, ffi.NULL)
    torch.cuda.synchronize()
    want, want_lse = lazytriton.flash_attn_with_kvcache(q, kc2, vc2, k, v, cache_seqlens=lens, causal=True,
                                                        return_softmax_lse=True, num_splits=1, rotary_cos=cos,
                                                        rotary_sin=sin, rotary_interleaved=bool(paged), **index)
    report[f"rotary-{name}"] = [status, dll.lt_last_error().decode(), float((out.float() - want.float()).abs().max()),
                                float((lse - want_lse).abs().max()), torch.equal(kc, kc2) and torch.equal(vc, vc2)]
# A left-padded cache (cache_leftpad) from C, contiguous and paged, with the workspace's splits.
for paged in (False, True):
    batch = 8
    q = torch.randn(batch, 1, 32, 128, device="cuda").bfloat16()
    if paged:
        kc = torch.randn(batch * 32, 256, 8, 128, device="cuda").bfloat16()
        index = {"block_table": torch.randperm(batch * 32, device="cuda").reshape(batch, 32).int()}
    else:
        kc, index = torch.randn(batch, 8192, 8, 128, device="cuda").bfloat16(), {}
    vc = torch.randn_like(kc)
    lens = torch.randint(1, 8192, (batch,), device="cuda").int()
    pads = torch.minimum((torch.rand(batch, device="cuda") * lens).int(), lens)
    pads[0] = lens[0]
    out, lse = torch.empty_like(q), torch.empty(batch, 32, 1, device="cuda")
    p = ffi.new("lt_attn_kvcache_params *")
    call("lt_attn_kvcache_params_init", p)
    for name, t in (("q", q), ("k_cache", kc), ("v_cache", vc), ("cache_seqlens", lens), ("cache_leftpad", pads),
                    ("out", out), ("lse", lse), *index.items()):
        describe(getattr(p, name), t)
    size = ctypes.c_size_t(0)
    assert call("lt_attn_kvcache_workspace_size", p, ctypes.byref(size)) == 0
    ws = torch.empty(size.value // 4, device="cuda")
    describe(p.workspace, ws)
    status = call("lt_attn_kvcache", p, ffi.NULL)
    torch.cuda.synchronize()
    want, want_lse = lazytriton.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=pads,
                                                        return_softmax_lse=True, **index)
    finite = torch.isfinite(want_lse)
    report[f"leftpad-{'paged' if paged else 'contiguous'}"] = [
        status, dll.lt_last_error().decode(), float((out.float() - want.float()).abs().max()),
        float((lse[finite] - want_lse[finite]).abs().max()), torch.equal(torch.isfinite(lse), finite)]
print(json.dumps(report))
"""


@gpu
@pytest.mark.gpu
def test_the_c_call_on_a_gpu_is_the_python_call(prefix: Path, cache_dir: Path) -> None:
    report = report_of(GPU_IN_PROCESS, prefix)
    assert {name for name in report if name.startswith("append-")} == {"append-batch_idx-dv128", "append-paged-dv64",
                                                                      "append-batch_idx-dv64"}
    assert {"leftpad-contiguous", "leftpad-paged"} <= set(report)
    assert {name for name in report if name.startswith("rotary-")} == {"rotary-append-batch_idx-dv128",
                                                                      "rotary-append-paged-dv64",
                                                                      "rotary-append-batch_idx-dv64"}
    for name, (status, message, out_err, lse_err, *caches) in report.items():
        assert status == 0, (name, message)
        assert out_err < 2e-2 and lse_err < 1e-3, (name, out_err, lse_err)
        assert caches in ([], [True]), (name, "the appended caches (or the rows without keys) differ from Python's")
