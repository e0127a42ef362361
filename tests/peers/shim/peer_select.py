"""Which cases of a peer's test file run: a deterministic sample of each test function's parametrisation.

Pure functions of the collected cases (``Case``: the test function, the node id, its parameters), so the tests
call them directly. A case's rank is a hash of the seed and its node id, the same on every machine and run; a
fraction keeps the cases ranked under it, at least ``min_per_function`` of each function (its lowest ranks);
``every`` N keeps each function's cases 0, N, 2N, ... in collection order instead. ``shard`` K of ``shards`` N
keeps the kept cases whose shard (another hash of the seed and the node id) is K: N runs, each with its own K,
run every kept case once between them, whatever order each collects in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple


class Case(NamedTuple):
    function: str
    nodeid: str
    params: Mapping[str, Any]


def rank(nodeid: str, seed: int) -> float:
    """A number in [0, 1) fixed by the seed and the node id."""
    digest = hashlib.sha256(f"{seed}\0{nodeid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def shard_of(nodeid: str, seed: int, shards: int) -> int:
    """The shard in [0, shards) of a node id: fixed by the seed and the node id, apart from its sample rank."""
    return min(shards - 1, int(rank(f"shard\0{nodeid}", seed) * shards))


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` (shard K of N, 0 <= K < N) as (K, N); ValueError naming the text otherwise."""
    k, sep, n = text.partition("/")
    try:
        shard, shards = int(k), int(n)
    except ValueError:
        shard, shards = -1, 0
    if not sep or not 0 <= shard < shards:
        raise ValueError(f"a shard is K/N with 0 <= K < N (shard 0/3, 1/3, 2/3 of three runs), got {text!r}")
    return shard, shards


def too_long(params: Mapping[str, Any], max_seqlen: int) -> bool:
    """Whether a parameter named seqlen* is an int over ``max_seqlen`` (0: no bound)."""
    return max_seqlen > 0 and any(name.startswith("seqlen") and isinstance(value, int) and not isinstance(
        value, bool) and value > max_seqlen for name, value in params.items())


def select(cases: Iterable[Case], *, fraction: float = 1.0, every: int = 0, seed: int = 0,
           min_per_function: int = 1, max_seqlen: int = 0, shard: int = 0, shards: int = 1) -> list[str]:
    """The node ids kept, in collection order (of shard ``shard`` of ``shards``)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if every < 0 or min_per_function < 0 or max_seqlen < 0:
        raise ValueError(f"every, min_per_function and max_seqlen must be >= 0, got {every}, {min_per_function}, "
                         f"{max_seqlen}")
    if not 0 <= shard < shards:
        raise ValueError(f"shard must be in [0, shards), got shard {shard} of {shards}")
    cases = [c for c in cases if not too_long(c.params, max_seqlen)]
    by_function: dict[str, list[Case]] = {}
    for case in cases:
        by_function.setdefault(case.function, []).append(case)
    kept: set[str] = set()
    for group in by_function.values():
        if every > 0:
            kept.update(c.nodeid for i, c in enumerate(group) if i % every == 0)
            continue
        ranked = sorted(group, key=lambda c: rank(c.nodeid, seed))
        chosen = [c for c in ranked if rank(c.nodeid, seed) < fraction]
        if len(chosen) < min_per_function:
            chosen = ranked[:min_per_function]
        kept.update(c.nodeid for c in chosen)
    if shards > 1:
        kept = {nodeid for nodeid in kept if shard_of(nodeid, seed, shards) == shard}
    return [c.nodeid for c in cases if c.nodeid in kept]
