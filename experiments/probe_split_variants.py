"""Copies of the decoding split kernel's source, edited, timed beside the served kernel at batch 1.

``probe_split_anatomy.py`` found a stand-in split kernel with the same grid and math at 3.2-3.4 µs of device time
(1k keys, 16 splits, batch 1, H100) where the served split kernel takes 6.5. This probe takes
``kernels/flash_decode/triton_kernel.py`` as it is, applies one named edit at a time (each a text replacement,
refused if the text is not found), launches the edited ``flash_decode_split_kernel`` through Triton's JIT with
the arguments the binding passes for a contiguous bf16 cache (head dim 128, 32/8 heads, one query, lengths as a
tensor), and prints each copy's device µs a launch (torch.profiler) beside the served call's split kernel. Every
copy's partials are merged in float32 and checked against a float32 reference before it is timed.

Edits:
- ``jit``: none (the source as served, launched through the JIT: what the JIT's own specialisation changes);
- ``const-shapes``: group_size, seqlen_q, head_dim and head_dim_v constexpr (no runtime integer division);
- ``const-splits``: num_splits constexpr too;
- ``one-loop``: the three key loops (masked head, unmasked body, masked tail) as one masked loop;
- ``body-only``: only the unmasked loop over the split's range (right only where the length is a multiple of
  BLOCK_N, as in this probe's cases);
- combinations joined by ``+``.

Usage: python3 experiments/probe_split_variants.py [--lengths 1024,4096] [--splits 16,8]
       [--configs 32x2x4,64x4x3,64x1x3] [--edits jit,const-shapes,one-loop,body-only,const-shapes+one-loop]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from probe_split_anatomy import device_us, served_call  # noqa: E402

HQ, HK, D, BLOCK_M = 32, 8, 128, 16
SOURCE = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "flash_decode" / "triton_kernel.py"
LOOPS_START = "    for start_n in range(lo, tl.minimum(full_begin, hi), BLOCK_N):\n"
LOOPS_END = "\n    if KV_FP8 != \"none\":  # the cache holds v / v_descale"


def _loops(text: str, bounds: str, masked: str) -> str:
    """The three key loops replaced by one over ``bounds`` with MASKED ``masked``."""
    start, end = text.index(LOOPS_START), text.index(LOOPS_END)
    first = text[start:end].split("\n    for ")[0]  # the head loop, whose call passes MASKED True
    one = first.replace("range(lo, tl.minimum(full_begin, hi), BLOCK_N)", bounds)
    one = one.replace("attention_chunk, key_mask, stride_mn, True,", f"attention_chunk, key_mask, stride_mn, {masked},")
    return text[:start] + one + "\n" + text[end:]


def _replace(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"edit not applicable: {old!r} occurs {text.count(old)} times")
    return text.replace(old, new)


EDITS = {
    "jit": lambda t: t,
    "const-shapes": lambda t: _replace(t, "group_size, heads_q, seqlen_q, head_dim, head_dim_v,",
                                       "group_size: tl.constexpr, heads_q, seqlen_q: tl.constexpr, "
                                       "head_dim: tl.constexpr, head_dim_v: tl.constexpr,"),
    "const-splits": lambda t: _replace(t, "page_size, num_splits, window_left,",
                                       "page_size, num_splits: tl.constexpr, window_left,"),
    "one-loop": lambda t: _loops(t, "range(lo, hi, BLOCK_N)", "True"),
    "body-only": lambda t: _loops(t, "range(lo, hi, BLOCK_N)", "False"),
}


def edited_kernel(name: str, folder: pathlib.Path):
    """``flash_decode_split_kernel`` of the source with the edits of ``name`` (``a+b``), from its own module."""
    text = SOURCE.read_text()
    for part in name.split("+"):
        text = EDITS[part](text)
    path = folder / f"split_{name.replace('+', '_').replace('-', '_')}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module.flash_decode_split_kernel


def arguments(q, k, v, lens, part, lse_part, out, lse, splits, counters):
    """The split kernel's arguments by name, as the binding passes them for this contiguous, featureless call."""
    ints, floats = lens, lse  # unread, but typed as the description types them (the JIT types by tensor)
    args = dict(Q=q, K=k, V=v, Out=out, Lse=lse, OutPart=part, LsePart=lse_part, Seqlens=lens, BatchIdx=ints,
                BlockTable=ints, Alibi=floats, LeftPad=ints, RotaryCos=q, RotarySin=q, RotarySeqlens=ints,
                Sinks=floats, CuSeqlensQ=ints, KDescale=floats, VDescale=floats, KeyMask=counters.view(torch.uint8),
                Counters=counters)
    for name, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        args.update({f"stride_{name}b": t.stride(0), f"stride_{name}s": t.stride(1), f"stride_{name}h": t.stride(2)})
    args.update(stride_tb=0, stride_ab=0, stride_kdb=0, stride_kdh=0, stride_vdb=0, stride_vdh=0, stride_mb=0,
                stride_mn=0, group_size=HQ // HK, heads_q=HQ, seqlen_q=1, head_dim=D, head_dim_v=D, seqlen_const=0,
                seqlen_new=0, use_seqlens=1, use_batch_idx=0, page_size=0, num_splits=splits, window_left=-1,
                window_right=-1, attention_chunk=0, rotary_dim=0, seqlen_ro=0, use_rotary_seqlens=0,
                rotary_per_query=0, use_k_descale=0, use_v_descale=0, sm_scale=D ** -0.5, softcap=0.0,
                BLOCK_M=BLOCK_M, BLOCK_D=D, EVEN_D=True, BLOCK_DV=D, EVEN_DV=True, CAUSAL=False)
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--splits", default="16,8")
    parser.add_argument("--configs", default="32x2x4,64x4x3,64x2x3,64x1x3", help="BLOCK_N x warps x stages")
    parser.add_argument("--edits", default="jit,const-shapes,const-shapes+const-splits,one-loop,body-only,"
                                           "const-shapes+body-only")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    folder = pathlib.Path(tempfile.mkdtemp(prefix="split-variants-"))
    kernels = {name: edited_kernel(name, folder) for name in args.edits.split(",")}
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        torch.manual_seed(length)
        q = torch.randn(1, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, length, HK, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((1,), length, dtype=torch.int32, device="cuda")
        ref = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                             v.transpose(1, 2).float(), enable_gqa=True).transpose(1, 2)
        out = torch.empty_like(q)
        lse = torch.empty(1, HQ, 1, device="cuda", dtype=torch.float32)
        counters = torch.zeros(64, dtype=torch.int32, device="cuda")
        for splits in (int(x) for x in args.splits.split(",")):
            part = torch.empty(HQ * splits, D, device="cuda", dtype=torch.float32)  # (head, split) rows
            lse_part = torch.empty(HQ * splits, device="cuda", dtype=torch.float32)
            served = functools.partial(served_call, q, k, v, lens, splits)
            err = float((served().float() - ref).abs().max())
            rows.append((length, splits, "served", "-", device_us(served, "split"), err))
            for (bn, warps, stages) in configs:
                for name, kernel in kernels.items():
                    kw = arguments(q, k, v, lens, part, lse_part, out, lse, splits, counters)
                    launch = functools.partial(kernel[(splits, HK, 1)], **kw, BLOCK_N=bn, num_warps=warps,
                                               num_stages=stages)
                    part.fill_(float("nan"))
                    launch()
                    torch.cuda.synchronize()
                    lp = lse_part.view(HQ, splits)
                    w = torch.exp2(lp - lp.amax(1, keepdim=True))
                    merged = (part.view(HQ, splits, D) * w[..., None]).sum(1) / w.sum(1)[:, None]
                    err = float((merged.view(1, 1, HQ, D) - ref).abs().max())
                    if not err < 2e-2:
                        raise SystemExit(f"{name} {bn}x{warps}x{stages} wrong: max err {err} ({length} keys)")
                    rows.append((length, splits, name, f"{bn}x{warps}x{stages}",
                                 device_us(launch, "flash_decode_split"), err))
    print(f"\nsplit kernel copies: batch 1, bf16, hd {D}, {HQ}/{HK} heads, {torch.cuda.get_device_name()}")
    print(f"{'keys':>6} {'splits':>6}  {'copy':<34}{'BNxWxS':>9}{'device µs':>10}  max err")
    for length, splits, name, cfg, dev, err in rows:
        print(f"{length:>6} {splits:>6}  {name:<34}{cfg:>9}{dev:>10.2f}  {err:.1e}")


if __name__ == "__main__":
    main()
