"""Prewarm compresses its image while it compiles: same bytes as ``write_image``, whatever arrives when.

The Packer tests use synthetic entries (a dictionary trains on them: their
binaries share 64-byte pieces); the build tests compile three small variants
for real, with ``DICT_SAMPLES`` lowered so that the early path runs.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytriton import tuning
from lazytriton.cache_format import Entry, Provenance
from lazytriton.cache_format import image as image_format
from lazytriton.cache_format.image import DICT_SAMPLES, Image, choose_compression, write_image
from lazytriton.prewarm import builder, packing
from lazytriton.prewarm.enumeration import Axes, Planned, all_kernels, enumerate_variants
from lazytriton.prewarm.packing import Packer, compression_threads
from lazytriton.prewarm.schedule import samples_first
from lazytriton.prewarm.workdir import WorkDir, work_dir_for
from lazytriton.target import Target

META = {"built_by": "test"}
PLAN = enumerate_variants(Axes(targets=(Target.parse("sm_90"),)), tuning.tables_for(all_kernels()))


def synthetic(n: int, seed: int = 0, size: int = 4096) -> list[Entry]:
    rng = random.Random(seed)
    pool = [rng.randbytes(64) for _ in range(128)]
    return [Entry(
        key=xxhash.xxh3_128_hexdigest(f"packing:{seed}:{i}".encode()), variant="flash_fwd:sm_90:fp16:::",
        target="sm_90", kind="cubin", binary=b"\x7fELF" + b"".join(rng.choice(pool) for _ in range(size // 64)),
        name="flash_fwd_kernel", num_warps=4, num_ctas=1, warp_size=32, shared=0, global_scratch_size=0,
        global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1, arg_types=("*fp16", "i32"),
        hidden_args=(), provenance=Provenance("triton", "3.6.0", "0123456789abcdef", 0.0, 1)) for i in range(n)]


ENTRIES = synthetic(DICT_SAMPLES + 16)


def expected_bytes(entries: list[Entry], folder: Path) -> bytes:
    return write_image(folder / "expected.ltimg", entries, meta=META).path.read_bytes()


def wait_for(condition: object, what: str, deadline_s: float = 120.0) -> None:
    """Poll ``condition()`` until true; fail naming ``what`` after a generous deadline (never a timing test)."""
    end = time.monotonic() + deadline_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < end, f"still waiting for {what} after {deadline_s} s"
        time.sleep(0.01)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.permutations(range(len(ENTRIES))), st.sets(st.integers(0, len(ENTRIES) - 1), max_size=12))
def test_any_arrival_order_and_any_failures_give_write_images_bytes(tmp_path: Path, order: list[int],
                                                                    failed: set[int]) -> None:
    kept = [ENTRIES[i] for i in order if i not in failed]
    with Packer((e.key for e in ENTRIES), threads=2) as packer:
        for i in order:
            if i in failed:
                packer.drop(ENTRIES[i].key)
            else:
                packer.add(ENTRIES[i])
        info = packer.write(tmp_path / "packed.ltimg", META)
    assert info.path.read_bytes() == expected_bytes(kept, tmp_path)


def test_entries_are_compressed_once_the_samples_are_in_before_the_write(tmp_path: Path) -> None:
    samples = sorted(ENTRIES, key=lambda e: e.key)[:DICT_SAMPLES]
    rest = [e for e in ENTRIES if e not in samples]
    with Packer((e.key for e in ENTRIES), threads=2) as packer:
        assert packer.sample_keys() == [e.key for e in samples]
        for entry in rest[:5] + samples:
            packer.add(entry)  # the last sample starts the training, then every entry so far is compressed
        wait_for(lambda: packer.compressed == DICT_SAMPLES + 5, "the entries added so far to be compressed")
        for entry in rest[5:]:
            packer.add(entry)
        wait_for(lambda: packer.compressed == len(ENTRIES), "every entry to be compressed")
        info = packer.write(tmp_path / "packed.ltimg", META)
    assert info.path.read_bytes() == expected_bytes(ENTRIES, tmp_path)
    with Image(info.path) as image:
        assert image.codec_name == "zstd-dict" and not image.verify()


def test_an_unplanned_entry_among_the_samples_retrains_and_the_bytes_still_follow_the_entries(tmp_path: Path) -> None:
    extra = min(synthetic(40, seed=1), key=lambda e: e.key)  # an entry nobody planned, maybe before every sample
    with Packer((e.key for e in ENTRIES), threads=2) as packer:
        for entry in ENTRIES:
            packer.add(entry)
        packer.add(extra)  # the dictionary was trained already, on samples that may no longer be the first
        info = packer.write(tmp_path / "packed.ltimg", META)
    assert info.path.read_bytes() == expected_bytes([*ENTRIES, extra], tmp_path)


def test_a_compression_fits_only_the_samples_and_options_it_was_chosen_for() -> None:
    raws = sorted((e.encode() for e in ENTRIES), key=lambda raw: raw)[:DICT_SAMPLES]
    chosen = choose_compression(raws)
    options = ("zstd-dict", image_format.DEFAULT_LEVEL, image_format.DEFAULT_DICT_BYTES, image_format.DICT_K,
               image_format.DICT_D)
    assert chosen.codec == image_format.CODEC_ZSTD_DICT and chosen.fits(options, raws)
    assert not chosen.fits(options, raws[1:]) and not chosen.fits(("zstd-dict", 3, *options[2:]), raws)
    plain = choose_compression(raws[:3])  # too few samples to train on: plain zstd
    assert plain.codec == image_format.CODEC_ZSTD and plain.dictionary == b""
    with pytest.raises(ValueError, match="at most DICT_SAMPLES"):
        choose_compression([*raws, raws[0]])
    with pytest.raises(ValueError, match="codec must be one of"):
        choose_compression(raws, codec="lzma")


def test_a_packer_refuses_an_entry_given_twice_and_its_threads_follow_the_workers() -> None:
    with Packer([], threads=1) as packer, pytest.raises(ValueError, match="given twice"):
        packer.add(ENTRIES[0])
        packer.add(ENTRIES[0])
    assert [compression_threads(j) for j in (1, 8, 9, 16, 64)] == [1, 1, 2, 2, 8]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 30), unique=True, max_size=20), st.sets(st.integers(0, 30)))
def test_samples_first_moves_the_samples_ahead_and_keeps_each_part_in_order(picked: list[int],
                                                                            samples: set[int]) -> None:
    plan = [PLAN[i] for i in picked]
    keys = {PLAN[i].key for i in samples}
    ordered = samples_first(plan, keys)
    assert sorted(p.key for p in ordered) == sorted(p.key for p in plan)
    ahead = [p for p in ordered if p.key in keys]
    assert ordered[:len(ahead)] == ahead == [p for p in plan if p.key in keys]
    assert ordered[len(ahead):] == [p for p in plan if p.key not in keys]


def quick_plan() -> list[Planned]:
    axes = Axes(targets=(Target.parse("sm_90"),), kernels=("flash_fwd",), dtypes=("fp16",), head_dims=(16,),
                causal=(False,))
    return enumerate_variants(axes, tuning.tables_for(("flash_fwd",)))


def test_a_build_compiles_the_samples_first_and_its_bytes_do_not_depend_on_j(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Two samples of three variants: the dictionary's samples are known before the last compile (too few
    # to train on, so plain zstd, but the early path runs: chosen, then each entry compressed as it comes).
    monkeypatch.setattr(packing, "DICT_SAMPLES", 2)
    monkeypatch.setattr(image_format, "DICT_SAMPLES", 2)
    plan = quick_plan()
    assert len(plan) == 3
    images = {}
    for jobs in (1, 2):
        out = tmp_path / f"j{jobs}.ltimg"
        report = builder.build(plan, out, jobs, created=0.0, keep_work=True)
        assert report.ok and report.compiled == 3
        images[jobs] = out.read_bytes()
        if jobs == 1:  # one worker: the order of the answers is the order handed out, the two samples first
            # (each part longest first, so the samples' own order is the estimate's, not their keys'; compared as
            # a list it broke whenever a source change reordered the keys)
            assert set(list(report.compile_times)[:2]) == set(sorted(p.key for p in plan)[:2])
    assert images[1] == images[2]
    work = WorkDir(work_dir_for(tmp_path / "j1.ltimg"))
    entries = [work.read(key) for key in work.keys()]
    assert images[1] == write_image(tmp_path / "direct.ltimg", [e for e in entries if e is not None],
                                    meta=builder.image_meta([e for e in entries if e is not None])).path.read_bytes()
