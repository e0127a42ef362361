"""The benchmarks' long-format CSV: rows appended, the header written once, by every bench_*.py."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path


def append_rows(path: Path, fields: Sequence[str], rows: Iterable[Mapping[str, object]]) -> None:
    """Append ``rows`` to the CSV at ``path`` (created, with its header, if new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        if new:
            writer.writeheader()
        writer.writerows(rows)
