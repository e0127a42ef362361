"""Does a decoding step that appends its new key gain from the split kernel launched as kv_append's dependent?

A decoding call given k and v (``flash_attn_with_kvcache(..., k=, v=)``, FlashAttention's decoding step) launches
kv_append, then the split kernel (and the combine kernel where it splits). Under ``PDL`` kv_append releases its
dependent as it starts, and the split kernel, launched as its stream predecessor's programmatic dependent, waits
for that grid's memory before it reads anything: its launch and start overlap kv_append. Two processes, each with
its own cache dir: ``plain`` (the split kernel launched plainly: its spec's ``dependent`` cleared in the process,
so its wait returns at once, the stream ordering the kernels) and ``dependent`` (every split kernel a dependent, as
``flash_decode.DEPENDENT_SPLIT`` makes it). Both keep the combine kernel the split kernel's dependent.

Cases: bench_decode.py's contiguous ones (bf16, head dim 128, 32 query / 8 key/value heads, one query) at
``--batches`` x ``--lengths``: the step with its new key (written at length - 1, so every call writes the same
slot and reads ``length`` keys) and the same call without one. For each, the µs a call (a) back to back behind a
spin kernel (the host's launch cost hidden: what the device takes for eager calls, as bench_decode times it) and
(b) replayed from a CUDA graph, beside SDPA (cuDNN) on the same keys; ``dependent``'s outputs against ``plain``'s,
bit for bit.

Usage: python3 experiments/probe_decode_appended.py [--batches 1,8,64] [--lengths 1024,4096,32768] [--calls 100]
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from probe_decode_b1 import behind_spin_us, compare_modes, decode_case, graph_us

import lazytriton
from lazytriton import kernels
from lazytriton.kernels.trust import trusted_indices
from lazytriton.record import replace


def set_split(dependent: bool) -> None:
    """The split kernel launched as its predecessor's dependent in this process (``DEPENDENT_SPLIT``), or plainly
    (before its description is first looked up)."""
    import lazytriton.kernels.flash_decode as family

    spec = family.FLASH_DECODE_SPLIT
    family.FLASH_DECODE_SPLIT = replace(spec, dependent_flag="") if dependent else replace(spec, dependent="")
    assert kernels.get("flash_decode_split") is family.FLASH_DECODE_SPLIT, "looked up before the patch"


def case(batch: int, length: int, calls: int, scratch: Path, mode: str) -> dict[str, float]:
    gen, q, k_cache, v_cache = decode_case(batch, length)
    k_new, v_new = (torch.randn(batch, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))
    before = torch.full((batch,), length - 1, dtype=torch.int32, device="cuda")
    full = torch.full((batch,), length, dtype=torch.int32, device="cuda")

    def appending():
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=before)

    def reading():
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=full)

    outs = torch.stack([appending(), reading()]).cpu()
    saved = scratch / f"out-{batch}-{length}.pt"
    if mode == "plain":
        torch.save(outs, saved)
        equal = 1.0
    else:
        equal = float(torch.equal(outs, torch.load(saved)))
    qs, ks, vs = (x.transpose(1, 2) for x in (q, k_cache, v_cache))
    sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)  # noqa: E731
    row = {"equal": equal}
    for name, fn in (("append", appending), ("read", reading), ("sdpa", sdpa)):
        row[f"{name} eager"] = behind_spin_us(fn, calls)
        row[f"{name} graph"] = graph_us(fn, calls)
    return row


def main() -> None:
    found = compare_modes(__file__, __doc__, ("plain", "dependent"), "1,8,64", "1024,4096,32768", case,
                          lambda mode: set_split(mode == "dependent"))
    if found is None:
        return
    print("µs a call; plain: the split kernel launched plainly, dep: as its predecessor's dependent")
    print(f"{'batch':>5} {'keys':>6} {'equal':>5} | {'append eager':>12} {'plain/dep':>9} {'x sdpa':>6} | "
          f"{'append graph':>12} {'plain/dep':>9} | {'read eager':>10} {'plain/dep':>9} | {'read graph':>10} "
          f"{'plain/dep':>9}")
    for key, plain in found["plain"].items():
        dep = found["dependent"][key]
        batch, length = key.split(",")
        cells = []
        for what in ("append eager", "append graph", "read eager", "read graph"):
            cells.append(f"{plain[what]:>5.2f}/{dep[what]:<6.2f} {plain[what] / dep[what]:>9.3f}")
            if what == "append eager":
                cells[-1] += f" {dep['sdpa eager'] / dep[what]:>6.2f}"
        print(f"{batch:>5} {length:>6} {'yes' if dep['equal'] else 'NO':>5} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
