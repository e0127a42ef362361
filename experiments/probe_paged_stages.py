"""Whether a paged decoding call wants more pipeline stages than its tuning row gives a contiguous one.

The PTX of the paged split kernel at 2-4 stages keeps no K/V tile in flight in its loop (the block-table read
takes a stage; ``ptx_decode_stages.py``), and bench_decode.py reads paged b1 32k at 0.85x SDPA where the
contiguous call of the same row reads 0.95x. This times bench_decode.py's own cases (one process per config,
its median device time per call, SDPA beside it in the same process) with the split row of each ``--lengths``
bucket replaced by ``--block-n`` keys, ``--warps`` warps and each of ``--stages`` stages, through the user
tuning table (``<cache dir>/tuning/flash_decode.csv``, restored afterwards), and the shipped row as it is
(``row``). ``--page-size`` passes bench_decode.py's page sizes (small pages are gathered, PAGE_GATHER, at the
same rows). Prints, per case, each config's µs, GB/s and ratio to SDPA, and writes bench_decode's CSV rows.

Usage: python3 experiments/probe_paged_stages.py [--lengths 4k,32k] [--batches 1,8] [--stages 2,3,4,5]
       [--block-n 64] [--warps 4] [--head-dim 128] [--page-size 256[,1,16]] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import os
import pathlib
import subprocess
import sys
import tempfile

from lazytriton import record, tuning
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPLIT = decode_dispatch.DECODE_KERNELS[0]


def length(text: str) -> int:
    return int(text[:-1]) * 1024 if text.lower().endswith("k") else int(text)


ROWS = 4  # bench_decode.py's query rows a key/value head: 32/8 heads, one query (the table's seqlen_q bucket)


def override_rows(head_dim: int, lengths: list[int], block_n: int, warps: int, stages: int) -> list[tuning.Row]:
    """The shipped hd ``head_dim`` bf16 split rows of the lengths' buckets, the config replaced.

    Rows of bench_decode's GQA bucket (``ROWS``) only: other buckets' rows (MQA's) serve other calls.
    """
    shipped = tuning.read_table(tuning.table_path(SPLIT))
    buckets = {tuning.bucket(n) for n in lengths}
    rows = [r for r in shipped if r.kernel == SPLIT and r.dtype == "bf16" and r.head_dim == head_dim
            and r.seqlen_k in buckets and r.seqlen_q == tuning.bucket(ROWS) and r.target == "sm_90"]
    if len(rows) != len(buckets):
        raise SystemExit(f"the shipped table has {len(rows)} sm_90 bf16 hd{head_dim} split rows for "
                         f"{len(buckets)} buckets: nothing to replace")
    return [record.replace(r, BLOCK_N=block_n, num_warps=warps, num_stages=stages) for r in rows]


def write_user_table(rows: list[tuning.Row] | None, user_path: pathlib.Path) -> None:
    """The user tuning table holding ``rows`` only (None: no user table: the shipped rows serve)."""
    if rows is None:
        user_path.unlink(missing_ok=True)
    else:
        user_path.parent.mkdir(parents=True, exist_ok=True)
        user_path.write_text(tuning.Table(rows).to_csv())


def run_bench(args: argparse.Namespace, rows: list[tuning.Row] | None, user_path: pathlib.Path,
              out_csv: pathlib.Path) -> None:
    write_user_table(rows, user_path)
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--batches", args.batches,
                    "--lengths", args.lengths, "--layouts", "contiguous,paged", "--head-dims", str(args.head_dim),
                    "--page-size", args.page_size, "--csv", str(out_csv)], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4k,32k")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--stages", default="2,3,4,5")
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", default="256", help="bench_decode.py's --page-size (paged cases a size)")
    parser.add_argument("--csv", type=pathlib.Path, help="bench_decode.py's rows of every config, with a config column")
    args = parser.parse_args()
    lengths = [length(t) for t in args.lengths.split(",")]
    user_path = tuning.user_table_path(SPLIT)
    saved = user_path.read_bytes() if user_path.exists() else None
    configs: list[tuple[str, list[tuning.Row] | None]] = [("row", None)]
    configs += [(f"{args.block_n}x{args.warps}x{s}", override_rows(args.head_dim, lengths, args.block_n, args.warps,
                                                                   int(s))) for s in args.stages.split(",")]
    results: dict[tuple[str, int, int, int], dict[str, tuple[float, float, float]]] = {}
    written: list[dict[str, str]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, rows in configs:
                out_csv = pathlib.Path(tmp) / f"{name}.csv"
                run_bench(args, rows, user_path, out_csv)
                with out_csv.open() as f:
                    got = list(csv.DictReader(f))
                sdpa = {_case(r): float(r["p50_ms"]) for r in got if r["provider"] == "sdpa"}
                for r in got:
                    written.append({"config": name, **r})
                    if r["provider"] != "lazytriton":
                        continue
                    case = _case(r)
                    ms = float(r["p50_ms"])
                    results.setdefault(case, {})[name] = (ms * 1e3, float(r["gb_s"]), sdpa[case] / ms)
    finally:
        if saved is None:
            user_path.unlink(missing_ok=True)
        else:
            user_path.write_bytes(saved)
    if args.csv is not None and written:
        new = not args.csv.exists()
        with args.csv.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(written[0]))
            if new:
                writer.writeheader()
            writer.writerows(written)
    names = [n for n, _ in configs]
    print(f"{'case':<22}" + "".join(f"{n:>24}" for n in names))
    print(f"{'':<22}" + "".join(f"{'us  GB/s  xSDPA':>24}" for _ in names))
    for (layout, page, batch, n), row in sorted(results.items(), key=lambda kv: (kv[0][3], kv[0][2], kv[0][:2])):
        cells = "".join(f"{row[c][0]:>9.1f} {row[c][1]:>6.0f} {row[c][2]:>6.2f}  " if c in row else f"{'-':>24}"
                        for c in names)
        where = f"{layout} p{page}" if page else layout
        print(f"{where:<10} b{batch:<3} {n // 1024:>4}k  " + cells)


def _case(r: dict[str, str]) -> tuple[str, int, int, int]:
    """A bench_decode.py row's case: layout, page size (0: contiguous), batch, keys."""
    return r["layout"], int(r.get("page_size") or 0), int(r["batch"]), int(r["cache_len"])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
