"""Prewarm: enumeration (pure, made-up tables), then real builds of small sm_90 and gfx942 variants.

The builds compile head dim 16 fp16 variants (well under a second each) with ``-j 2``; every
image here holds real cubins and HSACO, none is launched. ``SOURCE_DATE_EPOCH`` is set for all
builds, so the same inputs must give the same image bytes.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import run_python

from lazytriton import geometry, record, tuning
from lazytriton.cache_format.image import Image
from lazytriton.cli import main as cli_main
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.prewarm import enumeration
from lazytriton.prewarm.enumeration import (
    DEFAULT_SEQLENS,
    Axes,
    in_shard,
    parse_shard,
    select_shard,
    variants_from_misses,
)
from lazytriton.prewarm.progress import Progress, format_duration, render
from lazytriton.target import Target
from lazytriton.variant import Variant

SM90, SM80, GFX942 = Target.parse("sm_90"), Target.parse("sm_80"), Target.parse("gfx942")
FWD = ("flash_fwd",)  # these tests are of the forward's plan; tests/test_families.py has the backward's
EMPTY = tuning.Table(())
EPOCH = "1700000000"


def enumerate_variants(axes: Axes, table: tuning.Table) -> list[Any]:
    """The plan without flash_fwd_gluon's twins (test_plan_holds_the_gluon_twin_of_each_call_it_serves has them)."""
    return [p for p in enumeration.enumerate_variants(axes, table) if p.variant.kernel != "flash_fwd_gluon"]


def test_plan_holds_the_gluon_twin_of_each_call_it_serves() -> None:
    axes = Axes((SM90,), FWD, dtypes=("bf16",), head_dims=(64, 128), causal=(False, True), seqlens_q=(4096, 1000))
    plan = enumeration.enumerate_variants(axes, EMPTY)
    twins = [p for p in plan if p.variant.kernel == "flash_fwd_gluon"]
    # 1000's bucket is 1024's, where the programs walk more query tiles (flash_fwd.dispatch.GLUON_Q_TILES: BLOCK_M is a
    # program's rows; hd128 walks 4 at 4096 too, so full 1024 and 4096 share one variant); at 4096 hd64 takes
    # GLUON_WIDE's 192-row tiles, causal too (ping-pong x8 at 1024, GLUON_TABLE's row). Aligned only (the
    # axis default is both alignments), each once.
    assert sorted((v.variant.get("BLOCK_D"), v.variant.get("CAUSAL"), v.variant.get("BLOCK_M"), v.origin)
                  for v in twins) == [(64, False, 192, "gluon table"), (64, False, 1024, "gluon table"),
                                      (64, True, 192, "gluon table"), (64, True, 1024, "gluon table"),
                                      (128, False, 512, "gluon table"), (128, True, 512, "gluon table"),
                                      (128, True, 1024, "gluon table")]
    for twin in twins:
        serves = {fwd_dispatch.flash_fwd_gluon_default_variant(SM90, "bf16", int(twin.variant.get("BLOCK_D")),
                                                               bool(twin.variant.get("CAUSAL")), True, False, s, s)
                  for s in (4096, 1024)}
        assert twin.variant in serves, "a variant dispatch serves a call of the plan with"
EM_CUDA, EM_AMDGPU = 190, 224


def row(sq: int, sk: int, block_m: int, block_n: int = 64, target: str = "sm_90", dtype: str = "bf16",
        head_dim: int = 128, causal: bool = True) -> tuning.Row:
    return tuning.Row(target, "flash_fwd", dtype, head_dim, causal, sq, sk, block_m, block_n, 4, 3, 0, 400.0,
                      "NVIDIA H200", "2026-11-30")


# A made-up table: one sm_90 group with three rows at uneven buckets, one sm_80 row.
TABLE = tuning.Table([row(16, 4096, 16, 32), row(1024, 1024, 64, 64), row(4096, 4096, 128, 32),
                      row(4096, 4096, 128, 128, target="sm_80")])
CALL_SEQLENS = (1, 15, 16, 17, 64, 65, 100, 1000, 1024, 1025, 4096, 4097, 100_000)


def keys(axes: Axes, table: tuning.Table = EMPTY) -> list[str]:
    return [p.key for p in enumerate_variants(axes, table)]


# --- enumeration (pure) ----------------------------------------------------------------------------------------


def test_default_grid_covers_every_call_dispatch_can_make_at_a_padded_head_dim() -> None:
    plan = enumerate_variants(Axes((SM90,), kernels=FWD), EMPTY)
    planned = {p.key for p in plan}
    assert len(planned) == len(plan), "deduplicated by key"
    assert {p.origin for p in plan} == {"default"}
    selected = set()
    for dtype, head_dim, causal, sq in itertools.product(("fp16", "bf16", "fp32"), geometry.HEAD_DIMS,
                                                         (False, True), CALL_SEQLENS):
        selected.add(fwd_dispatch.flash_fwd_variant(SM90, dtype, head_dim, causal, True, sq, seqlen_k=sq * 3,
                                                    table=EMPTY).key())
    assert selected == planned, "the plan is exactly what dispatch selects: nothing missing, nothing extra"
    assert all(p.variant.target == "sm_90" and p.variant.get("ALIGN16") is True for p in plan)


def test_table_groups_are_built_at_their_rows_and_the_rest_at_the_default_classes() -> None:
    axes = Axes((SM90,), kernels=FWD, dtypes=("bf16",), head_dims=(128,))
    plan = enumerate_variants(axes, TABLE)
    causal = [p for p in plan if p.variant.get("CAUSAL")]
    assert sorted(p.variant.get("BLOCK_M") for p in causal) == [16, 64, 128]
    assert {p.origin for p in causal} == {"table"}
    full = [p for p in plan if not p.variant.get("CAUSAL")]
    assert {p.origin for p in full} == {"default"}
    assert len(full) == len({fwd_dispatch.default_config(SM90, "bf16", 128, s, False) for s in DEFAULT_SEQLENS})
    # Every call in the table's group, at any seqlens, is served by a planned variant.
    for sq, sk in itertools.product(CALL_SEQLENS, CALL_SEQLENS):
        for is_causal in (False, True):
            v = fwd_dispatch.flash_fwd_variant(SM90, "bf16", 128, is_causal, True, sq, seqlen_k=sk, table=TABLE)
            assert v.key() in {p.key for p in plan}, (sq, sk, is_causal)
    # The sm_80 row is not in an sm_90 plan, and is in an sm_80 one.
    sm80 = enumerate_variants(Axes((SM80,), kernels=FWD, dtypes=("bf16",), head_dims=(128,), causal=(True,)), TABLE)
    assert [(p.origin, p.variant.get("BLOCK_N")) for p in sm80] == [("table", 128)]


def test_no_axis_flags_means_table_rows_plus_the_default_grid() -> None:
    with_table = {p.key: p for p in enumerate_variants(Axes((SM90,), kernels=FWD), TABLE)}
    without = {p.key for p in enumerate_variants(Axes((SM90,), kernels=FWD), EMPTY)}
    table_rows = {k for k, p in with_table.items() if p.origin == "table"}
    assert len(table_rows) == 3
    # Only the table's group changed: its default variants gave way to its rows.
    group = {p.key for p in enumerate_variants(Axes((SM90,), FWD, dtypes=("bf16",), head_dims=(128,), causal=(True,)),
                                               EMPTY)}
    assert set(with_table) == (without - group) | table_rows


def test_explicit_axes_padded_head_dims_unaligned_and_seqlens() -> None:
    axes = Axes((SM90,), FWD, dtypes=("fp16",), head_dims=(80, 96, 128), causal=(False,), seqlens_q=(100, 128),
                aligned=(True, False))
    plan = enumerate_variants(axes, EMPTY)
    flags = [(p.variant.get("BLOCK_D"), dict(p.variant.functional).get("BLOCK_D2", 0), p.variant.get("EVEN_D"),
              p.variant.get("ALIGN16")) for p in plan]
    # 80 and 96 take split tiles (64 + 16, 64 + 32: attention.SPLIT_BY_DEFAULT); 100 and 128 fall in the same
    # seqlen bucket.
    assert flags == [(64, 16, True, True), (64, 16, True, False), (64, 32, True, True), (64, 32, True, False),
                     (128, 0, True, True), (128, 0, True, False)]
    assert [p.variant.get("BLOCK_M") for p in plan] == [128] * 6


def test_index64_axis_adds_exactly_the_variants_large_tensors_select() -> None:
    axes = Axes((SM90,), FWD, dtypes=("bf16",), head_dims=(128,), causal=(False, True), seqlens_q=(4096,))
    narrow = enumerate_variants(axes, TABLE)
    wide = enumerate_variants(record.replace(axes, index64=(False, True)), TABLE)
    assert [p.variant.get("INDEX64") for p in narrow] == [False, False]
    assert [p.variant.get("INDEX64") for p in wide] == [False, True, False, True]
    assert [p.key for p in wide if not p.variant.get("INDEX64")] == [p.key for p in narrow]
    for planned in wide:  # the same variant dispatch picks for a call whose tensors span 2**31 elements
        v = planned.variant
        picked = fwd_dispatch.flash_fwd_variant(SM90, "bf16", 128, v.get("CAUSAL"), True, 4096,
                                                index64=v.get("INDEX64"), seqlen_k=4096, table=TABLE)
        assert picked.key() == planned.key


def test_order_is_stable_and_follows_the_targets_as_given() -> None:
    axes = Axes((GFX942, SM90), dtypes=("fp16", "bf16"), head_dims=(64,))
    first, second = keys(axes), keys(axes)
    assert first == second
    plan = enumerate_variants(axes, EMPTY)
    targets = [p.variant.target for p in plan]
    assert targets == sorted(targets, key=["gfx942", "sm_90"].index)
    assert all(p.variant.get("waves_per_eu") == 2 for p in plan if p.variant.target == "gfx942")


@pytest.mark.parametrize(("field", "value", "match"), [
    ("dtypes", ("fp8",), "dtype"), ("head_dims", (0,), "head dim"), ("head_dims", (257,), "257"),
    ("seqlens_q", (0,), "seqlens_q"), ("seqlens_k", (2**31,), "seqlens_k"),
])
def test_bad_axes_name_the_axis_and_value(field: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Axes((SM90,), **{field: value})
    with pytest.raises(ValueError, match="target"):
        Axes(())


def test_variants_from_misses_dedupes_and_reports_bad_lines() -> None:
    a = fwd_dispatch.flash_fwd_variant(SM90, "fp16", 64, False, True, 4096)
    b = fwd_dispatch.flash_fwd_variant(GFX942, "bf16", 128, True, True, 16)
    lines = [json.dumps({"variant": str(a), "key": a.key()}), "", json.dumps({"variant": str(b)}),
             json.dumps({"variant": str(a), "compile_s": 1.0}), "{not json", json.dumps(["variant"]),
             json.dumps({"variant": "flash_fwd:sm_90:fp16::"}), json.dumps({"variant": 7})]
    plan, problems = variants_from_misses(lines, "m.jsonl")
    assert [p.variant for p in plan] == [a, b]
    assert [p.origin for p in plan] == ["misses m.jsonl:1", "misses m.jsonl:3"]
    assert [problem.split(":")[1] for problem in problems] == ["5", "6", "7", "8"]
    assert all(problem.startswith("m.jsonl:") for problem in problems)


def test_shards_partition_the_plan_by_key() -> None:
    plan = enumerate_variants(Axes((SM90, GFX942)), TABLE)
    for n in range(1, 6):
        parts = [select_shard(plan, (i, n)) for i in range(1, n + 1)]
        assert sorted(p.key for part in parts for p in part) == sorted(p.key for p in plan)
        assert sum(len(part) for part in parts) == len(plan), "disjoint"
        for part in parts:
            assert part == [p for p in plan if p in part], "plan order kept"
    # Depends on the key alone: a smaller plan puts each key in the same shard.
    small = plan[::7]
    assert all(in_shard(p.key, (2, 3)) == (p in select_shard(plan, (2, 3))) for p in small)
    assert parse_shard("2/3") == (2, 3)
    for bad in ("0/3", "4/3", "a/b", "3", "1/0", ""):
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)


def test_progress_lines_and_eta() -> None:
    assert [format_duration(s) for s in (0, 42.4, 185, 7620)] == ["0s", "42s", "3m05s", "2h07m"]
    line = render(5, 20, 1, 10.0)
    assert "5/20" in line and "25%" in line and "1 failed" in line and "ETA 30s" in line and "0.50/s" in line
    assert "took 40s" in render(20, 20, 0, 40.0)
    clock = iter(range(1000))
    log = io.StringIO()
    progress = Progress(100, log, clock=lambda: float(next(clock)))
    progress.begin()
    for i in range(100):
        progress.step(failed=i == 3)
    lines = log.getvalue().splitlines()
    assert len(lines) == 21, "not a terminal: one line per 5% (and the start)"
    assert "100/100" in lines[-1] and "1 failed" in lines[-1]


def test_cli_list_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.prewarm import cli
    from lazytriton.variant import DTYPES

    assert cli.DTYPES == DTYPES, "the parser's copy (kept to build it without importing variant) is in sync"
    assert cli_main(["prewarm", "--target", "sm_90", "--kernel", "flash_fwd", "--dtype", "fp16", "--head-dim", "80",
                     "--causal", "bottom_right", "--list"]) == 0
    out, err = capsys.readouterr()
    listed = [line.split() for line in out.splitlines()]
    expected = enumerate_variants(Axes((SM90,), FWD, dtypes=("fp16",), head_dims=(80,), causal=(True,)),
                                  tuning.table_for("flash_fwd"))
    # Beside flash_fwd's, the flash_fwd_gluon twins of the calls GLUON_TABLE serves (80 = 64 + 16, split tiles):
    # one a query-tile count (a program's rows), 3 at these seqlens (8 tiles at 1k, 4 at 4k, one from 8k).
    triton = [line for line in listed if not line[2].startswith("flash_fwd_gluon")]
    assert [k for k, _, _ in triton] == [p.key for p in expected]
    assert err.strip() == f"{len(listed)} variants: flash_fwd {len(triton)}, flash_fwd_gluon 3"
    assert len(listed) - len(triton) == 3
    assert all(Variant.parse(v).key() == k and Variant.parse(v).get("CAUSAL") is True for k, _, v in listed)
    assert cli_main(["prewarm", "--target", "sm_90", "--kernel", "flash_fwd", "--dtype", "fp16", "--head-dim", "80",
                     "--causal", "bottom_right", "--index64", "--list"]) == 0
    wide = [Variant.parse(line.split()[2]) for line in capsys.readouterr().out.splitlines()]
    # flash_fwd twice (INDEX64 or not); the Gluon kernel has 32-bit offsets only, so its twins once
    assert len(wide) == 2 * len(expected) + 3 and sum(v.get("INDEX64") for v in wide) == len(expected)
    assert cli_main(["prewarm", "--dtype", "fp16", "--list"]) == 2
    assert "--target is required" in capsys.readouterr().err
    assert cli_main(["prewarm", "--from-misses", "m.jsonl", "--dtype", "fp16", "--out", "x.ltimg"]) == 2
    assert "--dtype" in capsys.readouterr().err
    assert cli_main(["prewarm", "--target", "sm_90"]) == 2
    assert "--out" in capsys.readouterr().err
    for flags, match in ((["--dtype", "fp8"], "fp8"), (["--head-dim", "300"], "300"), (["--shard", "4/3"], "4/3"),
                         (["-j", "0"], "-j"), (["--causal", "maybe"], "maybe"),
                         (["--causal", "true"], "none, top_left, bottom_right")):
        with pytest.raises(SystemExit):
            cli_main(["prewarm", "--target", "sm_90", *flags, "--list"])
        assert match in capsys.readouterr().err


def test_targets_are_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never.ltimg"
    for bad in ("sm_999", "sm90x", "gfx123"):
        assert cli_main(["prewarm", "--target", f"sm_90,{bad}", *SMALL, "-j", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"lazytriton prewarm: error: --target {bad}: ") and "sm_90" in err
        if bad != "sm90x":
            assert "known targets: sm_80, " in err and "gfx942" in err
    assert not out.exists() and not Path(f"{out}.work").exists(), "nothing built, no image, no work dir"


def test_causal_takes_the_api_and_explain_vocabulary(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.prewarm import cli

    assert cli.CAUSAL_MODES == geometry.CAUSAL_MODES, "one spelling of the causal modes everywhere"

    def listed(modes: str) -> set[str]:
        assert cli_main(["prewarm", "--target", "sm_90", *SMALL, "--causal", modes, "--list"]) == 0
        return {line.split()[0] for line in capsys.readouterr().out.splitlines()}

    none, top_left, bottom_right = listed("none"), listed("top_left"), listed("bottom_right")
    assert top_left == bottom_right and not top_left & none, "both causal modes build the one CAUSAL=true binary"
    assert listed("none,top_left,bottom_right") == none | top_left
    assert cli_main(["prewarm", "--target", "sm_90", *SMALL, "--causal", "causal", "--list"]) == 0
    out, err = capsys.readouterr()
    assert {line.split()[0] for line in out.splitlines()} == top_left
    assert "--causal causal read as top_left" in err


# --- real builds -----------------------------------------------------------------------------------------------

SMALL = ["--kernel", "flash_fwd", "--dtype", "fp16", "--head-dim", "16"]


def prewarm_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lazytriton.cli", "prewarm", *args]


def prewarm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(prewarm_command(*args), capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, SOURCE_DATE_EPOCH=EPOCH), check=False)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def counts(result: subprocess.CompletedProcess[str]) -> dict[str, int]:
    found = re.search(r"(\d+) reused, (\d+) compiled, (\d+) failed", result.stdout)
    assert found, result.stdout + result.stderr
    return dict(zip(("reused", "compiled", "failed"), map(int, found.groups()), strict=True))


def listed_keys(*args: str) -> list[str]:
    return [line.split()[0] for line in prewarm(*args, "--list").stdout.splitlines()]


def image_keys(path: Path) -> list[str]:
    with Image(path) as image:
        return list(image.keys())


@pytest.fixture(scope="module")
def full_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One image of sm_90 and gfx942 variants (6 entries), built once for the module."""
    out = tmp_path_factory.mktemp("full") / "full.ltimg"
    result = prewarm("--target", "sm_90,gfx942", *SMALL, "--causal", "none", "-j", "2", "--out", str(out))
    assert counts(result) == {"reused": 0, "compiled": 6, "failed": 0}
    assert not Path(f"{out}.work").exists(), "a clean build removes its work directory"
    return out


def test_one_image_holds_several_targets(full_build: Path) -> None:
    with Image(full_build) as image:
        assert image.meta["targets"] == ["gfx942", "sm_90"]
        entries = [image.read(key) for key in image.keys()]
    by_target = {t: [e for e in entries if e and e.target == t] for t in ("sm_90", "gfx942")}
    assert [len(v) for v in by_target.values()] == [3, 3]
    for target, machine, kind in (("sm_90", EM_CUDA, "cubin"), ("gfx942", EM_AMDGPU, "hsaco")):
        for entry in by_target[target]:
            assert entry.kind == kind and entry.binary[:4] == b"\x7fELF"
            assert struct.unpack_from("<H", entry.binary, 18)[0] == machine
            assert entry.provenance.created == float(EPOCH)
            assert Variant.parse(entry.variant).key() == entry.key


def test_shards_union_is_the_full_build_and_merges_to_the_same_bytes(full_build: Path, tmp_path: Path) -> None:
    axes = ["--target", "sm_90,gfx942", *SMALL, "--causal", "none"]
    parts = [tmp_path / f"part{i}.ltimg" for i in (1, 2, 3)]
    for i, part in enumerate(parts, 1):
        assert listed_keys(*axes, "--shard", f"{i}/3") == [k for k in listed_keys(*axes) if in_shard(k, (i, 3))]
        prewarm(*axes, "--shard", f"{i}/3", "-j", "2", "--out", str(part))
    shard_keys = [image_keys(part) for part in parts]
    assert sorted(k for ks in shard_keys for k in ks) == sorted(listed_keys(*axes)) == image_keys(full_build)
    assert sum(map(len, shard_keys)) == 6, "shards are disjoint"
    merged = tmp_path / "merged.ltimg"
    result = prewarm("--merge", *map(str, parts), "--out", str(merged))
    assert "6 entries" in result.stdout
    assert merged.read_bytes() == full_build.read_bytes(), "same inputs, same image bytes"


def test_codec_none_stores_the_same_entries_as_they_are(full_build: Path, tmp_path: Path) -> None:
    """``--codec none`` (a build reusing every entry of the image it replaces, and a merge): plain blobs."""
    with Image(full_build) as image:
        assert image.meta["codec"] == "zstd-dict" or len(image) < 8  # fewer than 8 entries train no dictionary
        expected = {key: image.read(key).encode() for key in image.keys()}
    rebuilt = tmp_path / "plain.ltimg"
    shutil.copyfile(full_build, rebuilt)
    result = prewarm("--target", "sm_90,gfx942", *SMALL, "--causal", "none", "-j", "2", "--codec", "none",
                     "--out", str(rebuilt))
    assert counts(result) == {"reused": 6, "compiled": 0, "failed": 0}
    merged = tmp_path / "merged-plain.ltimg"
    prewarm("--merge", str(full_build), "--out", str(merged), "--codec", "none")
    for path in (rebuilt, merged):
        with Image(path) as image:
            assert image.meta["codec"] == "none" and image.meta["level"] == 0
            assert {key: image.read(key).encode() for key in image.keys()} == expected
        assert path.stat().st_size > sum(map(len, expected.values())), "every entry stored whole"
    assert prewarm("--merge", str(full_build), "--out", str(merged), "--codec", "lz4", check=False).returncode == 2


def _snapshot(entries: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in entries.glob("*.entry")}


def test_a_killed_prewarm_resumes_without_rebuilding_anything(tmp_path: Path) -> None:
    axes = ["--target", "sm_90", *SMALL]  # 6 variants: 3 seqlen classes x causal or not
    out = tmp_path / "img.ltimg"
    entries = Path(f"{out}.work") / "entries"
    proc = subprocess.Popen(prewarm_command(*axes, "-j", "1", "--out", str(out)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=dict(os.environ, SOURCE_DATE_EPOCH=EPOCH))
    try:
        deadline = time.monotonic() + 120
        while len(list(entries.glob("*.entry"))) < 2:
            assert proc.poll() is None, "prewarm ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    time.sleep(0.5)  # its worker dies with it (PR_SET_PDEATHSIG); let a last rename land
    before = _snapshot(entries)
    assert 2 <= len(before) < 6 and not out.exists()

    result = prewarm(*axes, "-j", "2", "--keep-work", "--out", str(out))
    done = counts(result)
    assert done["reused"] == len(before) and done["compiled"] == 6 - len(before) and done["failed"] == 0
    after = _snapshot(entries)
    assert {name: after[name] for name in before} == before, "an entry built before the kill was rewritten"
    assert sorted(image_keys(out)) == sorted(listed_keys(*axes))

    # A merge of the work directory gives the same image; run again: everything is reused.
    merged = tmp_path / "from-work.ltimg"
    prewarm("--merge", str(Path(f"{out}.work")), "--out", str(merged))
    assert merged.read_bytes() == out.read_bytes()
    assert counts(prewarm(*axes, "--out", str(out))) == {"reused": 6, "compiled": 0, "failed": 0}
    assert merged.read_bytes() == out.read_bytes()


def test_a_failing_variant_is_recorded_and_the_rest_built(tmp_path: Path) -> None:
    good = fwd_dispatch.flash_fwd_variant(SM90, "fp16", 16, False, True, 64)
    bad = Variant.parse(str(good).replace("BLOCK_D=16", "BLOCK_D=8"))  # tl.dot needs K >= 16
    odd = str(good).replace("BLOCK_M=64", "BLOCK_M=48")  # not a power of two: refused before compiling
    # No Triton backend selects for sm_12: LLVM aborts the worker process (SIGABRT) instead of raising.
    crash = Variant.parse(str(good).replace("sm_90", "sm_12"))
    misses = tmp_path / "misses.jsonl"
    misses.write_text("\n".join([json.dumps({"variant": str(v)}) for v in (bad, crash, good, odd)] + ["oops"]) + "\n")
    out = tmp_path / "img.ltimg"
    result = prewarm("--from-misses", str(misses), "-j", "2", "--out", str(out), check=False)
    assert result.returncode == 1, result.stderr
    assert counts(result) == {"reused": 0, "compiled": 1, "failed": 2}
    assert f"skipped {misses}:5" in result.stderr and "FAILED" in result.stderr
    assert f"skipped {misses}:4: bad variant" in result.stderr and "BLOCK_M=48 must be a power of two" in result.stderr
    failures = [json.loads(line) for line in (tmp_path / "img.ltimg.work" / "failures.jsonl").read_text().splitlines()]
    assert sorted(f["key"] for f in failures) == sorted([bad.key(), crash.key()])
    assert "CompilationError" in next(f["error"] for f in failures if f["key"] == bad.key())
    assert "SIGABRT" in next(f["error"] for f in failures if f["key"] == crash.key())
    assert image_keys(out) == [good.key()]


RESOLVE = """
import json, os, sys
from lazytriton import runtime
from lazytriton.variant import Variant
rt = runtime.get()
sources = [rt.resolve(Variant.parse(text)).source for text in json.loads(os.environ["VARIANTS"])]
print(json.dumps({"sources": sources, "compiles": rt.compiles,
                  "triton": sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))[:3]}))
"""


def test_jit_then_prewarm_from_misses_then_zero_compiles(tmp_path: Path, cache_dir: Path) -> None:
    variants = [str(fwd_dispatch.flash_fwd_variant(SM90, "fp16", 16, causal, True, 64)) for causal in (False, True)]
    env = {"VARIANTS": json.dumps(variants)}
    first = run_python(RESOLVE, env)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout.splitlines()[-1])["sources"] == ["jit", "jit"]
    misses = cache_dir / "misses.jsonl"
    assert len(misses.read_text().splitlines()) == 2

    image = tmp_path / "served.ltimg"
    # The JIT's entries are in the local cache: copied into the image, not compiled again.
    built = prewarm("--from-misses", str(misses), "-j", "2", "--out", str(image))
    assert counts(built) == {"reused": 2, "compiled": 0, "failed": 0}, built.stderr
    assert "or in the cache" in built.stderr
    with Image(image) as served:
        assert {served.read(k).provenance.created for k in served.keys()} == {float(EPOCH)}  # type: ignore[union-attr]
    empty = tmp_path / "empty-cache"
    second = run_python(RESOLVE, {**env, "LAZYTRITON_CACHE_DIR": str(empty), "LAZYTRITON_IMAGES": str(image),
                                  "LAZYTRITON_JIT": "0"})
    assert second.returncode == 0, second.stderr
    report = json.loads(second.stdout.splitlines()[-1])
    assert report == {"sources": ["image", "image"], "compiles": 0, "triton": []}
    assert not (empty / "misses.jsonl").exists()


BUILD_FROM_STDIN = """
import io, json, sys
from pathlib import Path
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.prewarm import Planned, build
from lazytriton.target import Target
variant = fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 16, False, True, 16)
report = build([Planned(variant, variant.key(), "test")], Path(sys.argv[1]), 1, stream=io.StringIO())
print(json.dumps({"compiled": report.compiled, "failures": [e for _, e in report.failures]}))
"""


def test_the_python_api_builds_from_a_main_that_is_no_file(tmp_path: Path) -> None:
    # Workers are plain subprocesses: a build started from stdin (or a notebook, or an unguarded
    # script) works, where multiprocessing's spawn would re-run the caller's __main__ in each worker.
    out = tmp_path / "api.ltimg"
    result = subprocess.run([sys.executable, "-", str(out)], input=BUILD_FROM_STDIN, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"compiled": 1, "failures": []}
    assert len(image_keys(out)) == 1
