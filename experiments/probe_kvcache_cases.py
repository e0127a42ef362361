"""Which of tests/test_kvcache.py's cases a GPU gets wrong, under dispatch's choices or with one of them undone.

Runs the test file's covering cases (``--match``: those whose id holds every
given word) through ``flash_attn_with_kvcache`` on the GPU and checks each
against the file's float64 reference with its rule, printing the served split
variant and ok or the error. ``--no-cap`` compiles the feature variants without
the register cap (``dispatch.MAX_CAPPED_HEAD_DIM = 0``); ``--gather-below N``
sets ``dispatch.GATHER_BELOW`` (pages gathered key by key under N keys). Each
setting runs in a process of its own (``--cache-dir``: a cache dir of its own
for it), so nothing compiled under one serves another.

Usage: python3 experiments/probe_kvcache_cases.py [--match page32 w20_3] [--no-cap] [--gather-below 32]
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", nargs="*", default=["page"], help="words every case id must hold")
    parser.add_argument("--no-cap", action="store_true", help="no register cap on the feature variants")
    parser.add_argument("--gather-below", type=int, default=None, help="dispatch.GATHER_BELOW for this process")
    parser.add_argument("--cache-dir", default=None, help="LAZYTRITON_CACHE_DIR for this process")
    args = parser.parse_args()
    if args.cache_dir:
        os.environ["LAZYTRITON_CACHE_DIR"] = args.cache_dir
    sys.path.insert(0, str(ROOT / "tests"))
    import test_kvcache
    import torch

    from lazytriton.kernels.flash_decode import binding, checks
    from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
    from lazytriton.kernels.flash_decode.checks import Inputs
    from lazytriton.target import Target

    if args.no_cap:
        decode_dispatch.MAX_CAPPED_HEAD_DIM = 0
    if args.gather_below is not None:
        decode_dispatch.GATHER_BELOW = args.gather_below
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: the interpreter, dispatch's choices for sm_90
    capability = torch.cuda.get_device_capability() if device == "cuda" else (9, 0)
    target = Target.parse(f"sm_{capability[0]}{capability[1]}")
    failed = 0
    cases = [c for c in test_kvcache.CASES if all(word in str(c) for word in args.match)]
    for case in cases:
        inputs = test_kvcache.make_inputs(case, batch=3)
        options = test_kvcache.options(case)
        fields = inspect.signature(Inputs).parameters  # every tensor the case has
        t = Inputs(**{name: inputs[name] for name in fields if name in inputs})
        call = checks.check(t, causal=options["causal"], window_size=options["window_size"],
                            softcap=options["softcap"], num_splits=case.splits)
        aligned, index64 = binding.layout_flags(t, torch.empty_like(inputs["q"]))
        split, _ = binding.variants(target, inputs["q"].dtype, call, aligned, index64)
        gpu = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in inputs.items()}
        got = test_kvcache.run(gpu, **options, num_splits=case.splits)
        cpu = {n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in gpu.items()}  # as test_kvcache_gpu
        try:
            test_kvcache.check_against_reference(cpu, tuple(x.cpu() for x in got), **options)
            verdict = "ok"
        except AssertionError as exc:
            failed += 1
            verdict = "FAIL " + str(exc).splitlines()[0][:100]
        print(f"{case}: {verdict}\n    {split}", flush=True)
    print(f"{failed} of {len(cases)} failed (no_cap={args.no_cap}, gather_below={decode_dispatch.GATHER_BELOW})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
