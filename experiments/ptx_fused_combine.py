"""How the installed Triton lowers the fused combine's ticket: the barrier, the atomic and the loads, per target.

flash_decode_split with FUSED_COMBINE=true (kernels/flash_decode/triton_kernel.py) publishes each program's partial
with a CTA barrier and an acq_rel gpu-scope atomic add on its row block's counter; the program that takes the last
ticket reads every split's partial with ``.cg`` loads (from L2: never a stale L1 line). This compiles the variant
(bf16, head dim 128, GQA rows of 16, contiguous; ``--paged`` for a paged cache) for each target with the installed
Triton (no GPU needed), and counts the instructions of the assembly that carry them: PTX's ``atom``,
``bar.sync``, ``fence`` and ``ld.global.cg`` (sm_90, sm_80), AMDGCN's ``global_atomic``, ``s_barrier``,
``buffer_wbl2``/``buffer_inv`` and non-temporal (``nt``) loads (gfx942), beside the variant without the flag
(none of them but the barriers its pipelining uses).

Usage: python experiments/ptx_fused_combine.py [--targets sm_90,sm_80,gfx942] [--paged]
       (run it with each Triton: the GPU host's 3.6 beside CI's 3.9)
"""

from __future__ import annotations

import argparse
import importlib
import re
from collections import Counter
from typing import Any

PATTERNS = {"cuda": (r"\batom\.[\w.]+", r"\bred\.[\w.]+", r"\bbar\.sync\b|\bbarrier\.sync\b", r"\bfence\.[\w.]+",
                     r"\bld\.global\.cg[\w.]*", r"\bmembar\.[\w.]+"),
            "hip": (r"\bglobal_atomic_\w+", r"\bs_barrier\b", r"\bbuffer_wbl2\b[ \t]*\w*", r"\bbuffer_inv\b[ \t]*\w*",
                    r"\bglobal_load_\w+(?=[^\n]*\bnt\b)")}


def assembly(variant: Any) -> str:
    """The PTX (CUDA) or AMDGCN (HIP) of a variant, compiled by the installed Triton as lazytriton.compiler does."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lazytriton.compiler import divisibility_hints
    from lazytriton.kernels import get
    from lazytriton.target import Target
    from lazytriton.variant import kernel_constexprs

    spec = get(variant.kernel)
    target = Target.parse(variant.target)
    fn = getattr(importlib.import_module(spec.module), spec.function)
    constexprs = kernel_constexprs(variant, spec.constexprs)
    signature = spec.signature(variant.dtype, bool(variant.constexprs.get("INDEX64", False)), constexprs)
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=divisibility_hints(spec, variant))
    arch: int | str = int(target.arch) if target.backend == "cuda" else target.arch
    options = {**dict(variant.options), "enable_fp_fusion": True}
    kernel = triton.compile(source, target=GPUTarget(target.backend, arch, target.warp_size), options=options)
    return str(kernel.asm["ptx" if target.backend == "cuda" else "amdgcn"])


def lowering(text: str, backend: str) -> Counter[str]:
    """Each matching instruction (its opcode and qualifiers) and how often it occurs."""
    found: Counter[str] = Counter()
    for pattern in PATTERNS[backend]:
        for match in re.finditer(pattern, text):
            shown = " ".join(match.group(0).split())
            found[shown + " nt" if shown.startswith("global_load") else shown] += 1
    return found


def main() -> None:
    import triton

    from lazytriton.kernels.flash_decode import dispatch
    from lazytriton.target import Target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="sm_90,sm_80,gfx942")
    parser.add_argument("--paged", action="store_true")
    args = parser.parse_args()
    print(f"triton {triton.__version__}")
    for name in args.targets.split(","):
        target = Target.parse(name)
        for fused in (False, True):
            variant = dispatch.decode_variant("flash_decode_split", target, "bf16", 128, False, True, 4, 4096,
                                              paged=args.paged, page_size=256 if args.paged else 0,
                                              fused_combine=fused)
            found = lowering(assembly(variant), target.backend)
            shown = ", ".join(f"{op} x{n}" for op, n in sorted(found.items())) or "none"
            print(f"{name:7} FUSED_COMBINE={str(fused).lower():5}: {shown}")


if __name__ == "__main__":
    main()
