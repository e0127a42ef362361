"""The README's serving figures from the benchmarks' CSVs: decoding GB/s beside SDPA, and transformers' generation.

``--decode`` reads ``results/decode.csv`` (``bench_decode.py``: a row per provider x case x run),
``--generation`` ``results/transformers.csv`` (``bench_transformers.py``: a row per impl x metric x run).

Which decode value a cell or point shows (``select_decode``, the rule the tests pin):

- rows of one GPU only (``--gpu``; default: the GPU of the newest usable row, a
  ``cpu`` smoke row never being the default);
- a row is usable when its ``check`` is ``ok`` and its ``gb_s`` is present;
- for each (provider, layout, dtype, head dim, query heads, key/value heads,
  batch, cache length, page size) the row with the latest ``timestamp`` wins;
  of rows of one timestamp, the later in the file. Values may so come from
  different runs (a later run timed only some lengths): such cells are marked
  ``*``, such points hollow;
- the view (``--layout``, ``--dtype``, ``--head-dim``, ``--heads``,
  ``--page-size``; default: contiguous, bfloat16, head dim 128, 32/8 heads)
  keeps one case family; the providers are lazytriton and SDPA.

``--decode --summary`` prints a markdown table: a row per batch (``--batches``,
default every batch of the view), a column per cache length, each cell
"lazytriton GB/s / SDPA GB/s (ratio x)" ("-" for a provider without a value),
then the geomean ratio over the cells with both, the GPU and the date range.
``--decode`` draws a PNG (default ``docs/decode_gbs.png``), the same bytes for
the same CSV: GB/s against the cache length (log2 axis), one panel per batch
(``--batches``, default 1,32), the datasheet peak (``csvlog.memory_peak_gb_s``) dashed.

``--generation --summary`` prints a markdown table: for each (config, batch) of
the GPU (``--gpu``; default: the newest row's device), the newest run's (rows
of one ``time``) prefill ms and generation tokens/s of sdpa and lazytriton,
their ratios (tokens/s lazytriton / sdpa, prefill sdpa / lazytriton: above 1
means lazytriton is faster), lazytriton's and sdpa's logits max error against
float32 with the rule's verdict, and the greedy tokens equal with theirs. The
checks are shown, not filtered: a failed run's row says FAIL.

``--since`` leaves out rows older than an ISO 8601 timestamp (both modes).

Usage: python benchmarks/plot_serving.py --decode [--summary] [--out docs/decode_gbs.png] [--batches 1,32]
           [--layout contiguous|paged] [--gpu NAME] [--csv PATH] [--since TIME]
       python benchmarks/plot_serving.py --generation --summary [--gpu NAME] [--csv PATH] [--since TIME]
(``plot_perf.py --decode ...`` and ``plot_perf.py --generation ...`` run this script.)
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from csvlog import memory_peak_gb_s
from csvread import POSITIVE, POSITIVE_INT, TIME, Row, field, positive_float, positive_int, read_rows, timestamp

if TYPE_CHECKING:
    from matplotlib.artist import Artist

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DECODE_REQUIRED = ("provider", "layout", "dtype", "head_dim", "batch", "heads_q", "heads_k", "cache_len",
                   "page_size", "gb_s", "check", "gpu", "timestamp")
GENERATION_REQUIRED = ("time", "device", "config", "batch", "impl", "metric", "value", "check")
# The decode figure's providers, in legend order, with their colours (plot_perf.py's for lazytriton and SDPA).
PROVIDERS = {"lazytriton": ("lazytriton", "tab:red"), "sdpa": ("SDPA", "tab:blue")}
DEFAULT_BATCHES = (1, 32)
FIGSIZE = (11.0, 4.8)
DPI = 100


def page_size(text: str) -> int:
    """A paged cache's page size, or 0 for a contiguous cache's empty cell."""
    return positive_int(text) if text else 0




def date_range(stamps: Iterable[dt.datetime]) -> str:
    days = sorted({s.astimezone(dt.timezone.utc).date().isoformat() for s in stamps})
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def newest_device(rows: Iterable[Row], usable: Callable[[Row], bool], device: str, time: str) -> str:
    """The ``device`` column of the newest usable row (by ``time``, then file order); never a ``cpu`` smoke row."""
    stamped = [(field(r, time, timestamp, TIME), r.line, r.fields[device]) for r in rows
               if usable(r) and r.fields.get(device) not in (None, "", "cpu")]
    if not stamped:
        raise ValueError(f"rows: no usable row of a GPU (column {device}); expected benchmark results")
    return str(max(stamped)[2])


# Decoding ---------------------------------------------------------------------------------------------------------


class DecodeKey(NamedTuple):
    """One decode value's identity: the latest run's value is shown for it."""

    provider: str
    layout: str
    dtype: str
    head_dim: int
    heads_q: int
    heads_k: int
    batch: int
    cache_len: int
    page_size: int  # 0: a contiguous cache


class DecodePoint(NamedTuple):
    gb_s: float
    gpu: str
    timestamp: dt.datetime


class View(NamedTuple):
    """The case family a table or figure shows (every key field but provider, batch and cache length)."""

    layout: str = "contiguous"
    dtype: str = "bfloat16"
    head_dim: int = 128
    heads_q: int = 32
    heads_k: int = 8
    page_size: int = 0

    def holds(self, key: DecodeKey) -> bool:
        return (key.layout, key.dtype, key.head_dim, key.heads_q, key.heads_k, key.page_size) == tuple(self)

    def __str__(self) -> str:
        cache = f"paged cache ({self.page_size}-key pages)" if self.page_size else f"{self.layout} cache"
        return f"{cache}, {self.dtype}, head dim {self.head_dim}, {self.heads_q}/{self.heads_k} heads"


def decode_usable(row: Row) -> bool:
    """Whether a decode row has a value to show: ``check`` ok and ``gb_s`` present."""
    return (row.fields.get("check") or "").strip() == "ok" and bool((row.fields.get("gb_s") or "").strip())


def select_decode(rows: Iterable[Row], gpu: str) -> dict[DecodeKey, DecodePoint]:
    """For each decode key on ``gpu``, the latest usable row's point (of one timestamp: the later row in the file).

    Pure: the tests call it with made-up rows.
    """
    selected: dict[DecodeKey, DecodePoint] = {}
    for row in rows:
        f = row.fields
        if f.get("gpu") != gpu or not decode_usable(row):
            continue
        key = DecodeKey(f["provider"], f["layout"], f["dtype"],
                        *(field(row, c, positive_int, POSITIVE_INT)
                          for c in ("head_dim", "heads_q", "heads_k", "batch", "cache_len")),
                        field(row, "page_size", page_size, "empty or a positive integer"))
        point = DecodePoint(field(row, "gb_s", positive_float, POSITIVE), gpu, field(row, "timestamp", timestamp, TIME))
        if key not in selected or point.timestamp >= selected[key].timestamp:
            selected[key] = point
    return selected


def in_view(selected: Mapping[DecodeKey, DecodePoint], view: View,
            batches: Iterable[int] | None = None) -> dict[DecodeKey, DecodePoint]:
    """The points of ``view``'s providers and (when given) ``batches``; ValueError if none is left."""
    wanted = None if batches is None else set(batches)
    points = {k: p for k, p in selected.items() if k.provider in PROVIDERS and view.holds(k)
              and (wanted is None or k.batch in wanted)}
    if not points:
        seen = sorted({f"{k.layout} {k.dtype} hd{k.head_dim} {k.heads_q}/{k.heads_k} p{k.page_size}"
                       for k in selected})
        raise ValueError(f"view={view} batches={None if wanted is None else sorted(wanted)}: no lazytriton or sdpa "
                         f"point; the selected rows hold {seen}")
    return points


def _gb_s(point: DecodePoint | None) -> str:
    return "-" if point is None else f"{point.gb_s:.0f}"


def decode_table(selected: Mapping[DecodeKey, DecodePoint], view: View, batches: Iterable[int] | None = None) -> str:
    """The README's decode table: a row per batch, a column per cache length; the geomean ratio, GPU, dates below."""
    points = in_view(selected, view, batches)
    lengths = sorted({k.cache_len for k in points})
    head = ["batch", *(f"{_length_label(n)} keys" for n in lengths)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    newest = max(p.timestamp for p in points.values())
    ratios, earlier = [], 0
    for batch in sorted({k.batch for k in points}):
        cells = [str(batch)]
        for n in lengths:
            base = DecodeKey("", view.layout, view.dtype, view.head_dim, view.heads_q, view.heads_k, batch, n,
                             view.page_size)
            pair = [points.get(base._replace(provider=p)) for p in PROVIDERS]
            if pair == [None, None]:
                cells.append("-")
                continue
            ours, sdpa = pair
            cell = f"{_gb_s(ours)} / {_gb_s(sdpa)}"
            if ours is not None and sdpa is not None:
                ratios.append(ours.gb_s / sdpa.gb_s)
                cell += f" ({ratios[-1]:.2f}x)"
            if any(p is not None and p.timestamp < newest for p in pair):
                earlier += 1
                cell += " *"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    gpu = next(iter(points.values())).gpu
    summary = (f"lazytriton / SDPA geomean {geomean(ratios):.2f}x over {len(ratios)} cases "
               f"({min(ratios):.2f}-{max(ratios):.2f}x)" if ratios else "no case has both providers")
    lines.append(f"\nGB/s, lazytriton / SDPA (ratio); {summary}. {gpu}, {view}, "
                 f"{date_range(p.timestamp for p in points.values())}.")
    if earlier:
        lines.append(f"Cells marked * ({earlier}) come from a run before the newest ({_utc(newest)}), which did not "
                     "time them.")
    return "\n".join(lines)


def _utc(stamp: dt.datetime) -> str:
    return stamp.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def draw_decode(selected: Mapping[DecodeKey, DecodePoint], view: View, batches: Sequence[int], out: Path) -> None:
    """Write the decode figure to ``out`` (PNG): a panel per batch, GB/s by cache length, the datasheet peak dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = in_view(selected, view, batches)
    shown = sorted({k.batch for k in points})
    lengths = sorted({k.cache_len for k in points})
    gpu = next(iter(points.values())).gpu
    peak = memory_peak_gb_s(gpu)
    fig = Figure(figsize=(max(FIGSIZE[0], FIGSIZE[0] * len(shown) / 2), FIGSIZE[1]), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(shown), sharey=True, squeeze=False)[0]
    newest = max(p.timestamp for p in points.values())
    top = max([p.gb_s for p in points.values()] + ([peak] if peak else []))
    for ax, batch in zip(axes, shown, strict=True):
        for provider, (label, color) in PROVIDERS.items():
            found = sorted((k.cache_len, p) for k, p in points.items() if k.provider == provider and k.batch == batch)
            if not found:
                continue
            ax.plot([n for n, _ in found], [p.gb_s for _, p in found], marker="o", color=color, label=label,
                    linewidth=2.2 if provider == "lazytriton" else 1.4)
            older = [(n, p.gb_s) for n, p in found if p.timestamp < newest]
            if older:  # a point a later run did not time: hollow
                ax.plot([n for n, _ in older], [g for _, g in older], linestyle="none", marker="o", color=color,
                        markerfacecolor="white", label=f"{label}, a run before {_utc(newest)}")
        if peak:
            ax.axhline(peak, color="tab:gray", linestyle="--", linewidth=1.0,
                       label=f"datasheet peak ({peak:.0f} GB/s)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [_length_label(n) for n in lengths])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.set_xlabel("cache length (keys)", fontsize=9)
    axes[0].set_ylim(0, top * 1.08)  # shared; from 0 so heights compare
    axes[0].set_ylabel("GB/s (K, V and q read, out written)")
    legend: dict[str, Artist] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=min(len(legend), 3), frameon=False)
    fig.suptitle(f"Decoding (one query a sequence) on the {gpu}: {view}\n(benchmarks/results/decode.csv, "
                 f"{date_range(p.timestamp for p in points.values())})", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", metadata={"Software": None})


# Generation -------------------------------------------------------------------------------------------------------


class Metric(NamedTuple):
    value: str
    check: str


class Run(NamedTuple):
    """The newest run of one (config, batch) on one GPU: its time and each (impl, metric)'s value and check."""

    config: str
    batch: int
    time: dt.datetime
    metrics: Mapping[tuple[str, str], Metric]


def generation_usable(row: Row) -> bool:
    """Whether a transformers row has a value (checks are shown, not filtered)."""
    return bool((row.fields.get("value") or "").strip())


def select_generation(rows: Iterable[Row], gpu: str) -> list[Run]:
    """For each (config, batch) on ``gpu``, its newest run (the rows of its latest ``time``), oldest config first.

    Within the run, of two rows of the same (impl, metric) the later in the file wins. Pure: the tests call it.
    """
    runs: dict[tuple[str, int], tuple[dt.datetime, dict[tuple[str, str], Metric]]] = {}
    for row in rows:
        f = row.fields
        if f.get("device") != gpu or not generation_usable(row):
            continue
        group = (f["config"], field(row, "batch", positive_int, POSITIVE_INT))
        time = field(row, "time", timestamp, TIME)
        if group not in runs or time > runs[group][0]:
            runs[group] = (time, {})
        if time == runs[group][0]:
            runs[group][1][(f["impl"], f["metric"])] = Metric(f["value"].strip(), (f.get("check") or "").strip())
    return sorted((Run(c, b, t, m) for (c, b), (t, m) in runs.items()), key=lambda r: (r.time, r.config))


def _number(run: Run, impl: str, metric: str) -> float | None:
    """A numeric metric of the run, None if absent; ValueError naming config, impl and metric if not a number."""
    found = run.metrics.get((impl, metric))
    if found is None:
        return None
    try:
        return positive_float(found.value)
    except ValueError:
        raise ValueError(f"config={run.config!r} {impl} {metric}={found.value!r}: expected {POSITIVE}") from None


def _pair(run: Run, metric: str, digits: int) -> tuple[str, float | None, float | None]:
    """``sdpa / lazytriton`` of a metric as text ("-" for an absent one), and both values."""
    sdpa, ours = _number(run, "sdpa", metric), _number(run, "lazytriton", metric)
    return " / ".join("-" if v is None else f"{v:.{digits}f}" for v in (sdpa, ours)), sdpa, ours


def _ratio(top: float | None, bottom: float | None) -> str:
    return "-" if top is None or bottom is None else f"{top / bottom:.2f}x"


# bench_transformers.py's config: the model (name, hidden size, heads, layers, dtype), then the cache and prompts.
MODEL_WORDS = re.compile(r"\S+ h\d+ heads \d+/\d+ layers \d+ \S+ ")


def shared_model(configs: Sequence[str]) -> str:
    """The model every config names before its cache and prompts ("" if they differ or one names nothing more)."""
    models = {m.group(0) if (m := MODEL_WORDS.match(c)) else "" for c in configs}
    return models.pop().strip() if len(models) == 1 else ""


def generation_table(runs: Sequence[Run], gpu: str) -> str:
    """The README's generation table: per config, prefill ms and tokens/s of both with ratios, and the checks."""
    if not runs:
        raise ValueError(f"gpu={gpu!r}: no transformers run; expected rows of bench_transformers.py")
    model = shared_model([r.config for r in runs])
    head = ["config", "batch", "prefill ms, sdpa / lazytriton", "prefill speedup", "tokens/s, sdpa / lazytriton",
            "generation speedup", "logits max err vs fp32, sdpa / lazytriton (rule)", "greedy tokens equal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        prefill, sdpa_ms, ours_ms = _pair(run, "prefill_ms", 2)
        tokens, sdpa_tok, ours_tok = _pair(run, "gen_tokens_per_s", 1)
        errors = _pair(run, "logits_max_err_vs_fp32", 3)[0]
        rule = run.metrics.get(("lazytriton", "logits_max_err_vs_fp32")) or run.metrics.get(
            ("sdpa", "logits_max_err_vs_fp32"))
        greedy = run.metrics.get(("lazytriton", "greedy_tokens_equal_of_compared"))
        cells = [run.config.removeprefix(model).strip() or run.config, str(run.batch), prefill,
                 _ratio(sdpa_ms, ours_ms), tokens, _ratio(ours_tok, sdpa_tok),
                 "-" if rule is None else f"{errors} ({rule.check or 'no verdict'})",
                 "-" if greedy is None else f"{greedy.value} ({greedy.check or 'no verdict'})"]
        lines.append("| " + " | ".join(cells) + " |")
    model_note = f"model: {model}; " if model else ""
    lines.append(f"\nSpeedups above 1 mean lazytriton is faster; {model_note}{gpu}, "
                 f"{date_range(r.time for r in runs)}.")
    return "\n".join(lines)


# Command line -----------------------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, comma-separated; got {text!r}")
    return values


def _heads(text: str) -> tuple[int, int]:
    values = _ints(text.replace("/", ","))
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"--heads: expected query/key-value heads such as 32/8; got {text!r}")
    return values[0], values[1]


def _since(text: str) -> dt.datetime:
    try:
        return timestamp(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--since: expected an ISO 8601 timestamp, got {text!r}") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--decode", action="store_true", help="decoding GB/s (decode.csv)")
    which.add_argument("--generation", action="store_true", help="transformers' generation (transformers.csv)")
    parser.add_argument("--summary", action="store_true", help="print the markdown table (draws nothing)")
    parser.add_argument("--csv", type=Path, default=None,
                        help="the CSV (default benchmarks/results/decode.csv or transformers.csv)")
    parser.add_argument("--gpu", default=None, help="this GPU's rows (default: the newest usable row's GPU)")
    parser.add_argument("--since", type=_since, default=None, help="leave out rows older than this ISO 8601 time")
    parser.add_argument("--out", type=Path, default=None, help="the decode PNG (default docs/decode_gbs.png)")
    parser.add_argument("--batches", type=_ints, default=None,
                        help="decode batches, comma-separated (default: the figure 1,32; the table every batch)")
    parser.add_argument("--layout", choices=("contiguous", "paged"), default="contiguous")
    parser.add_argument("--page-size", type=int, default=256, help="a paged view's page size (default 256)")
    parser.add_argument("--dtype", default="bfloat16", help="the CSV's dtype spelling (default bfloat16)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads", type=_heads, default=(32, 8), help="query/key-value heads (default 32/8)")
    args = parser.parse_args(argv)
    if args.generation and not args.summary:
        parser.error("--generation draws no figure: give --summary")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    since = args.since
    if args.generation:
        rows = read_rows(args.csv or RESULTS / "transformers.csv", GENERATION_REQUIRED)
        rows = [r for r in rows if since is None or field(r, "time", timestamp, TIME) >= since]
        gpu = args.gpu or newest_device(rows, generation_usable, "device", "time")
        print(generation_table(select_generation(rows, gpu), gpu))
        return 0
    rows = read_rows(args.csv or RESULTS / "decode.csv", DECODE_REQUIRED)
    rows = [r for r in rows if since is None or field(r, "timestamp", timestamp, TIME) >= since]
    gpu = args.gpu or newest_device(rows, decode_usable, "gpu", "timestamp")
    view = View(args.layout, args.dtype, args.head_dim, *args.heads, args.page_size if args.layout == "paged" else 0)
    selected = select_decode(rows, gpu)
    if args.summary:
        print(decode_table(selected, view, args.batches))
        return 0
    out = args.out or HERE.parent / "docs" / "decode_gbs.png"
    draw_decode(selected, view, args.batches or DEFAULT_BATCHES, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
