"""A miss log of the variants an FP8 GPU round runs, for an image built here and carried to the host.

Prints one JSON line a variant (``lazytriton prewarm --from-misses``' input): every tiling of
``flash_fwd_fp8_gluon`` in both key orders (V_OPERAND_ORDER on and off), e4m3 and e5m2, causal or not (what
``tests/test_fp8_gluon.py``'s GPU tests and ``bench_flash_fwd.py --fp8`` run), and the bf16 and Triton FP8
forwards' variants of the bench's 16k rows at head dims 64/128/256. Build the image with the host's Triton
(3.6: the CI's second venv) and carry it under ``.whl/``::

    python3 experiments/fp8_gluon_variants.py > /tmp/fp8-misses.jsonl
    /tmp/lazytriton-ci-triton-3.6.0/bin/python3 -m lazytriton prewarm --from-misses /tmp/fp8-misses.jsonl \\
        --out .whl/fp8.ltimg -j 2

``gpu_round.sh fp8gluon`` serves from it where it is there.
"""

from __future__ import annotations

import json


def main() -> int:
    from lazytriton.capi import embedded
    from lazytriton.kernels.flash_fwd import fp8_gluon

    found = set()
    for head_dim in fp8_gluon.HEAD_DIMS:
        for tiles in fp8_gluon.configs(head_dim):
            for causal in ("none", "top_left"):
                for dtype in ("e4m3", "e5m2"):
                    for order in (True, False):
                        found.add(str(fp8_gluon.variant("sm_90", dtype, head_dim, causal, True, False, 16384, 16384,
                                                        tiles=tiles, operand_order=order)))
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            for code in (2, 5):  # bf16, e4m3 (flash_fwd_fp8): what the C API's plan and Python's binding choose
                found.add(str(embedded.plan_variant("flash_fwd", 90, code, head_dim, causal, True, False, 16384,
                                                    16384, head_dim_v=head_dim)))
    for text in sorted(found):
        print(json.dumps({"variant": text}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
