"""Draw the README's performance figure, TFLOP/s by seqlen per provider, from the benchmarks' CSVs.

Reads ``benchmarks/results/flash_fwd.csv`` and ``flash_bwd.csv`` (the long
format of ``csvlog.py``: one row per provider x mode x case x run) and draws
one figure per dtype: rows forward / backward, columns head dim x causal,
one line per provider, seqlen on a log2 axis.

Which value a point shows (``select_latest``, the rule the tests pin):

- rows of one GPU only (``--gpu``; default: the GPU of the newest usable bf16 or fp16 row);
- a row is skipped when its ``tflops`` is empty (host-cost rows, failed
  providers) or when the file has a ``check`` column and the row's value is not
  ``ok`` (a provider that failed FlashAttention's gradient rule is not plotted);
- for each (provider, mode, dtype, head dim, causal, seqlen) the row with the
  latest ``timestamp`` wins; between rows of the same timestamp, the later row
  in the file wins (appended last). Points of one panel may therefore come from
  different runs when a later run timed only some providers: a provider's line
  with a point older than the newest point of its mode (forward or backward)
  is drawn dashed and labelled "earlier run". The title gives the date range
  of the data drawn.

``--summary`` prints a markdown table of geomean ratios (lazytriton against
SDPA's cuDNN and flash backends, forward and backward) over the same selected
points; a ratio pairs two points of the same case, and cases missing either
side are left out (the table says how many cases each ratio covers, and a
note under it how many pairs come from different runs, if any).

The PNG is deterministic for a given CSV and matplotlib/FreeType install:
fixed size and dpi, the Agg canvas, no pyplot state, and no ``Software``
entry in the PNG metadata (matplotlib writes no time into a PNG).

``--since`` (default ``DEVICE_TIME_SINCE``) leaves out points older than a
timestamp: rows timed before 2026-12-02 07:00 UTC held each call's host
latency (the device idled from the previous sync until the call's first
launch; ``lazytriton.cli.timing.LEAD_CYCLES`` says why), so their
ratios are not comparable with later rows' and are not drawn or summed.

``--head-dims`` keeps the rows of those head dims only (the README draws
64/128/256 in one figure and the split and padded ones in another); the
figure widens with its panels.

Usage: python benchmarks/plot_perf.py [--dtype bf16|fp16] [--out docs/perf_bf16.png]
       [--fwd-csv PATH] [--bwd-csv PATH] [--gpu NAME] [--head-dims 64,128,256]
       [--since 2026-12-02T07:00:00+00:00]
       python benchmarks/plot_perf.py --summary     (the markdown table; draws nothing)
       python benchmarks/plot_perf.py --decode|--generation ...   (runs plot_serving.py: decoding GB/s and
                                                               transformers' generation; its --help says more)
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import csvread
from csvread import POSITIVE_INT, TIME, Row, field, positive_float, positive_int, timestamp

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# The benchmarks' spelling on the command line -> the CSV's spelling (str(torch.dtype) minus "torch.").
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# Figure rows: (CSV mode, row title). The backward CSV's ``fwd+bwd`` rows are not drawn.
MODES = (("fwd", "forward"), ("bwd", "backward"))
# Known providers, in legend order, with fixed colours so every figure reads the same.
PROVIDERS = {
    "lazytriton": ("lazytriton", "tab:red"),
    "sdpa_cudnn": ("SDPA cuDNN", "tab:blue"),
    "sdpa_flash": ("SDPA flash (FA2)", "tab:green"),
    "triton_jit": ("Triton JIT", "tab:gray"),
}
RATIO_REFERENCES = (("sdpa_cudnn", "SDPA cuDNN"), ("sdpa_flash", "SDPA flash"))
REQUIRED = ("provider", "mode", "dtype", "head_dim", "causal", "seqlen", "tflops", "gpu", "timestamp")
FIGSIZE = (13.0, 6.0)
DPI = 100


class Key(NamedTuple):
    """One plotted point's identity: the latest run's value is drawn for it."""

    provider: str
    mode: str
    dtype: str
    head_dim: int
    causal: bool
    seqlen: int


class Point(NamedTuple):
    tflops: float
    gpu: str
    timestamp: dt.datetime


def read_rows(path: Path) -> list[Row]:
    """Every row of one forward or backward CSV, unparsed; an error names the file if a required column is missing."""
    return csvread.read_rows(path, REQUIRED)


def _bool(text: str) -> bool:
    if text not in ("True", "False"):
        raise ValueError(text)
    return text == "True"


# Rows from this time on are timed as lazytriton.cli.timing times calls: the device busy while the host enqueues
# each call, so the events hold device time only; older rows hold the call's host latency too (0.04-0.35 ms a call)
DEVICE_TIME_SINCE = "2026-12-02T07:00:00+00:00"


def _since(text: str) -> dt.datetime:
    try:
        return timestamp(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--since: expected an ISO 8601 timestamp, got {text!r}") from None


def usable(row: Row) -> bool:
    """Whether a row has a throughput to draw: tflops present, and a ``check`` column (if any) saying ok."""
    if not (row.fields.get("tflops") or "").strip():
        return False
    return "check" not in row.fields or (row.fields["check"] or "").strip() == "ok"


def newest_gpu(rows: Iterable[Row], dtypes: Iterable[str] | None = None) -> str:
    """The GPU of the newest usable row (of ``dtypes`` when given): the default for a figure that must show one GPU.

    The figure and the summary draw the 16-bit rows (``DTYPES``), so a newer run of other rows alone (an FP8 grid
    on another GPU) does not move them to that GPU.
    """
    wanted = None if dtypes is None else set(dtypes)
    stamped = [(field(r, "timestamp", timestamp, TIME), r.line, r.fields["gpu"]) for r in rows
               if usable(r) and (wanted is None or r.fields.get("dtype") in wanted)]
    if not stamped:
        raise ValueError("rows: no row with a tflops value and an ok check; expected benchmark results")
    return str(max(stamped)[2])


def select_latest(rows: Iterable[Row], gpu: str) -> dict[Key, Point]:
    """For each (provider, mode, dtype, head dim, causal, seqlen) on ``gpu``, the latest usable row's point.

    Pure: the tests call it with made-up rows. Rows are taken in order, so of
    two rows with the same timestamp the later one wins.
    """
    selected: dict[Key, Point] = {}
    for row in rows:
        f = row.fields
        if f.get("gpu") != gpu or not usable(row):
            continue
        key = Key(f["provider"], f["mode"], f["dtype"], field(row, "head_dim", positive_int, POSITIVE_INT),
                  field(row, "causal", _bool, "True or False"), field(row, "seqlen", positive_int, POSITIVE_INT))
        point = Point(field(row, "tflops", positive_float, "a positive finite number"), gpu,
                      field(row, "timestamp", timestamp, TIME))
        if key not in selected or point.timestamp >= selected[key].timestamp:
            selected[key] = point
    return selected


class Ratio(NamedTuple):
    """lazytriton / a reference over the cases both have; ``mixed`` pairs compare points of different runs."""

    geomean: float
    low: float
    high: float
    cases: int
    mixed: int


def geomean_ratio(selected: Mapping[Key, Point], mode: str, reference: str, dtypes: Sequence[str]) -> Ratio | None:
    """lazytriton / ``reference`` in ``mode`` over the cases of ``dtypes`` that both have; None if there are none."""
    ratios, mixed = [], 0
    for key, point in selected.items():
        if key.provider == "lazytriton" and key.mode == mode and key.dtype in dtypes:
            other = selected.get(key._replace(provider=reference))
            if other is not None:
                ratios.append(point.tflops / other.tflops)
                mixed += other.timestamp != point.timestamp
    if not ratios:
        return None
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    return Ratio(geomean, min(ratios), max(ratios), len(ratios), mixed)


def summary_table(selected: Mapping[Key, Point]) -> str:
    """The README's markdown table: geomean (and range) of lazytriton's ratio to each SDPA backend."""
    dtypes = [d for d in DTYPES.values() if any(k.dtype == d for k in selected)]
    short = {v: k for k, v in DTYPES.items()}
    head = ["", *(f"{short[d]} geomean" for d in dtypes), "all geomean", "range", "cases"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mixed = 0
    for mode, title in MODES:
        for reference, name in RATIO_REFERENCES:
            total = geomean_ratio(selected, mode, reference, dtypes)
            if total is None:
                continue
            per_dtype = [geomean_ratio(selected, mode, reference, [d]) for d in dtypes]
            cells = [f"{title}: lazytriton / {name}",
                     *("-" if r is None else f"{r.geomean:.2f}x" for r in per_dtype),
                     f"{total.geomean:.2f}x", f"{total.low:.2f}-{total.high:.2f}x", str(total.cases)]
            lines.append("| " + " | ".join(cells) + " |")
            mixed += total.mixed
    if mixed:
        lines.append(f"\n{mixed} of these ratios compare points from different runs (see plot_perf.py's rule).")
    return "\n".join(lines)


def _seqlen_label(seqlen: int) -> str:
    return f"{seqlen // 1024}k" if seqlen % 1024 == 0 else str(seqlen)


def _providers(selected: Mapping[Key, Point]) -> list[str]:
    """The providers to draw: the known ones in legend order, then any other, sorted."""
    present = {k.provider for k in selected}
    return [p for p in PROVIDERS if p in present] + sorted(present - set(PROVIDERS))


def _date_range(points: Iterable[Point]) -> str:
    days = sorted({p.timestamp.astimezone(dt.timezone.utc).date().isoformat() for p in points})
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def _newest_runs(points: Mapping[Key, Point]) -> dict[str, dt.datetime]:
    """The newest timestamp drawn in each mode: a line with an older point is marked as an earlier run."""
    newest: dict[str, dt.datetime] = {}
    for key, point in points.items():
        newest[key.mode] = max(newest.get(key.mode, point.timestamp), point.timestamp)
    return newest


def _draw_panel(ax: Axes, points: Mapping[Key, Point], panel: Key, seqlens: Sequence[int], newest: dt.datetime) -> None:
    """One panel (mode, dtype, head dim, causal from ``panel``): a line per provider, dashed if from an earlier run."""
    for provider in _providers(points):
        found = [(s, points[k]) for s in seqlens if (k := panel._replace(provider=provider, seqlen=s)) in points]
        if not found:
            continue
        label, color = PROVIDERS.get(provider, (provider, None))
        earlier = any(p.timestamp < newest for _, p in found)
        ax.plot([s for s, _ in found], [p.tflops for _, p in found], marker="o", color=color,
                label=f"{label} (earlier run)" if earlier else label, linestyle="--" if earlier else "-",
                linewidth=2.2 if provider == "lazytriton" else 1.4)
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [_seqlen_label(s) for s in seqlens])
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    causal = "causal" if panel.causal else "non-causal"
    ax.set_title(f"{dict(MODES)[panel.mode]}\nhead dim {panel.head_dim}, {causal}", fontsize=9)


def draw(selected: Mapping[Key, Point], dtype: str, out: Path) -> None:
    """Write the figure for one CSV dtype spelling to ``out`` (PNG), deterministically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = {k: p for k, p in selected.items() if k.dtype == dtype and k.mode in dict(MODES)}
    if not points:
        raise ValueError(f"dtype={dtype!r}: no fwd/bwd points for it; expected one of "
                         f"{sorted({k.dtype for k in selected})}")
    panels = sorted({(k.head_dim, k.causal) for k in points})
    seqlens = sorted({k.seqlen for k in points})
    newest = _newest_runs(points)
    # FIGSIZE holds six panels (three head dims); more widen the figure at the same width a panel.
    fig = Figure(figsize=(max(FIGSIZE[0], FIGSIZE[0] * len(panels) / 6), FIGSIZE[1]), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(MODES), len(panels), sharex=True, sharey="row", squeeze=False)
    for r, (mode, _) in enumerate(MODES):
        for c, (head_dim, causal) in enumerate(panels):
            if mode in newest:
                _draw_panel(axes[r][c], points, Key("", mode, dtype, head_dim, causal, 0), seqlens, newest[mode])
        top = max((p.tflops for k, p in points.items() if k.mode == mode), default=1.0)
        axes[r][0].set_ylim(0, top * 1.08)  # shared by the row; from 0 so heights compare
        axes[r][0].set_ylabel("TFLOP/s")
    for ax in axes[-1]:
        ax.set_xlabel("seqlen", fontsize=9)
    legend: dict[str, Artist] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=len(legend), frameon=False)
    gpu = next(iter(points.values())).gpu
    short = {v: k for k, v in DTYPES.items()}.get(dtype, dtype)
    fig.suptitle(f"Attention TFLOP/s on the {gpu}, {short}, batch x seqlen = 16k tokens, hidden 2048 "
                 f"(benchmarks/results, {_date_range(points.values())})")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", metadata={"Software": None})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the figure's dtype (default bf16)")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default docs/perf_<dtype>.png)")
    parser.add_argument("--fwd-csv", type=Path, default=RESULTS / "flash_fwd.csv")
    parser.add_argument("--bwd-csv", type=Path, default=RESULTS / "flash_bwd.csv")
    parser.add_argument("--gpu", default=None, help="plot this GPU's rows (default: the newest bf16/fp16 row's GPU)")
    parser.add_argument("--summary", action="store_true", help="print the geomean-ratio markdown table instead")
    parser.add_argument("--since", type=_since, default=timestamp(DEVICE_TIME_SINCE),
                        help=f"leave out points older than this ISO 8601 timestamp (default {DEVICE_TIME_SINCE}: "
                             "the first rows timed as device time only)")
    parser.add_argument("--head-dims", type=_head_dims, default=None,
                        help="comma-separated head dims to draw or sum up (default: every one in the CSVs)")
    return parser.parse_args(argv)


def _head_dims(text: str) -> frozenset[int]:
    try:
        dims = frozenset(int(d) for d in text.split(",") if d.strip())
    except ValueError:
        dims = frozenset()
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"head dims must be positive integers, comma-separated; got {text!r}")
    return dims


SERVING_FLAGS = ("--decode", "--generation")  # handed to plot_serving.py, the serving figures' tool


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(flag in argv for flag in SERVING_FLAGS):
        import plot_serving  # this script's folder: on sys.path when it runs

        return plot_serving.main(argv)
    args = parse_args(argv)
    rows = [row for path in (args.fwd_csv, args.bwd_csv) for row in read_rows(path)]
    gpu = args.gpu or newest_gpu(rows, DTYPES.values())
    selected = {k: p for k, p in select_latest(rows, gpu).items() if p.timestamp >= args.since}
    if args.head_dims is not None:
        selected = {k: p for k, p in selected.items() if k.head_dim in args.head_dims}
    if args.summary:
        print(summary_table(selected))
        return 0
    out = args.out or HERE.parent / "docs" / f"perf_{args.dtype}.png"
    draw(selected, DTYPES[args.dtype], out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
