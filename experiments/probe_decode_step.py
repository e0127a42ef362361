"""One decoding step's attention of a left-padded batch, five ways, on the GPU: which path a model's step should take.

The layer of ``bench_transformers.py``'s random Llama (16 query and 4 key/value heads of head dim 128, bf16), one
query a sequence against a cache of ``--kv`` keys whose first keys are padding (a different pad a row):

- ``sdpa``: torch's SDPA with the boolean (batch, 1, 1, kv) mask, as transformers' "sdpa" runs it;
- ``bias``: lazytriton's SDPA drop-in with the mask as an additive bias (the integration's decoding step);
- ``kvcache``: ``flash_attn_with_kvcache`` on the cache in place (its (batch, heads, kv, d) tensors transposed, no
  copy) with ``cache_leftpad``: the decoding kernels, the GQA group packed into one tile;
- ``key_mask``: the same kernels with the boolean mask's (batch, kv) view as their key mask
  (``kvcache.with_key_mask``, KEY_MASK: no cache_leftpad, no value check, the warm path);
- ``step``: the integration's ``decoding_step`` (transformers' layer call: its route checks, then ``key_mask``).

Each is checked against a float32 reference first (FlashAttention's rule: at most 2x SDPA's own error plus 1e-3),
then timed: device µs a call (CUDA events over ``--calls`` calls, median of ``--reps`` rounds, the providers'
rounds interleaved) and host µs a call (the same loop's wall time). Prints a table; ``--csv`` appends rows.

Usage: python3 experiments/probe_decode_step.py [--batch 8] [--kv 64,576,4096] [--csv PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from csvlog import append_rows  # noqa: E402

import lazytriton  # noqa: E402
from lazytriton.integrations import transformers as lt_transformers  # noqa: E402
from lazytriton.kvcache import with_key_mask as masked  # noqa: E402

FIELDS = ("time", "device", "batch", "kv", "provider", "metric", "value")


def inputs(batch: int, kv: int, hq: int, hk: int, d: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(kv)
    q = torch.randn(batch, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(batch, hk, kv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    pads = torch.randint(0, max(1, kv // 2), (batch,), device="cuda", generator=g, dtype=torch.int32)
    pads[0] = 0
    mask = (torch.arange(kv, device="cuda")[None, :] >= pads[:, None])[:, None, None, :]
    return q, k, v, pads, mask


def providers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pads: torch.Tensor,
              mask: torch.Tensor) -> dict[str, object]:
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    kc, vc, qc = k.transpose(1, 2), v.transpose(1, 2), q.transpose(1, 2)  # (batch, seq, heads, d) views

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def with_bias() -> torch.Tensor:
        return lazytriton.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

    def kvcache() -> torch.Tensor:
        return lazytriton.flash_attn_with_kvcache(qc, kc, vc, cache_leftpad=pads).transpose(1, 2)

    keys = mask[:, 0, 0]

    def key_mask() -> torch.Tensor:
        return masked(qc, kc, vc, keys).transpose(1, 2)

    def step() -> torch.Tensor:
        return lt_transformers.decoding_step(q, k, v, mask, None, {})

    return {"sdpa": sdpa, "bias": with_bias, "kvcache": kvcache, "key_mask": key_mask, "step": step}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.float() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def time_rounds(calls: dict[str, object], n: int, reps: int) -> dict[str, tuple[float, float]]:
    device: dict[str, list[float]] = {name: [] for name in calls}
    host: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(n):
                fn()  # type: ignore[operator]
            end.record()
            t1 = time.perf_counter()
            end.synchronize()
            device[name].append(start.elapsed_time(end) * 1e3 / n)
            host[name].append((t1 - t0) * 1e6 / n)
    return {name: (statistics.median(device[name]), statistics.median(host[name])) for name in calls}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kv", default="64,576,4096,32768")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--csv", type=Path, default=None)
    args = p.parse_args()
    rows, table = [], []
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    for kv in (int(x) for x in args.kv.split(",")):
        q, k, v, pads, mask = inputs(args.batch, kv, 16, 4, 128)
        calls = providers(q, k, v, pads, mask)
        want = reference(q, k, v, mask)
        errors = {name: float((fn() - want).abs().max()) for name, fn in calls.items()}  # type: ignore[operator]
        ok = {name: err <= 2 * errors["sdpa"] + 1e-3 for name, err in errors.items()}
        times = time_rounds(calls, args.calls, args.reps)
        for name in calls:
            dev, host = times[name]
            table.append((kv, name, errors[name], ok[name], dev, host, times["sdpa"][0] / dev))
            for metric, value in (("max_err", errors[name]), ("device_us", dev), ("host_us", host)):
                rows.append({"time": stamp, "device": torch.cuda.get_device_name(), "batch": args.batch, "kv": kv,
                             "provider": name, "metric": metric, "value": f"{value:.6g}"})
    if args.csv:
        append_rows(args.csv, FIELDS, rows)
    print(f"one decoding step's attention, batch {args.batch}, heads 16/4, head dim 128, bf16, left-padded")
    print(f"{'kv':>6} {'provider':<8} {'max err':>9} {'rule':>5} {'device us':>10} {'host us':>8} {'sdpa/x':>7}")
    for kv, name, err, good, dev, host, ratio in table:
        print(f"{kv:>6} {name:<8} {err:>9.2e} {'ok' if good else 'FAIL':>5} {dev:>10.2f} {host:>8.2f} {ratio:>7.2f}")
    return 0 if all(row[3] for row in table) else 1


if __name__ == "__main__":
    sys.exit(main())
