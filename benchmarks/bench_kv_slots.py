"""Benchmark lazytriton's slot-addressed KV-cache write beside the same write in PyTorch, measured in the same run.

The write (vLLM's ``reshape_and_cache_flash``) reads each new token's key and
value once and writes them at their slots: bound by memory, so throughput is
reported in GB/s (key and value read, the same bytes written, the slots read,
over the median of CUDA-event-timed runs, interleaved with the other
providers') against the GPU's bandwidth (H200: 4.8 TB/s). At a decoding
step's few tokens it is bound by the launch instead: the time is the figure.

The grid: Llama-3-8B's cache (8 key/value heads of head dim 128, bf16, pages
of 16 slots) at 1, 32, 256 and 4096 tokens; 256 tokens on pages of one slot
(SGLang's token pool); gpt-oss's heads (8 of head dim 64) at 256 tokens. key
and value are views of a fused qkv projection (32 query heads), as vLLM hands
them over; the slots are distinct, in random order over a cache of 65536
slots, int64. Providers:

- ``lazytriton``: ``write_kvcache_slots(key, value, key_cache, value_cache,
  slot_mapping)``, the public call (one kernel);
- ``index_copy``: ``index_copy_`` of key and value over the caches' flattened
  slots (two kernels; no skipped slot, no host sync);
- ``indexing``: vLLM-style torch indexing, padding dropped first
  (``slots[slots >= 0]``: a boolean index, one host sync), then
  ``cache[slot // block_size, slot % block_size] = key``.

Each provider writes a fresh copy of the caches once before timing and is
checked bit for bit against ``kv_slots.reference.write_reference``: ``ok`` or
``wrong``. Rows go to a long-format CSV (``benchmarks/results/kv_slots.csv``);
with ``$OUT`` set the report is also written to ``$OUT/bench_kv_slots.log``.

Usage: python benchmarks/bench_kv_slots.py [--csv PATH] [--warmup N] [--reps N]
       python benchmarks/bench_kv_slots.py --list     (the cases; no GPU needed)
       python benchmarks/bench_kv_slots.py --quick    (two tiny cases on CPU: the interpreter, CI)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from csvlog import append_rows, memory_peak_gb_s, run_meta

import lazytriton
from lazytriton.cli.timing import interleaved_ms
from lazytriton.kernels.kv_slots.reference import write_reference

FIELDS = ["kernel", "provider", "case", "tokens", "heads_k", "head_dim", "block_size", "p50_ms", "gb_s", "bw_frac",
          "check", "gpu", "torch", "triton", "lazytriton", "timestamp"]
PROVIDERS = ("lazytriton", "index_copy", "indexing")
QUERY_HEADS = 32
CACHE_SLOTS = 65536


class Case(NamedTuple):
    name: str
    tokens: int
    heads_k: int
    head_dim: int
    block_size: int
    slots: int = CACHE_SLOTS

    @property
    def bytes(self) -> int:
        """key and value read and written (bf16), the int64 slots read."""
        return self.tokens * (self.heads_k * self.head_dim * 2 * 2 * 2 + 8)

    @property
    def label(self) -> str:
        return f"{self.name:<8} t{self.tokens:<5} h{self.heads_k:<2} d{self.head_dim:<4} page{self.block_size:<3}"


CASES = [*(Case("llama3", n, 8, 128, 16) for n in (1, 32, 256, 4096)), Case("pool", 256, 8, 128, 1),
         Case("gpt-oss", 256, 8, 64, 16)]
QUICK_CASES = [Case("llama3", 5, 2, 64, 16, 64), Case("pool", 7, 2, 32, 1, 32)]


def make_inputs(case: Case, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """key and value as views of a fused qkv projection, random caches, distinct int64 slots in random order."""
    gen = torch.Generator(device=device).manual_seed(seed)
    d, hk = case.head_dim, case.heads_k
    qkv = torch.randn(case.tokens, (QUERY_HEADS + 2 * hk) * d, generator=gen, device=device).bfloat16()
    key = qkv[:, QUERY_HEADS * d:(QUERY_HEADS + hk) * d].view(case.tokens, hk, d)
    value = qkv[:, (QUERY_HEADS + hk) * d:].view(case.tokens, hk, d)
    blocks = case.slots // case.block_size
    key_cache = torch.randn(blocks, case.block_size, hk, d, generator=gen, device=device).bfloat16()
    value_cache = torch.randn(blocks, case.block_size, hk, d, generator=gen, device=device).bfloat16()
    slots = torch.randperm(case.slots, generator=gen, device=device)[:case.tokens]
    return key, value, key_cache, value_cache, slots


def lazytriton_call(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slots: torch.Tensor) -> Callable[[], None]:
    return lambda: lazytriton.write_kvcache_slots(key, value, key_cache, value_cache, slots)


def index_copy_call(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slots: torch.Tensor) -> Callable[[], None]:
    flat_k, flat_v = key_cache.flatten(0, 1), value_cache.flatten(0, 1)  # views: the caches are contiguous

    def run() -> None:
        flat_k.index_copy_(0, slots, key)
        flat_v.index_copy_(0, slots, value)

    return run


def indexing_call(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  slots: torch.Tensor) -> Callable[[], None]:
    page = key_cache.shape[1]

    def run() -> None:
        keep = slots >= 0
        kept = slots[keep]
        blocks, rows = kept // page, kept % page
        key_cache[blocks, rows] = key[keep]
        value_cache[blocks, rows] = value[keep]

    return run


CALLS = (lazytriton_call, index_copy_call, indexing_call)


class Result(NamedTuple):
    case: Case
    provider: str
    ms: float
    check: str

    def gb_s(self) -> float:
        return self.case.bytes / (self.ms * 1e-3) / 1e9


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "kv_slots.csv")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    parser.add_argument("--quick", action="store_true", help="two tiny cases on CPU through Triton's interpreter")
    return parser.parse_args(argv)


def run_case(case: Case, device: torch.device, seed: int, warmup: int, reps: int) -> list[Result]:
    """Every provider on one case: checked once on fresh caches, then timed in turns on caches of their own."""
    key, value, key_cache, value_cache, slots = make_inputs(case, device, seed)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    write_reference(key, value, want_k, want_v, slots)
    checks, calls = [], []
    for make in CALLS:
        mine_k, mine_v = key_cache.clone(), value_cache.clone()
        make(key, value, mine_k, mine_v, slots)()
        checks.append("ok" if torch.equal(mine_k, want_k) and torch.equal(mine_v, want_v) else "wrong")
        calls.append(make(key, value, mine_k, mine_v, slots))
    times = interleaved_ms(calls, device.type == "cuda", warmup=warmup, reps=reps)
    return [Result(case, provider, ms, check) for provider, ms, check in zip(PROVIDERS, times, checks, strict=True)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the grid; exit status 1 if a lazytriton row failed its check, 2 without a GPU."""
    args = parse_args(argv)
    case_list = QUICK_CASES if args.quick else CASES
    if args.list:
        for case in case_list:
            print(f"{case.label}  {case.bytes / 1e6:.3f} MB per call")
        return 0
    device = torch.device("cpu" if args.quick else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_kv_slots needs a CUDA GPU (or --quick, --list)", file=sys.stderr)
        return 2
    warmup, reps = (0, 1) if args.quick else (args.warmup, args.reps)
    meta = run_meta("kv_slots", device)
    peak = memory_peak_gb_s(meta["gpu"])
    lines = [f"bench_kv_slots on {meta['gpu']}: torch {meta['torch']}, triton {meta['triton']}, "
             f"peak {'unknown' if peak is None else f'{peak:.0f} GB/s'}"]
    print(lines[0])
    results: list[Result] = []
    for index, case in enumerate(case_list):
        found = run_case(case, device, 100 + index, warmup, reps)
        line = f"{case.label} " + "  ".join(f"{r.provider} {r.ms:8.4f} ms {r.gb_s():6.0f} GB/s {r.check:<5}"
                                             for r in found)
        print(line)
        lines.append(line)
        results.extend(found)
    append_rows(args.csv, FIELDS, ({**meta, "provider": r.provider, "case": r.case.name, "tokens": r.case.tokens,
                                     "heads_k": r.case.heads_k, "head_dim": r.case.head_dim,
                                     "block_size": r.case.block_size, "p50_ms": f"{r.ms:.5f}",
                                     "gb_s": f"{r.gb_s():.1f}",
                                     "bw_frac": "" if peak is None else f"{r.gb_s() / peak:.3f}",
                                     "check": r.check} for r in results))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_kv_slots.log").write_text("\n".join(lines) + "\n")
    return 1 if any(r.provider == "lazytriton" and r.check != "ok" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
