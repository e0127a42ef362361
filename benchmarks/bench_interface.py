"""The public entry points on a GPU, beside their peers in the same run.

1. Host time per warm call on a tiny shape (µs, wall clock over many calls):
   ``attn_fwd``, ``flash_attn_func`` and ``scaled_dot_product_attention``,
   each eager (the direct path) and through the torch op, beside
   ``torch.add``, SDPA's default and the same kernel through Triton's JIT.
2. A small model step (two attention blocks, bf16, forward) under
   ``torch.compile`` with lazytriton's SDPA drop-in and with torch's SDPA, and
   eager.
3. CUDA graph replay of 16 attention calls against the same calls eager.

Rows go to a long-format CSV (benchmark, provider, mode, value, unit, ...).

Usage: python benchmarks/bench_interface.py [--csv PATH]
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_flash_fwd import host_us, time_ms, triton_jit
from csvlog import append_rows

import lazytriton
from lazytriton import interface
from lazytriton.driver import fastlaunch

FIELDS = ["benchmark", "provider", "mode", "value", "unit", "gpu", "torch", "triton", "lazytriton", "timestamp"]


def host_rows() -> list[tuple[str, str, float]]:
    q, k, v = (torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    calls: dict[str, Callable[[], object]] = {
        "attn_fwd": lambda: lazytriton.attn_fwd(q, k, v),
        "flash_attn_func": lambda: lazytriton.flash_attn_func(qb, kb, vb),
        "lazytriton_sdpa": lambda: lazytriton.scaled_dot_product_attention(q, k, v),
    }
    rows = []
    for name, fn in calls.items():
        rows.append((name, "eager", host_us(fn)))
        with interface.always_through_op():
            rows.append((name, "op", host_us(fn)))
    rows.append(("torch_add", "eager", host_us(lambda: torch.add(q, q))))
    rows.append(("sdpa_default", "eager", host_us(lambda: F.scaled_dot_product_attention(q, k, v))))
    rows.append(("triton_jit", "eager", host_us(triton_jit(q, k, v, False))))
    return rows


class Block(torch.nn.Module):
    """Pre-norm attention + MLP, with the attention function as a parameter."""

    def __init__(self, dim: int, heads: int, attention: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = self.attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.out(a)
        return x + self.mlp(self.norm2(x))


def model_rows() -> list[tuple[str, str, float]]:
    torch.manual_seed(0)
    x = torch.randn(4, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    rows = []
    outputs = {}
    for name, attention in (("lazytriton_sdpa", lazytriton.scaled_dot_product_attention),
                            ("torch_sdpa", F.scaled_dot_product_attention)):
        torch.manual_seed(1)
        model = torch.nn.Sequential(Block(1024, 16, attention), Block(1024, 16, attention)).cuda().bfloat16().eval()
        with torch.no_grad():
            rows.append((name, "eager", time_ms(lambda: model(x)) * 1e3))  # noqa: B023
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True)
            outputs[name] = compiled(x).float()
            rows.append((name, "compiled", time_ms(lambda: compiled(x)) * 1e3))  # noqa: B023
    err = float((outputs["lazytriton_sdpa"] - outputs["torch_sdpa"]).norm() / outputs["torch_sdpa"].norm())
    print(f"model step: relative difference lazytriton vs torch SDPA {err:.1e}")
    if err > 2e-2:
        raise SystemExit(f"model outputs differ: {err}")
    return rows


def graph_rows() -> list[tuple[str, str, float]]:
    q, k, v = (torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lazytriton.preload(q, k, causal=True)

    def calls() -> object:
        for _ in range(16):
            out = lazytriton.attn_fwd(q, k, v, causal=True)[0]
        return out

    eager_us = time_ms(calls) * 1e3 / 16
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        calls()
        with torch.cuda.graph(graph):
            captured = calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, lazytriton.attn_fwd(q, k, v, causal=True)[0]), "replay differs from eager"
    return [("attn_fwd_x16", "eager", eager_us), ("attn_fwd_x16", "graph_replay", time_ms(graph.replay) * 1e3 / 16)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=Path(__file__).with_name("results") / "interface.csv")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_interface needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "lazytriton": lazytriton.__version__,
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    print(f"launch path: {fastlaunch.path_name()} (benchmarks/bench_host.py compares both)")
    sections = [("host", "us_per_call", host_rows()), ("model_step", "us", model_rows()),
                ("cuda_graph", "us_per_call", graph_rows())]
    append_rows(args.csv, FIELDS, ({**meta, "benchmark": bench, "provider": provider, "mode": mode,
                                    "value": round(value, 2), "unit": unit}
                                   for bench, unit, rows in sections for provider, mode, value in rows))
    add = next(v for p, _, v in sections[0][2] if p == "torch_add")
    print("\nbenchmark   provider          mode           value   vs torch.add (host) / vs torch SDPA (model)")
    base = {m: v for p, m, v in sections[1][2] if p == "torch_sdpa"}
    for bench, unit, rows in sections:
        for provider, mode, value in rows:
            ratio = value / add if bench == "host" else value / base[mode] if bench == "model_step" else None
            extra = f"{ratio:6.2f}x" if ratio is not None else ""
            print(f"{bench:<11} {provider:<17} {mode:<12} {value:9.2f} {unit:<12} {extra}")
    entry_points = ("attn_fwd", "flash_attn_func", "lazytriton_sdpa")
    eager = [v for p, m, v in sections[0][2] if m == "eager" and p in entry_points]
    print(f"median host µs of the three entry points, eager: {statistics.median(eager):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
