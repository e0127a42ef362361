"""DeepSeek MLA's decode in ``flash_attn_with_kvcache``: FlashAttention-3's ``qv``, v of 512, the latent cache.

Two forms of one attention (``kernels/flash_decode/mla.py``): FlashAttention-3's qv (q, k of head dim d; v, qv
of dv: scores (q . k + qv . v) x scale, default 1/sqrt(d + dv)) and FlashMLA's/vLLM's latent cache (k_cache
(..., 576), v_cache = k_cache[..., :512], q = [q_nope | q_pe]). Numerics against the float64 reference
(``flash_decode.reference``) with FlashAttention's rule, on CPU through Triton's interpreter on small shapes:
GQA/MQA, contiguous and paged (pages a tile divides and gathered ones), causal, new keys, several splits. Then
bad input, the variants, prewarm and explain, compiled variants, and GPU-marked tests at real sizes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from conftest import gpu
from test_kvcache import check_out_lse

import lazytriton
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_decode import binding, checks, mla
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_decode.reference import kvcache_reference
from lazytriton.target import Target

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
SM90 = Target.parse("sm_90")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def randn(gen: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def layout(gen: torch.Generator, batch: int, capacity: int, page: int) -> tuple[int, int, torch.Tensor | None]:
    """(cache rows, rows a page, block table): contiguous with page 0, else a shuffled pool of 2x the pages."""
    if not page:
        return batch, capacity, None
    per_seq = -(-capacity // page)
    pool = torch.randperm(2 * batch * per_seq, generator=gen)[:batch * per_seq]
    return 2 * batch * per_seq, page, pool.view(batch, per_seq).to(torch.int32)


def qv_inputs(dtype: torch.dtype, d: int, dv: int, heads: tuple[int, int], sq: int, page: int, new: int,
              seed: int, batch: int = 2, capacity: int = 40) -> dict[str, Any]:
    """FlashAttention-3's qv form: q, k_cache, v_cache (separate), qv, lengths (one empty sequence), new keys."""
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    rows, per_row, table = layout(gen, batch, capacity, page)
    lens = torch.tensor([capacity - new - 3, 0][:batch] + [capacity - new] * (batch - 2), dtype=torch.int32)
    args: dict[str, Any] = {"q": randn(gen, dtype, batch, sq, hq, d), "qv": randn(gen, dtype, batch, sq, hq, dv),
                            "k_cache": randn(gen, dtype, rows, per_row, hk, d),
                            "v_cache": randn(gen, dtype, rows, per_row, hk, dv), "cache_seqlens": lens,
                            "block_table": table}
    if new:
        args.update(k=randn(gen, dtype, batch, new, hk, d), v=randn(gen, dtype, batch, new, hk, dv))
    return args


def latent_inputs(dtype: torch.dtype, d: int, dv: int, heads: tuple[int, int], sq: int, page: int, new: int,
                  seed: int, batch: int = 2, capacity: int = 40) -> dict[str, Any]:
    """MLA's latent cache: one cache of d columns, v_cache its first dv (a view); new keys k, v = k[..., :dv]."""
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    rows, per_row, table = layout(gen, batch, capacity, page)
    lens = torch.tensor([capacity - new - 5, 1][:batch] + [capacity - new] * (batch - 2), dtype=torch.int32)
    cache = randn(gen, dtype, rows, per_row, hk, d)
    args: dict[str, Any] = {"q": randn(gen, dtype, batch, sq, hq, d), "k_cache": cache, "v_cache": cache[..., :dv],
                            "cache_seqlens": lens, "block_table": table}
    if new:
        k = randn(gen, dtype, batch, new, hk, d)
        args.update(k=k, v=k[..., :dv])
    return args


def run(args: dict[str, Any], **opts: Any) -> tuple[torch.Tensor, ...]:
    """The call on a copy of the caches (the latent form's view kept a view): (out, lse, k_cache, v_cache)."""
    k_cache = args["k_cache"].clone()
    shared = mla.shared_cache(args["k_cache"], args["v_cache"])
    v_cache = k_cache[..., :args["v_cache"].shape[-1]] if shared else args["v_cache"].clone()
    mine = {**args, "k_cache": k_cache, "v_cache": v_cache}
    out, lse = lazytriton.flash_attn_with_kvcache(**mine, **opts, return_softmax_lse=True)
    return out, lse, k_cache, v_cache


def check(args: dict[str, Any], **opts: Any) -> tuple[torch.Tensor, ...]:
    """The call against the float64 reference (FlashAttention's rule, the same-dtype reference's error x 2)."""
    got = run(args, **opts)
    ref_args = {name: value for name, value in args.items() if value is not None}
    opts = {name: value for name, value in opts.items() if name != "num_splits"}  # the reference has no splits
    exact = kvcache_reference(**{n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                                 for n, t in ref_args.items()}, **opts)
    same = kvcache_reference(**ref_args, **opts)
    check_out_lse(got[:2], exact[:2], same[:2])
    assert torch.equal(got[2].double(), exact[2]), "k_cache after the append"
    assert torch.equal(got[3].double(), exact[3]), "v_cache after the append"
    return got


QV_CASES = [  # (dtype, d, dv, heads, seqlen_q, page, new, causal, splits)
    (F16, 32, 64, (4, 1), 1, 0, 0, False, 1),
    (BF16, 32, 64, (8, 1), 2, 16, 1, True, 3),
    (F32, 16, 48, (4, 2), 3, 0, 2, True, 0),
    (F16, 64, 512, (16, 1), 1, 16, 0, False, 2),  # MLA's own dims, 16 heads of one latent head
    (BF16, 32, 256, (4, 1), 2, 4, 1, False, 0),  # pages no key tile divides (gathered)
]


@pytest.mark.parametrize("case", QV_CASES, ids=str)
def test_qv_follows_flashattentions_rule(case: tuple[Any, ...]) -> None:
    dtype, d, dv, heads, sq, page, new, causal, splits = case
    check(qv_inputs(dtype, d, dv, heads, sq, page, new, seed=hash(case) % 1000), causal=causal, num_splits=splits)


LATENT_CASES = [  # (dtype, d, dv, heads, seqlen_q, page, new, causal, splits)
    (F16, 96, 64, (8, 1), 1, 0, 0, False, 1),
    (BF16, 96, 64, (4, 1), 2, 16, 1, True, 0),
    (F16, 576, 512, (16, 1), 1, 32, 1, False, 3),  # FlashMLA's cache: 576 = 512 latent + 64 rope
    (F32, 80, 64, (4, 2), 3, 0, 2, True, 2),
]


@pytest.mark.parametrize("case", LATENT_CASES, ids=str)
def test_the_latent_cache_follows_flashattentions_rule(case: tuple[Any, ...]) -> None:
    dtype, d, dv, heads, sq, page, new, causal, splits = case
    args = latent_inputs(dtype, d, dv, heads, sq, page, new, seed=hash(case) % 1000)
    out, lse, k_cache, v_cache = check(args, causal=causal, num_splits=splits)
    assert v_cache.data_ptr() == k_cache.data_ptr(), "v_cache stays k_cache's view"


def test_the_latent_cache_is_the_qv_form_on_the_same_bytes() -> None:
    """One kernel, one layout: the latent call and the qv call on its split columns give the same bits."""
    args = latent_inputs(F16, 96, 64, (8, 1), 2, 16, 0, seed=7)
    q, cache, dv = args["q"], args["k_cache"], 64
    latent = lazytriton.flash_attn_with_kvcache(**args, causal=True, return_softmax_lse=True)
    split = lazytriton.flash_attn_with_kvcache(q[..., dv:], cache[..., dv:], cache[..., :dv], qv=q[..., :dv],
                                               cache_seqlens=args["cache_seqlens"],
                                               block_table=args["block_table"], causal=True,
                                               return_softmax_lse=True)
    assert torch.equal(latent[0], split[0]) and torch.equal(latent[1], split[1])


def test_the_latent_form_reads_the_callers_cache_without_a_copy() -> None:
    args = latent_inputs(BF16, 96, 64, (4, 1), 1, 16, 1, seed=3)
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["cache_seqlens"],
                      block_table=args["block_table"])
    call = checks.check(t)
    assert call.qv and call.head_dim == 32 and call.head_dim_v == 64
    assert call.scale == pytest.approx(1 / math.sqrt(96))
    kernel = mla.kernel_inputs(t, call)
    element = args["k_cache"].element_size()
    assert kernel.q is args["q"] and kernel.v_cache is args["v_cache"]
    assert kernel.k_cache.data_ptr() == args["k_cache"].data_ptr() + 64 * element  # k's columns after v's
    # the new latent row: v's columns through v_cache, the rest through k_cache, each written once
    assert kernel.k.data_ptr() == args["k"].data_ptr() + 64 * element and kernel.v.data_ptr() == args["k"].data_ptr()
    assert kernel.k.shape[-1] + kernel.v.shape[-1] == args["k"].shape[-1]


def test_qvs_default_scale_is_flashattention3s() -> None:
    args = qv_inputs(F16, 64, 512, (2, 1), 1, 0, 0, seed=1, capacity=8)
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], cache_seqlens=args["cache_seqlens"],
                      qv=args["qv"])
    assert checks.check(t).scale == pytest.approx(1 / math.sqrt(64 + 512))
    assert checks.check(t, softmax_scale=0.25).scale == 0.25


def test_packed_queries_take_qv() -> None:
    """vLLM's mixed batch (cu_seqlens_q) with qv: each sequence as its own call."""
    args = qv_inputs(BF16, 32, 64, (4, 1), 3, 16, 0, seed=11)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    q, qv = args["q"], args["qv"]
    packed_q, packed_qv = torch.cat((q[0], q[1, :1])), torch.cat((qv[0], qv[1, :1]))
    out = lazytriton.flash_attn_with_kvcache(packed_q, args["k_cache"], args["v_cache"], qv=packed_qv,
                                             cache_seqlens=args["cache_seqlens"], block_table=args["block_table"],
                                             cu_seqlens_q=cu, max_seqlen_q=3, causal=True)
    for b, rows in ((0, slice(0, 3)), (1, slice(3, 4))):
        one = lazytriton.flash_attn_with_kvcache(q[b:b + 1, :rows.stop - rows.start], args["k_cache"],
                                                 args["v_cache"], qv=qv[b:b + 1, :rows.stop - rows.start],
                                                 cache_seqlens=args["cache_seqlens"][b:b + 1],
                                                 block_table=args["block_table"][b:b + 1], causal=True)
        torch.testing.assert_close(out[rows], one[0], rtol=0, atol=2e-2)


def test_torch_compile_traces_both_forms() -> None:
    compiled = torch.compile(lambda *a, **k: lazytriton.flash_attn_with_kvcache(*a, **k), fullgraph=True)
    args = qv_inputs(F16, 32, 64, (4, 1), 1, 0, 0, seed=5)
    torch.testing.assert_close(compiled(**args), lazytriton.flash_attn_with_kvcache(**args), rtol=0, atol=0)
    latent = latent_inputs(F16, 96, 64, (4, 1), 1, 16, 1, seed=6)
    expected = run(latent)
    cache = latent["k_cache"].clone()
    out = compiled(**{**latent, "k_cache": cache, "v_cache": cache[..., :64]})
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    assert torch.equal(cache, expected[2]), "the new latent row lands in the cache, through the op"


# ---------------------------------------------------------------------------
# Bad input: named before anything is written


def _bad(what: str) -> tuple[dict[str, Any], type, str]:
    qv_args = qv_inputs(F16, 32, 64, (4, 1), 1, 0, 1, seed=2)
    latent = latent_inputs(F16, 96, 64, (4, 1), 1, 0, 1, seed=2)
    cache, wide = latent["k_cache"], torch.zeros(2, 40, 1, 800, dtype=F16)
    cases: dict[str, tuple[dict[str, Any], type, str]] = {
        "qv shape": ({**qv_args, "qv": qv_args["qv"][..., :32]}, ValueError, "qv must have shape"),
        "qv dtype": ({**qv_args, "qv": qv_args["qv"].float()}, TypeError, "qv must be torch.float16"),
        "qv type": ({**qv_args, "qv": [1.0]}, TypeError, "qv must be a torch.Tensor"),
        "qv strides": ({**qv_args, "qv": qv_args["qv"].transpose(-1, -2).contiguous().transpose(-1, -2)},
                       ValueError, "qv must have a contiguous last dim"),
        "qv with the latent cache": ({**latent, "qv": torch.zeros(2, 1, 4, 64, dtype=F16)}, ValueError,
                                     "qv is given but v_cache is k_cache"),
        "head_dim_v over 512": ({**qv_args, "v_cache": torch.zeros(2, 40, 1, 520, dtype=F16), "k": None, "v": None,
                                 "qv": None}, ValueError, "head_dim_v"),
        "head dim 576 apart": ({**qv_args, "q": torch.zeros(2, 1, 4, 576, dtype=F16),
                                "k_cache": torch.zeros(2, 40, 1, 576, dtype=F16), "k": None, "v": None, "qv": None},
                               ValueError, "head dim"),
        "latent columns past 256": ({**latent, "q": torch.zeros(2, 1, 4, 800, dtype=F16), "k_cache": wide,
                                     "k": None, "v": None, "v_cache": wide[..., :512]},
                                    ValueError, "columns after v's"),
        "v not k's columns": ({**latent, "v": latent["k"][..., :64].clone()}, ValueError, "v must be k[..., :64]"),
        "caches overlapping otherwise": ({**latent, "v_cache": cache[..., 32:]}, ValueError,
                                         "v_cache shares k_cache's memory"),
        "rotary with the latent cache": ({**latent, "rotary_cos": torch.ones(64, 8, dtype=F16),
                                          "rotary_sin": torch.zeros(64, 8, dtype=F16)}, ValueError, "rotary_cos"),
        "qv with a float8 cache": ({**qv_args, "k_cache": qv_args["k_cache"].to(torch.float8_e4m3fn),
                                    "v_cache": qv_args["v_cache"].to(torch.float8_e4m3fn), "k": None, "v": None},
                                   ValueError, "qv with a float8 cache"),
    }
    return cases[what]


BAD = ["qv shape", "qv dtype", "qv type", "qv strides", "qv with the latent cache", "head_dim_v over 512",
       "head dim 576 apart", "latent columns past 256", "v not k's columns", "caches overlapping otherwise",
       "rotary with the latent cache", "qv with a float8 cache"]


@pytest.mark.parametrize("what", BAD)
def test_bad_input_is_named_before_anything_is_written(what: str) -> None:
    args, error, needle = _bad(what)
    before = args["k_cache"].clone()
    with pytest.raises(error, match=needle.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        lazytriton.flash_attn_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before), "nothing is written before the checks pass"


def test_reading_through_overlapping_caches_is_fine() -> None:
    """Overlap only matters to writes: a call without new keys reads any two views of one tensor."""
    latent = latent_inputs(F32, 96, 64, (4, 1), 1, 0, 0, seed=4)
    cache = latent["k_cache"]
    args = {**latent, "q": latent["q"][..., :64], "k_cache": cache[..., 32:], "v_cache": cache[..., :64]}
    check(args)


# ---------------------------------------------------------------------------
# Variants, prewarm, explain


def test_qv_is_the_split_kernels_flag_and_512_its_value_tile() -> None:
    split = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 64, False, True, 128, 32768,
                                           head_dim_v=512, paged=True, qv=True)
    combine = decode_dispatch.decode_variant("flash_decode_combine", SM90, "bf16", 64, False, True, 128, 32768,
                                             head_dim_v=512, qv=True)
    assert "QV=true" in str(split) and "BLOCK_DV=512" in str(split) and "BLOCK_D=64" in str(split)
    assert "QV" not in str(combine) and "BLOCK_D=512" in str(combine)
    assert (split.get("BLOCK_M"), split.get("BLOCK_N"), split.get("num_warps")) == (32, 32, 8)
    plain = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 64, False, True, 16, 4096)
    assert "QV" not in str(plain)
    append = dispatch.kernel_variant("kv_append", SM90, "bf16", 64, False, True, 1, 1, head_dim_v=512)
    assert "BLOCK_DV=512" in str(append)


def test_the_memo_key_carries_qv() -> None:
    base = checks.Call(2, 16, 1, 1, 64, 0, 4096, 0, 2, 4096, False, 0.1, head_dim_v=512)
    plain, with_qv = (binding.memo_key(0, torch.bfloat16, call, True, False) for call in (base, base._replace(qv=True)))
    assert with_qv[:len(plain)] == plain and with_qv[len(plain):] == binding.QV_TAG


def test_prewarm_plans_mla(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton import tuning
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants

    kernels = ("flash_fwd", "flash_decode_split", "flash_decode_combine", "kv_append")
    axes = Axes(targets=(SM90,), kernels=kernels, dtypes=("bf16",), head_dims=(64,), head_dims_v=(512,),
                causal=(False,), seqlens_q=(128,), seqlens_k=(32768,), qv=(False, True), paged=(True,))
    planned = [str(p.variant) for p in enumerate_variants(axes, tuning.tables_for(kernels))]
    forward = [v for v in planned if v.startswith("flash_fwd:")]  # v of 512 as two pieces of 256 (value_split)
    assert forward and all("BLOCK_DV=256" in v for v in forward), "the forward takes no v of 512"
    split = [v for v in planned if v.startswith("flash_decode_split")]
    assert len(split) == 2 and sum("QV=true" in v for v in split) == 1 and all("BLOCK_DV=512" in v for v in split)
    assert any(v.startswith("flash_decode_combine") and "BLOCK_D=512" in v for v in planned)
    assert any(v.startswith("kv_append") and "BLOCK_DV=512" in v for v in planned)
    from lazytriton.cli import main as cli_main

    assert cli_main(["prewarm", "--kernel", "flash_decode", "--target", "sm_90", "--dtype", "bf16", "--head-dim",
                     "64", "--head-dim-v", "512", "--qv", "--seqlen-q", "128", "--seqlen-k", "32768",
                     "--list"]) == 0
    listed = capsys.readouterr().out
    assert "QV=true" in listed and "BLOCK_DV=512" in listed


def test_explain_describes_qv(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main as cli_main

    assert cli_main(["cache", "explain", "--kernel", "flash_decode_split", "--dtype", "bf16", "--head-dim", "64",
                     "--head-dim-v", "512", "--qv", "--seqlen-q", "128", "--seqlen-k", "32768", "--page-size", "64",
                     "--target", "sm_90"]) == 0
    text = capsys.readouterr().out
    assert "QV=true" in text and "qv (QV=true on the split kernel)" in text
    assert cli_main(["cache", "explain", "--kernel", "flash_fwd", "--dtype", "bf16", "--head-dim", "64", "--qv",
                     "--seqlen-q", "128"]) != 0
    assert "--qv is flash_attn_with_kvcache's qv" in capsys.readouterr().err


@pytest.mark.parametrize("paged", [False, True])
def test_mla_variants_compile_for_sm_90(paged: bool, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Real entries (Triton's compiler, no GPU): MLA's split, combine and append at 64/512."""
    from compiled_once import compiled, shared_dir

    from lazytriton.kernels import get

    where = shared_dir(tmp_path_factory)
    for kernel in ("flash_decode_split", "flash_decode_combine", "kv_append"):
        variant = dispatch.kernel_variant(kernel, SM90, "bf16", 64, False, True, 128, 32768, paged=paged,
                                          head_dim_v=512, qv=kernel == "flash_decode_split")
        entry = compiled(variant, where)
        assert len(entry.arg_types) == len(get(kernel).params)


# ---------------------------------------------------------------------------
# On the GPU, at real sizes


def _gpu_latent(batch: int, capacity: int, heads: int, page: int, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (batch, 1, heads, 576), a paged latent cache (blocks, page, 1, 576), its block table and lengths."""
    per_seq = capacity // page
    cache = torch.randn(batch * per_seq, page, 1, 576, generator=gen, device="cuda").to(BF16)
    table = torch.randperm(batch * per_seq, generator=gen, device="cuda").view(batch, per_seq).to(torch.int32)
    lens = torch.randint(1, capacity + 1, (batch,), generator=gen, device="cuda").to(torch.int32)
    q = torch.randn(batch, 1, heads, 576, generator=gen, device="cuda").to(BF16)
    return q, cache, table, lens


def _on_cpu(out: torch.Tensor, lse: torch.Tensor | None, q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, qv: torch.Tensor | None = None, **opts: Any) -> None:
    """FlashAttention's rule for a GPU call against the references, computed on the CPU (float64 and q's dtype)."""
    opts = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in opts.items()}
    inputs = [x.cpu() if x is not None else None for x in (q, k_cache, v_cache, qv)]
    exact = kvcache_reference(*(x.double() for x in inputs[:3]),
                              qv=None if inputs[3] is None else inputs[3].double(), **opts)
    same = kvcache_reference(*inputs[:3], qv=inputs[3], **opts)
    if lse is None:
        err, same_err = (float((x.cpu().double() - exact[0]).abs().max()) for x in (out, same[0]))
        assert err <= 2 * same_err + 1e-3, f"out: max error {err:.3g} > 2 x {same_err:.3g}"
    else:
        check_out_lse((out.cpu(), lse.cpu()), exact[:2], same[:2])


@gpu
@pytest.mark.parametrize(("batch", "capacity", "heads"), [(1, 32768, 128), (16, 8192, 128), (64, 4096, 16),
                                                          (4, 16384, 64)])
def test_mla_latent_decode_gpu(batch: int, capacity: int, heads: int) -> None:
    """FlashMLA's call: a paged latent cache of 576 (v its first 512), one query, DeepSeek's scale 1/sqrt(192)."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + heads)
    q, cache, table, lens = _gpu_latent(batch, capacity, heads, 64, gen)
    opts = {"cache_seqlens": lens, "block_table": table, "softmax_scale": 192 ** -0.5}
    out, lse = lazytriton.flash_attn_with_kvcache(q, cache, cache[..., :512], **opts, return_softmax_lse=True)
    _on_cpu(out, lse, q, cache, cache[..., :512], **opts)


@gpu
@pytest.mark.parametrize(("batch", "capacity", "causal"), [(8, 4096, False), (2, 32768, True)])
def test_mla_qv_decode_gpu(batch: int, capacity: int, causal: bool) -> None:
    """FlashAttention-3's qv form at MLA's sizes, two queries a sequence (speculative decoding), 128 heads."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    _, cache, table, lens = _gpu_latent(batch, capacity, 128, 64, gen)
    q = torch.randn(batch, 2, 128, 576, generator=gen, device="cuda").to(BF16)
    opts = {"cache_seqlens": lens, "block_table": table, "causal": causal}
    out = lazytriton.flash_attn_with_kvcache(q[..., 512:], cache[..., 512:], cache[..., :512], qv=q[..., :512],
                                             **opts)
    _on_cpu(out, None, q[..., 512:], cache[..., 512:], cache[..., :512], qv=q[..., :512], **opts)
