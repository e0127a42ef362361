"""FlashAttention-3's torch ops over lazytriton (``lazytriton.flash_attn_3_ops``): schemas, routes, results.

Each op's answer must be the lazytriton call's that FlashAttention-3's own Python functions stand for, bit for bit
(the same kernels through the interpreter), and its Meta kernel must give the real outputs' shapes and dtypes.
The schemas are checked as FlashAttention-3's ``test_flash3_bw_compatibility`` checks its own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import gpu
from torch._C import parse_schema

import lazytriton
from lazytriton import flash_attn_3_ops

# FlashAttention-3's hopper/test_flash_attn.py::test_flash3_bw_compatibility, its schemas as written there.
PEER_SCHEMAS = {
    "fwd": "flash_attn_3::fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new=None, "
           "Tensor(v_new!)? v_new=None, Tensor? q_v=None, Tensor(out!)? out=None, "
           "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
           "Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, Tensor? seqused_k=None, "
           "int? max_seqlen_q=None, int? max_seqlen_k=None, Tensor? page_table=None, "
           "Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
           "Tensor? seqlens_rotary=None, Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, "
           "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
           "int attention_chunk=0, float softcap=0., bool is_rotary_interleaved=False, "
           "Tensor? scheduler_metadata=None, int num_splits=0, bool? pack_gqa=None, int sm_margin=0) "
           "-> (Tensor(out!), Tensor, Tensor, Tensor)",
    "bwd": "flash_attn_3::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
           "Tensor(dq!)? dq=None, Tensor(dk!)? dk=None, Tensor(dv!)? dv=None, Tensor? cu_seqlens_q=None, "
           "Tensor? cu_seqlens_k=None, Tensor? seqused_q=None, Tensor? seqused_k=None, int? max_seqlen_q=None, "
           "int? max_seqlen_k=None, float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, "
           "int window_size_right=-1, float softcap=0., bool deterministic=False, int sm_margin=0) "
           "-> (Tensor(dq!), Tensor(dk!), Tensor(dv!), Tensor, Tensor, Tensor, Tensor, Tensor)",
    "fwd_combine": "flash_attn_3::fwd_combine(Tensor out_partial, Tensor lse_partial, Tensor(out!)? out=None, "
                   "ScalarType? out_dtype=None) -> (Tensor(out!), Tensor)",
    "get_scheduler_metadata": "flash_attn_3::get_scheduler_metadata(int batch_size, int max_seqlen_q, "
                              "int max_seqlen_k, int num_heads, int num_heads_k, int headdim, int headdim_v, "
                              "ScalarType qkv_dtype, Tensor seqused_k, Tensor? cu_seqlens_q=None, "
                              "Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, "
                              "Tensor? leftpad_k=None, int? page_size=None, int max_seqlen_k_new=0, "
                              "bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
                              "int attention_chunk=0, bool has_softcap=False, int num_splits=0, "
                              "bool? pack_gqa=None, int sm_margin=0) -> Tensor",
}

flash_attn_3_ops.register()
OPS = torch.ops.flash_attn_3


def _meta(t: Any) -> Any:
    return t.to("meta") if isinstance(t, torch.Tensor) else t


def _same_meta(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], real: tuple[torch.Tensor, ...]) -> None:
    fake = op(*(_meta(a) for a in args), **{k: _meta(v) for k, v in kwargs.items()})
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


def _qkv(b: int, sq: int, sk: int, hq: int = 4, hk: int = 2, d: int = 16, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=gen).half() for s, h in ((sq, hq), (sk, hk), (sk, hk))]


@pytest.mark.parametrize("name", sorted(PEER_SCHEMAS))
def test_each_schema_is_backward_compatible_with_flash_attention_3s(name: str) -> None:
    schema = getattr(OPS, name).default._schema
    assert schema.is_backward_compatible_with(parse_schema(PEER_SCHEMAS[name]))


def test_register_defines_the_ops_once_and_leaves_defined_ones_alone() -> None:
    assert flash_attn_3_ops.register() is False  # defined above: nothing done
    assert flash_attn_3_ops.defined("fwd") and not flash_attn_3_ops.defined("no_such_op")


@pytest.mark.parametrize(("causal", "window", "softcap"), [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                           (False, (3, 1), 5.0)])
def test_dense_fwd_is_flash_attn_func_and_bwd_its_gradients(causal: bool, window: tuple[int, int],
                                                            softcap: float) -> None:
    q, k, v = _qkv(2, 5, 7, seed=int(causal) + 2 * window[0])
    kwargs: dict[str, Any] = {"is_causal": causal, "window_size_left": window[0], "window_size_right": window[1],
                              "softcap": softcap}
    out, lse, out_accum, lse_accum = OPS.fwd(q, k, v, **kwargs)
    ref, ref_lse, _ = lazytriton.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                                 return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert out_accum.numel() == 0 and lse_accum.numel() == 0 and out_accum.dtype == torch.float32
    _same_meta(OPS.fwd, (q, k, v), kwargs, (out, lse, out_accum, lse_accum))
    given = torch.empty_like(out)
    assert OPS.fwd(q, k, v, out=given, **kwargs)[0] is given and torch.equal(given, ref)

    dout = torch.randn_like(out)
    bwd_kwargs = {k: v for k, v in kwargs.items()}
    dq, dk, dv, d, lse_log2, *accum = OPS.bwd(dout, q, k, v, out, lse, **bwd_kwargs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    lazytriton.flash_attn_func(*leaves, causal=causal, window_size=window, softcap=softcap).backward(dout)
    assert all(torch.equal(g, t.grad) for g, t in zip((dq, dk, dv), leaves, strict=True))
    torch.testing.assert_close(d, (dout.float() * out.float()).sum(-1).transpose(1, 2))
    torch.testing.assert_close(lse_log2, lse / torch.log(torch.tensor(2.0)))
    assert all(a.numel() == 0 for a in accum)
    _same_meta(OPS.bwd, (dout, q, k, v, out, lse), bwd_kwargs, (dq, dk, dv, d, lse_log2, *accum))
    dq_given = torch.empty_like(q)
    assert OPS.bwd(dout, q, k, v, out, lse, dq=dq_given, **bwd_kwargs)[0] is dq_given
    assert torch.equal(dq_given, dq)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_packed_fwd_is_flash_attn_varlen_func_and_bwd_its_gradients() -> None:
    gen = torch.Generator().manual_seed(3)
    lq, lk = [3, 0, 6], [5, 2, 6]
    q = torch.randn(sum(lq), 4, 16, generator=gen).half()
    k, v = (torch.randn(sum(lk), 2, 16, generator=gen).half() for _ in range(2))
    cu_q, cu_k = _cu(lq), _cu(lk)
    kwargs: dict[str, Any] = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 6, "max_seqlen_k": 6,
                              "is_causal": True}
    out, lse, *accum = OPS.fwd(q, k, v, **kwargs)
    ref, ref_lse, _ = lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, causal=True,
                                                        return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse) and lse.shape == (4, sum(lq))
    _same_meta(OPS.fwd, (q, k, v), kwargs, (out, lse, *accum))
    dout = torch.randn_like(out)
    dq, dk, dv, d, *_ = OPS.bwd(dout, q, k, v, out, lse, **kwargs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    lazytriton.flash_attn_varlen_func(*leaves, cu_q, cu_k, 6, 6, causal=True).backward(dout)
    assert all(torch.equal(g, t.grad) for g, t in zip((dq, dk, dv), leaves, strict=True))
    torch.testing.assert_close(d, (dout.float() * out.float()).sum(-1).transpose(0, 1))


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_fwd_is_flash_attn_with_kvcache_and_appends_in_place(paged: bool) -> None:
    gen = torch.Generator().manual_seed(4 + paged)
    b, hq, hk, d, capacity, page = 2, 4, 2, 16, 32, 8
    q = torch.randn(b, 1, hq, d, generator=gen).half()
    k_cache, v_cache = (torch.randn(b, capacity, hk, d, generator=gen).half() for _ in range(2))
    k_new, v_new = (torch.randn(b, 2, hk, d, generator=gen).half() for _ in range(2))
    lens = torch.tensor([9, 20], dtype=torch.int32)
    pads = torch.tensor([2, 0], dtype=torch.int32)
    table = None
    if paged:
        table = torch.randperm(b * capacity // page, generator=gen).reshape(b, -1).to(torch.int32)
        k_cache, v_cache = (c.reshape(-1, page, hk, d)[torch.argsort(table.flatten())] for c in (k_cache, v_cache))
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    out, lse, *_ = OPS.fwd(q, *caches[0], k_new, v_new, seqused_k=lens, page_table=table, leftpad_k=pads,
                           is_causal=True)
    ref, ref_lse = lazytriton.flash_attn_with_kvcache(q, *caches[1], k_new, v_new, cache_seqlens=lens,
                                                      block_table=table, cache_leftpad=pads, causal=True,
                                                      return_softmax_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert all(torch.equal(a, r) for a, r in zip(caches[0], caches[1], strict=True))  # the new keys landed
    # a read of the cache without new keys: seqused_k (FlashAttention-3's cache_seqlens) alone makes it a KV call
    read, _, _, _ = OPS.fwd(q, *caches[0], seqused_k=lens + 2, page_table=table)
    assert torch.equal(read, lazytriton.flash_attn_with_kvcache(q, *caches[1], cache_seqlens=lens + 2,
                                                                block_table=table))


def test_fwd_combine_is_flash_attn_combine() -> None:
    gen = torch.Generator().manual_seed(5)
    out_partial = torch.randn(3, 2, 4, 2, 16, generator=gen)
    lse_partial = torch.randn(3, 2, 4, 2, generator=gen)
    out, lse = OPS.fwd_combine(out_partial, lse_partial, out_dtype=torch.float16)
    ref, ref_lse = lazytriton.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float16)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    _same_meta(OPS.fwd_combine, (out_partial, lse_partial), {"out_dtype": torch.float16}, (out, lse))
    given = torch.empty(2, 4, 2, 16)
    assert OPS.fwd_combine(out_partial, lse_partial, out=given)[0] is given


def test_scheduler_metadata_is_empty_and_fwd_takes_it() -> None:
    lens = torch.tensor([5, 7], dtype=torch.int32)
    meta = OPS.get_scheduler_metadata(2, 1, 32, 4, 2, 16, 16, torch.float16, lens, num_splits=3)
    assert meta.dtype == torch.int32 and meta.numel() == 0
    q, k, v = _qkv(2, 1, 32)
    assert torch.equal(OPS.fwd(q, k, v, seqused_k=lens, scheduler_metadata=meta, num_splits=3)[0],
                       lazytriton.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=3))
    with pytest.raises(ValueError, match="num_heads_k"):
        OPS.get_scheduler_metadata(2, 1, 32, 4, 3, 16, 16, torch.float16, lens)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        OPS.get_scheduler_metadata(2, 1, -1, 4, 2, 16, 16, torch.float16, lens)


def test_arguments_lazytriton_cannot_serve_are_refused_by_name() -> None:
    q, k, v = _qkv(2, 1, 8)
    lens = torch.tensor([3, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="q_descale"):
        OPS.fwd(q, k, v, seqused_k=lens, q_descale=torch.ones(1))
    with pytest.raises(NotImplementedError, match="seqused_q"):
        OPS.fwd(q, k, v, seqused_q=lens, seqlens_rotary=None, leftpad_k=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="seqlens_rotary"):
        OPS.fwd(q.reshape(2, 4, 16), k.reshape(16, 2, 16), v.reshape(16, 2, 16), cu_seqlens_q=_cu([1, 1]),
                cu_seqlens_k=_cu([8, 8]), max_seqlen_q=1, max_seqlen_k=8, seqlens_rotary=lens)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        OPS.fwd(q.reshape(2, 4, 16), k.reshape(16, 2, 16), v.reshape(16, 2, 16), cu_seqlens_q=_cu([1, 1]),
                cu_seqlens_k=_cu([8, 8]), max_seqlen_q=1)
    with pytest.raises(NotImplementedError, match="seqused_k"):
        OPS.bwd(q, q, k, v, q, torch.zeros(2, 4, 1), seqused_k=lens)


@gpu
def test_gpu_ops_serve_each_route_as_the_lazytriton_call() -> None:
    """On a GPU, at real sizes: fwd (dense, KV cache paged with new keys), bwd and fwd_combine, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(6)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k, v = randn(2, 1024, 16, 128), randn(2, 1024, 4, 128), randn(2, 1024, 4, 128)
    out, lse, *_ = OPS.fwd(q, k, v, is_causal=True)
    ref, ref_lse, _ = lazytriton.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    dout = randn(*out.shape)
    dq, dk, dv, *_ = OPS.bwd(dout, q, k, v, out, lse, is_causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    lazytriton.flash_attn_func(*leaves, causal=True).backward(dout)
    assert all(torch.equal(g, t.grad) for g, t in zip((dq, dk, dv), leaves, strict=True))

    pages = randn(64, 256, 4, 128), randn(64, 256, 4, 128)
    table = torch.randperm(64, generator=gen, device="cuda").reshape(2, 32).to(torch.int32)
    lens = torch.tensor([3000, 7000], dtype=torch.int32, device="cuda")
    new = randn(2, 1, 4, 128), randn(2, 1, 4, 128)
    caches = [tuple(p.clone() for p in pages) for _ in range(2)]
    qd = randn(2, 1, 16, 128)
    out, lse, *_ = OPS.fwd(qd, *caches[0], *new, seqused_k=lens, page_table=table, is_causal=True)
    ref, ref_lse = lazytriton.flash_attn_with_kvcache(qd, *caches[1], *new, cache_seqlens=lens, block_table=table,
                                                      causal=True, return_softmax_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert all(torch.equal(a, r) for a, r in zip(caches[0], caches[1], strict=True))

    parts = torch.randn(4, 2, 1, 16, 128, generator=gen, device="cuda")
    lses = torch.randn(4, 2, 1, 16, generator=gen, device="cuda")
    combined = OPS.fwd_combine(parts, lses, out_dtype=torch.bfloat16)
    expected = lazytriton.flash_attn_combine(parts, lses, out_dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(combined, expected, strict=True))
