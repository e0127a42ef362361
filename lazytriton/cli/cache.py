"""``lazytriton cache``: list, count, verify, explain, bound, clear, export and import cached entries.

    lazytriton cache ls [--tier all|image|local] [--target sm_90,gfx942] [--json]
    lazytriton cache stats [--json]
    lazytriton cache verify [PATH] [--json] # the local tier and images, or one image / cache dir
    lazytriton cache explain [--json] --dtype bf16 --head-dim 128 --seqlen-q 4096 [--seqlen-k N]
                             [--causal none|top_left|bottom_right] [--target sm_90] [--unaligned]
                             [--kernel flash_fwd|flash_bwd|flash_bwd_dq|flash_bwd_dkdv|flash_decode|...]
    lazytriton cache gc [--max-bytes 2G]    # least recently used entries go first; damaged rows, orphaned files
    lazytriton cache clear                  # entries, counters, miss log, compile locks
    lazytriton cache export FILE [--target sm_90,...]   # --out FILE: the same
    lazytriton cache import FILE

Exit status: 0 when all is well, 1 when something checked fails (a damaged
entry, an invalid binary, nothing to export), 2 for a bad argument. Nothing
here writes to a tier except ``gc``, ``clear``, ``import`` and (to its own file) ``export``.
With ``--json``, ``ls``, ``stats``, ``verify`` and ``explain`` print their report as one JSON object
instead (same exit status; errors stay one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lazytriton import config
from lazytriton.cache_format import Entry, EntryError
from lazytriton.cache_format.elf import check_binary
from lazytriton.cache_format.image import Image, ImageError, write_image
from lazytriton.cli.report import Report, emit, image_paths, open_runtime, plural
from lazytriton.misslog import MISS_LOG_MAX_BYTES, summarize
from lazytriton.record import record
from lazytriton.store.local import ORPHAN_GRACE_S, LocalTier


def human_bytes(n: int) -> str:
    """``n`` bytes as B, KiB, MiB or GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def parse_size(text: str) -> int:
    """A byte count such as ``1048576``, ``500M``, ``2G`` or ``1.5GiB`` (binary units)."""
    try:
        return config.parse_size(text, "--max-bytes")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_targets(text: str | None) -> set[str] | None:
    """Canonical target names from ``sm_90,gfx942`` (None: all)."""
    from lazytriton.target import Target

    if not text:
        return None
    return {str(Target.parse(name)) for name in text.split(",") if name.strip()}


@record
class Row:
    """One cached entry as ``ls`` and ``verify`` see it (``entry`` None: it failed to decode)."""

    tier: str
    where: str
    key: str
    size: int
    entry: Entry | None
    problem: str = ""


def local_rows(tier: LocalTier) -> Iterator[Row]:
    """Every row of a local tier, read without side effects and never unpickled.

    A database that cannot be opened is one damaged row (key ``-``): every
    process then runs from memory only, which ``verify`` must not call "all ok".
    """
    if tier.problem is not None:
        yield Row(tier.name, str(tier.directory), "-", 0, None,
                  f"the local cache database cannot be opened ({tier.problem}): every process runs from memory "
                  "only; `lazytriton cache clear` starts it afresh")
        return
    for stored in tier.scan():
        if stored.data is None:
            yield Row(tier.name, str(tier.directory), stored.key, 0, None, stored.problem)
            continue
        try:
            entry = Entry.decode(stored.data, expected_key=stored.key)
            yield Row(tier.name, str(tier.directory), stored.key, len(stored.data), entry)
        except EntryError as exc:
            yield Row(tier.name, str(tier.directory), stored.key, len(stored.data), None, str(exc))


def image_rows(path: Path, tier: str = "image") -> Iterator[Row]:
    """Every entry of one image; an image that does not open yields one row with the problem."""
    try:
        image = Image(path)
    except (ImageError, OSError) as exc:
        yield Row(tier, str(path), "-", 0, None, f"image does not open: {exc}")
        return
    with image:
        for key in image.keys():
            stored = image.sizes(key)[0]
            try:
                yield Row(tier, str(path), key, stored, image.read(key))
            except ImageError as exc:
                yield Row(tier, str(path), key, stored, None, str(exc))
        for key, problem in image.check_order():
            yield Row(tier, str(path), key, 0, None, problem)


def binary_problems(entry: Entry) -> list[str]:
    """Why an entry's binary is not what it claims (kind, target, symbol, launch metadata); empty when it is."""
    from lazytriton.store.probe import launch_problems
    from lazytriton.target import Target

    problems = []
    try:
        expected_kind = Target.parse(entry.target).binary_kind
        if entry.kind != expected_kind:
            problems.append(f"kind {entry.kind} does not fit target {entry.target} ({expected_kind})")
    except ValueError as exc:
        problems.append(str(exc))
    problems += check_binary(entry.kind, entry.target, entry.binary, entry.name)
    return problems + (launch_problems(entry) if not problems else [])


def tier_rows(rt: Any, tier: str = "all") -> list[Row]:
    """The rows of every image on the search path (``image``), of the local tier (``local``), or both (``all``)."""
    rows = [row for p in image_paths(rt) for row in image_rows(p)] if tier in ("all", "image") else []
    return rows + (list(local_rows(rt.local)) if tier in ("all", "local") else [])


# --- commands ---------------------------------------------------------------------------------------------------
# Each report is computed once and rendered by ``report.emit`` (text, or itself with --json).


def ls_report(rt: Any, tier: str, targets: set[str] | None) -> Report:
    """The entries ``ls`` shows, and the images or databases that do not open (``problems``, no entry counted).

    A damaged entry has target, kernel and variant None and says its ``problem``.
    """
    entries, problems = [], []
    for row in tier_rows(rt, tier):
        entry = row.entry
        if entry is None and row.key == "-":  # an image or a database that does not open: no entry at all
            problems.append({"tier": row.tier, "where": row.where, "problem": row.problem})
            continue
        if targets is not None and (entry is None or entry.target not in targets):
            continue
        target, kernel, variant = (None, None, None) if entry is None else (
            entry.target, entry.variant.split(":", 1)[0], entry.variant)
        entries.append({"target": target, "kernel": kernel, "variant": variant, "bytes": row.size, "tier": row.tier,
                        "where": row.where, "key": row.key, "problem": row.problem if entry is None else None})
    return {"entries": entries, "count": len(entries), "problems": problems}


def print_ls(report: Report) -> None:
    """The entries as a table whose columns line up (each as wide as its widest cell), then the problems."""
    rows = [("TARGET", "KERNEL", "SIZE", "TIER", "KEY", "VARIANT")]
    for e in report["entries"]:
        rows.append((e["target"] or "?", e["kernel"] or "?", human_bytes(e["bytes"]), e["tier"], e["key"],
                     e["variant"] if e["problem"] is None else f"DAMAGED: {e['problem']}"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        cells = [row[i].rjust(width) if i == 2 else row[i].ljust(width) for i, width in enumerate(widths)]
        print(" ".join([*cells, row[5]]))
    for problem in report["problems"]:
        print(f"{problem['tier']} {problem['where']}: {problem['problem']}")
    print(plural(report["count"], "entry"))


def cmd_ls(args: argparse.Namespace) -> int:
    emit(args, ls_report(open_runtime(), args.tier, parse_targets(args.target)), print_ls)
    return 0


def stats_report(rt: Any) -> Report:
    """Entries and bytes per tier, the images that do not open, the local counters and the miss log's length."""
    paths = image_paths(rt)
    image_entries = image_bytes = 0
    problems = []
    for path in paths:
        try:
            with Image(path) as image:
                image_entries += image.count
            image_bytes += path.stat().st_size
        except (ImageError, OSError) as exc:
            problems.append({"where": str(path), "problem": f"does not open: {exc}"})
    local = rt.local.stats()
    tiers = {"image": {"entries": image_entries, "bytes": image_bytes, "images": [str(p) for p in paths],
                       "problems": problems},
             "local": {"entries": local.entries, "bytes": local.bytes, "where": str(rt.local.directory),
                       "problem": rt.local.problem}}
    miss_log = summarize(rt.miss_log)
    return {"tiers": tiers, "counters": {"hits": 0, "compiles": 0, "corrupt": 0, **rt.counters()},
            "misses": miss_log["lines"], "miss_log": miss_log}


def print_stats(report: Report) -> None:
    image, local, counters = report["tiers"]["image"], report["tiers"]["local"], report["counters"]
    for problem in image["problems"]:
        print(f"image {problem['where']}: {problem['problem']}")
    print(f"{'TIER':<6} {'ENTRIES':>8} {'BYTES':>10}  WHERE")
    print(f"{'image':<6} {image['entries']:>8} {human_bytes(image['bytes']):>10}  {len(image['images'])} image(s): "
          f"{', '.join(image['images']) or 'none on the search path'}")
    print(f"{'local':<6} {local['entries']:>8} {human_bytes(local['bytes']):>10}  {local['where']}")
    if local["problem"] is not None:
        print(f"local tier unusable: its database cannot be opened ({local['problem']}); running from memory only")
    miss_log = report["miss_log"]
    print(f"hits {counters['hits']}, misses {report['misses']}{'' if miss_log['complete'] else '+'} "
          f"(JIT compiles in the miss log), compiles {counters['compiles']}, corrupt {counters['corrupt']} "
          "(local counters, since the cache was created)")
    if miss_log["problem"] is not None:
        print(f"miss log {miss_log['where']}: {miss_log['problem']}")
    elif not miss_log["complete"]:
        print(f"miss log {miss_log['where']}: counted in its first {MISS_LOG_MAX_BYTES >> 20} MiB only "
              "(the bound on a miss log)")
    others = {k: v for k, v in sorted(counters.items()) if k not in ("hits", "compiles", "corrupt")}
    if others:
        print("other counters: " + ", ".join(f"{k} {v}" for k, v in others.items()))


def cmd_stats(args: argparse.Namespace) -> int:
    emit(args, stats_report(open_runtime()), print_stats)
    return 0


def _rows_to_verify(path: Path | None, rt: Any) -> list[Row]:
    if path is None:
        return tier_rows(rt)
    if path.is_file():
        return list(image_rows(path))
    if path.is_dir():
        for directory in (path / "entries", path):
            if (directory / "cache.db").is_file():
                return list(local_rows(LocalTier(directory)))
        images = sorted(path.glob("*.ltimg"))
        if images:
            return [row for p in images for row in image_rows(p)]
    raise ValueError(f"PATH {path} is not an image, a folder of images or a cache dir")


def verify_report(rows: list[Row]) -> Report:
    """Entries checked, one failure per problem found, how many entries failed, and whether all is ok."""
    failures = []
    failed = 0
    for row in rows:
        problems = [row.problem] if row.entry is None else binary_problems(row.entry)
        failed += bool(problems)
        failures += [{"tier": row.tier, "where": row.where, "key": row.key, "problem": p} for p in problems]
    checked = sum(1 for row in rows if row.key != "-")  # "-": an image or a database that does not open
    return {"checked": checked, "failed": failed, "failures": failures, "ok": failed == 0}


def print_verify(report: Report) -> None:
    for f in report["failures"]:
        print(f"FAIL {f['tier']} {f['where']} {f['key']}: {f['problem']}")
    outcome = f"{report['failed']} failed" if report["failed"] else "all ok"
    print(f"{plural(report['checked'], 'entry')} checked (checksum, decoding, ELF kind, arch and kernel symbol): "
          f"{outcome}")


def cmd_verify(args: argparse.Namespace) -> int:
    report = verify_report(_rows_to_verify(args.path, open_runtime()))
    emit(args, report, print_verify)
    return 0 if report["ok"] else 1


def cmd_gc(args: argparse.Namespace) -> int:
    rt = open_runtime()
    tier = rt.local
    if tier.problem is not None:
        print(f"local tier {tier.directory} cannot be opened ({tier.problem}); {_reset_advice(tier)}", file=sys.stderr)
        return 1
    before = tier.stats()
    damaged = tier.drop_damaged()
    removed, freed = tier.cull(args.max_bytes)
    orphans, orphan_bytes = tier.sweep_orphans()
    after = tier.stats()
    bound = args.max_bytes if args.max_bytes is not None else tier.size_limit
    print(f"removed {plural(removed, 'least recently used entry')} ({human_bytes(freed)}), {damaged} damaged rows and "
          f"{orphans} orphaned files ({human_bytes(orphan_bytes)}, no index row, older than "
          f"{ORPHAN_GRACE_S / 3600:.0f} h); local tier {tier.directory}: {before.entries} -> {after.entries} "
          f"entries, {human_bytes(before.bytes)} -> {human_bytes(after.bytes)} (bound {human_bytes(bound)})")
    return 0


def _reset_advice(tier: LocalTier) -> str:
    """How to make an unusable local tier usable again: ``cache clear``, or what the user must remove first."""
    obstacles = tier.obstacles()
    if obstacles:
        return (f"{', '.join(map(str, obstacles))} is a directory where the database belongs; lazytriton never "
                "removes a directory it did not make: move it away, then run `lazytriton cache clear`")
    return "`lazytriton cache clear` resets it"


def cmd_clear(args: argparse.Namespace) -> int:
    """Remove the local tier's entries and counters, the miss log and the compile locks; images are untouched.

    What is not lazytriton's to remove (a directory at the miss log's or at the
    database's name) is left and named on stderr; exit status 1 when the local
    tier stays unusable because of it.
    """
    rt = open_runtime()
    cache_dir = rt.settings.cache_dir
    entries = rt.local.clear()
    left = []
    misses = _remove_file(rt.miss_log)
    if misses < 0:
        left.append(f"{rt.miss_log} is a directory, not a miss log: left as it is")
    locks = 0
    lock_dir = cache_dir / "locks"
    if lock_dir.is_dir() and not lock_dir.is_symlink():
        for path in lock_dir.iterdir():
            if path.name.endswith(".lock") and not path.is_dir():
                locks += max(_remove_file(path), 0)
    print(f"cleared {cache_dir}: {plural(entries, 'entry')} and the counters (local tier {rt.local.directory}), "
          f"{'the' if misses > 0 else 'no'} miss log, {locks} compile locks; images are untouched")
    for line in left:
        print(f"lazytriton cache clear: {line}", file=sys.stderr)
    if rt.local.obstacles():
        print(f"lazytriton cache clear: the local tier is still unusable: {_reset_advice(rt.local)}", file=sys.stderr)
        return 1
    return 0


def _remove_file(path: Path) -> int:
    """Unlink ``path`` (a link itself, never its target); 1 if it was there, 0 if not, -1 for a directory (left)."""
    try:
        path.unlink()
        return 1
    except FileNotFoundError:
        return 0
    except IsADirectoryError:
        return -1
    except PermissionError:  # unlink(2) of a directory: EISDIR on Linux, EPERM on macOS
        if path.is_dir() and not path.is_symlink():
            return -1
        raise


def cmd_export(args: argparse.Namespace) -> int:
    if args.path is not None and args.out is not None and args.path != args.out:
        raise ValueError(f"PATH {args.path} and --out {args.out} differ; give the image's path once")
    out = args.path if args.path is not None else args.out
    if out is None:
        raise ValueError("PATH (the image file to write) is required: lazytriton cache export PATH")
    rt = open_runtime()
    targets = parse_targets(args.target)
    entries, damaged = [], 0
    for row in local_rows(rt.local):
        if row.entry is None:
            damaged += 1
            print(f"skipped damaged entry {row.key}: {row.problem}", file=sys.stderr)
        elif targets is None or row.entry.target in targets:
            entries.append(row.entry)
    if not entries:
        print(f"nothing to export: the local tier {rt.local.directory} holds no entry"
              f"{' for ' + ','.join(sorted(targets)) if targets else ''}", file=sys.stderr)
        return 1
    info = write_image(out, entries, codec=args.codec, meta={"source": "lazytriton cache export"})
    print(f"wrote {plural(info.entries, 'entry')} ({', '.join(sorted({e.target for e in entries}))}) to {info.path}: "
          f"{human_bytes(info.stored_bytes)}, {info.stored_bytes / max(info.binary_bytes, 1):.3f} of the binaries' "
          f"{human_bytes(info.binary_bytes)} ({info.codec})")
    return 1 if damaged else 0


def cmd_import(args: argparse.Namespace) -> int:
    rt = open_runtime()
    added = present = 0
    failed = []
    for row in image_rows(args.file):
        problems = [row.problem] if row.entry is None else binary_problems(row.entry)  # verify's checks
        if problems or row.entry is None:
            failed.append(row)
            for problem in problems:
                print(f"FAIL {row.key}: {problem}", file=sys.stderr)
            continue
        held = rt.local.peek(row.key)
        if held is not None and held == row.entry.encode():
            present += 1
        elif rt.local.put(row.key, row.entry):
            added += 1
        else:
            failed.append(row)
            print(f"FAIL {row.key}: the local tier {rt.local.directory} did not store it", file=sys.stderr)
    print(f"imported {plural(added, 'entry')} into {rt.local.directory} ({present} already there, "
          f"{len(failed)} failed)")
    return 1 if failed else 0


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``fn`` with a bad value (ValueError naming it) reported as a usage error, exit status 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except ValueError as exc:
            print(f"lazytriton cache {args.cache_command}: error: {exc}", file=sys.stderr)
            return 2

    return run


def add_parser(sub: Any) -> None:
    """Register ``cache`` and its subcommands on the ``lazytriton`` parser's subparsers."""
    cache = sub.add_parser("cache", help="list, count, verify, explain, bound, export and import cached entries")
    commands = cache.add_subparsers(dest="cache_command", required=True)
    ls = commands.add_parser("ls", help="entries of the image and local tiers: target, kernel, size, tier, variant")
    ls.add_argument("--tier", choices=("all", "image", "local"), default="all")
    ls.add_argument("--target", help="only these targets, comma-separated (sm_90,gfx942)")
    ls.set_defaults(fn=_guarded(cmd_ls))
    stats = commands.add_parser("stats", help="entries and bytes per tier; hits, misses, compiles, corrupt")
    stats.set_defaults(fn=_guarded(cmd_stats))
    verify = commands.add_parser("verify", help="checksums and binary validity (ELF kind, arch, kernel symbol)")
    verify.add_argument("path", nargs="?", type=Path, help="an image, a folder of images or a cache dir "
                        "(default: the local tier and every image on the search path)")
    verify.set_defaults(fn=_guarded(cmd_verify))
    ex = commands.add_parser("explain", help="for a described call: variant, tuning row, key, and which tier serves "
                                             "(each kernel of a family: --kernel flash_bwd)")
    from lazytriton.cli.explain import add_arguments, cmd_explain

    add_arguments(ex)
    ex.set_defaults(fn=_guarded(cmd_explain))
    for command in (ls, stats, verify, ex):
        command.add_argument("--json", action="store_true", help="print one JSON object (sorted keys) instead of text")
    gc = commands.add_parser("gc", help="bound the local tier's size (least recently used entries first), "
                                        "drop damaged rows, sweep orphaned files")
    gc.add_argument("--max-bytes", type=parse_size,
                    help="bound in bytes (500M, 2G; default: LAZYTRITON_CACHE_MAX_BYTES, else 4G)")
    gc.set_defaults(fn=_guarded(cmd_gc))
    clear = commands.add_parser("clear", help="remove the local tier's entries and counters, the miss log and "
                                              "the compile locks (images are untouched)")
    clear.set_defaults(fn=_guarded(cmd_clear))
    export = commands.add_parser("export", help="write the local tier's entries to an image")
    export.add_argument("path", nargs="?", type=Path, help="the image file to write")
    export.add_argument("--out", type=Path, help="the same as PATH")
    export.add_argument("--target", help="only these targets, comma-separated")
    export.add_argument("--codec", choices=("zstd-dict", "zstd", "none"), default="zstd-dict",
                        help="how the image stores its entries (prewarm's --codec)")
    export.set_defaults(fn=_guarded(cmd_export))
    imp = commands.add_parser("import", help="copy an image's verified entries into the local tier")
    imp.add_argument("file", type=Path, help="the image to read")
    imp.set_defaults(fn=_guarded(cmd_import))
