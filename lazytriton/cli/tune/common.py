"""What every family's tuner shares: compiling candidates, the shared-memory fit, the tables, the ranking.

The ranking: candidates timed over several cases (``score``, ``pick``). The
family tuners (``cli.tune.<family>``) call ``compile_all`` through this
module, so a test replaces it in one place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from lazytriton import runtime, tuning
from lazytriton.fsutil import write_atomically
from lazytriton.variant import Variant

WORST_SLACK = 1.02  # worst ratios within 2% of the least one tie (pick)


def csv_list(text: str) -> list[str]:
    """The non-empty items of a comma-separated flag value, stripped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _resolve(text: str) -> tuple[str, str]:
    """Resolve one variant through the runtime (compile lock, lease, miss log, every tier); the error, if any."""
    try:
        runtime.get().resolve(Variant.parse(text))
        return text, ""
    except Exception as exc:
        return text, f"{type(exc).__name__}: {str(exc)[:200]}"


def compile_all(variants: Sequence[Variant], jobs: int) -> dict[str, str]:
    """Compile what the cache lacks in ``jobs`` processes, each through its runtime; the failures by variant.

    Each worker resolves exactly as a call does, so a candidate is compiled
    under the key's file lock (and the shared tier's lease), stored in every
    writable tier and recorded in the miss log; the parent then loads it from
    the cache.
    """
    rt = runtime.get()
    missing = [str(v) for v in variants if rt.chain.get(v.key()) is None]
    failures: dict[str, str] = {}
    if missing:
        with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
            for text, error in pool.map(_resolve, missing):
                if error:
                    failures[text] = error
    return failures


def fitting(variants: Sequence[Variant]) -> list[Variant]:
    """The variants whose tiles fit their target's shared memory (prewarm's estimate), in order (pure)."""
    from lazytriton.prewarm.limits import refusal

    return [v for v in variants if refusal(v) is None]


def write_table(path: Path, table: tuning.Table) -> None:
    """Write the CSV atomically (temp file, then rename)."""
    write_atomically(path, [table.to_csv().encode()])


def save_rows(path: Path, rows: Sequence[tuning.Row]) -> None:
    """Merge ``rows`` into the table at ``path`` (rows of other groups and kernels kept) and write it atomically."""
    old = tuning.Table.parse(path.read_text(), str(path.name)) if path.exists() else tuning.Table(())
    write_table(path, tuning.merge(old, rows))


def score(times: Sequence[Sequence[float | None]]) -> list[tuple[float, float] | None]:
    """Each candidate's (worst, geometric mean) of its time over each case's best (pure); None: a case failed.

    ``times[i][c]``: candidate i's ms on case c (None: wrong or failed). Candidates rank by the worst ratio
    first (``pick``): one table row serves every case of its bucket (flash_decode's: batch 1 to 64), and a tile
    that wins the large batches by a few percent while losing batch 1 (latency-bound, few programs) by 10% is
    the worse choice; the geometric mean breaks ties.
    """
    cases = len(times[0]) if times else 0
    best = [min((x for t in times if (x := t[c]) is not None), default=None) for c in range(cases)]
    scores: list[tuple[float, float] | None] = []
    for row in times:
        if any(t is None for t in row) or any(b is None for b in best):
            scores.append(None)
            continue
        ratios = [t / b for t, b in zip(row, best, strict=True)]  # type: ignore[operator]
        scores.append((max(ratios, default=1.0),
                       math.exp(math.fsum(math.log(r) for r in ratios) / max(1, cases))))
    return scores


def pick(scores: Sequence[tuple[float, float] | None]) -> int | None:
    """The winner's index among ``score``'s answers (pure); None where none ran.

    The least geometric mean among the candidates whose worst ratio is within ``WORST_SLACK`` of the least
    worst one (a timing's noise is not a loss).
    """
    worst = min((s[0] for s in scores if s is not None), default=None)
    if worst is None:
        return None
    near = [(s[1], i) for i, s in enumerate(scores) if s is not None and s[0] <= worst * WORST_SLACK]
    return min(near)[1]
