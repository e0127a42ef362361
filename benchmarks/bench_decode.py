"""Benchmark lazytriton's decoding attention (``flash_attn_with_kvcache``) beside SDPA, measured in the same run.

Decoding reads the whole KV cache once per token and is bound by memory, so
throughput is reported in GB/s: bytes of K and V read plus q read and out
written, over the median of CUDA-event-timed runs (``lazytriton.cli.timing
.event_ms``), against the GPU's bandwidth (H200: 4.8 TB/s).

The grid: one query per sequence, bf16, head dim 128, 32 query heads over 8
key/value heads (GQA), every sequence of the batch at the cache's length,
caches of 1k, 4k, 16k and 32k tokens, batch 1, 8, 32 and 64, a contiguous
cache and a paged one (pages of 256 keys, a random block table); --head-dims,
--heads and --page-size (``--page-size 1,16,256``: a paged case per size;
pages no key tile divides, such as 1, run the gathered kernel) widen it
(``--head-dims 64,128`` is the grid ``lazytriton tune --kernel flash_decode
--head-dim 64,128`` tunes). Providers:

- ``lazytriton``: ``flash_attn_with_kvcache(q, k_cache, v_cache,
  cache_seqlens=..., block_table=...)``, the public call, inside
  ``trusted_indices()`` (the value checks of the indices cost a host
  synchronisation per call, which a serving loop skips);
- ``sdpa``: ``F.scaled_dot_product_attention(q, K, V, enable_gqa=True)`` on
  the same keys and values in SDPA's (batch, heads_k, seqlen, head_dim)
  layout (for a paged case: the cache gathered once, outside the timing);
- ``sdpa_gather`` (paged only): the gather of each sequence's blocks plus
  SDPA, timed together: what a paged cache costs a caller without a paged
  kernel.

``--rotary interleaved`` (or ``halves``) adds two providers, a decoding step
with its new key: ``lazytriton_append`` (k and v of one token appended at
cache_seqlens = length - 1, then the attention) and ``lazytriton_rotary``
(the same call with rotary_cos/rotary_sin over the whole head dim,
rotary_interleaved=True or False: the key rotated by kv_append, q by the split
kernel), and a table of their times: rotary over the same step without it, per
case, with its geomean and max (the goal: within 1.10). ``--sinks`` adds
``lazytriton_sinks``: the lazytriton call with attention sinks (one float32
logit a query head, gpt-oss's), checked against the reference with them; the
table then ends with its time over the same call's without sinks.
``--leftpad`` adds ``lazytriton_leftpad``: the lazytriton call with
``cache_leftpad`` (1 to 63 keys of padding at the front of each sequence,
FlashAttention's left-padded batch: the keys from the pad to the length are
read); the table then ends with its time a key read over the same call's
without it (the goal: within 1.10).

``--kv-dtype e4m3`` (or ``e5m2``) adds ``lazytriton_fp8``: the same call on
a float8 copy of the cache (``k_cache / k_descale`` per key/value head,
descale = the head's amax / the format's largest value, saturated, RTNE: what
kv_append writes), with k_descale and v_descale; its bytes count K and V at
one byte each, and its reference is the dequantised cache's. A table then
gives, per case, the bf16 cache's time and GB/s beside the float8 cache's and
the speedup (bf16 time / float8 time: how much more the float8 cache decodes
in the same time); the goal is at least 1.8 at batch 1-32 from
4k keys.

``--mla`` runs DeepSeek MLA's decode instead (``bench_decode_mla.py``: the
576/512 latent cache read in place, FlashAttention-3's qv form of it, and
SDPA on the same math; --batches, --lengths from 4k, --layouts, --quick and
--list apply).
``--fused-combine`` adds ``lazytriton_fused``: the ``lazytriton`` call with the
combine fused into the split kernel (``flash_decode.dispatch.fusing_combine``'s
switch, set around each call: one launch where the call has several splits),
timed right after ``lazytriton`` and ``sdpa`` on the same inputs; a table then
gives both lazytriton times, the fused call's speedup over the two kernels and
each one's over SDPA (the goal: at least 1.0x SDPA on every row).
``--python-lookup`` adds ``lazytriton_pylookup``: the ``lazytriton`` call with its warm path's entry lookup
in Python (``hot.make(front=False)``: the C++ tail kept where it is built), timed after ``lazytriton`` and
``sdpa`` on the same inputs; lines then give the C++ lookup's speedup (lazytriton over lazytriton_pylookup;
the swap of the warm function around each pylookup call adds ~0.1 µs to its time).
``--packed-new`` adds the decoding step with its new key (``lazytriton_append``)
beside the same step with FlashAttention-3's ``cu_seqlens_k_new`` (the new
keys packed, one a sequence) written into ``out=`` (``lazytriton_packed_new``).

``--layers N`` gives each provider N sets of inputs (q, caches, tables: a
model's N layers) and each timed call reads the next set, as a decoding step
reads each layer's cache once: by default (1) every call reads the cache the
call before it read, and a cache smaller than the GPU's L2 (the H100's 50 MB:
batch 8 at 1k keys is 33.5 MB) is then read partly from L2, not from memory.
``--layers auto`` takes, per case, the fewest sets whose caches together are
at least twice the L2 (1 from a cache that size on). Rows then go to
``results/decode_layers.csv`` (``--csv`` otherwise), with a ``layers`` column.

Each provider's first output is checked against a float32 reference of
batch element 0 (max error at most 2e-2): ``ok``, or ``wrong`` (timed,
marked ``*``), or ``failed`` (did not run). Rows go to a long-format CSV
(``benchmarks/results/decode.csv``); the table comes last; with ``$OUT`` set
the report is also written to ``$OUT/bench_decode.log``.

Usage: python benchmarks/bench_decode.py [--csv PATH] [--batches 1,8,32,64] [--lengths 1k,4k,16k,32k]
       [--layouts contiguous,paged] [--page-size 256[,1,16]] [--head-dims 128] [--heads 32/8] [--warmup N]
       [--reps N] [--rotary interleaved|halves] [--sinks] [--leftpad] [--kv-dtype e4m3|e5m2] [--mla] [--packed-new]
       [--fused-combine] [--python-lookup] [--layers N|auto]
       python benchmarks/bench_decode.py --list     (the cases; no GPU needed)
       python benchmarks/bench_decode.py --quick    (tiny cases on CPU, pages of 16 and 3 keys: the interpreter, CI)
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from csvlog import append_rows, memory_peak_gb_s, run_meta

import lazytriton
from lazytriton.cli.timing import median_ms
from lazytriton.kvcache import trusted_indices

FIELDS = ["kernel", "provider", "layout", "dtype", "head_dim", "batch", "heads_q", "heads_k", "cache_len",
          "page_size", "p50_ms", "gb_s", "bw_frac", "max_err", "check", "gpu", "torch", "triton", "lazytriton",
          "timestamp"]
PROVIDERS = ("lazytriton", "sdpa", "sdpa_gather")
# With --rotary: a decoding step with its new key, without and with rotary.
ROTARY_PROVIDERS = ("lazytriton_append", "lazytriton_rotary")
ROTARY_GOAL = 1.10  # rotary's time over the same step without it
LEFTPAD_GOAL = 1.10  # cache_leftpad's time a key read over the same call's without it
SINKS = "lazytriton_sinks"  # --sinks: lazytriton's call with attention sinks
LEFTPAD = "lazytriton_leftpad"  # --leftpad: lazytriton's call with cache_leftpad (each sequence's first keys padding)
MAX_LEFTPAD = 64  # --leftpad's pads: 1 to 63 keys a sequence, none a multiple of a key tile's size
FP8 = "lazytriton_fp8"  # --kv-dtype: lazytriton's call on a float8 copy of the cache
PACKED = "lazytriton_packed_new"  # --packed-new: the step's new keys packed by cu_seqlens_k_new, written into out=
COLD = "lazytriton_cold"  # --cold-path: lazytriton's call without its warm path (every call checked and planned)
FUSED = "lazytriton_fused"  # --fused-combine: lazytriton's call with the combine fused into the split kernel
PYLOOKUP = "lazytriton_pylookup"  # --python-lookup: lazytriton's call with its warm path's entry lookup in Python
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_GOAL = 1.8  # the float8 cache's speedup over the bf16 cache at batch <= 32 from 4k keys
TOLERANCE = 2e-2


class Case(NamedTuple):
    layout: str  # "contiguous" or "paged"
    batch: int
    cache_len: int
    page_size: int = 256
    heads_q: int = 32
    heads_k: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16

    @property
    def bytes(self) -> int:
        """K and V read, q read and out written."""
        return self.bytes_at(torch.finfo(self.dtype).bits // 8)

    def bytes_at(self, kv_size: int) -> int:
        """The bytes with K and V of ``kv_size`` bytes an element (1: a float8 cache), q and out in the dtype."""
        size = torch.finfo(self.dtype).bits // 8
        return self.batch * self.head_dim * (2 * self.cache_len * self.heads_k * kv_size + 2 * self.heads_q * size)

    @property
    def label(self) -> str:
        length = f"{self.cache_len // 1024}k" if self.cache_len % 1024 == 0 else str(self.cache_len)
        shape = "" if (self.head_dim, self.heads_q, self.heads_k) == (128, 32, 8) else \
            f" d{self.head_dim} {self.heads_q}/{self.heads_k}"
        page = f" p{self.page_size}" if self.layout == "paged" and self.page_size != 256 else ""
        return f"{self.layout:<10} b{self.batch:<3} {length:>4}{shape}{page}"


class Result(NamedTuple):
    case: Case
    provider: str
    ms: float | None
    max_err: float | None
    check: str  # ok, wrong, failed
    note: str = ""

    @property
    def gb_s(self) -> float | None:
        if self.ms is None:
            return None
        return (self.case.bytes_at(1) if self.provider == FP8 else self.case.bytes) / self.ms / 1e6


def cases(batches: Sequence[int], lengths: Sequence[int], layouts: Sequence[str], page_sizes: Sequence[int],
          head_dims: Sequence[int] = (128,), heads: Sequence[tuple[int, int]] = ((32, 8),)) -> list[Case]:
    """The grid: a paged case per page size, one contiguous case (its page size unused: the first)."""
    return [Case(layout, b, n, page, hq, hk, d) for d in head_dims for hq, hk in heads for layout in layouts
            for page in (page_sizes if layout == "paged" else page_sizes[:1]) for n in lengths for b in batches]


# A contiguous case, a paged one and a paged one no key tile divides (pages of 3 keys: the gathered kernel).
QUICK_CASES = [Case(layout, 2, 48, page, 4, 2, 32)
               for layout, page in (("contiguous", 16), ("paged", 16), ("paged", 3))]


# ---------------------------------------------------------------------------
# Arguments


def _ints(flag: str, low: int) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            values = []
        if not values or min(values) < low:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected comma-separated integers >= {low} (4k = 4096)")
        return values

    return parse


def _layouts(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values or not set(values) <= {"contiguous", "paged"}:
        raise argparse.ArgumentTypeError(f"--layouts {text!r}: expected a subset of contiguous,paged")
    return values


def _heads(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        q, _, k = item.partition("/")
        if not (q.isdigit() and k.isdigit() and int(k) > 0 and int(q) % int(k) == 0):
            raise argparse.ArgumentTypeError(f"--heads {text!r}: expected pairs like 32/8 (query heads a multiple "
                                             "of key/value heads)")
        pairs.append((int(q), int(k)))
    if not pairs:
        raise argparse.ArgumentTypeError(f"--heads {text!r}: expected pairs like 32/8")
    return pairs


def _layers(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--layers takes a count of at least 1 or auto, not {text!r}")
    return value


def layer_count(case: Case, layers: int | str, l2_bytes: int) -> int:
    """How many sets of inputs a case's calls cycle through: ``layers``, or for ``auto`` the fewest whose bytes read
    (``Case.bytes``: K and V, q and out) are together at least twice ``l2_bytes``."""
    if layers != "auto":
        return int(layers)
    return max(1, math.ceil(2 * l2_bytes / case.bytes))


def cycling(fns: Sequence[Callable[[], torch.Tensor]]) -> Callable[[], torch.Tensor]:
    """One call of the next of ``fns`` a call, in turn, starting at the first."""
    if len(fns) == 1:
        return fns[0]
    turn = [-1]

    def run() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(fns)
        return fns[turn[0]]()

    return run


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=None,
                        help="the CSV rows are appended to (default results/decode.csv; with --layers other than 1: "
                             "results/decode_layers.csv)")
    parser.add_argument("--batches", type=_ints("--batches", 1), default=[1, 8, 32, 64])
    parser.add_argument("--lengths", type=_ints("--lengths", 16), default=[1024, 4096, 16384, 32768])
    parser.add_argument("--layouts", type=_layouts, default=["contiguous", "paged"])
    parser.add_argument("--page-size", type=_ints("--page-size", 1), default=[256],
                        help="keys per page of the paged cache, comma-separated (default 256; 1,16: SGLang's "
                             "pages of 1 key, gathered, beside pages of 16)")
    parser.add_argument("--head-dims", type=_ints("--head-dims", 1), default=[128],
                        help="head dims, default 128 (64,128: the grid lazytriton tune --kernel flash_decode covers)")
    parser.add_argument("--heads", type=_heads, default=[(32, 8)], help="query/key-value heads, default 32/8")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    parser.add_argument("--rotary", choices=("interleaved", "halves"), default=None,
                        help="also time the decoding step with its new key without and with rotary_cos/rotary_sin "
                             "(rotary_interleaved=True: interleaved; False: halves), and their ratio")
    parser.add_argument("--sinks", action="store_true",
                        help="also time lazytriton's call with attention sinks (provider lazytriton_sinks)")
    parser.add_argument("--leftpad", action="store_true",
                        help="also time lazytriton's call with cache_leftpad (provider lazytriton_leftpad)")
    parser.add_argument("--kv-dtype", choices=tuple(FP8_DTYPES), default=None,
                        help="also time lazytriton's call on a float8 copy of the cache (provider lazytriton_fp8, "
                             "with k_descale/v_descale per key/value head) and its speedup over the bf16 cache")
    parser.add_argument("--mla", action="store_true",
                        help="DeepSeek MLA's decode instead: the 576/512 latent cache, its qv form and SDPA "
                             "(bench_decode_mla.py)")
    parser.add_argument("--packed-new", action="store_true",
                        help="also time the decoding step with its new key (lazytriton_append) beside the same step "
                             "with the new keys packed by cu_seqlens_k_new and the output written into out= "
                             "(lazytriton_packed_new)")
    parser.add_argument("--cold-path", action="store_true",
                        help="also time lazytriton's call without its warm path (provider lazytriton_cold: every "
                             "call checked and planned) and the warm path's speedup over it")
    parser.add_argument("--fused-combine", action="store_true",
                        help="also time lazytriton's call with the combine fused into the split kernel (provider "
                             "lazytriton_fused) and its speedup over the two kernels and over SDPA")
    parser.add_argument("--python-lookup", action="store_true",
                        help="also time lazytriton's call with its warm path's entry lookup in Python (provider "
                             "lazytriton_pylookup) and the C++ lookup's speedup over it")
    parser.add_argument("--layers", type=_layers, default=1,
                        help="sets of inputs (a model's layers) each provider's timed calls read in turn (default "
                             "1: every call the same cache; auto: caches together at least twice the L2)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny cases on CPU (Triton's interpreter), contiguous and paged (pages of 16 and 3 "
                             "keys): checks the script end to end")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        parser.error(f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}")
    if args.mla and args.layers != 1:
        parser.error("--layers applies to the GQA grid, not --mla")
    if args.csv is None:
        args.csv = Path(__file__).with_name("results") / ("decode.csv" if args.layers == 1 else "decode_layers.csv")
    return args


# ---------------------------------------------------------------------------
# Inputs, providers, checking


class Inputs(NamedTuple):
    q: torch.Tensor  # (batch, 1, heads_q, head_dim)
    k_cache: torch.Tensor  # contiguous (batch, len, heads_k, d), or paged (blocks, page, heads_k, d)
    v_cache: torch.Tensor
    lens: torch.Tensor  # int32 (batch,)
    table: torch.Tensor | None  # int32 (batch, len / page), a random permutation of the blocks
    k_sdpa: torch.Tensor  # (batch, heads_k, len, d): the same keys in SDPA's layout
    v_sdpa: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor, bool] | None = None  # cos, sin (len, head_dim / 2), interleaved
    sinks: torch.Tensor | None = None  # float32 (heads_q,): the attention sinks of lazytriton_sinks
    leftpad: torch.Tensor | None = None  # int32 (batch,): lazytriton_leftpad's cache_leftpad, 1 to MAX_LEFTPAD - 1
    fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # k8, v8, k_descale, v_descale


def float8_copy(cache: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache / descale as ``fmt``, descale (heads_k,) float32): each head's amax at the format's largest value."""
    largest = torch.finfo(fmt).max
    descale = (cache.float().abs().amax(dim=(0, 1, 3)) / largest).clamp_min(1e-12)
    return (cache.float() / descale[:, None]).clamp(-largest, largest).to(fmt), descale


def make_inputs(case: Case, device: torch.device, seed: int, rotary: str | None = None,
                kv_dtype: str | None = None) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    b, n, hk, d = case.batch, case.cache_len, case.heads_k, case.head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(case.dtype)

    q = randn(b, 1, case.heads_q, d)
    lens = torch.full((b,), n, dtype=torch.int32, device=device)
    if case.layout == "paged":
        pages = -(-n // case.page_size)
        k_cache, v_cache = randn(b * pages, case.page_size, hk, d), randn(b * pages, case.page_size, hk, d)
        table = torch.randperm(b * pages, generator=gen, device=device).reshape(b, pages).to(torch.int32)
        k_sdpa, v_sdpa = gather(k_cache, table, n).contiguous(), gather(v_cache, table, n).contiguous()
    else:
        k_cache, v_cache = randn(b, n, hk, d), randn(b, n, hk, d)
        table = None
        k_sdpa, v_sdpa = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
    tables = None
    if rotary is not None:
        angles = torch.rand(n, d // 2, generator=gen, device=device) * 2 * math.pi
        tables = (angles.cos().to(case.dtype), angles.sin().to(case.dtype), rotary == "interleaved")
    sinks = torch.randn(case.heads_q, generator=gen, device=device)
    leftpad = torch.randint(1, MAX_LEFTPAD, (b,), generator=gen, device=device, dtype=torch.int32)
    leftpad = torch.minimum(leftpad, lens // 2)  # half the keys left at least (the tiny --quick caches)
    fp8 = None
    if kv_dtype is not None:
        (k8, kd), (v8, vd) = float8_copy(k_cache, FP8_DTYPES[kv_dtype]), float8_copy(v_cache, FP8_DTYPES[kv_dtype])
        fp8 = (k8, v8, kd, vd)
    return Inputs(q, k_cache, v_cache, lens, table, k_sdpa, v_sdpa, tables, sinks, leftpad, fp8)


def gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Each sequence's blocks, in order, as SDPA's (batch, heads_k, length, head_dim)."""
    blocks = cache[table.long()]  # (batch, pages, page, heads_k, d)
    b, pages, page, hk, d = blocks.shape
    return blocks.reshape(b, pages * page, hk, d)[:, :length].transpose(1, 2)


def lazytriton_call(t: Inputs) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(t.q, t.k_cache, t.v_cache, cache_seqlens=t.lens,
                                                     block_table=t.table)  # type: ignore[no-any-return]

    return run


def step_call(t: Inputs, rotary: bool) -> Callable[[], torch.Tensor]:
    """The decoding step with its new key: the last cached key and value appended again at length - 1 (so the
    cache is what it was), with or without rotary (the new key then rotated: every call writes the same)."""
    k_new = t.k_sdpa[:, :, -1:].transpose(1, 2).contiguous()  # (batch, 1, heads_k, d)
    v_new = t.v_sdpa[:, :, -1:].transpose(1, 2).contiguous()
    lens = t.lens - 1
    cos, sin, interleaved = t.rotary if rotary and t.rotary is not None else (None, None, True)

    def run() -> torch.Tensor:
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(  # type: ignore[no-any-return]
                t.q, t.k_cache, t.v_cache, k_new, v_new, cache_seqlens=lens, block_table=t.table, rotary_cos=cos,
                rotary_sin=sin, rotary_interleaved=interleaved)

    return run


def packed_step_call(t: Inputs) -> Callable[[], torch.Tensor]:
    """``step_call``'s step (no rotary) with FlashAttention-3's cu_seqlens_k_new (one new key a sequence, packed
    (batch, heads_k, d)) and the output written into a buffer of the caller's (out=)."""
    k_new = t.k_sdpa[:, :, -1].contiguous()  # (batch, heads_k, d)
    v_new = t.v_sdpa[:, :, -1].contiguous()
    lens = t.lens - 1
    cu = torch.arange(t.q.shape[0] + 1, dtype=torch.int32, device=t.q.device)
    out = torch.empty_like(t.q)

    def run() -> torch.Tensor:
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(  # type: ignore[no-any-return]
                t.q, t.k_cache, t.v_cache, k_new, v_new, cache_seqlens=lens, block_table=t.table,
                cu_seqlens_k_new=cu, out=out)

    return run


def lazytriton_sinks_call(t: Inputs) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(t.q, t.k_cache, t.v_cache, cache_seqlens=t.lens,
                                                     block_table=t.table, sinks=t.sinks)  # type: ignore[no-any-return]

    return run


def lazytriton_leftpad_call(t: Inputs) -> Callable[[], torch.Tensor]:
    """The lazytriton call with cache_leftpad: each sequence's keys from its pad to its length."""
    def run() -> torch.Tensor:
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(  # type: ignore[no-any-return]
                t.q, t.k_cache, t.v_cache, cache_seqlens=t.lens, block_table=t.table, cache_leftpad=t.leftpad)

    return run


def lazytriton_fp8_call(t: Inputs) -> Callable[[], torch.Tensor]:
    assert t.fp8 is not None
    k8, v8, kd, vd = t.fp8

    def run() -> torch.Tensor:
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(t.q, k8, v8, cache_seqlens=t.lens, block_table=t.table,
                                                     k_descale=kd, v_descale=vd)  # type: ignore[no-any-return]

    return run


def lazytriton_cold_call(t: Inputs) -> Callable[[], torch.Tensor]:
    """The ``lazytriton`` provider's call with the warm path's table bypassed: each call checked and planned."""
    from lazytriton.kernels.flash_decode import hot as decode_hot

    call = lazytriton_call(t)
    serve = decode_hot.serve

    def run() -> torch.Tensor:
        decode_hot.serve = lambda *args: None  # the warm path declines: today's path serves
        try:
            return call()
        finally:
            decode_hot.serve = serve

    return run


def lazytriton_pylookup_call(t: Inputs) -> Callable[[], torch.Tensor]:
    """The ``lazytriton`` provider's call with its warm path's entry lookup in Python (the C++ tail kept)."""
    from lazytriton.kernels.flash_decode import hot as decode_hot

    call = lazytriton_call(t)
    serve, python_lookup = decode_hot.serve, decode_hot.make(front=False)

    def run() -> torch.Tensor:
        decode_hot.serve = python_lookup
        try:
            return call()
        finally:
            decode_hot.serve = serve

    return run


def lazytriton_fused_call(t: Inputs) -> Callable[[], torch.Tensor]:
    """The ``lazytriton`` provider's call with the combine fused into the split kernel (its own warm entry)."""
    from lazytriton.kernels.flash_decode import dispatch as decode_dispatch

    call = lazytriton_call(t)

    def run() -> torch.Tensor:
        # fusing_combine's switch, set without its context manager (whose ~1 µs the timing would count)
        saved, decode_dispatch.FUSED_COMBINE_BY_DEFAULT = decode_dispatch.FUSED_COMBINE_BY_DEFAULT, True
        try:
            return call()
        finally:
            decode_dispatch.FUSED_COMBINE_BY_DEFAULT = saved

    return run


def sdpa_call(t: Inputs) -> Callable[[], torch.Tensor]:
    q = t.q.transpose(1, 2)
    return lambda: F.scaled_dot_product_attention(q, t.k_sdpa, t.v_sdpa, enable_gqa=True).transpose(1, 2)


def sdpa_gather_call(t: Inputs) -> Callable[[], torch.Tensor]:
    q, length = t.q.transpose(1, 2), t.k_sdpa.shape[2]

    def run() -> torch.Tensor:
        k, v = gather(t.k_cache, t.table, length), gather(t.v_cache, t.table, length)  # type: ignore[arg-type]
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)

    return run


FACTORIES: dict[str, Callable[[Inputs], Callable[[], torch.Tensor]]] = {
    "lazytriton": lazytriton_call, "sdpa": sdpa_call, "sdpa_gather": sdpa_gather_call,
    "lazytriton_append": lambda t: step_call(t, False), "lazytriton_rotary": lambda t: step_call(t, True),
    SINKS: lazytriton_sinks_call, LEFTPAD: lazytriton_leftpad_call, FP8: lazytriton_fp8_call,
    PACKED: packed_step_call, COLD: lazytriton_cold_call,
    FUSED: lazytriton_fused_call, PYLOOKUP: lazytriton_pylookup_call}


def providers(case: Case, rotary: bool = False, sinks: bool = False, fp8: bool = False,
              packed: bool = False, cold: bool = False, fused: bool = False, python_lookup: bool = False,
              leftpad: bool = False) -> list[str]:
    return [p for p in PROVIDERS if p != "sdpa_gather" or case.layout == "paged"] + ([FUSED] if fused else []) + \
        ([PYLOOKUP] if python_lookup else []) + \
        (list(ROTARY_PROVIDERS) if rotary else []) + ([SINKS] if sinks else []) + ([LEFTPAD] if leftpad else []) + \
        ([FP8] if fp8 else []) + \
        ((["lazytriton_append"] if not rotary else []) + [PACKED] if packed else []) + ([COLD] if cold else [])


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (..., d) rotated at one position (cos, sin: (d / 2,)), FlashAttention's rule, in float32."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference(t: Inputs, provider: str = "lazytriton") -> torch.Tensor:
    """Batch element 0's output in float32, from the SDPA-layout keys: (1, heads_q, head_dim).

    ``lazytriton_rotary``: q and the new (last) key rotated at position length - 1, in the inputs' dtype;
    ``lazytriton_sinks``: with t's sinks (one more column of the softmax, dropped after it);
    ``lazytriton_leftpad``: the keys from batch element 0's pad on;
    ``lazytriton_fp8``: from the float8 cache, dequantised.
    """
    q = t.q[0, 0].float()  # (heads_q, d)
    group = q.shape[0] // t.k_sdpa.shape[1]
    keys = t.k_sdpa[0].float()  # (heads_k, len, d)
    values = t.v_sdpa[0].float()
    if provider == FP8 and t.fp8 is not None:
        k8, v8, kd, vd = t.fp8
        length = keys.shape[1]
        if t.table is None:
            keys, values = k8[0].transpose(0, 1).float(), v8[0].transpose(0, 1).float()
        else:
            keys, values = gather(k8, t.table[:1], length)[0].float(), gather(v8, t.table[:1], length)[0].float()
        keys, values = keys * kd[:, None, None], values * vd[:, None, None]
    if provider == "lazytriton_rotary" and t.rotary is not None:
        cos, sin, interleaved = (t.rotary[0][-1].float(), t.rotary[1][-1].float(), t.rotary[2])
        q = rotated(q, cos, sin, interleaved).to(t.q.dtype).float()
        keys = keys.clone()
        keys[:, -1] = rotated(keys[:, -1], cos, sin, interleaved).to(t.q.dtype).float()
    if provider == LEFTPAD and t.leftpad is not None:
        pad = int(t.leftpad[0])
        keys, values = keys[:, pad:], values[:, pad:]
    k = keys.repeat_interleave(group, 0)  # (heads_q, len, d)
    v = values.repeat_interleave(group, 0)
    scores = torch.einsum("hd,hnd->hn", q, k) / math.sqrt(q.shape[-1])
    if provider == SINKS and t.sinks is not None:
        return torch.einsum("hn,hnd->hd", torch.cat([scores, t.sinks[:, None]], -1).softmax(-1)[:, :-1], v)[None]
    return torch.einsum("hn,hnd->hd", scores.softmax(-1), v)[None]




def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def measure(case: Case, provider: str, sets: Sequence[Inputs], ref: torch.Tensor, device: torch.device,
            args: argparse.Namespace) -> Result:
    """Check the first output (of the first set, ``ref``'s), then time calls cycling through the sets; any exception
    makes a ``failed`` result."""
    try:
        fn = cycling([FACTORIES[provider](t) for t in sets])
        err = float((fn()[0].float() - ref).abs().max())
        ms = median_ms(fn, device.type == "cuda", args.warmup, args.reps)
        return Result(case, provider, ms, err, "ok" if err <= TOLERANCE else "wrong")
    except Exception as exc:  # a backend missing on this GPU, or a kernel that fails, is reported, not fatal
        return Result(case, provider, None, None, "failed", _brief(exc))


# ---------------------------------------------------------------------------
# Output


class Log:
    """Prints the report as it goes; with ``$OUT`` set, also writes it line by line to ``$OUT/bench_decode.log``."""

    def __init__(self, out: str | None = None) -> None:
        self.lines: list[str] = []
        self.path = Path(out) / "bench_decode.log" if out else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        if self.path is not None:  # kept as it goes: a run killed at its time limit leaves what it measured
            with self.path.open("a") as f:
                f.write(line + "\n")


def csv_row(r: Result, meta: dict[str, str], peak: float | None) -> dict[str, object]:
    c = r.case
    return {**meta, "provider": r.provider, "layout": c.layout, "dtype": str(c.dtype).split(".")[-1],
            "head_dim": c.head_dim, "batch": c.batch, "heads_q": c.heads_q, "heads_k": c.heads_k,
            "cache_len": c.cache_len, "page_size": c.page_size if c.layout == "paged" else "",
            "p50_ms": "" if r.ms is None else round(r.ms, 5), "gb_s": "" if r.gb_s is None else round(r.gb_s, 1),
            "bw_frac": "" if r.gb_s is None or peak is None else round(r.gb_s / peak, 3),
            "max_err": "" if r.max_err is None else f"{r.max_err:.1e}", "check": r.check}


def _cell(r: Result | None) -> str:
    if r is None:
        return "-"
    if r.gb_s is None:
        return "failed"
    return f"{r.gb_s:.0f}{'' if r.check == 'ok' else '*'}"


def _speedup(lt: Result | None, other: Result | None) -> float:
    """How many times faster lazytriton ran than a peer (both ran and passed the check)."""
    if lt is None or other is None or not lt.check == other.check == "ok" or not lt.ms or not other.ms:
        return math.nan
    return other.ms / lt.ms


def print_table(results: Sequence[Result], peak: float | None, log: Log) -> None:
    """Per case: GB/s of each provider, lazytriton's share of the peak, and its speedup over each peer."""
    by = {(r.case, r.provider): r for r in results}
    shown = "unknown" if peak is None else f"{peak:.0f}"
    log(f"\nGB/s (peak {shown})".ljust(28) + "".join(f"{p:>12}" for p in PROVIDERS) + f"{'lt % peak':>10}"
        + f"{'x sdpa':>8}{'x gather':>9}")
    speedups: dict[str, list[float]] = {"sdpa": [], "sdpa_gather": []}
    for case in dict.fromkeys(r.case for r in results):
        lt = by.get((case, "lazytriton"))
        frac = (f"{100 * lt.gb_s / peak:>9.0f}%" if lt is not None and lt.gb_s is not None and peak
                else f"{'-':>10}")
        row = []
        for peer in speedups:
            x = _speedup(lt, by.get((case, peer)))
            if not math.isnan(x):
                speedups[peer].append(x)
            row.append(f"{x:>8.2f}" if not math.isnan(x) else f"{'-':>8}")
        log(f"{case.label:<27}" + "".join(f"{_cell(by.get((case, p))):>12}" for p in PROVIDERS) + frac
            + row[0] + " " + row[1])
    for name, fn in (("geomean", _geomean), ("min", min)):
        cells = [f"{fn(xs):>8.2f}" if xs else f"{'-':>8}" for xs in speedups.values()]
        log(name.ljust(27) + " " * (12 * len(PROVIDERS) + 10) + cells[0] + " " + cells[1])
    sunk = []  # time with sinks over time without, per case where both ran
    for case in dict.fromkeys(r.case for r in results):
        with_sinks, plain = by.get((case, SINKS)), by.get((case, "lazytriton"))
        if with_sinks is not None and plain is not None and with_sinks.ms and plain.ms:
            sunk.append(with_sinks.ms / plain.ms)
    if sunk:
        log(f"with sinks / without (time of the same call): geomean {_geomean(sunk):.3f}, highest {max(sunk):.3f} "
            f"over {len(sunk)} cases")
    padded = []  # time a key read with cache_leftpad over time a key read without, per case where both ran
    for case in dict.fromkeys(r.case for r in results):
        with_pad, plain = by.get((case, LEFTPAD)), by.get((case, "lazytriton"))
        if with_pad is not None and plain is not None and with_pad.ms and plain.ms:
            read = case.cache_len - (MAX_LEFTPAD / 2)  # the pads' mean: 1 to MAX_LEFTPAD - 1 keys fewer
            padded.append((with_pad.ms / read) / (plain.ms / case.cache_len))
    if padded:
        log(f"with cache_leftpad / without (time a key read): geomean {_geomean(padded):.3f}, highest "
            f"{max(padded):.3f} over {len(padded)} cases (the goal: within {LEFTPAD_GOAL:.2f})")
    bad = [r for r in results if r.check != "ok"]
    for r in bad:
        log(f"  {r.provider} {r.check} on {' '.join(r.case.label.split())}: {r.note or f'max error {r.max_err:.1e}'}")




def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def print_fp8(results: Sequence[Result], log: Log) -> None:
    """Per case: the bf16 and float8 caches' time and GB/s, and the speedup; the goal rows' geomean and min."""
    by = {(r.case, r.provider): r for r in results}
    log("\nfloat8 cache".ljust(28) + f"{'bf16 ms':>10}{'fp8 ms':>10}{'bf16 GB/s':>11}{'fp8 GB/s':>10}{'x bf16':>8}")
    goal_rows = []
    for case in dict.fromkeys(r.case for r in results):
        plain, fp8 = by.get((case, "lazytriton")), by.get((case, FP8))
        if plain is None or fp8 is None:
            continue
        x = _speedup(fp8, plain)
        if not math.isnan(x) and case.batch <= 32 and case.cache_len >= 4096:
            goal_rows.append(x)
        cells = "".join(f"{r.ms:>10.4f}" if r.ms is not None else f"{'failed':>10}" for r in (plain, fp8))
        rates = f"{_cell(plain):>11}{_cell(fp8):>10}"
        log(f"{case.label:<27}{cells}{rates}" + (f"{x:>8.2f}" if not math.isnan(x) else f"{'-':>8}"))
    if goal_rows:
        log(f"batch <= 32 from 4k keys: geomean {_geomean(goal_rows):.2f}, min {min(goal_rows):.2f} over "
            f"{len(goal_rows)} cases ({'at least' if min(goal_rows) >= FP8_GOAL else 'under'} {FP8_GOAL:.1f})")


def print_cold(results: Sequence[Result], log: Log) -> None:
    """The warm path's speedup: lazytriton's time over lazytriton_cold's, per case, its geomean, min and max."""
    by = {(r.case, r.provider): r for r in results}
    gains = [_speedup(by[case, "lazytriton"], by[case, COLD]) for case in dict.fromkeys(r.case for r in results)
             if (case, "lazytriton") in by and (case, COLD) in by]
    gains = [x for x in gains if not math.isnan(x)]
    if gains:
        log(f"warm path: lazytriton over lazytriton_cold, geomean {_geomean(gains):.2f}x, min {min(gains):.2f}x, "
            f"max {max(gains):.2f}x over {len(gains)} cases")


def print_lookup(results: Sequence[Result], log: Log) -> None:
    """The C++ entry lookup's speedup: lazytriton's time over lazytriton_pylookup's, per case and their geomean."""
    by = {(r.case, r.provider): r for r in results}
    cases = dict.fromkeys(r.case for r in results)
    gains = {case: _speedup(by[case, "lazytriton"], by[case, PYLOOKUP]) for case in cases
             if (case, "lazytriton") in by and (case, PYLOOKUP) in by}
    for case, x in gains.items():
        log(f"C++ lookup: {case.label:<27} {x:.3f}x over the Python lookup")
    known = [x for x in gains.values() if not math.isnan(x)]
    if known:
        log(f"C++ lookup: lazytriton over lazytriton_pylookup, geomean {_geomean(known):.3f}x, min {min(known):.3f}x, "
            f"max {max(known):.3f}x over {len(known)} cases")


def print_fused(results: Sequence[Result], log: Log) -> None:
    """Per case: the two kernels' and the fused call's ms, fused over two, and each over SDPA; geomeans and mins."""
    by = {(r.case, r.provider): r for r in results}
    log("\nfused combine (ms)".ljust(28) + f"{'2 kernels':>10}{'fused':>10}{'sdpa':>10}{'x 2 krn':>9}{'2k x sdpa':>10}"
        f"{'fu x sdpa':>10}")
    columns: list[list[float]] = [[], [], []]
    for case in dict.fromkeys(r.case for r in results):
        plain, fused, sdpa = by.get((case, "lazytriton")), by.get((case, FUSED)), by.get((case, "sdpa"))
        if plain is None or fused is None:
            continue
        ratios = (_speedup(fused, plain), _speedup(plain, sdpa), _speedup(fused, sdpa))
        for column, x in zip(columns, ratios, strict=True):
            if not math.isnan(x):
                column.append(x)
        cells = "".join(f"{r.ms:>10.4f}" if r is not None and r.ms is not None else f"{'-':>10}"
                        for r in (plain, fused, sdpa))
        log(f"{case.label:<27}{cells}" + "".join(f"{x:>9.2f}" if not math.isnan(x) else f"{'-':>9}" for x in ratios))
    for name, fn in (("geomean", _geomean), ("min", min)):
        log(f"{name:<27}{'':>30}" + "".join(f"{fn(xs):>9.2f}" if xs else f"{'-':>9}" for xs in columns))


def print_rotary(results: Sequence[Result], log: Log) -> None:
    """Per case: the step's time without and with rotary, and their ratio; the geomean and max ratio."""
    by = {(r.case, r.provider): r for r in results}
    ratios = []
    log("\nrotary (ms)".ljust(28) + f"{'append':>10}{'rotary':>10}{'ratio':>8}")
    for case in dict.fromkeys(r.case for r in results):
        plain, rotary = by.get((case, "lazytriton_append")), by.get((case, "lazytriton_rotary"))
        if plain is None or rotary is None:
            continue
        ratio = rotary.ms / plain.ms if plain.ms and rotary.ms else math.nan
        if not math.isnan(ratio):
            ratios.append(ratio)
        cells = [f"{x.ms:>10.4f}" if x.ms is not None else f"{'failed':>10}" for x in (plain, rotary)]
        log(f"{case.label:<27}" + "".join(cells) + (f"{ratio:>8.3f}" if not math.isnan(ratio) else f"{'-':>8}"))
    if ratios:
        worst = max(ratios)
        log(f"{'geomean':<27}{'':>20}{_geomean(ratios):>8.3f}")
        log(f"{'max':<27}{'':>20}{worst:>8.3f}  ({'within' if worst <= ROTARY_GOAL else 'over'} "
            f"{ROTARY_GOAL:.2f})")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the grid; exit status 1 if a lazytriton row failed or failed its check, 2 without a GPU."""
    args = parse_args(argv)
    log = Log(os.environ.get("OUT"))
    if args.mla:
        import bench_decode_mla

        return bench_decode_mla.run(args, FIELDS, log)
    if args.quick:
        device, case_list = torch.device("cpu"), QUICK_CASES
        args.warmup, args.reps = 0, 1
    else:
        device, case_list = torch.device("cuda"), cases(args.batches, args.lengths, args.layouts, args.page_size,
                                                     args.head_dims, args.heads)
    if args.list:
        for case in case_list:
            print(f"{case.label}  {case.bytes / 1e9:.3f} GB per call")
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU (or --quick, --list)", file=sys.stderr)
        return 2
    meta = run_meta("flash_decode", device)
    peak = memory_peak_gb_s(meta["gpu"])
    log(f"bench_decode on {meta['gpu']}: torch {meta['torch']}, triton {meta['triton']}, "
        f"peak {'unknown' if peak is None else f'{peak:.0f} GB/s'}"
        f"{'' if args.layers == 1 else f'; each call reads the next of --layers {args.layers} sets of caches'}")
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    results: list[Result] = []
    counts: dict[Case, int] = {}
    for index, case in enumerate(case_list):
        counts[case] = layer_count(case, args.layers, l2_bytes)
        sets = [make_inputs(case, device, 1000 + index + 100_003 * layer, args.rotary, args.kv_dtype)
                for layer in range(counts[case])]
        for provider in providers(case, args.rotary is not None, args.sinks, args.kv_dtype is not None,
                                  args.packed_new, args.cold_path, args.fused_combine, args.python_lookup,
                                  args.leftpad):
            r = measure(case, provider, sets, reference(sets[0], provider), device, args)
            shown = f"{r.ms:.4f} ms {r.gb_s:.0f} GB/s err {r.max_err:.1e}" if r.ms is not None else ""
            layers = f" ({counts[case]} layers)" if args.layers != 1 else ""
            log(f"{case.label}  {provider:<11} {r.check:<6} {shown}{layers} {r.note}".rstrip())
            results.append(r)
        del sets
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.layers == 1:
        append_rows(args.csv, FIELDS, (csv_row(r, meta, peak) for r in results))
    else:
        append_rows(args.csv, [*FIELDS, "layers"], ({**csv_row(r, meta, peak), "layers": counts[r.case]}
                                                    for r in results))
    print_table(results, peak, log)
    if args.rotary is not None:
        print_rotary(results, log)
    if args.kv_dtype is not None:
        print_fp8(results, log)
    if args.cold_path:
        print_cold(results, log)
    if args.fused_combine:
        print_fused(results, log)
    if args.python_lookup:
        print_lookup(results, log)
    failed = [r for r in results if r.provider.startswith("lazytriton") and r.check != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
