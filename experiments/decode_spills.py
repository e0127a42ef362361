"""Registers and stack of the decoding split kernel's feature variants, capped as dispatch serves them and not.

Compiles (no GPU needed) the split variant dispatch chooses for each feature flag at ``--head-dims``, contiguous
and paged (``--page-size``), aligned and unaligned, and prints each binary's registers a thread and stack bytes
(``cuobjdump --dump-resource-usage``; Triton's bundled cuobjdump is used when none is on PATH), with and without
dispatch's ``maxnreg`` (``dispatch.capped_registers``): what the register cap gives and costs in spills. Run it
under each Triton the GPU hosts use (the host's is 3.6).

Usage: python3 experiments/decode_spills.py [--head-dims 40,128] [--dtype fp16] [--page-size 256] [--target sm_90]
    [--features window,sinks]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

FEATURES = ("window", "softcap", "alibi", "leftpad", "rotary", "sinks", "varlen_q", "chunk", "key_mask")


def cuobjdump() -> str:
    """cuobjdump on PATH, else the one Triton's NVIDIA backend ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(bundled):
        sys.exit("no cuobjdump on PATH or in Triton's NVIDIA backend")
    return bundled


def usage(binary: bytes, tool: str) -> tuple[int, int]:
    """(registers a thread, stack bytes) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(binary)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    reg, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return int(reg.group(1)) if reg else -1, int(stack.group(1)) if stack else -1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="40,128")
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    parser.add_argument("--page-size", type=int, default=256, help="the paged cases' page size")
    parser.add_argument("--target", default="sm_90")
    parser.add_argument("--features", default=",".join(FEATURES))
    args = parser.parse_args()
    import triton

    from lazytriton import compiler
    from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
    from lazytriton.target import Target
    from lazytriton.variant import Variant

    tool, target = cuobjdump(), Target.parse(args.target)
    print(f"Triton {triton.__version__}, {args.target}, {args.dtype}: registers / stack bytes, as served "
          f"(cap: dispatch's maxnreg) and with the other choice")
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for page in (0, args.page_size):
            for aligned in (True, False):
                for feature in args.features.split(","):
                    flags = {feature: True, **({"paged": True, "page_size": page} if page else {})}
                    served = decode_dispatch.decode_variant("flash_decode_split", target, args.dtype, head_dim,
                                                            False, aligned, 4, 4096, **flags)
                    capped = "maxnreg" in dict(served.options)
                    text = str(served)
                    other = Variant.parse(text.replace("maxnreg=128,", "") if capped else
                                          text.replace(":num_stages", ":maxnreg=128,num_stages"))
                    got = [usage(compiler.compile_in_process(v).binary, tool) for v in (served, other)]
                    print(f"hd {head_dim:3d} {'page ' + str(page) if page else 'contiguous':10s} "
                          f"{'aligned' if aligned else 'unaligned':9s} {feature:9s} served "
                          f"{'capped' if capped else 'uncapped'} {got[0][0]}/{got[0][1]}, "
                          f"{'uncapped' if capped else 'capped'} {got[1][0]}/{got[1][1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
