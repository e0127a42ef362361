"""``lazytriton tune --kernel flash_decode``: tune the decoding kernels over a grid of serving shapes.

A decoding call (``flash_attn_with_kvcache``) launches ``flash_decode_split``
and, when the split heuristic cuts the keys in several splits,
``flash_decode_combine``; ``binding.launch_gpu(..., forced=...)`` launches a
candidate pair exactly as a call does (the same split count, workspace and
grids). The tuning table keys a row by the packed query rows per key/value
head (column ``seqlen_q``: group size x queries) and the cache's capacity
(column ``seqlen_k``); batch and layout are not in the key. So one row must
serve batch 1 and batch 64, a contiguous and a paged cache: each bucket's
candidates are timed on every case of the grid that falls in it (layouts x
batches), and the winner is the candidate that loses least on its worst case
against each case's best time, the geometric mean breaking near ties
(``common.pick``; no case may be wrong). A paged case
caps BLOCK_N at its page size, as dispatch does (pages under
``dispatch.GATHER_BELOW`` keys are gathered, PAGE_GATHER=true, and cap nothing).

The split kernel is swept first with the combine kernel at dispatch's
current choice, then the combine kernel with the split kernel at the winner,
on the cases that split (a bucket where no case splits gets no combine row).
A row's ``tflops`` is the geometric mean of 4 x batch x heads x length x
head_dim over the pair's time (decoding's TFLOP/s are small; the GB/s, the
figure that matters, is printed).

The split count is not a column: it depends on the batch, which the table
does not key. The heuristic (``binding.splits_for``: FlashAttention-2's, with
SMs x ``programs_per_sm`` slots, by the candidate split kernel's shared memory,
and splits of at least ``min_split_keys``) is timed as calls run it (which
cases need the combine at all is decided at ``PROGRAMS_PER_SM`` a SM, the
most slots); ``--splits-report`` also times forced split counts
with the winners and prints how far the heuristic is from the best, so its
inputs can be revised from a measurement.

Everything but the GPU timing is pure (``candidates``, ``sweep_variants``,
``case_splits``, ``tune_bucket`` with an injected timer, ``rows_for``) and
tested on CPU (tests/test_tune_decode.py).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from lazytriton import geometry, tuning
from lazytriton.cli.tune import common
from lazytriton.driver.gpu import DriverError
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

SPLIT, COMBINE = decode_dispatch.DECODE_KERNELS
MAX_ERROR = 2e-2  # max abs error of batch 0's output against a float32 reference (bench_decode.py's rule)
DEFAULT_BATCHES = (1, 8, 32, 64)
DEFAULT_LENGTHS = (1024, 4096, 16384, 32768)
DEFAULT_HEADS = ((32, 8),)  # bench_decode.py's GQA (Llama-3-8B); add 32/32 (MHA) or 64/8 for other buckets
DEFAULT_PAGE = 256

# (BLOCK_N, num_warps, num_stages) of the split kernel, at each BLOCK_M from 16 up to the rows' class
# (decode_rows_class): a tile of fewer rows than a key/value head's group (MQA's 32) runs more programs, each reading
# the head's keys for part of its rows (the rest from L2), where the class's one tile a head would need splits and
# a combine to fill the GPU (H100, MQA 32/1 at batch 64 and 1k keys: 16-row tiles 17.5 µs a call, 32-row 20.2 at
# their best split count).
# Around the default (64, 4, 3; paged 5 stages): key tiles of 32-256 keys (16-64 KB of K and V a step at head dim
# 128), 2-8 warps, 2-5 stages. One warp is left out: it takes 1.3-3x the time of 2-4 warps at batch 1 (H100,
# ``experiments/probe_split_variants.py``).
_SPLIT = ((64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 4, 5), (64, 8, 3), (64, 2, 3), (128, 4, 2), (128, 4, 3),
          (128, 4, 4), (128, 8, 3), (128, 8, 4), (32, 4, 2), (32, 4, 3), (32, 4, 5), (32, 2, 4), (256, 8, 2),
          (256, 8, 3))
# (BLOCK_M, BLOCK_N, num_warps) of the combine kernel (rows, splits read per lse step), one stage (no loop to pipeline).
_COMBINE = ((16, 16, 4), (16, 16, 2), (16, 8, 1), (32, 16, 4), (64, 16, 4), (16, 32, 4), (32, 32, 8))

# time(case, split variant, combine variant) -> (median ms of the call's launches, max abs error)
Timer = Callable[["Case", Variant, Variant], tuple[float, float]]


class Case(NamedTuple):
    """One decoding shape of the grid: one query per sequence, every sequence at the cache's length."""

    layout: str  # "contiguous" or "paged"
    batch: int
    cache_len: int
    heads_q: int
    heads_k: int
    head_dim: int
    dtype: str
    page_size: int = DEFAULT_PAGE

    @property
    def paged(self) -> bool:
        return self.layout == "paged"

    @property
    def rows(self) -> int:
        """Packed query rows per key/value head: the group size (one query)."""
        return self.heads_q // self.heads_k

    @property
    def capacity(self) -> int:
        """Keys per sequence the cache holds (whole pages when paged)."""
        return -(-self.cache_len // self.page_size) * self.page_size if self.paged else self.cache_len

    @property
    def bytes(self) -> int:
        """K and V read, q read and out written (bench_decode.py's count)."""
        size = 4 if self.dtype == "fp32" else 2
        return size * self.batch * self.head_dim * (2 * self.cache_len * self.heads_k + 2 * self.heads_q)

    @property
    def flops(self) -> float:
        return 4.0 * self.batch * self.heads_q * self.cache_len * self.head_dim

    @property
    def bucket(self) -> tuple[int, int]:
        """The table's (seqlen_q, seqlen_k) buckets this case is timed for."""
        return tuning.bucket(self.rows), tuning.bucket(self.capacity)


def grid(dtype: str, head_dim: int, heads: Sequence[tuple[int, int]], batches: Sequence[int],
         lengths: Sequence[int], layouts: Sequence[str], page_size: int = DEFAULT_PAGE) -> list[Case]:
    """The cases of one (dtype, head dim) group, in (heads, length, layout, batch) order (pure)."""
    return [Case(layout, b, n, hq, hk, head_dim, dtype, page_size)
            for hq, hk in heads for n in lengths for layout in layouts for b in batches]


def by_bucket(cases: Sequence[Case]) -> dict[tuple[int, int], list[Case]]:
    """The cases grouped by the table row that serves them (pure)."""
    groups: dict[tuple[int, int], list[Case]] = {}
    for case in cases:
        groups.setdefault(case.bucket, []).append(case)
    return groups


def _fits(target: Target, dtype: str, head_dim: int, cfg: Config) -> bool:
    """Whether the split kernel's K and V stages fit the target's shared memory (a lower bound; unknown: yes)."""
    from lazytriton.prewarm.limits import KNOWN_TARGETS

    limits = KNOWN_TARGETS.get(str(target))
    if limits is None:
        return True
    size = 4 if dtype == "fp32" else 2
    buffers = max(1, cfg.num_stages - 1)
    return buffers * 2 * cfg.block_n * geometry.padded_head_dim(head_dim) * size <= limits.shared


def candidates(kernel: str, target: Target, dtype: str, head_dim: int, rows: int) -> list[Config]:
    """Configs worth timing for one kernel and rows bucket (pure): dispatch's default first, then the grid.

    Split tiles wider than 64 keys are left out at head dim 256 and fp32
    (registers), and any whose K/V stages cannot fit the target's shared
    memory; AMD gets at most 2 stages and waves_per_eu 2, as its default.
    """
    if kernel not in decode_dispatch.DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {decode_dispatch.DECODE_KERNELS}, got {kernel!r}")
    padded = geometry.padded_head_dim(head_dim)
    default = decode_dispatch.decode_default_config(kernel, target, dtype, padded, rows)
    hip = target.backend == "hip"
    waves = 2 if hip else 0
    if kernel == COMBINE:
        configs = [Config(m, n, w, 1, waves) for m, n, w in _COMBINE]
    else:
        row_tiles = [m for m in (16, 32, 64) if m <= decode_dispatch.decode_rows_class(rows)]
        wide = padded == 256 or dtype == "fp32"
        configs = [Config(m, n, w, min(s, 2) if hip else s, waves) for m in reversed(row_tiles)
                   for n, w, s in _SPLIT if not (wide and n > 64)]
        configs = [c for c in configs if _fits(target, dtype, padded, c)]
    return [default, *(c for c in dict.fromkeys(configs) if c != default)]


def variant_for(kernel: str, target: Target, case: Case, config: Config | None,
                table: tuning.Table | None = None) -> Variant:
    """The variant a call of ``case`` runs with ``config`` (None: dispatch's choice), aligned and 32-bit (pure)."""
    page = case.page_size if case.paged else 0
    return decode_dispatch.decode_variant(kernel, target, case.dtype, case.head_dim, False, True, case.rows,
                                          case.capacity, config=config, table=table, page_size=page,
                                          paged=case.paged and kernel == SPLIT)


def cut_to_page(config: Config, case: Case) -> Config:
    """A split config as dispatch serves it to ``case``: BLOCK_N no wider than the page allows."""
    if not case.paged:
        return config
    limit = decode_dispatch.key_block_limit(case.page_size)
    return Config(config.block_m, min(config.block_n, limit), config.num_warps, config.num_stages,
                  config.waves_per_eu)


def sweep_variants(target: Target, cases: Sequence[Case], table: tuning.Table | None = None
                   ) -> dict[str, dict[Case, list[Variant]]]:
    """For each kernel and case: each candidate's variant (pure); the combine kernel's list starts with dispatch's.

    Index i of every case's list is the same candidate config, so a
    candidate's times over the cases line up, and the row written for the
    winner makes dispatch run exactly what was timed on every case. The
    split kernel's current choice is not a candidate of its own: without a
    row it differs by layout (the paged default takes 5 stages), which one
    row cannot say; both defaults are among the candidates. The combine
    kernel does not see the layout, so its current choice (index 0) is the
    partner of the split sweep.
    """
    sweeps: dict[str, dict[Case, list[Variant]]] = {SPLIT: {}, COMBINE: {}}
    for case in cases:
        split = candidates(SPLIT, target, case.dtype, case.head_dim, case.rows)
        sweeps[SPLIT][case] = [variant_for(SPLIT, target, case, cut_to_page(c, case)) for c in split]
        combine = candidates(COMBINE, target, case.dtype, case.head_dim, case.rows)
        sweeps[COMBINE][case] = [variant_for(COMBINE, target, case, None, table),
                                 *(variant_for(COMBINE, target, case, c) for c in combine)]
    return sweeps


def case_splits(case: Case, block_m: int, block_n: int, slots: int) -> int:
    """The split count a call of ``case`` gets from the heuristic on a GPU of ``slots`` (SMs x programs) (pure)."""
    from lazytriton.kernels.flash_decode import binding
    from lazytriton.kernels.flash_decode.checks import Call

    rows_c = case.batch * case.capacity // case.page_size if case.paged else case.batch
    call = Call(case.batch, case.heads_q, case.heads_k, 1, case.head_dim, 0, case.capacity,
                case.page_size if case.paged else 0, rows_c, case.cache_len, False, 1.0)
    return binding.splits_for(call, block_m, block_n, slots, binding.min_split_keys(case.head_dim))


def _sweep(kernel: str, variants: dict[Case, list[Variant]], partner: dict[Case, Variant], cases: Sequence[Case],
           timer: Timer, failed: frozenset[str]) -> tuple[int, list[float]] | None:
    """(index of the winning candidate, its ms per case) of one kernel over ``cases``, the partner fixed."""
    count = len(variants[cases[0]])
    times: list[list[float | None]] = [[] for _ in range(count)]
    for case in cases:  # cases outermost: the GPU timer allocates one case's tensors at a time
        for i, variant in enumerate(variants[case]):
            if str(variant) in failed:
                times[i].append(None)
                continue
            pair = (variant, partner[case]) if kernel == SPLIT else (partner[case], variant)
            try:
                ms, err = timer(case, *pair)
            except DriverError as exc:  # e.g. more shared memory than the estimate said: not a candidate
                print(f"  skipped {variant.tuned} {dict(variant.options)}: {exc}", file=sys.stderr)
                times[i].append(None)
                continue
            times[i].append(ms if err <= MAX_ERROR and math.isfinite(ms) else None)
    won = common.pick(common.score(times))
    if won is None:
        return None
    return won, [t for t in times[won] if t is not None]



class Won(NamedTuple):
    """A bucket's winners: the split and combine variants per case, and the pair's ms per case."""

    split: dict[Case, Variant]
    combine: dict[Case, Variant]  # dispatch's current choice where not tuned
    ms: dict[Case, float]
    combine_tuned: bool  # False: no case of the bucket splits (or no combine candidate worked)


def tune_bucket(cases: Sequence[Case], sweeps: dict[str, dict[Case, list[Variant]]], timer: Timer, slots: int,
                failed: frozenset[str] = frozenset()) -> Won | None:
    """One bucket's winners: the split kernel over every case, then the combine kernel on the cases that split.

    None when no split candidate is correct on every case.
    """
    combine_now = {case: sweeps[COMBINE][case][0] for case in cases}
    split = _sweep(SPLIT, sweeps[SPLIT], combine_now, cases, timer, failed)
    if split is None:
        return None
    split_won = {case: sweeps[SPLIT][case][split[0]] for case in cases}
    ms = dict(zip(cases, split[1], strict=True))
    splitting = [c for c in cases
                 if case_splits(c, int(split_won[c].get("BLOCK_M")), int(split_won[c].get("BLOCK_N")), slots) > 1]
    combine = _sweep(COMBINE, sweeps[COMBINE], split_won, splitting, timer, failed) if splitting else None
    if combine is None:
        return Won(split_won, combine_now, ms, False)
    ms.update(zip(splitting, combine[1], strict=True))
    return Won(split_won, {case: sweeps[COMBINE][case][combine[0]] for case in cases}, ms, True)


def rows_for(won: Won, cases: Sequence[Case], gpu: str, measured: str) -> list[tuning.Row]:
    """The tuning rows that make dispatch pick the winners for the bucket's calls (pure).

    The split row holds the contiguous cases' variant where there is one (a
    paged call cuts its BLOCK_N to its page, as the variants timed did).
    """
    rate = math.exp(math.fsum(math.log(c.flops / won.ms[c] / 1e9) for c in cases) / len(cases))
    first = next((c for c in cases if not c.paged), cases[0])
    picks = [won.split[first]] + ([won.combine[first]] if won.combine_tuned else [])
    return [tuning.Row(v.target, v.kernel, v.dtype, int(v.get("BLOCK_D")), False, first.bucket[0], first.bucket[1],
                       int(v.get("BLOCK_M")), int(v.get("BLOCK_N")), int(v.get("num_warps")),
                       int(v.get("num_stages")), int(dict(v.options).get("waves_per_eu", 0)), round(rate, 3), gpu,
                       measured) for v in picks]


# ---------------------------------------------------------------------------
# On the GPU


def make_inputs(case: Case, seed: int = 0, device: str = "cuda") -> dict[str, Any]:
    """Tensors of one case (bench_decode.py's: random cache, a random block table when paged) and the reference.

    The reference is batch element 0's output in float32, (heads_q, head_dim).
    """
    import torch

    from lazytriton.kernels.flash_decode import checks

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[case.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    b, hk, d = case.batch, case.heads_k, case.head_dim

    def randn(*shape: int) -> Any:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = randn(b, 1, case.heads_q, d)
    lens = torch.full((b,), case.cache_len, dtype=torch.int32, device=device)
    table = None
    if case.paged:
        pages = case.capacity // case.page_size
        k_cache, v_cache = randn(b * pages, case.page_size, hk, d), randn(b * pages, case.page_size, hk, d)
        table = torch.randperm(b * pages, generator=gen, device=device).reshape(b, pages).to(torch.int32)
        k0 = k_cache[table[0].long()].reshape(-1, hk, d)[:case.cache_len]
        v0 = v_cache[table[0].long()].reshape(-1, hk, d)[:case.cache_len]
    else:
        k_cache, v_cache = randn(b, case.cache_len, hk, d), randn(b, case.cache_len, hk, d)
        k0, v0 = k_cache[0], v_cache[0]
    t = checks.Inputs(q, k_cache, v_cache, None, None, lens, None, table)
    call = checks.check(t)
    group = case.rows
    k0, v0 = (x.float().repeat_interleave(group, 1) for x in (k0, v0))  # (len, heads_q, d)
    scores = torch.einsum("hd,nhd->hn", q[0, 0].float(), k0) * call.scale
    ref = torch.einsum("hn,nhd->hd", scores.softmax(-1), v0)
    return {"t": t, "call": call, "ref": ref}


def gpu_timer(reps: int) -> Timer:
    """Time a (split, combine) pair launched as a call launches it (``binding.launch_gpu``, forced).

    One case's tensors are allocated at a time (the sweeps walk cases outermost).
    """
    from lazytriton.cli.timing import event_ms
    from lazytriton.kernels.flash_decode import binding

    held: dict[Case, dict[str, Any]] = {}

    def time_pair(case: Case, split: Variant, combine: Variant) -> tuple[float, float]:
        if case not in held:
            held.clear()  # free the last case's cache first
            held[case] = make_inputs(case)
        inputs = held[case]
        t, call = inputs["t"], inputs["call"]
        out, lse = binding.empty_outputs(t.q, call)

        def launch() -> None:
            binding.launch_gpu(t, out, lse, call, forced=(split, combine))

        launch()
        err = float((out[0, 0].float() - inputs["ref"]).abs().max())
        return event_ms(launch, reps=reps), err

    return time_pair


def _time_forced(inputs: dict[str, Any], split: Variant, combine: Variant, splits: int, reps: int) -> float:
    """The time (ms) of a call of ``inputs`` with its split count forced to ``splits`` (GPU)."""
    from lazytriton.cli.timing import event_ms
    from lazytriton.kernels.flash_decode import binding

    t, call = inputs["t"], inputs["call"]._replace(num_splits=splits)
    out, lse = binding.empty_outputs(t.q, call)
    return event_ms(lambda: binding.launch_gpu(t, out, lse, call, forced=(split, combine)), reps=reps)


def splits_report(won: Won, cases: Sequence[Case], reps: int) -> None:
    """Print, per case, the heuristic's split count and time beside the best forced count's (GPU).

    The heuristic's count is the one a call runs: its slots come from the loaded split kernel's shared memory
    (``binding.gpu_slots``), not the most slots the sweeps assume.
    """
    import torch

    from lazytriton import runtime
    from lazytriton.kernels.flash_decode import binding

    device = torch.cuda.current_device()
    for case in cases:
        inputs = make_inputs(case)
        split, combine = won.split[case], won.combine[case]
        slots = binding.gpu_slots(device, getattr(runtime.get().kernel(split, device), "shared", 0))
        chosen = case_splits(case, int(split.get("BLOCK_M")), int(split.get("BLOCK_N")), slots)
        timed = {n: _time_forced(inputs, split, combine, n, reps) for n in sorted({1, 2, 4, 8, 16, 32, 64, chosen})}
        best = min(timed, key=timed.__getitem__)
        print(f"    splits {case.layout:<10} b{case.batch:<3} {case.cache_len:>6}: heuristic {chosen} "
              f"{timed[chosen] * 1e3:.1f} us, best {best} {timed[best] * 1e3:.1f} us "
              f"({timed[chosen] / timed[best]:.2f}x)")
        del inputs  # free this case's cache before the next


def tune_group(target: Target, dtype: str, head_dim: int, cases: Sequence[Case], jobs: int, reps: int, gpu: str,
               slots: int, report: bool = False) -> list[tuning.Row]:
    """Rows for one (dtype, head dim) group: per bucket of the grid, the split and combine winners."""
    sweeps = sweep_variants(target, cases)
    needed = list(dict.fromkeys(v for vs in sweeps.values() for lst in vs.values() for v in lst))
    failures = common.compile_all(needed, jobs)
    timer = gpu_timer(reps)
    rows: list[tuning.Row] = []
    today = dt.date.today().isoformat()
    for (rows_b, cap_b), bucket_cases in by_bucket(cases).items():
        won = tune_bucket(bucket_cases, sweeps, timer, slots, frozenset(failures))
        if won is None:
            print(f"  no split candidate worked on every case of {dtype} hd{head_dim} rows {rows_b} cache {cap_b}",
                  file=sys.stderr)
            continue
        rows += rows_for(won, bucket_cases, gpu, today)
        for case in bucket_cases:
            v = won.split[case]
            print(f"  {dtype} hd{head_dim} {case.heads_q}/{case.heads_k} {case.layout:<10} b{case.batch:<3} "
                  f"{case.cache_len:>6}: BLOCK_N={v.get('BLOCK_N')} warps={v.get('num_warps')} "
                  f"stages={v.get('num_stages')} {case.bytes / won.ms[case] / 1e6:.0f} GB/s")
        if report:
            splits_report(won, bucket_cases, reps)
    return rows


CAUSAL_APPLIES = False  # one query a sequence: a causal mask hides nothing, so the rows are causal=False only


def tune(kernels: Sequence[str], target: Target, dtype: str, head_dim: int, causal: bool,
         args: argparse.Namespace, gpu: str) -> list[tuning.Row]:
    """The rows for one (dtype, head dim) group of ``lazytriton tune``, over the grid of its flags."""
    import torch

    from lazytriton.kernels.flash_decode import binding

    cases = grid(dtype, head_dim, args.heads, args.batches, args.lengths, args.layouts, args.page_size)
    slots = binding.gpu_slots(torch.cuda.current_device())
    return tune_group(target, dtype, head_dim, cases, args.jobs, args.reps, gpu, slots, args.splits_report)


def _ints(text: str) -> list[int]:
    """Comma-separated positive ints, 4k = 4096 (argparse type)."""
    try:
        values = [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in common.csv_list(text)]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers (4k = 4096), got {text!r}")
    return values


def _heads(text: str) -> list[tuple[int, int]]:
    """Comma-separated heads_q/heads_k pairs, heads_q a multiple of heads_k (argparse type)."""
    pairs = []
    for item in common.csv_list(text):
        q, _, k = item.partition("/")
        if not (q.isdigit() and k.isdigit() and int(k) > 0 and int(q) % int(k) == 0):
            raise argparse.ArgumentTypeError(f"--heads items must look like 32/8 (query heads a multiple of "
                                             f"key/value heads), got {item!r}")
        pairs.append((int(q), int(k)))
    if not pairs:
        raise argparse.ArgumentTypeError(f"--heads: expected pairs like 32/8, got {text!r}")
    return pairs


def _layouts(text: str) -> list[str]:
    values = common.csv_list(text)
    if not values or not set(values) <= {"contiguous", "paged"}:
        raise argparse.ArgumentTypeError(f"--layouts: expected a subset of contiguous,paged, got {text!r}")
    return values


def _page_size(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--page-size must be a positive integer (keys a page), got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The decoding grid's flags (--kernel flash_decode); defaults are bench_decode.py's grid."""
    group = parser.add_argument_group("flash_decode's grid")
    group.add_argument("--batches", type=_ints, default=list(DEFAULT_BATCHES), help="default 1,8,32,64")
    group.add_argument("--lengths", type=_ints, default=list(DEFAULT_LENGTHS),
                       help="cache lengths, default 1k,4k,16k,32k")
    group.add_argument("--layouts", type=_layouts, default=["contiguous", "paged"])
    group.add_argument("--heads", type=_heads, default=list(DEFAULT_HEADS),
                       help="query/key-value heads, default 32/8 (each group size is a table bucket)")
    group.add_argument("--page-size", type=_page_size, default=DEFAULT_PAGE, help="keys per page, default 256")
    group.add_argument("--splits-report", action="store_true",
                       help="also time forced split counts with the winners and print the heuristic's distance")
