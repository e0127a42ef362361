"""``bench_decode.py --mla``: DeepSeek MLA's decode (576/512 latent cache) beside SDPA on the same math.

MLA's serving call (FlashMLA's, vLLM's MLA backends): one latent cache (blocks, page, 1, 576) whose first 512
columns are v, q (batch, 1, heads, 576) = [q_nope | q_pe], DeepSeek-V3's scale 1/sqrt(192). Providers, each
timed over the median of CUDA-event-timed runs:

- ``lazytriton_mla``: ``flash_attn_with_kvcache(q, cache, cache[..., :512], cache_seqlens=, block_table=)``:
  the latent cache read in place (v a view), each key's 576 columns read once (the QV variant);
- ``lazytriton_qv``: FlashAttention-3's form of the same call, ``flash_attn_with_kvcache(q[..., 512:],
  cache[..., 512:], cache[..., :512], qv=q[..., :512], ...)``: the same kernel, plus the join of q and qv;
- ``sdpa``: ``F.scaled_dot_product_attention(q, K, K[..., :512], enable_gqa=True)`` with K the cache in SDPA's
  (batch, 1, len, 576) layout (a paged case's gathered once, outside the timing): the same math, whatever
  backend torch picks for head dims 576/512.

Bytes (GB/s) count the cache's 576 columns once per key, q read and out written (what the latent call must
move), for every provider alike; against the H200's 4.8 TB/s. Each provider's output for batch element 0 is
checked against a float32 reference (max error 2e-2). Rows go to bench_decode's CSV (head_dim ``576/512``,
heads_k 1), a table comes last. The grid: batch 1, 8, 32, 64; caches of 4k, 16k, 32k; 128 and 16 query heads
(DeepSeek-V3's 128 heads, split 8-ways by tensor parallelism: 16); pages of 64 keys, and a contiguous cache.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from csvlog import append_rows, memory_peak_gb_s, run_meta

import lazytriton
from lazytriton.cli.timing import median_ms
from lazytriton.kvcache import trusted_indices

LATENT, ROPE = 512, 64
DIM = LATENT + ROPE
SCALE = 192 ** -0.5  # DeepSeek-V3's qk head dim: 128 nope + 64 rope
PROVIDERS = ("lazytriton_mla", "lazytriton_qv", "sdpa")
TOLERANCE = 2e-2


class MlaCase(NamedTuple):
    layout: str  # "contiguous" or "paged"
    batch: int
    cache_len: int
    heads: int = 128
    page_size: int = 64
    latent: int = LATENT
    rope: int = ROPE
    dtype: torch.dtype = torch.bfloat16

    @property
    def dim(self) -> int:
        return self.latent + self.rope

    @property
    def bytes(self) -> int:
        """The cache's rows read once, q read, out written."""
        size = torch.finfo(self.dtype).bits // 8
        return self.batch * size * (self.cache_len * self.dim + self.heads * (self.dim + self.latent))

    @property
    def label(self) -> str:
        length = f"{self.cache_len // 1024}k" if self.cache_len % 1024 == 0 else str(self.cache_len)
        page = f" p{self.page_size}" if self.layout == "paged" else ""
        return f"mla {self.layout:<10} b{self.batch:<3} {length:>4} h{self.heads}{page}"


class MlaInputs(NamedTuple):
    q: torch.Tensor  # (batch, 1, heads, dim)
    cache: torch.Tensor  # (batch, len, 1, dim) or paged (blocks, page, 1, dim)
    lens: torch.Tensor
    table: torch.Tensor | None
    k_sdpa: torch.Tensor  # (batch, 1, len, dim)


def cases(batches: Sequence[int], lengths: Sequence[int], layouts: Sequence[str],
          heads: Sequence[int] = (128, 16)) -> list[MlaCase]:
    return [MlaCase(layout, b, n, h) for h in heads for layout in layouts for n in lengths for b in batches]


QUICK_CASES = [MlaCase("contiguous", 2, 48, 8, 16, 64, 32), MlaCase("paged", 2, 48, 8, 16, 64, 32)]


def make_inputs(case: MlaCase, device: torch.device, seed: int) -> MlaInputs:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(case.dtype)

    q = randn(case.batch, 1, case.heads, case.dim)
    lens = torch.full((case.batch,), case.cache_len, dtype=torch.int32, device=device)
    if case.layout == "paged":
        per_seq = -(-case.cache_len // case.page_size)
        cache = randn(case.batch * per_seq, case.page_size, 1, case.dim)
        table = torch.randperm(case.batch * per_seq, generator=gen, device=device).view(case.batch, per_seq)
        table = table.to(torch.int32)
        rows = cache[table.long()].flatten(1, 2)[:, :case.cache_len]  # (batch, len, 1, dim)
    else:
        cache, table = randn(case.batch, case.cache_len, 1, case.dim), None
        rows = cache
    return MlaInputs(q, cache, lens, table, rows.transpose(1, 2).contiguous())


def _mla(t: MlaInputs, latent: int) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(t.q, t.cache, t.cache[..., :latent], cache_seqlens=t.lens,
                                                      block_table=t.table, softmax_scale=SCALE)
    return run


def _qv(t: MlaInputs, latent: int) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(t.q[..., latent:], t.cache[..., latent:],
                                                      t.cache[..., :latent], qv=t.q[..., :latent],
                                                      cache_seqlens=t.lens, block_table=t.table, softmax_scale=SCALE)
    return run


def _sdpa(t: MlaInputs, latent: int) -> Callable[[], torch.Tensor]:
    q = t.q.transpose(1, 2)  # (batch, heads, 1, dim)

    def run() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, t.k_sdpa, t.k_sdpa[..., :latent], scale=SCALE, enable_gqa=True)
        return out.transpose(1, 2)
    return run


FACTORIES = {"lazytriton_mla": _mla, "lazytriton_qv": _qv, "sdpa": _sdpa}


def reference(t: MlaInputs, latent: int) -> torch.Tensor:
    """Batch element 0's output, float32: softmax(q . K x scale) . K[..., :latent]."""
    keys = t.k_sdpa[0, 0].float()  # (len, dim)
    scores = (t.q[0, 0].float() @ keys.T) * SCALE  # (heads, len)
    return (scores.softmax(-1) @ keys[:, :latent])[None]  # (1, heads, latent)


class MlaResult(NamedTuple):
    case: MlaCase
    provider: str
    ms: float | None
    max_err: float | None
    check: str
    note: str = ""

    @property
    def gb_s(self) -> float | None:
        return None if self.ms is None else self.case.bytes / self.ms / 1e6


def measure(case: MlaCase, provider: str, t: MlaInputs, device: torch.device, warmup: int, reps: int) -> MlaResult:
    try:
        fn = FACTORIES[provider](t, case.latent)
        err = float((fn()[0].float() - reference(t, case.latent)).abs().max())
        ms = median_ms(fn, device.type == "cuda", warmup, reps)
        return MlaResult(case, provider, ms, err, "ok" if err <= TOLERANCE else "wrong")
    except Exception as exc:  # a backend missing for these head dims is reported, not fatal
        text = str(exc).strip().splitlines()
        return MlaResult(case, provider, None, None, "failed", f"{type(exc).__name__}: {text[0][:200] if text else ''}")


def csv_row(r: MlaResult, meta: dict[str, str], peak: float | None) -> dict[str, object]:
    c = r.case
    return {**meta, "provider": r.provider, "layout": c.layout, "dtype": str(c.dtype).split(".")[-1],
            "head_dim": f"{c.dim}/{c.latent}", "batch": c.batch, "heads_q": c.heads, "heads_k": 1,
            "cache_len": c.cache_len, "page_size": c.page_size if c.layout == "paged" else "",
            "p50_ms": "" if r.ms is None else round(r.ms, 5), "gb_s": "" if r.gb_s is None else round(r.gb_s, 1),
            "bw_frac": "" if r.gb_s is None or peak is None else round(r.gb_s / peak, 3),
            "max_err": "" if r.max_err is None else f"{r.max_err:.1e}", "check": r.check}


def print_table(results: Sequence[MlaResult], peak: float | None, log: Callable[[str], None]) -> None:
    """Per case: each provider's GB/s (its fraction of the peak), and lazytriton_mla's speedup over SDPA."""
    log("")
    log(f"{'case':<34} " + " ".join(f"{p:>22}" for p in PROVIDERS) + "  mla/sdpa")
    by = {(r.case, r.provider): r for r in results}
    for case in dict.fromkeys(r.case for r in results):
        cells = []
        for provider in PROVIDERS:
            r = by.get((case, provider))
            share = "" if r is None or r.gb_s is None or peak is None else f" {r.gb_s / peak:.0%}"
            cells.append(f"{'-' if r is None or r.gb_s is None else f'{r.gb_s:.0f} GB/s{share}':>22}"
                         + ("*" if r is not None and r.check == "wrong" else ""))
        mla, sdpa = by.get((case, "lazytriton_mla")), by.get((case, "sdpa"))
        speedup = f"{sdpa.ms / mla.ms:.2f}x" if mla and sdpa and mla.ms and sdpa.ms else "-"
        log(f"{case.label:<34} " + " ".join(cells) + f"  {speedup:>8}")


def run(args: argparse.Namespace, csv_fields: Sequence[str], log: Callable[[str], None]) -> int:
    """The MLA grid (``args``: bench_decode's, with --mla); exit status 1 if a lazytriton row failed its check."""
    if args.quick:
        device, case_list = torch.device("cpu"), QUICK_CASES
        warmup, reps = 0, 1
    else:
        layouts = args.layouts
        lengths = [n for n in args.lengths if n >= 4096] or args.lengths
        device, case_list = torch.device("cuda"), cases(args.batches, lengths, layouts)
        warmup, reps = args.warmup, args.reps
    if args.list:
        for case in case_list:
            print(f"{case.label}  {case.bytes / 1e9:.3f} GB per call")
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_decode --mla needs a CUDA GPU (or --quick, --list)", file=sys.stderr)
        return 2
    meta = run_meta("flash_decode", device)
    peak = memory_peak_gb_s(meta["gpu"])
    log(f"bench_decode --mla on {meta['gpu']}: torch {meta['torch']}, triton {meta['triton']}, "
        f"peak {'unknown' if peak is None else f'{peak:.0f} GB/s'}")
    results = []
    for index, case in enumerate(case_list):
        t = make_inputs(case, device, 2000 + index)
        for provider in PROVIDERS:
            r = measure(case, provider, t, device, warmup, reps)
            shown = f"{r.ms:.4f} ms {r.gb_s:.0f} GB/s err {r.max_err:.1e}" if r.ms is not None else ""
            log(f"{case.label}  {provider:<15} {r.check:<6} {shown} {r.note}".rstrip())
            results.append(r)
        del t
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    append_rows(args.csv, csv_fields, (csv_row(r, meta, peak) for r in results))
    print_table(results, peak, log)
    failed = [r for r in results if r.provider.startswith("lazytriton") and r.check != "ok"]
    return 1 if failed else 0
