"""The MLA forward's grid (``bench_flash_fwd.py --mla``): FlashAttention-3's qv and v of 512 (flash_fwd_mla).

DeepSeek's MLA prefill with the absorbed projections: q/k of head dim 64 (the rotary part), v and qv of 512 (the
latent), 16 query heads on one key/value head (MQA: the latent is shared), bf16, causal or not, 16k tokens
(batch x seqlen: 16 x 1k, 4 x 4k, 1 x 16k); also v of 512 without qv and of 256 with it (FlashAttention-3's other
test sizes). Providers, timed in turns (``bench_flash_fwd._turns``), each checked against SDPA first:

- ``lazytriton_mla``: ``lazytriton.flash_attn_func(q, k, v, qv=qv)``;
- ``fa3``: FlashAttention-3's ``flash_attn_interface.flash_attn_func`` with the same arguments, where installed;
- ``sdpa_efficient``: torch's SDPA (memory-efficient backend) on the joined form, q = [qv | q] and k = [v | k]
  (head dim 576, v 512), which is the same attention; where torch refuses it, a message and NaN.

TFLOP/s count 2 x seqlen_q x seqlen_k x (d + dv) for the scores (d alone without qv) and 2 x ... x dv for P.V,
halved when causal. Rows go to the same long-format CSV as the other grids.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import torch
from csvlog import append_rows

import lazytriton

MLA_TOKENS = 16384
MLA_HEADS = 16
MLA_SEQLENS = (1024, 4096, 16384)
# (head dim, v's head dim, qv): MLA's 64 + 512 with qv first, then FlashAttention-3's other sizes.
MLA_SHAPES = ((64, 512, True), (64, 512, False), (64, 256, True))
MAX_REL_ERR = 2e-2
DEVICE = "cuda"  # the tests run a case on the CPU (the interpreter) with tiny sizes


def _sdpa_joined(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qv: torch.Tensor | None, causal: bool,
                 scale: float) -> torch.Tensor:
    """SDPA (memory-efficient backend) on the joined form, in FlashAttention's (batch, seqlen, heads, dim) layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if qv is not None:
        q, k = torch.cat((qv, q), -1), torch.cat((v, k), -1)
    heads = q.shape[2]
    k, v = (t.expand(-1, -1, heads, -1) for t in (k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=causal, scale=scale)
    return out.transpose(1, 2)


def _fa3() -> Callable[..., torch.Tensor] | None:
    try:
        from flash_attn_interface import flash_attn_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    return flash_attn_func  # type: ignore[no-any-return]


def mla_case(seqlen: int, head_dim: int, dim_v: int, with_qv: bool, causal: bool, meta: dict[str, str],
             turns: Callable[[dict[str, Callable[[], object]]], tuple[list[str], list[float]]]
             ) -> list[dict[str, object]]:
    """One row set: the providers of one shape, checked against SDPA's joined form, then timed in turns."""
    batch = MLA_TOKENS // seqlen
    q, k = (torch.randn(batch, seqlen, h, head_dim, device=DEVICE, dtype=torch.bfloat16) for h in (MLA_HEADS, 1))
    v = torch.randn(batch, seqlen, 1, dim_v, device=DEVICE, dtype=torch.bfloat16)
    qv = torch.randn(batch, seqlen, MLA_HEADS, dim_v, device=DEVICE, dtype=torch.bfloat16) if with_qv else None
    scale = (head_dim + (dim_v if with_qv else 0)) ** -0.5
    made: dict[str, Callable[[], object]] = {
        "lazytriton_mla": lambda: lazytriton.flash_attn_func(q, k, v, causal=causal, qv=qv)}
    fa3 = _fa3()
    if fa3 is not None:
        made["fa3"] = lambda: fa3(q, k, v, causal=causal, qv=qv)
    made["sdpa_efficient"] = lambda: _sdpa_joined(q, k, v, qv, causal, scale)
    ref = None
    errs: dict[str, float] = {}
    for name in reversed(made):  # SDPA first: the others are checked against it
        try:
            got = made[name]()
            got = got[0] if isinstance(got, tuple) else got
            ref = got if ref is None else ref
            errs[name] = float((got.float() - ref.float()).norm() / ref.float().norm())  # type: ignore[union-attr]
        except Exception as exc:
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:160]}", file=sys.stderr)
            errs[name] = math.nan
    names, times = turns({name: made[name] for name, err in errs.items() if err < MAX_REL_ERR})
    timed = dict(zip(names, times, strict=True))
    flops = 2 * seqlen * seqlen * batch * MLA_HEADS * (head_dim + (dim_v if with_qv else 0) + dim_v)
    flops /= 2 if causal else 1
    return [{**meta, "provider": name, "mode": f"fwd_mla_dv{dim_v}{'_qv' if with_qv else ''}", "dtype": "bf16",
             "head_dim": head_dim, "causal": causal, "batch": batch, "heads": MLA_HEADS, "seqlen": seqlen,
             "p50_ms": round(timed.get(name, math.nan), 4),
             "tflops": round(flops / timed.get(name, math.nan) / 1e9, 1), "us_per_call": "",
             "rel_err": f"{errs[name]:.1e}"} for name in made]


def mla(args: argparse.Namespace, meta: dict[str, str], fields: list[str],
        turns: Callable[[dict[str, Callable[[], object]]], tuple[list[str], list[float]]]) -> list[dict[str, object]]:
    """The MLA grid: rows appended to ``args.csv`` case by case, one line printed each."""
    rows: list[dict[str, object]] = []
    for head_dim, dim_v, with_qv in MLA_SHAPES:
        for seqlen in MLA_SEQLENS:
            for causal in (False, True):
                torch.manual_seed(seqlen + dim_v)
                done = mla_case(seqlen, head_dim, dim_v, with_qv, causal, meta, turns)
                append_rows(args.csv, fields, done)
                rows += done
                print(f"d{head_dim} dv{dim_v}{' qv' if with_qv else '   '} {'causal' if causal else 'full  '} "
                      f"{seqlen // 1024}k: " + "  ".join(f"{r['provider']} {r['tflops']}" for r in done), flush=True)
                torch.cuda.empty_cache()
    return rows
