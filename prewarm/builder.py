"""Build an image from a plan: reuse what exists, compile the rest in parallel, write the image.

``build`` is resumable. Entries already in the work directory (``OUT.work/``,
see ``workdir``) or in an existing image at ``OUT`` are verified and reused;
so are those a ``cached`` lookup finds (the CLI passes the runtime's tiers for
``--from-misses``: what a run compiled just in time is copied, not compiled
again). Only the rest is compiled, each variant within ``pool.Limits``, the
longest first (``schedule``); one that cannot fit its target
(``limits.refusal``) is refused before compiling.
A variant that fails is reported on the progress stream and recorded in
``OUT.work/failures.jsonl``; the build goes on and the image holds everything
that built. No image is written when nothing built and something failed. The
work directory is removed after a build with no failures (the image then
holds it all), else kept so that a rerun retries only the failures.

The image is compressed while the build runs (``packing``): the variants
whose entries train its dictionary are compiled first, and each entry is
compressed as it arrives, so that after the last compile only the last few
blobs and the file itself are left.

Same inputs, same image bytes: Triton's output was byte-identical across
compiles (cubin and HSACO, checked for sm_90, sm_80 and gfx942 with Triton
3.9), the image orders entries by key and trains its dictionary on the
first of them deterministically, whatever order they arrived in and
whatever -j, and the image meta holds nothing time-dependent. The one
field that differs is each entry's ``provenance.created``: set
``SOURCE_DATE_EPOCH`` and it is that time instead of the compile time.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import lazytriton
from lazytriton.cache_format import Entry
from lazytriton.cache_format.image import Image, ImageError, ImageInfo, write_image
from lazytriton.prewarm.enumeration import Planned
from lazytriton.prewarm.limits import refusal
from lazytriton.prewarm.packing import Packer, compression_threads
from lazytriton.prewarm.pool import Limits, Result, Started, compile_all
from lazytriton.prewarm.progress import Progress
from lazytriton.prewarm.schedule import longest_first, samples_first
from lazytriton.prewarm.workdir import WorkDir, work_dir_for
from lazytriton.record import replace

log = logging.getLogger("lazytriton.prewarm")


@dataclass(slots=True)
class BuildReport:
    """What one build did."""

    out: Path
    work: Path
    planned: int = 0
    reused: int = 0
    from_cache: int = 0
    compiled: int = 0
    failures: list[tuple[Planned, str]] = field(default_factory=list)
    image: ImageInfo | None = None
    compile_seconds: float = 0.0
    seconds: float = 0.0
    compile_times: dict[str, float] = field(default_factory=dict)  # key -> seconds its worker took (the bench reads it)
    write_seconds: float = 0.0  # from the last compile to the image on disk (what compression is left, the file)
    compressed_early: int = 0  # entries compressed before the last compile ended (the bench prints it)
    started: float = 0.0  # time.perf_counter() at the build's start
    # key -> (worker, handed out, answer read), time.perf_counter(): the schedule as it ran (the bench reads it)
    spans: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    workers: Started | None = None  # how the workers were started (forked from the fork server, or plain)

    @property
    def ok(self) -> bool:
        return not self.failures


def image_meta(entries: Sequence[Entry]) -> dict[str, Any]:
    """The image's meta: who built it and with which compilers (no time: same inputs, same bytes)."""
    compilers = sorted({f"{e.provenance.compiler} {e.provenance.compiler_version}" for e in entries})
    return {"built_by": f"lazytriton {lazytriton.__version__} prewarm", "compilers": compilers}


def _open_previous(out: Path) -> Image | None:
    """The image already at ``out``, whose entries a rebuild reuses; None if absent or damaged."""
    if not out.is_file():
        return None
    try:
        return Image(out)
    except (ImageError, OSError) as exc:
        log.warning("existing image %s is not reused: %s", out, exc)
        return None


def _read(key: str, work: WorkDir, previous: Image | None) -> Entry | None:
    entry = work.read(key)
    if entry is None and previous is not None and key in previous:
        try:
            entry = previous.read(key)
        except ImageError as exc:
            log.warning("existing image entry not reused: %s", exc)
    return entry


def _brief(error: str) -> str:
    """A multi-line compiler error as its first and last lines (failures.jsonl keeps it whole)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if len(lines) <= 2:
        return " / ".join(lines)
    return f"{lines[0][:300]} ... {lines[-1][:300]}"


def _copy_cached(todo: Sequence[Planned], cached: Callable[[str], Entry | None], work: WorkDir,
                 created: float | None) -> set[str]:
    """Copy into the work directory each planned entry that ``cached`` holds; their keys."""
    copied = set()
    for planned in todo:
        entry = cached(planned.key)
        if entry is None or entry.key != planned.key:
            continue
        if created is not None:  # as a compile here would have stamped it: same inputs, same bytes
            entry = replace(entry, provenance=replace(entry.provenance, created=created))
        work.write(entry)
        copied.add(planned.key)
    return copied


def _refuse(todo: Sequence[Planned], report: BuildReport, work: WorkDir, stream: TextIO) -> list[Planned]:
    """Record as failures the variants that cannot fit their target; the rest."""
    kept = []
    for planned in todo:
        why = refusal(planned.variant)
        if why is None:
            kept.append(planned)
            continue
        error = f"refused before compiling: {why}"
        report.failures.append((planned, error))
        work.record_failure(str(planned.variant), planned.key, error)
        stream.write(f"prewarm: REFUSED {planned.variant} ({planned.origin}): {why}\n")
    return kept


def build(plan: Sequence[Planned], out: Path, jobs: int, *, created: float | None = None, keep_work: bool = False,
          stream: TextIO = sys.stderr, limits: Limits | None = None,
          cached: Callable[[str], Entry | None] | None = None, codec: str = "zstd-dict") -> BuildReport:
    """Build the image ``out`` holding every variant of ``plan`` that compiles (see the module docstring).

    ``codec``: how its entries are stored (``write_image``'s: ``zstd-dict``, ``zstd`` or ``none``).
    """
    start = time.perf_counter()
    out = Path(out)
    work = WorkDir(work_dir_for(out)).create()
    work.clear_failures()
    report = BuildReport(out, work.path, planned=len(plan), started=start)
    previous = _open_previous(out)
    try:
        with Packer((p.key for p in plan), compression_threads(jobs), codec) as packer:
            _build_into(packer, plan, jobs, report, work, previous, created, stream, limits, cached)
    finally:
        if previous is not None:
            previous.close()
    if report.ok and not keep_work:
        shutil.rmtree(work.path, ignore_errors=True)
    report.seconds = time.perf_counter() - start
    return report


def _build_into(packer: Packer, plan: Sequence[Planned], jobs: int, report: BuildReport, work: WorkDir,
                previous: Image | None, created: float | None, stream: TextIO, limits: Limits | None,
                cached: Callable[[str], Entry | None] | None) -> None:
    """Reuse, compile and write: each entry goes to ``packer`` as it is read, and the image is written from it."""
    for planned in plan:
        entry = None if planned.key in packer else _read(planned.key, work, previous)
        if entry is not None:
            packer.add(entry)
    if cached is not None:
        copied = _copy_cached([p for p in plan if p.key not in packer], cached, work, created)
        report.from_cache = len(copied)
        for key in copied:
            _add_built(packer, key, work)
    report.reused = len(packer)
    todo = _refuse([p for p in plan if p.key not in packer], report, work, stream)
    for planned, _ in report.failures:
        packer.drop(planned.key)  # refused
    if report.reused:
        stream.write(f"prewarm: {report.reused} of {len(plan)} variants already built (in {work.path} or "
                     f"{report.out}{', or in the cache' if cached is not None else ''}); compiling {len(todo)}\n")
    progress = Progress(len(todo), stream)
    if todo:
        progress.begin()

    def on_result(planned: Planned, result: Result) -> None:
        report.compile_seconds += result.seconds
        report.compile_times[planned.key] = result.seconds
        report.spans[planned.key] = (result.worker, result.began, result.ended)
        if result.error is None:
            report.compiled += 1
            _add_built(packer, planned.key, work)
        else:
            packer.drop(planned.key)
            report.failures.append((planned, result.error))
            work.record_failure(str(planned.variant), planned.key, result.error)
            progress.note(f"prewarm: FAILED {planned.variant} ({planned.origin}): {_brief(result.error)}")
        progress.step(failed=result.error is not None)

    report.workers = compile_all(samples_first(longest_first(todo), packer.sample_keys()), jobs, work, created,
                                 on_result, limits)
    written = time.perf_counter()
    report.compressed_early = packer.compressed
    entries = packer.entries
    if entries or not report.failures:  # never an empty image for a build that failed
        report.image = packer.write(report.out, meta=image_meta(entries))
    report.write_seconds = time.perf_counter() - written


def _add_built(packer: Packer, key: str, work: WorkDir) -> None:
    """Give ``packer`` the entry a worker (or the cache) just wrote; one unreadable now is left out of the image."""
    if key in packer:  # a plan that names a variant twice
        return
    entry = work.read(key)  # verified; a damaged file is removed, so a rerun builds it again
    if entry is None:
        packer.drop(key)
    else:
        packer.add(entry)


def entries_of(source: Path) -> Iterator[Entry]:
    """The verified entries of an image file or a work directory; ImageError names a damaged one."""
    if source.is_dir():
        work = WorkDir(source)
        if not work.entries.is_dir():
            raise ImageError(f"merge source {source} is a folder without entries/ (not a prewarm work directory)")
        for key in work.keys():
            entry = work.read(key)
            if entry is None:
                raise ImageError(f"merge source {source}: entry {key} is damaged")
            yield entry
        return
    if not source.is_file():
        raise ImageError(f"merge source {source} does not exist")
    with Image(source) as image:
        for key in list(image.keys()):
            entry = image.read(key)
            if entry is None:  # pragma: no cover - keys() lists only what the index holds
                raise ImageError(f"merge source {source}: entry {key} vanished")
            yield entry


def merge(sources: Sequence[Path], out: Path, codec: str = "zstd-dict") -> tuple[ImageInfo, int]:
    """One image from several images and/or work directories; the first source holding a key wins.

    Returns the image written and how many duplicate keys were left out. ``codec``: how the image stores its
    entries (``write_image``'s).
    """
    entries: dict[str, Entry] = {}
    duplicates = 0
    for source in sources:
        for entry in entries_of(Path(source)):
            if entry.key in entries:
                duplicates += 1
            else:
                entries[entry.key] = entry
    values = list(entries.values())
    return write_image(out, values, codec=codec, meta=image_meta(values)), duplicates

