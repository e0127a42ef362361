"""Where the first cache-served call of a fresh process spends its time (cProfile, top 25 by cumulative)."""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

t0 = time.perf_counter()
q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()
t1 = time.perf_counter()
profile = cProfile.Profile()
profile.enable()
from lazytriton.flash import attn_fwd  # noqa: E402

attn_fwd(q, k, v)
torch.cuda.synchronize()
profile.disable()
t2 = time.perf_counter()
print(f"torch CUDA init {1e3 * (t1 - t0):.1f} ms; import + first lazytriton call {1e3 * (t2 - t1):.1f} ms;"
      f" triton imported: {'triton' in sys.modules}")
pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
