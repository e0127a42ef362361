"""What every family's tuner shares: compiling the candidates the cache lacks, the shared-memory fit, the tables.

The family tuners (``cli.tune.<family>``) call ``compile_all`` through this
module, so a test replaces it in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from lazytriton import runtime, tuning
from lazytriton.fsutil import write_atomically
from lazytriton.variant import Variant


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
