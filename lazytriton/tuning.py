"""The tuning table: the best tile sizes and compile options per call shape.

Its source of truth is a CSV file in git in each kernel family's folder
(``kernels/flash_fwd/tuning.csv``; ``kernels/flash_bwd/tuning.csv`` holds the
rows of both backward kernels, told apart by the ``kernel`` column), one row
per (target, kernel, dtype, head dim, causal, seqlen_q bucket, seqlen_k
bucket), with the TFLOP/s measured and the GPU and date that measured it
(``lazytriton tune`` writes rows). Buckets
are powers of two; a call takes the first bucket at or above its seqlen, else
the last. A call the table does not cover gets ``flash_fwd.dispatch.default_config``:
never an error.

``lazytriton tune`` writes its rows to the user's table of the family,
``$LAZYTRITON_CACHE_DIR/tuning/<family>.csv`` (never into the installed
package; one file per family, as shipped); ``table_for`` reads the shipped
table and the user's, the user's rows replacing shipped rows of the same
group and buckets.

``lookup`` and ``merge`` are pure and work on a ``Table``; ``table_for`` reads
the files once per process (per cache dir): the shipped table by group
(``Table.parse_by_group``: a group's rows are converted and checked on its
first lookup, as a process looks up a few groups of hundreds of rows), the
user's whole (a damaged one is refused before it serves, and the shipped
table serves instead).
"""

from __future__ import annotations

import csv
import functools
import io
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from lazytriton.record import fields, record

T = TypeVar("T")
if TYPE_CHECKING:  # annotations only: no alias made at import
    Group = tuple[str, str, str, int, bool]  # (target, kernel, dtype, head_dim, causal): ``Row.group``

MAX_ROW_HEAD_DIM = 512
COLUMNS = ("target", "kernel", "dtype", "head_dim", "causal", "seqlen_q", "seqlen_k",
           "BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "waves_per_eu", "tflops", "gpu", "measured")


@record
class Row:
    """One tuned configuration and the measurement that chose it."""

    target: str
    kernel: str
    dtype: str
    head_dim: int
    causal: bool
    seqlen_q: int
    seqlen_k: int
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    waves_per_eu: int
    tflops: float
    gpu: str
    measured: str

    @property
    def group(self) -> tuple[str, str, str, int, bool]:
        return (self.target, self.kernel, self.dtype, self.head_dim, self.causal)


def bucket_index(seqlen: int) -> int:
    """log2 of ``bucket(seqlen)``: the hot path's memo keys seqlens by this small int."""
    return max(seqlen - 1, 0).bit_length()


def bucket(seqlen: int) -> int:
    """The power-of-two bucket a seqlen falls in (its ceiling power of two; 1 for 0 and 1).

    Dispatch sees a call's seqlens only through this function (see
    ``flash_fwd.dispatch.flash_fwd_variant``), so two calls in the same buckets get the
    same variant, and the memo key (``bucket_index``) may stand for them.
    """
    return 1 << bucket_index(seqlen)


_BOOLS = {"0": False, "1": True, "false": False, "true": True}


@functools.cache
def _kinds() -> tuple[tuple[str, str], ...]:
    """(name, type) of Row's fields, in order: computed once, not per row."""
    return tuple((f.name, f.type) for f in fields(Row))


def parse_row(record: dict[str, str], where: str = "") -> Row:
    """A Row from one CSV record; ValueError naming the column if anything is off."""
    return _parse_values([record.get(name) or "" for name, _ in _kinds()], where)


def _bool(text: str) -> bool:
    return _BOOLS[text.strip()]


_CONVERTERS: dict[str, Callable[[str], Any]] = {"int": int, "str": str.strip, "bool": _bool, "float": float}


@functools.cache
def _converters() -> tuple[Callable[[str], Any], ...]:
    return tuple(_CONVERTERS[kind] for _, kind in _kinds())


_POW2_COLUMNS = ("seqlen_q", "seqlen_k", "BLOCK_M", "BLOCK_N")


@functools.cache
def _positions() -> tuple[tuple[tuple[str, int], ...], int]:
    """(name, position) of the power-of-two columns among Row's fields, and head_dim's position."""
    names = [name for name, _ in _kinds()]
    return tuple((name, names.index(name)) for name in _POW2_COLUMNS), names.index("head_dim")


def _parse_values(raws: list[str], where: str) -> Row:
    """A Row from its fields' texts in field order (``parse_row``'s checks and messages)."""
    try:  # int() and float() take surrounding blanks, as the checks below do after strip()
        values = [convert(text) for convert, text in zip(_converters(), raws, strict=True)]
    except (ValueError, KeyError):
        values = _parse_slowly(raws, where)  # to name the column
    pow2, head_dim = _positions()
    for name, i in pow2:  # checked on the values, before the record is made (a table's rows pass them all)
        n = values[i]
        if not (n > 0 and n & (n - 1) == 0):
            raise ValueError(f"tuning table{where}: {name}={n} must be a power of two")
    if not 0 < values[head_dim] <= MAX_ROW_HEAD_DIM:  # a padded tile (a power of two) or a split head dim's own (96)
        raise ValueError(f"tuning table{where}: head_dim={values[head_dim]} must be in 1..{MAX_ROW_HEAD_DIM}")
    return Row(*values)


def _parse_slowly(raws: list[str], where: str) -> list[Any]:
    """``_parse_values``' conversions field by field: ValueError naming the first column that does not convert."""
    values: list[Any] = []
    for (name, kind), text in zip(_kinds(), raws, strict=True):
        raw = text.strip()
        try:
            if kind == "int":
                values.append(int(raw))
            elif kind == "str":
                values.append(raw)
            elif kind == "bool":
                values.append(_BOOLS[raw])
            else:
                values.append(float(raw))
        except (ValueError, KeyError):
            raise ValueError(f"tuning table{where}: column {name} has {raw!r}, expected {kind}") from None
    return values


def _lines(text: str, where: str) -> list[tuple[int, list[str]]]:
    """(line number, fields in Row's order) of each non-blank line of a table's CSV text."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, [])
    position = {name: i for i, name in enumerate(header)}
    missing = set(COLUMNS) - set(position)
    if missing:
        raise ValueError(f"tuning table{where and ' ' + where} lacks columns {sorted(missing)}")
    order = [position[name] for name, _ in _kinds()]
    width = len(header)
    as_written = order == list(range(width))  # the header is COLUMNS in Row's order (as ``to_csv`` writes it)
    lines = []
    for n, line in enumerate(reader):
        if not line:
            continue
        if len(line) < width:
            line += [""] * (width - len(line))
        lines.append((n + 2, line if as_written and len(line) == width else [line[i] for i in order]))
    return lines


def _parse_lines(lines: Iterable[tuple[int, list[str]]], where: str) -> list[Row]:
    """The rows of ``_lines``' lines, converted and checked (ValueError naming the column and the line)."""
    rows = []
    for n, texts in lines:
        try:
            rows.append(_parse_values(texts, ""))
        except ValueError:  # the line's place named only for a line that fails: again, with it
            _parse_values(texts, f" {where} line {n}")
            raise
    return rows


def _indexed(rows: Iterable[Row]) -> dict[Group, dict[int, dict[int, Row]]]:
    """Rows by group, then seqlen_q bucket, then seqlen_k bucket (ascending); ValueError for two of one place."""
    index: dict[Group, dict[int, dict[int, Row]]] = {}
    for row in rows:
        by_k = index.setdefault(row.group, {}).setdefault(row.seqlen_q, {})
        if row.seqlen_k in by_k:
            raise ValueError(f"tuning table: two rows for {row.group} seqlen_q={row.seqlen_q} "
                             f"seqlen_k={row.seqlen_k}")
        by_k[row.seqlen_k] = row
    return {g: {q: dict(sorted(ks.items())) for q, ks in sorted(qs.items())} for g, qs in index.items()}


_GROUP_COLUMNS = 5  # Row's first fields are its group's: (target, kernel, dtype, head_dim, causal)


class Table:
    """Rows indexed for lookup: group -> seqlen_q bucket -> seqlen_k bucket -> row.

    A table read by ``parse_by_group`` holds each group's lines as text until
    the group's first lookup (``group``), which converts and checks them then;
    ``rows``, iteration and ``len`` convert and check them all.
    """

    def __init__(self, rows: Iterable[Row]) -> None:
        self._rows: tuple[Row, ...] | None = tuple(rows)
        self._index = _indexed(self._rows)
        self._lines: list[tuple[int, list[str]]] = []  # (line number, fields in Row's order): parse_by_group's
        self._pending: dict[Group, list[tuple[int, list[str]]]] = {}
        self._where = ""

    @classmethod
    def parse(cls, text: str, where: str = "") -> Table:
        """The table in CSV ``text`` (a header naming ``COLUMNS``, in any order; blank lines skipped).

        Read as ``csv.DictReader`` would (a short line's missing fields are
        empty, a repeated column's last value counts) through ``csv.reader``.
        Every row is converted and checked here.
        """
        return cls(_parse_lines(_lines(text, where), where))

    @classmethod
    def parse_by_group(cls, text: str, where: str = "") -> Table:
        """``parse``'s table with each group's rows converted and checked on the group's first lookup.

        What the runtime reads: a process looks up a few groups of a table of
        hundreds of rows (a training step's first call reads two tables).
        Each line's group columns are converted here (a line whose group does
        not convert is refused now, naming its column and line); the rest of a
        group's lines, when ``group`` first asks for it, with ``parse``'s
        checks and messages.
        """
        table = cls(())
        table._rows = None
        table._where = where
        table._lines = _lines(text, where)
        converters = _converters()[:_GROUP_COLUMNS]
        groups: dict[tuple[str, ...], Any] = {}  # a group's texts -> its key: each distinct text converted once
        for n, texts in table._lines:
            written = tuple(texts[:_GROUP_COLUMNS])
            key = groups.get(written)
            if key is None:
                try:
                    key = tuple(convert(text) for convert, text in zip(converters, written, strict=True))
                    groups[written] = key
                except (ValueError, KeyError):
                    _parse_values(texts, f" {where} line {n}")  # raises, naming the column
                    raise
            table._pending.setdefault(key, []).append((n, texts))
        return table

    def group(self, key: Group) -> dict[int, dict[int, Row]] | None:
        """The rows of group ``key`` by seqlen_q bucket, then seqlen_k bucket (ascending); None if it has none."""
        found = self._index.get(key)
        if found is None:
            lines = self._pending.get(key)
            if lines is not None:  # another thread may convert the same lines meanwhile: the same rows
                found = _indexed(_parse_lines(lines, self._where)).get(key)
                self._index[key] = found  # type: ignore[assignment]
        return found

    @property
    def rows(self) -> tuple[Row, ...]:
        """Every row, in the text's order (a table read by ``parse_by_group``: all converted and checked now)."""
        if self._rows is None:
            whole = Table(_parse_lines(self._lines, self._where))
            self._index, self._rows = whole._index, whole._rows
        return self._rows  # type: ignore[return-value]

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(COLUMNS)
        for row in sorted(self.rows, key=lambda r: (*r.group, r.seqlen_q, r.seqlen_k)):
            writer.writerow([int(v) if isinstance(v, bool) else v for v in (getattr(row, c) for c in COLUMNS)])
        return out.getvalue()

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def _first_at_or_above(buckets: Mapping[int, T], value: int) -> T:
    last: T | None = None
    for bound, item in buckets.items():
        last = item
        if bound >= value:
            break
    assert last is not None, "a bucket map is never empty"
    return last


def lookup(table: Table, target: str, kernel: str, dtype: str, head_dim: int, causal: bool,
           seqlen_q: int, seqlen_k: int) -> Row | None:
    """The row serving a call: first bucket at or above each seqlen, else the last; None if no group."""
    by_q = table.group((target, kernel, dtype, head_dim, causal))
    if not by_q:
        return None
    by_k = _first_at_or_above(by_q, seqlen_q)
    return _first_at_or_above(by_k, seqlen_k)


def family(name: str) -> str:
    """The kernel family of ``name``, a family (``flash_bwd``) or one of its kernels (``flash_bwd_dq``)."""
    from lazytriton.kernels import FAMILIES, family_of

    return name if name in FAMILIES else family_of(name)  # family_of: ValueError naming an unknown kernel


def table_path(kernel: str) -> Path:
    """The CSV file of a family's shipped tuning table, in its folder (one file for all its kernels).

    ``kernel`` is a family or a kernel name: ``flash_bwd``, ``flash_bwd_dq``
    and ``flash_bwd_dkdv`` all name ``kernels/flash_bwd/tuning.csv``.
    """
    from lazytriton.kernels import FAMILIES, get

    return get(FAMILIES[family(kernel)][0]).source_path.with_name("tuning.csv")


def user_table_path(kernel: str, cache_dir: Path | None = None) -> Path:
    """The user's tuning table of a family (``lazytriton tune`` writes here): ``<cache dir>/tuning/<family>.csv``.

    ``kernel`` is a family or a kernel name; two kernels of one family share
    the file, as they share the shipped one.
    """
    if cache_dir is None:
        from lazytriton.config import settings

        cache_dir = settings().cache_dir
    return cache_dir / "tuning" / f"{family(kernel)}.csv"


def merge(table: Table, rows: Iterable[Row]) -> Table:
    """``table`` with ``rows`` replacing any row of the same group and buckets (pure)."""
    new = {(*r.group, r.seqlen_q, r.seqlen_k): r for r in rows}
    kept = [r for r in table if (*r.group, r.seqlen_q, r.seqlen_k) not in new]
    return Table([*kept, *new.values()])


def read_table(path: Path) -> Table:
    """The table in a CSV file; an empty table if there is none."""
    if not path.is_file():
        return Table(())
    return Table.parse(path.read_text(), str(path.name))


def read_table_by_group(path: Path) -> Table:
    """``read_table``, each group's rows converted and checked on its first lookup (``Table.parse_by_group``)."""
    if not path.is_file():
        return Table(())
    return Table.parse_by_group(path.read_text(), str(path.name))


def table_for(kernel: str) -> Table:
    """A kernel's tuning table: its family's shipped rows, then the user's over them (read once per process).

    The table holds the rows of every kernel of the family; ``lookup`` takes
    the kernel's own.
    """
    name = family(kernel)
    return _table_for(name, user_table_path(name))


def tables_for(kernels: Iterable[str]) -> Table:
    """One table with the rows of every family the kernels belong to (prewarm plans several families at once)."""
    families = dict.fromkeys(family(k) for k in kernels)
    return Table(row for name in families for row in table_for(name))


@functools.cache
def _table_for(kernel: str, user_path: Path) -> Table:
    shipped = read_table_by_group(table_path(kernel))  # a few of its groups serve a process
    try:
        user = read_table(user_path)
    except (OSError, ValueError) as exc:  # a damaged user table must not stop calls: the shipped one serves
        import logging

        logging.getLogger("lazytriton.tuning").warning("ignoring the tuning table %s: %s", user_path, exc)
        return shipped
    return merge(shipped, user) if len(user) else shipped

