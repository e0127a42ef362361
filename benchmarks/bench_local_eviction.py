"""How many rows diskcache should evict per write: the evidence for ``lazytriton.store.local.CULL_LIMIT``.

The local tier lets diskcache's own eviction bound it: a write that finds the
store at or over its bound evicts ``cull_limit`` rows, least recently used
first. This writes a stream of entries of 20-300 KiB (the sizes of real
cubins; seeded, so every run writes the same stream) into an 8 MiB bound,
reading a random earlier entry between writes, for several cull limits, and
reports per limit:

- ``over``: writes after which the store is still over its bound, and the
  largest excess;
- ``self_evicted``: writes whose own entry was evicted by that same write;
- ``evicted``: rows evicted in all, and the entries left at the end;
- ``put_ms``: the median time of a write.

Usage: python benchmarks/bench_local_eviction.py [--puts 600] [--bound 8M] [--limits 1,2,4,10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from lazytriton.cache_format import Entry, Provenance
from lazytriton.config import parse_size
from lazytriton.store import local


def _entry(key: str, size: int) -> Entry:
    return Entry(key=key, variant="flash_fwd:sm_90:fp16:::", target="sm_90", kind="cubin",
                 binary=b"\x7fELF" + random.randbytes(size), name="k", num_warps=4, num_ctas=1, warp_size=32,
                 shared=0, global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                 profile_scratch_align=1, arg_types=(), hidden_args=(),
                 provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1))


def run(limit: int, puts: int, bound: int) -> dict[str, float]:
    """Write ``puts`` entries under ``bound`` with diskcache evicting ``limit`` rows per write."""
    random.seed(13)
    with tempfile.TemporaryDirectory() as directory:
        tier = local.LocalTier(Path(directory) / "entries", size_limit=bound, cull_limit=limit)
        written: list[str] = []
        over = self_evicted = 0
        excess = 0
        times = []
        for i in range(puts):
            key = f"{i + 1:032x}"
            entry = _entry(key, random.randint(20 << 10, 300 << 10))
            start = time.perf_counter()
            assert tier.put(key, entry)
            times.append(time.perf_counter() - start)
            written.append(key)
            volume = tier.stats().bytes
            if volume > bound:
                over += 1
                excess = max(excess, volume - bound)
            if tier.peek(key) is None:
                self_evicted += 1
            tier.get(random.choice(written))  # a read moves an entry up the LRU order
        left = tier.stats().entries
        tier.close()
    return {"limit": limit, "over": over, "max_excess_kib": excess / 1024, "self_evicted": self_evicted,
            "evicted": puts - left, "left": left, "put_ms": statistics.median(times) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--puts", type=int, default=600)
    parser.add_argument("--bound", default="8M")
    parser.add_argument("--limits", default="1,2,4,10")
    args = parser.parse_args()
    bound = parse_size(args.bound, "--bound")
    print(f"{args.puts} writes of 20-300 KiB entries under a {args.bound} bound")
    print(f"{'limit':>5} {'over':>6} {'max excess':>11} {'self evicted':>13} {'left':>5} {'put ms':>7}")
    for limit in (int(x) for x in args.limits.split(",")):
        r = run(limit, args.puts, bound)
        print(f"{limit:>5} {r['over']:>6} {r['max_excess_kib']:>8.0f} KiB {r['self_evicted']:>13} "
              f"{r['left']:>5} {r['put_ms']:>7.2f}")


if __name__ == "__main__":
    main()
