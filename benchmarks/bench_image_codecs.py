"""Choose the image codec by measurement, on the default sm_90 prewarm set.

The set: flash_fwd for sm_90 over dtype {fp16, bf16, fp32} x head dim {16, 32,
64, 128, 256} x causal {no, yes} x seqlen_q {16, 64, 4096} (seqlen_k =
seqlen_q), aligned, configs from dispatch (tuning table, else defaults),
deduplicated by key. Its entries are compiled once, in parallel, into a scratch
folder (``--scratch``) that later runs reuse.

For each codec it reports the stored bytes against the raw binaries' bytes,
and the median time of one lookup + decompress + verify (``Image.read``) over
every key, plus the median ``Image`` open time. The zstd codecs are measured
through real images (``write_image``); LZMA, which the image format does not
carry, through the same steps by hand (blob checksum, decompress, Entry
decode). The table is printed and its rows are appended to a long-format CSV.

Usage: python benchmarks/bench_image_codecs.py [--scratch DIR] [--csv PATH] [-j N] [--quick]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import datetime as dt
import lzma
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import xxhash

from lazytriton.cache_format import Entry
from lazytriton.cache_format import image as image_format
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import Target
from lazytriton.variant import Variant

DTYPES = ("fp16", "bf16", "fp32")
HEAD_DIMS = (16, 32, 64, 128, 256)
SEQLENS_Q = (16, 64, 4096)
FIELDS = ["codec", "level", "dict_bytes", "dict_k", "dict_d", "entries", "raw_binary_bytes", "raw_entry_bytes",
          "stored_bytes", "ratio", "read_p50_ms", "read_max_ms", "open_p50_ms", "first_read_ms", "write_s",
          "machine", "zstd", "triton", "lazytriton", "timestamp"]
DEFAULT_SCRATCH = Path(tempfile.gettempdir()) / "lazytriton-bench" / "image_codecs" / "sm_90"


def default_variants(target: str = "sm_90") -> list[Variant]:
    """The default prewarm set for ``target``, one variant per key, in key order."""
    by_key: dict[str, Variant] = {}
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            for causal in (False, True):
                for seqlen_q in SEQLENS_Q:
                    variant = fwd_dispatch.flash_fwd_variant(Target.parse(target), dtype, head_dim, causal, True,
                                                             seqlen_q, seqlen_k=seqlen_q)
                    by_key.setdefault(variant.key(), variant)
    return [by_key[key] for key in sorted(by_key)]


def _compile_one(text: str) -> tuple[str, bytes | str]:
    from lazytriton.compiler import CompileError, compile_variant

    variant = Variant.parse(text)
    try:
        return variant.key(), compile_variant(variant).encode()
    except CompileError as exc:
        return variant.key(), str(exc)


def compile_entries(variants: Sequence[Variant], scratch: Path, jobs: int) -> list[Entry]:
    """The entries of ``variants``, compiled into ``scratch/<key>.entry`` unless already there."""
    scratch.mkdir(parents=True, exist_ok=True)
    todo = [v for v in variants if not (scratch / f"{v.key()}.entry").exists()]
    if todo:
        print(f"compiling {len(todo)} of {len(variants)} variants with {jobs} processes into {scratch}", flush=True)
        start = time.perf_counter()
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            for n, (key, result) in enumerate(pool.map(_compile_one, [str(v) for v in todo]), 1):
                if isinstance(result, str):
                    print(f"  failed: {result}", file=sys.stderr)
                    continue
                tmp = scratch / f".{key}.tmp"
                tmp.write_bytes(result)
                os.replace(tmp, scratch / f"{key}.entry")
                print(f"  {n}/{len(todo)} {time.perf_counter() - start:.0f} s", end="\r", flush=True)
        print(f"\ncompiled in {time.perf_counter() - start:.0f} s")
    return [Entry.decode((scratch / f"{v.key()}.entry").read_bytes(), expected_key=v.key())
            for v in variants if (scratch / f"{v.key()}.entry").exists()]


def machine() -> str:
    """The CPU model and core count, for the table."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _p50_ms(samples_ns: Sequence[int]) -> float:
    return statistics.median(samples_ns) / 1e6


def _time_reads(read: Callable[[str], object], keys: Sequence[str], passes: int) -> tuple[float, float]:
    """(median, max) ms of ``read(key)`` over every key, after one warm-up pass."""
    for key in keys:
        read(key)
    times = []
    for _ in range(passes):
        for key in keys:
            start = time.perf_counter_ns()
            read(key)
            times.append(time.perf_counter_ns() - start)
    return _p50_ms(times), max(times) / 1e6


@dataclass(frozen=True)
class Config:
    """One codec setting to measure."""

    codec: str
    level: int = 0
    dict_bytes: int = 0
    dict_k: int = 0
    dict_d: int = 0

    @property
    def label(self) -> str:
        if self.codec == "zstd-dict":
            return f"zstd-{self.level} + dict {self.dict_bytes >> 10} KiB (k={self.dict_k}, d={self.dict_d})"
        if self.codec == "zstd":
            return f"zstd-{self.level}"
        if self.codec.startswith("lzma"):
            return f"{self.codec} preset {self.level}"
        return self.codec


def measure_image(entries: Sequence[Entry], config: Config, workdir: Path, passes: int) -> dict[str, object]:
    """Write a real image with ``config`` and time its reads."""
    path = workdir / "bench.ltimg"
    start = time.perf_counter()
    info = image_format.write_image(path, entries, codec=config.codec, level=max(config.level, 1),
                                    dict_bytes=config.dict_bytes, dict_k=config.dict_k or image_format.DICT_K,
                                    dict_d=config.dict_d or image_format.DICT_D)
    write_s = time.perf_counter() - start
    keys = [e.key for e in entries]
    opens, firsts = [], []
    for key in keys[:: max(1, len(keys) // 20)]:
        start = time.perf_counter_ns()
        image = image_format.Image(path)
        opens.append(time.perf_counter_ns() - start)
        image.read(key)
        firsts.append(time.perf_counter_ns() - start)
        image.close()
    with image_format.Image(path) as image:
        read_p50, read_max = _time_reads(image.read, keys, passes)
    return {"stored_bytes": info.stored_bytes, "read_p50_ms": read_p50, "read_max_ms": read_max,
            "open_p50_ms": _p50_ms(opens), "first_read_ms": _p50_ms(firsts), "write_s": write_s}


def measure_lzma(entries: Sequence[Entry], config: Config, passes: int) -> dict[str, object]:
    """LZMA by hand, as an image would use it: per entry (``lzma``) or one stream for all (``lzma-solid``)."""
    raws = {e.key: e.encode() for e in entries}
    start = time.perf_counter()
    overhead = image_format.HEADER_SIZE + image_format.RECORD_SIZE * len(raws) + 128  # header, index, meta
    if config.codec == "lzma-solid":  # AOTriton's way: the whole family in one stream
        order = sorted(raws)
        offsets, position = {}, 0
        for key in order:
            offsets[key] = (position, len(raws[key]))
            position += len(raws[key])
        solid = lzma.compress(b"".join(raws[k] for k in order), preset=config.level)
        stored = len(solid) + overhead

        def read(key: str) -> Entry:
            everything = lzma.decompress(solid)
            at, size = offsets[key]
            return Entry.decode(everything[at:at + size], expected_key=key)
    else:
        blobs = {key: (lzma.compress(raw, preset=config.level), len(raw)) for key, raw in raws.items()}
        sums = {key: xxhash.xxh3_64_intdigest(blob) for key, (blob, _) in blobs.items()}
        stored = sum(len(blob) for blob, _ in blobs.values()) + overhead

        def read(key: str) -> Entry:
            blob, raw_len = blobs[key]
            if xxhash.xxh3_64_intdigest(blob) != sums[key]:
                raise ValueError("checksum")
            return Entry.decode(lzma.LZMADecompressor().decompress(blob, max_length=raw_len), expected_key=key)
    write_s = time.perf_counter() - start
    keys = sorted(raws)
    read_p50, read_max = _time_reads(read, keys if config.codec == "lzma" else keys[:8], passes)
    return {"stored_bytes": stored, "read_p50_ms": read_p50, "read_max_ms": read_max, "open_p50_ms": 0.0,
            "first_read_ms": read_p50, "write_s": write_s}


def configs(quick: bool) -> list[Config]:
    """What to measure: the plain codecs, then dictionary sizes, then fastCOVER's k and d, then levels."""
    k, d = image_format.DICT_K, image_format.DICT_D
    plain = [Config("none"), Config("lzma", 6), Config("lzma", 9), Config("lzma-solid", 9),
             Config("zstd", 3), Config("zstd", 19), Config("zstd", 22)]
    sizes = [Config("zstd-dict", 19, size << 10, k, d) for size in (64, 256, 512, 1024, 2048)]
    cover = [Config("zstd-dict", 19, 1 << 20, kk, dd) for kk, dd in ((512, 8), (1024, 6), (1024, 8), (2048, 8),
                                                                    (4096, 8), (8192, 6), (16384, 8))]
    levels = [Config("zstd-dict", level, 1 << 20, k, d) for level in (3, 9, 22)]
    if quick:
        return [plain[0], plain[1], plain[5], sizes[0], sizes[3]]
    return plain + sizes + cover + levels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", type=Path, default=DEFAULT_SCRATCH, help="compiled entries, reused across runs")
    parser.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "image_codecs.csv")
    parser.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--passes", type=int, default=5, help="timed read passes over every key")
    parser.add_argument("--quick", action="store_true", help="a few codecs only")
    args = parser.parse_args(argv)

    entries = compile_entries(default_variants(), args.scratch, args.jobs)
    binary_bytes = sum(len(e.binary) for e in entries)
    entry_bytes = sum(len(e.encode()) for e in entries)
    where = machine()
    print(f"{len(entries)} entries (sm_90 default prewarm set): binaries {binary_bytes / 2**20:.2f} MiB, "
          f"encoded entries {entry_bytes / 2**20:.2f} MiB; {where}")
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    common = {"entries": len(entries), "raw_binary_bytes": binary_bytes, "raw_entry_bytes": entry_bytes,
              "machine": where, "zstd": version("zstandard"), "triton": entries[0].provenance.compiler_version,
              "lazytriton": version("lazytriton"), "timestamp": stamp}
    rows = []
    print(f"{'codec':<46} {'ratio':>7} {'MiB':>6} {'read p50 ms':>11} {'read max':>8} {'open ms':>7} "
          f"{'1st read':>8} {'write s':>7}")
    with tempfile.TemporaryDirectory(prefix="lazytriton-bench-") as tmp:
        for config in configs(args.quick):
            if config.codec.startswith("lzma"):
                measured = measure_lzma(entries, config, args.passes)
            else:
                measured = measure_image(entries, config, Path(tmp), args.passes)
            ratio = int(measured["stored_bytes"]) / binary_bytes  # type: ignore[call-overload]
            row = {**common, **measured, "codec": config.label, "level": config.level, "dict_bytes": config.dict_bytes,
                   "dict_k": config.dict_k, "dict_d": config.dict_d, "ratio": round(ratio, 4)}
            rows.append(row)
            print(f"{config.label:<46} {ratio:>7.4f} {int(row['stored_bytes']) / 2**20:>6.2f} "  # type: ignore[call-overload]
                  f"{row['read_p50_ms']:>11.3f} {row['read_max_ms']:>8.3f} {row['open_p50_ms']:>7.3f} "
                  f"{row['first_read_ms']:>8.3f} {row['write_s']:>7.1f}", flush=True)
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    new = not args.csv.exists()
    with args.csv.open("a", newline="") as f:
        writer = csv.DictWriter(f, FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    print(f"appended {len(rows)} rows to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
