"""Does programmatic dependent launch (PDL) shorten a decoding call's split -> combine pair on Hopper?

A decoding call with several splits is two launches: the split kernel writes partial outputs, the combine kernel
merges them. Between the two the device drains the split grid, then launches and ramps up the combine grid. With
PDL (sm_90: ``griddepcontrol``; ``kernels/flash_decode``'s ``PDL`` flag, off while ``PDL_FROM`` is None), the
split kernel lets its dependent launch early and the combine kernel, launched with programmatic stream
serialization, waits for the split grid's memory only where it reads the partials: its launch overlaps the split's
tail.

Each mode runs in its own process (the flag set before the first call, its binaries compiled into the mode's own
cache dir): ``off`` (``PDL_FROM`` None for this process), ``on`` (90, as shipped), both through lazytriton's own
launchers (the compiled helper and the C++ tails where built). Cases: bench_decode.py's contiguous ones (bf16,
head dim 128, 32 query / 8 key-value heads, one query) at ``--batches`` x ``--lengths``, inside
``trusted_indices``. For each: the µs a call (a) back to back behind a spin kernel (the host's launch cost hidden:
what the device takes for eager calls, as bench_decode times it) and (b) replayed from a CUDA graph, beside SDPA
(cuDNN); the ``on`` process checks its output against ``off``'s, bit for bit (saved to ``--scratch``).

Usage: python3 experiments/probe_decode_pdl.py [--batches 1,8] [--lengths 1024,4096,16384] [--calls 100]
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from probe_decode_b1 import behind_spin_us, compare_modes, decode_case, graph_us

import lazytriton
from lazytriton import kernels
from lazytriton.kernels.flash_decode import binding, checks
from lazytriton.kernels.trust import trusted_indices
from lazytriton.record import replace


def set_pdl(least: int | None) -> None:
    """Both decode kernels' PDL flag from capability ``least`` in this process (None: off), as ``PDL_FROM`` sets it.

    Before the descriptions are first looked up: their fingerprints (the keys) follow them.
    """
    import lazytriton.kernels.flash_decode as family

    for attribute in ("FLASH_DECODE_SPLIT", "FLASH_DECODE_COMBINE"):
        spec = getattr(family, attribute)
        flags = tuple((flag, least if flag == "PDL" else at) for flag, at in spec.capability_flags)
        setattr(family, attribute, replace(spec, capability_flags=flags))
        assert kernels.get(spec.name) is getattr(family, attribute), "looked up before the patch"


def case(batch: int, length: int, calls: int, scratch: Path, mode: str) -> dict[str, float]:
    gen, q, k_cache, v_cache = decode_case(batch, length)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")

    def ours():
        with trusted_indices():
            return lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)

    out = ours()
    call = checks.check(checks.Inputs(q, k_cache, v_cache, cache_seqlens=lens))
    aligned, index64 = binding.layout_flags(checks.Inputs(q, k_cache, v_cache, cache_seqlens=lens), out)
    split_kernel, block_m, block_n, combine_kernel, _ = binding.plan(q.device, q.dtype, call, aligned, index64)
    splits = binding.splits_for(call, block_m, block_n,
                                binding.gpu_slots(q.device.index, getattr(split_kernel, "shared", 0)),
                                binding.min_split_keys(call.head_dim))
    saved = scratch / f"out-{batch}-{length}.pt"
    if mode == "off":
        torch.save(out.cpu(), saved)
        equal = 1.0
    else:
        equal = float(torch.equal(out.cpu(), torch.load(saved)))
    qs, ks, vs = (x.transpose(1, 2) for x in (q, k_cache, v_cache))
    sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)  # noqa: E731
    row = {"splits": splits, "dependent": float(getattr(combine_kernel, "dependent", False)), "equal": equal}
    for name, fn in (("lazytriton", ours), ("sdpa", sdpa)):
        row[f"{name} eager"] = behind_spin_us(fn, calls)
        row[f"{name} graph"] = graph_us(fn, calls)
    return row


def main() -> None:
    found = compare_modes(__file__, __doc__, ("off", "on"), "1,8", "1024,4096,16384", case,
                          lambda mode: set_pdl(90 if mode == "on" else None))
    if found is None:
        return
    print(f"{'batch':>5} {'keys':>6} {'splits':>6} {'dep':>3} {'equal':>5}  {'off eager':>9} {'on eager':>9} "
          f"{'sdpa eager':>10}  {'off graph':>9} {'on graph':>9} {'sdpa graph':>10}  gain eager / graph")
    for key, off in found["off"].items():
        on = found["on"][key]
        batch, length = key.split(",")
        print(f"{batch:>5} {length:>6} {int(on['splits']):>6} {int(on['dependent']):>3} "
              f"{'yes' if on['equal'] else 'NO':>5}  {off['lazytriton eager']:>9.2f} {on['lazytriton eager']:>9.2f} "
              f"{on['sdpa eager']:>10.2f}  {off['lazytriton graph']:>9.2f} {on['lazytriton graph']:>9.2f} "
              f"{on['sdpa graph']:>10.2f}  {off['lazytriton eager'] / on['lazytriton eager']:.3f}x / "
              f"{off['lazytriton graph'] / on['lazytriton graph']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
