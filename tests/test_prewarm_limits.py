"""Prewarm's limits: known targets, variants refused before compiling, per-variant time and memory in workers.

The pure checks run on made-up variants. The pool's limits run a real build
whose worker (``prewarm_fake_worker``) hangs or over-allocates on chosen keys
and compiles the rest for real.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from lazytriton import tuning
from lazytriton.cli import main as cli_main
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.prewarm import builder, pool
from lazytriton.prewarm.enumeration import Axes, Planned, enumerate_variants, variants_from_misses
from lazytriton.prewarm.limits import KNOWN_TARGETS, estimate_shared, known_target, refusal
from lazytriton.prewarm.workdir import WorkDir, work_dir_for
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant, check_fields

SM90 = Target.parse("sm_90")
# The line of the report: a miss log asking for 1024 x 1024 tiles at fp32, head dim 256.
POISONED = ("flash_fwd:sm_90:fp32:ALIGN16=true,BLOCK_D=256,CAUSAL=false,EVEN_D=true,INDEX64=false"
            ":BLOCK_M=1024,BLOCK_N=1024:num_stages=1,num_warps=4")


def small(causal: bool = False, seqlen_q: int = 64) -> Variant:
    return fwd_dispatch.flash_fwd_variant(SM90, "fp16", 16, causal, True, seqlen_q)


# --- pure: targets, estimate, refusal ---------------------------------------------------------------------------


def test_known_targets_parse_and_unknown_ones_name_the_known() -> None:
    assert str(known_target("cuda:90")) == "sm_90" and str(known_target("hip:gfx942")) == "gfx942"
    for bad in ("sm_999", "gfx123"):
        with pytest.raises(ValueError, match=f"unknown target '{bad}'; known targets: sm_80, .*gfx942"):
            known_target(bad)
    with pytest.raises(ValueError, match="must look like"):
        known_target("sm90x")


# (target, dtype, BLOCK_M, BLOCK_N, head dim, num_stages, shared bytes Triton 3.5 reported for it)
MEASURED = [("sm_90", "fp16", 128, 64, 128, 4, 163840), ("sm_90", "fp16", 64, 64, 64, 3, 57344),
            ("sm_90", "fp32", 64, 32, 128, 2, 73984), ("sm_90", "fp32", 64, 16, 256, 1, 98304),
            ("sm_80", "fp16", 128, 64, 128, 3, 98304), ("sm_80", "fp16", 64, 32, 256, 2, 69632),
            ("gfx942", "fp16", 128, 64, 64, 2, 16384), ("gfx942", "fp16", 128, 64, 128, 2, 32768),
            ("gfx942", "fp16", 64, 32, 256, 2, 36864), ("gfx942", "fp32", 64, 16, 256, 1, 65536),
            # split tiles (160 = 128 + 32, 192 = 128 + 64): Triton 3.6's figures on the H200 (tune, 2026-12-01)
            ("sm_90", "bf16", 64, 128, 192, 3, 319488), ("sm_90", "bf16", 128, 128, 160, 3, 286720)]


@pytest.mark.parametrize(("target", "dtype", "block_m", "block_n", "block_d", "stages", "measured"), MEASURED)
def test_the_estimate_is_a_lower_bound_of_what_triton_allocated(target: str, dtype: str, block_m: int, block_n: int,
                                                                 block_d: int, stages: int, measured: int) -> None:
    config = Config(block_m, block_n, 4, stages, 2)
    variant = fwd_dispatch.flash_fwd_variant(Target.parse(target), dtype, block_d, False, True, 4096, config=config)
    assert measured // 2 <= estimate_shared(variant) <= measured  # never above; not uselessly far below


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "gfx942", "gfx950"])
def test_every_variant_dispatch_selects_is_allowed(target: str) -> None:
    axes = Axes((Target.parse(target),), aligned=(True, False), index64=(False, True))
    for planned in enumerate_variants(axes, tuning.table_for("flash_fwd")):
        assert check_fields(planned.variant) is planned.variant
        assert refusal(planned.variant) is None, planned.variant


def test_the_poisoned_variant_and_other_oversized_tiles_are_refused_with_a_reason() -> None:
    assert refusal(Variant.parse(POISONED)) == "BLOCK_M=1024 is over the cap of 256"
    wide = Variant.parse(POISONED.replace("BLOCK_M=1024,BLOCK_N=1024", "BLOCK_M=128,BLOCK_N=128"))
    why = refusal(wide)
    assert why is not None and "needs at least 384 KiB of shared memory" in why and "sm_90 has 227 KiB" in why
    assert refusal(Variant.parse(str(wide).replace("sm_90", "sm_12"))) is None, "unknown target: caps only"
    split = str(fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "bf16", 96, False, True, 4096)).replace("sm_90",
                                                                                                              "sm_12")
    assert "BLOCK_D2=32" in split and refusal(Variant.parse(split)) is None
    huge = Variant.parse(split.replace("BLOCK_D2=32", "BLOCK_D2=65536"))
    assert refusal(huge) == "BLOCK_D2=65536 is over the cap of 256"
    assert "BLOCK_D + BLOCK_D2 = 320" in str(refusal(Variant.parse(split.replace("BLOCK_D2=32", "BLOCK_D2=256"))))
    assert set(KNOWN_TARGETS) >= {"sm_80", "sm_90", "gfx942", "gfx950"}


def test_misses_skip_the_poisoned_line_with_a_reason() -> None:
    good = small()
    lines = [json.dumps({"variant": POISONED}), json.dumps({"variant": str(good)}),
             json.dumps({"variant": "flash_fwd:sm_90:fp16:::"})]
    plan, problems = variants_from_misses(lines, "m.jsonl")
    assert [p.variant for p in plan] == [good]
    assert problems[0].startswith("m.jsonl:1: refused ") and "BLOCK_M=1024 is over the cap of 256" in problems[0]
    assert problems[1].startswith("m.jsonl:3: bad variant") and "lacks BLOCK_M" in problems[1]


def test_the_cli_lists_a_poisoned_miss_log_without_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    misses = tmp_path / "misses.jsonl"
    misses.write_text(json.dumps({"variant": POISONED}) + "\n" + json.dumps({"variant": str(small())}) + "\n")
    assert cli_main(["prewarm", "--from-misses", str(misses), "--list"]) == 0
    out, err = capsys.readouterr()
    assert [line.split()[0] for line in out.splitlines()] == [small().key()]
    assert f"skipped {misses}:1: refused" in err and "over the cap" in err
    misses.write_text(json.dumps({"variant": POISONED}) + "\n")  # the report's log: the build starts no compiler
    assert cli_main(["prewarm", "--from-misses", str(misses), "--out", str(tmp_path / "next.ltimg")]) == 0
    out, err = capsys.readouterr()
    assert "0 compiled, 0 failed" in out and f"skipped {misses}:1: refused" in err


def test_a_refused_variant_is_a_failure_and_no_empty_image_is_written(tmp_path: Path) -> None:
    poisoned = Variant.parse(POISONED)
    out = tmp_path / "poisoned.ltimg"
    stream = io.StringIO()
    report = builder.build([Planned(poisoned, poisoned.key(), "test")], out, 2, stream=stream)
    assert report.compiled == 0 and report.image is None and not out.exists()
    assert [error for _, error in report.failures] == ["refused before compiling: BLOCK_M=1024 is over the cap of 256"]
    assert WorkDir(work_dir_for(out)).read_failures() == [
        {"variant": POISONED, "key": poisoned.key(), "error": report.failures[0][1]}]
    assert "REFUSED" in stream.getvalue()


# --- the workers' limits -------------------------------------------------------------------------------------


def test_limits_and_their_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.prewarm.cli import parse_memory

    assert pool.Limits() == pool.Limits(600.0, 4 << 30)
    for bad in ({"timeout": 0}, {"timeout": -1.0}, {"memory": -1}, {"memory": 1.5}):
        with pytest.raises(ValueError, match="variant"):
            pool.Limits(**bad)  # type: ignore[arg-type]
    assert [parse_memory(t) for t in ("0", "512M", "512MiB", "4G", "4gb", "1048576")] == [
        0, 512 << 20, 512 << 20, 4 << 30, 4 << 30, 1 << 20]
    for flags, needle in ((["--variant-timeout", "0"], "--variant-timeout"),
                          (["--variant-memory", "lots"], "--variant-memory")):
        with pytest.raises(SystemExit):
            cli_main(["prewarm", "--target", "sm_90", *flags, "--list"])
        assert needle in capsys.readouterr().err


def test_a_hanging_and_a_hungry_compile_are_stopped_and_the_build_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow, hungry, good = small(causal=True), small(seqlen_q=16), small()
    monkeypatch.setattr(pool, "WORKER_MODULE", "prewarm_fake_worker")
    monkeypatch.setenv("FAKE_SLOW_KEYS", slow.key())
    monkeypatch.setenv("FAKE_HUNGRY_KEYS", hungry.key())
    monkeypatch.setenv("FAKE_PID_DIR", str(tmp_path))
    out = tmp_path / "limits.ltimg"
    # 30 s: the one real compile (a head dim 16 variant, about a second) finishes long before, even on a busy machine.
    limits = pool.Limits(timeout=30.0, memory=1 << 30)
    plan = [Planned(v, v.key(), "test") for v in (slow, hungry, good)]
    report = builder.build(plan, out, 2, stream=io.StringIO(), limits=limits)
    errors = {planned.key: error for planned, error in report.failures}
    assert report.compiled == 1 and set(errors) == {slow.key(), hungry.key()}
    assert "timed out" in errors[slow.key()] and "--variant-timeout" in errors[slow.key()]
    assert "MemoryError" in errors[hungry.key()] and "1024 MiB" in errors[hungry.key()]
    recorded = {f["key"]: f["error"] for f in WorkDir(work_dir_for(out)).read_failures()}
    assert recorded == errors, "each limit hit is in failures.jsonl like a compile failure"
    from lazytriton.cache_format.image import Image

    with Image(out) as image:
        assert list(image.keys()) == [good.key()]
    pid = int((tmp_path / f"{slow.key()}.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the hanging worker was killed (and reaped)


def test_a_worker_gets_its_next_variant_before_the_parents_bookkeeping(tmp_path: Path) -> None:
    """compile_all hands the answering worker its next variant, then reports the answer (the build reads the entry
    and packs it meanwhile); each result says which worker held it and when, and the build keeps the spans."""
    import time

    plan = [Planned(v, v.key(), "test") for v in (small(), small(causal=True), small(seqlen_q=16))]
    reported: list[tuple[str, float, pool.Result]] = []

    def on_result(planned: Planned, result: pool.Result) -> None:
        reported.append((planned.key, time.perf_counter(), result))
        time.sleep(0.05)  # bookkeeping the next compile runs beside

    pool.compile_all(plan, 1, WorkDir(tmp_path / "work").create(), None, on_result)
    assert [key for key, _, _ in reported] == [p.key for p in plan]
    assert all(r.error is None and r.worker == 0 and r.began < r.ended <= at for _, at, r in reported)
    for (_, at, _), (_, _, following) in zip(reported, reported[1:], strict=False):
        assert following.began < at, "the next variant went out before the previous answer was reported"
    report = builder.build(plan, tmp_path / "spans.ltimg", 2, stream=io.StringIO())
    assert set(report.spans) == {p.key for p in plan} and report.started > 0
    assert all(worker in (0, 1) and report.started <= began < ended for worker, began, ended in report.spans.values())
