"""Benchmark a serving engine's mixed batch (prefills and decodes) as one call against its two parts run apart.

vLLM v1 runs every scheduled sequence of a step as one ``flash_attn_varlen_func(q, k_cache, v_cache,
cu_seqlens_q=..., seqused_k=..., block_table=..., causal=True)`` call: queries packed by cu_seqlens_q, keys
read from the paged cache. lazytriton serves it with the decoding kernels' packed-query path (VARLEN_Q=true).
Providers, on the same paged cache (bf16, 32 query heads over 8 key/value heads, head dim 128, pages of 16 keys
unless ``--page-size``):

- ``one_call``: the whole batch, one ``flash_attn_varlen_func`` call with a block table;
- ``parts``: the prefills (the same call over them alone) then the decodes (``flash_attn_with_kvcache`` with one
  query a sequence, (decodes, 1, heads, head_dim)), timed together: the same work as two launches of each kernel.

Each case: ``--prefills`` sequences of ``--prefill-len`` new queries whose caches hold ``--prefill-cached`` keys
before them (chunked prefill) and ``--decodes`` sequences of one query over ``--decode-len`` keys. The table gives
each provider's median time (CUDA events, ``lazytriton.cli.timing``) and one_call / parts (the target: <= 1.00),
and the outputs are checked equal within 2e-2. All calls run inside ``trusted_indices()``, as a serving loop does.

Usage: python benchmarks/bench_mixed.py [--prefills 1] [--prefill-len 512,2048] [--prefill-cached 0,2048]
       [--decodes 16,64,256] [--decode-len 4096] [--page-size 16] [--warmup N] [--reps N]
       python benchmarks/bench_mixed.py --quick     (tiny cases on CPU through the interpreter: CI)
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

import lazytriton
from lazytriton.cli.timing import median_ms
from lazytriton.kvcache import trusted_indices


class Case(NamedTuple):
    prefills: int
    prefill_len: int
    prefill_cached: int
    decodes: int
    decode_len: int
    page_size: int
    heads_q: int = 32
    heads_k: int = 8
    head_dim: int = 128


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 0")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefills", type=_ints, default=[1])
    parser.add_argument("--prefill-len", type=_ints, default=[512, 2048])
    parser.add_argument("--prefill-cached", type=_ints, default=[0, 2048])
    parser.add_argument("--decodes", type=_ints, default=[16, 64, 256])
    parser.add_argument("--decode-len", type=_ints, default=[4096])
    parser.add_argument("--page-size", type=_ints, default=[16])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="tiny cases on CPU (the interpreter): a smoke run")
    return parser.parse_args(argv)


def cases(args: argparse.Namespace) -> list[Case]:
    if args.quick:
        return [Case(1, 5, 3, 3, 20, 16, 4, 2, 32), Case(2, 3, 0, 2, 9, 5, 4, 2, 32)]
    return [Case(*c) for c in itertools.product(args.prefills, args.prefill_len, args.prefill_cached, args.decodes,
                                                args.decode_len, args.page_size)]


class Inputs(NamedTuple):
    q: torch.Tensor  # (total_q, heads, head_dim): the prefills' queries, then one a decode
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seqused_k: torch.Tensor
    block_table: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def make_inputs(case: Case, device: torch.device) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prefill_keys = case.prefill_cached + case.prefill_len
    counts = [case.prefill_len] * case.prefills + [1] * case.decodes
    lengths = [prefill_keys] * case.prefills + [case.decode_len] * case.decodes
    per = -(-max(lengths) // case.page_size)
    blocks = len(counts) * per
    shape = (blocks, case.page_size, case.heads_k, case.head_dim)
    k_cache = torch.randn(shape, device=device, generator=gen).to(dtype)
    v_cache = torch.randn(shape, device=device, generator=gen).to(dtype)
    table = torch.randperm(blocks, device=device, generator=gen).view(len(counts), per).int()
    cu = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32, device=device)
    q = torch.randn(sum(counts), case.heads_q, case.head_dim, device=device, generator=gen).to(dtype)
    return Inputs(q, k_cache, v_cache, cu, torch.tensor(lengths, dtype=torch.int32, device=device), table,
                  max(counts), max(lengths))


def one_call(t: Inputs) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        return lazytriton.flash_attn_varlen_func(  # type: ignore[no-any-return]
            t.q, t.k_cache, t.v_cache, t.cu_seqlens_q, None, t.max_seqlen_q, t.max_seqlen_k, causal=True,
            seqused_k=t.seqused_k, block_table=t.block_table)
    return run


def parts(t: Inputs, case: Case) -> Callable[[], torch.Tensor]:
    n = case.prefills
    rows = n * case.prefill_len
    q_pre, q_dec = t.q[:rows], t.q[rows:, None]  # the decodes: (decodes, 1, heads, head_dim)
    cu_pre = t.cu_seqlens_q[:n + 1]
    used_pre, used_dec = t.seqused_k[:n], t.seqused_k[n:]
    table_pre, table_dec = t.block_table[:n], t.block_table[n:]

    def run() -> torch.Tensor:
        pre = lazytriton.flash_attn_varlen_func(q_pre, t.k_cache, t.v_cache, cu_pre, None, case.prefill_len,
                                                case.prefill_cached + case.prefill_len, causal=True,
                                                seqused_k=used_pre, block_table=table_pre)
        dec = lazytriton.flash_attn_with_kvcache(q_dec, t.k_cache, t.v_cache, cache_seqlens=used_dec,
                                                 block_table=table_dec, causal=True)
        return torch.cat((pre, dec[:, 0]))
    return run


def measure(case: Case, device: torch.device, args: argparse.Namespace) -> tuple[float, float, float]:
    """(one_call ms, parts ms, max |one_call - parts|)."""
    t = make_inputs(case, device)
    whole, apart = one_call(t), parts(t, case)
    with trusted_indices():
        err = float((whole().float() - apart().float()).abs().max())
        on_gpu = device.type == "cuda"
        warmup, reps = (args.warmup, args.reps) if on_gpu else (0, 1)
        return median_ms(whole, on_gpu, warmup, reps), median_ms(apart, on_gpu, warmup, reps), err


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    print(f"{'prefills':>8} {'q_len':>6} {'cached':>6} {'decodes':>7} {'dec_len':>7} {'page':>4} "
          f"{'one_call_ms':>11} {'parts_ms':>9} {'ratio':>6} {'max_err':>8}")
    ratios, bad = [], 0
    for case in cases(args):
        whole, apart, err = measure(case, device, args)
        ratio = whole / apart
        ratios.append(ratio)
        bad += err > 2e-2
        print(f"{case.prefills:>8} {case.prefill_len:>6} {case.prefill_cached:>6} {case.decodes:>7} "
              f"{case.decode_len:>7} {case.page_size:>4} {whole:>11.4f} {apart:>9.4f} {ratio:>6.2f} {err:>8.2g}"
              + ("  WRONG" if err > 2e-2 else ""))
    geomean = torch.tensor(ratios).log().mean().exp().item()
    print(f"one_call / parts: geomean {geomean:.3f}, max {max(ratios):.3f} (target <= 1.00 on a GPU; "
          f"{device.type})")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
