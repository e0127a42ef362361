"""Probe: the backward's time by tensor layout (SDPA's bhsd against FlashAttention's bshd views) on the GPU.

bench_varlen.py measured lazytriton's backward on right-padded (batch, seqlen, heads, dim) tensors far below
bench_flash_bwd.py's figures on contiguous (batch, heads, seqlen, dim) ones; this separates the layout from
the rest. Prints ms and TFLOP/s (backward = 2.5x the forward's 4*B*H*S*S*D, halved if causal) per layout.

Usage: python benchmarks/probe_bwd_layout.py [--batch 4] [--heads 16] [--seqlen 4096] [--head-dim 128]
"""

from __future__ import annotations

import argparse

import torch

from lazytriton.cli.timing import event_ms
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_fwd import binding as fwd


def time_both(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool) -> tuple[float, float]:
    """Forward ms and backward ms (median of event-timed runs) of one call."""
    call = fwd.check(q, k, v, causal)
    out, lse = fwd.forward(q, k, v, call)
    return (event_ms(lambda: fwd.forward(q, k, v, call)),
            event_ms(lambda: bwd.backward(q, k, v, out, lse, do, call)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    a = p.parse_args()
    b, h, s, d = a.batch, a.heads, a.seqlen, a.head_dim
    for causal in (False, True):
        for layout in ("bhsd", "bshd"):
            shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
            q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            if layout == "bshd":
                q, k, v, do = (t.transpose(1, 2) for t in (q, k, v, do))
            f_ms, b_ms = time_both(q, k, v, do, causal)
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            print(f"{layout} causal={causal!s:5} fwd {f_ms:7.3f} ms {flops / f_ms / 1e9:6.0f} TFLOP/s   "
                  f"bwd {b_ms:7.3f} ms {2.5 * flops / b_ms / 1e9:6.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
