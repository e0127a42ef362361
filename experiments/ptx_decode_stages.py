"""How many K/V tiles the decoding split kernel keeps in flight, by stages, contiguous and paged (no GPU needed).

Triton's pipeliner gives each load of a loop a stage; a paged call's block-table read takes one of its own
before the K/V tiles that depend on it. This compiles ``flash_decode_split`` (bf16, head dim 128, GQA rows of
16, aligned; ``--block-n`` keys, ``--warps`` warps) at each of ``--stages`` for a contiguous cache and for
pages of ``--page-size`` keys with the installed Triton, and prints from its PTX: the ``cp.async`` copies, the
``cp.async.wait_group`` counts (the groups still in flight where the loop waits: 0 is no tile ahead) and the
32-bit global loads (the length and block-table reads).

Usage: python experiments/ptx_decode_stages.py [--target sm_90] [--stages 2,3,4,5] [--block-n 64] [--warps 4]
       (run it with each Triton: the GPU host's 3.6 beside CI's 3.9)
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ptx_fused_combine import assembly  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="sm_90")
    parser.add_argument("--stages", default="2,3,4,5")
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--page-size", type=int, default=256)
    args = parser.parse_args()
    from lazytriton.kernels.flash_decode import dispatch
    from lazytriton.target import Target
    from lazytriton.tiles import Config

    target = Target.parse(args.target)
    print(f"flash_decode_split, {args.target}, bf16, head dim 128, BLOCK_N {args.block_n}, {args.warps} warps")
    print(f"{'layout':<12}{'stages':>7}{'cp.async':>10}{'ld.global.b32':>15}  cp.async.wait_group counts")
    for page in (0, args.page_size):
        for stages in (int(x) for x in args.stages.split(",")):
            config = Config(16, args.block_n, args.warps, stages, 0)
            variant = dispatch.decode_variant(dispatch.DECODE_KERNELS[0], target, "bf16", 128, False, True, 4, 32768,
                                              config=config, page_size=page, paged=page > 0)
            ptx = assembly(variant)
            waits = re.findall(r"cp\.async\.wait_group\s+(\d+)", ptx)
            copies = len(re.findall(r"cp\.async\.cg", ptx))
            loads = len(re.findall(r"ld\.global\.b32", ptx))
            layout = f"paged {page}" if page else "contiguous"
            print(f"{layout:<12}{stages:>7}{copies:>10}{loads:>15}  {' '.join(waits)}")


if __name__ == "__main__":
    main()
