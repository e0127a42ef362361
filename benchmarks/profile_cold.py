"""Where the first cache-served call of a fresh process spends its time.

Prints torch's CUDA init, the import of ``lazytriton.flash``, the first call
until it returns and the GPU wait after it. With ``--profile`` the first call
runs under cProfile (which slows the Python parts) and the top functions by
own time follow. Serve it from an image with ``LAZYTRITON_IMAGES`` (and
``LAZYTRITON_JIT=0``, so nothing compiles) and a shape the image holds:

    python benchmarks/profile_cold.py --shape 4,16,2048,128 --causal [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--shape", default="1,2,128,64", help="batch,heads,seqlen,head_dim (bf16)")
parser.add_argument("--causal", action="store_true")
parser.add_argument("--profile", action="store_true", help="run the first call under cProfile")
parser.add_argument("--top", type=int, default=30)
args = parser.parse_args()
shape = tuple(int(x) for x in args.shape.split(","))

t0 = time.perf_counter()
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()
t1 = time.perf_counter()
from lazytriton import runtime  # noqa: E402
from lazytriton.flash import attn_fwd  # noqa: E402

t2 = time.perf_counter()
profile = cProfile.Profile()
if args.profile:
    profile.enable()
attn_fwd(q, k, v, causal=args.causal)
t3 = time.perf_counter()
torch.cuda.synchronize()
t4 = time.perf_counter()
profile.disable()
print(f"torch CUDA init {1e3 * (t1 - t0):.1f} ms; import {1e3 * (t2 - t1):.1f} ms; first call {1e3 * (t3 - t2):.1f} ms"
      f"{' (profiled)' if args.profile else ''}; GPU wait {1e3 * (t4 - t3):.1f} ms;"
      f" served {dict(runtime.get().served)}; compiles {runtime.get().compiles};"
      f" triton imported: {'triton' in sys.modules}")
if args.profile:
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
