"""Reading the benchmarks' CSVs back (plot_perf.py, plot_serving.py): rows as read, fields converted on demand.

The files are data, not trusted: a missing column, or a field that does not convert, is a ValueError naming the
file, the line, the column, the value and what was expected.
"""

from __future__ import annotations

import csv
import datetime as dt
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, TypeVar

T = TypeVar("T")
POSITIVE_INT, POSITIVE, TIME = "a positive integer", "a positive finite number", "an ISO 8601 timestamp"


class Row(NamedTuple):
    """One CSV row as read: its file and line (for errors) and its fields."""

    source: str
    line: int
    fields: Mapping[str, str]


def read_rows(path: Path, required: Sequence[str]) -> list[Row]:
    """Every row of one benchmark CSV (any line ends), unparsed; ValueError naming the file if a column is missing."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected the benchmark's columns {list(required)}")
        return [Row(str(path), n, fields) for n, fields in enumerate(reader, start=2)]


def field(row: Row, column: str, convert: Callable[[str], T], expected: str) -> T:
    """One field of an untrusted row, converted; ValueError naming file, line, column, value and expectation."""
    text = (row.fields.get(column) or "").strip()
    try:
        return convert(text)
    except ValueError:
        raise ValueError(f"{row.source}:{row.line}: column {column}={text!r}: expected {expected}") from None


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(text)
    return value


def timestamp(text: str) -> dt.datetime:
    """An ISO 8601 timestamp; one without a zone is taken as UTC (the benchmarks write UTC)."""
    value = dt.datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
