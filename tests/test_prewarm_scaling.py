"""Prewarm's parallel build: longest-first order, bytes that do not depend on -j, a killed worker, the bench.

The order is pure and tested on the default plan. The rest runs real
compiles of three head-dim-16 variants (about a second each): the scaling
benchmark's ``--quick`` mode (which fails unless its -j 1 and -j 2 images are
byte-identical), and a build whose worker is killed on one variant
(``prewarm_fake_worker``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytriton import tuning
from lazytriton.cache_format.image import Image
from lazytriton.prewarm import builder, pool
from lazytriton.prewarm.enumeration import Axes, Planned, all_kernels, enumerate_variants
from lazytriton.prewarm.schedule import UNKNOWN_SECONDS, estimate_seconds, longest_first
from lazytriton.prewarm.workdir import WorkDir, work_dir_for
from lazytriton.target import Target
from lazytriton.variant import Variant

BENCH = REPO / "benchmarks" / "bench_prewarm_scaling.py"
PLAN = enumerate_variants(Axes(targets=(Target.parse("sm_90"), Target.parse("gfx942"))),
                          tuning.tables_for(all_kernels()))


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The benchmark as a module (it imports its neighbours, as when run as a script)."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCH.parent))
    return importlib.import_module("bench_prewarm_scaling")


# --- the order (pure) -------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(PLAN), max_size=40, unique_by=lambda p: p.key))
def test_longest_first_is_a_stable_permutation_by_falling_estimate(todo: list[Planned]) -> None:
    ordered = longest_first(todo)
    assert sorted(p.key for p in ordered) == sorted(p.key for p in todo)
    estimates = [estimate_seconds(p.variant) for p in ordered]
    assert estimates == sorted(estimates, reverse=True)
    position = {p.key: i for i, p in enumerate(todo)}
    for a, b in zip(ordered, ordered[1:], strict=False):
        if estimate_seconds(a.variant) == estimate_seconds(b.variant):
            assert position[a.key] < position[b.key], "ties keep the plan's order"
    assert longest_first(ordered) == ordered


GIANT = Variant.parse("flash_bwd_dkdv:sm_90:fp32:ALIGN16=true,BLOCK_D=128,CAUSAL=true,EVEN_D=true,INDEX64=false"
                      ":BLOCK_M=32,BLOCK_N=64:num_stages=1,num_warps=4")


def test_the_measured_outliers_come_first_and_an_unknown_kernel_gets_the_median() -> None:
    # This fp32 dK/dV variant compiled in 60-82 s (30 s non-causal); every fp16/bf16 variant of the plan in under 7 s.
    sixteen_bit = [p for p in PLAN if p.variant.dtype != "fp32"]
    assert estimate_seconds(GIANT) > 5 * max(estimate_seconds(p.variant) for p in sixteen_bit)
    giant = Planned(GIANT, GIANT.key(), "test")
    assert longest_first([*sixteen_bit[:20], giant])[0] == giant
    odd = Variant.parse("flash_decode:sm_90:fp16:CAUSAL=false:BLOCK_N=64:num_warps=4")
    assert estimate_seconds(odd) == UNKNOWN_SECONDS


def test_the_bench_plan_is_fixed_varied_and_its_bound_is_right(bench: ModuleType) -> None:
    plan = bench.scaling_plan(48, ("fp16", "bf16"))
    assert [p.key for p in plan] == [p.key for p in bench.scaling_plan(48, ("fp16", "bf16"))]
    assert len({p.key for p in plan}) == 48 and {p.variant.dtype for p in plan} == {"fp16", "bf16"}
    # every family's kernels, and perhaps the Gluon twins the default plan holds beside them; flash_bwd_dsinks's
    # variants are fp32 (it sums float32 rows), outside a plan of fp16 and bf16; flash_fwd_mla is planned only when
    # asked for (--qv, --head-dim-v over 256), kv_append_lengths with the packed appends (--varlen)
    planned = {p.variant.kernel for p in plan}
    opt_in = {"flash_bwd_dsinks", "flash_fwd_mla", "kv_append_lengths"}
    assert set(all_kernels()) - opt_in <= planned <= {*all_kernels(), "flash_fwd_gluon", "flash_bwd_dkdv_gluon",
                                                      "flash_bwd_prep", "flash_bwd_fused_gluon"}
    assert len({p.variant.get("BLOCK_D") for p in plan}) == 5
    assert bench.plan_bound({"a": 8.0, "b": 1.0, "c": 1.0}, 4) == (10.0, 8.0, 1.25)
    assert bench.plan_bound({"a": 1.0, "b": 1.0}, 2) == (2.0, 1.0, 2.0)


def test_the_bench_float8_plan_holds_each_targets_float8_variants(bench: ModuleType) -> None:
    from lazytriton.float8_lowering import converts_float8

    plan = bench.float8_plan(("sm_90", "sm_80"))
    float8 = {(p.variant.target, p.variant.constexprs.get("KV_FP8")) for p in plan if converts_float8(p.variant)}
    assert float8 == {("sm_90", "e4m3"), ("sm_90", "e5m2"), ("sm_80", "e5m2")}, "no e4m3 below sm_89"
    assert {p.variant.kernel for p in plan} == {"flash_decode_split", "flash_decode_combine", "kv_append"}
    assert any(not converts_float8(p.variant) for p in plan), "the bf16 cache's variants too"


# --- real builds ------------------------------------------------------------------------------------------------


def test_bench_quick_builds_byte_identical_images_at_j1_and_j2(tmp_path: Path) -> None:
    out_csv = tmp_path / "prewarm.csv"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--csv", str(out_csv)], capture_output=True,
                          text=True, timeout=600, check=False, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "images identical" in proc.stdout  # the bench exits 1 when the two images differ
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["metric"] for r in rows] == ["throughput", "throughput", "speedup", "speedup_per_core", "plan_bound",
                                           "image_write", "image_write", "compile_sum_ratio"]
    assert all(r["mode"] == "scaling" and r["n"] == "3" and float(r["value"]) > 0 for r in rows)


SKIP_KEY = """
import json, triton.runtime.cache as cache
from lazytriton.compiler import compile_variant
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.prewarm.worker import skip_triton_key
from lazytriton.target import Target
variant = fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 16, False, True, 64)
hashed = compile_variant(variant).binary
skip_triton_key()
print(json.dumps({"same": compile_variant(variant).binary == hashed, "key": cache.triton_key()}))
"""


def test_a_worker_skips_tritons_install_hash_and_compiles_the_same_bytes() -> None:
    proc = subprocess.run([sys.executable, "-c", SKIP_KEY], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["same"] and report["key"].startswith("lazytriton-prewarm-worker-"), report


FIXED_LAYOUT = """
import json, subprocess
from lazytriton.prewarm.worker import fixed_layout_for_compilers
took = fixed_layout_for_compilers()
child = subprocess.run(["cat", "/proc/self/personality"], capture_output=True, text=True, check=True).stdout
print(json.dumps({"took": took, "child": int(child, 16)}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="personality(2) is Linux's")
def test_a_worker_runs_its_compilers_with_a_fixed_address_layout() -> None:
    """ptxas 12.8 compiles the fused backward at head dim 256 to one of two cubins by where its heap lands
    (prewarm/worker.py): what a worker execs must start without address randomisation."""
    proc = subprocess.run([sys.executable, "-c", FIXED_LAYOUT], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["took"] and report["child"] & 0x0040000, report  # ADDR_NO_RANDOMIZE, inherited by the exec


@pytest.mark.parametrize("fork", ["1", "0"])  # workers forked from the fork server, or plain interpreters
def test_a_worker_killed_mid_plan_costs_only_its_variant(fork: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAZYTRITON_PREWARM_FORK", fork)
    plan = longest_first(enumerate_variants(
        Axes(targets=(Target.parse("sm_90"),), kernels=("flash_fwd",), dtypes=("fp16",), head_dims=(16,),
             causal=(False,)), tuning.tables_for(("flash_fwd",))))
    killed = plan[0]  # the first handed out: one worker, so the others wait in the queue behind it
    monkeypatch.setattr(pool, "WORKER_MODULE", "prewarm_fake_worker")
    monkeypatch.setenv("FAKE_KILL_KEYS", killed.key)
    out, stream = tmp_path / "killed.ltimg", io.StringIO()
    report = builder.build(plan, out, 1, created=0.0, stream=stream)
    assert report.compiled == len(plan) - 1
    assert report.workers is not None and report.workers.forked == (2 if fork == "1" else 0), report.workers
    [(failed, error)] = report.failures
    assert failed.key == killed.key and "killed by SIGKILL" in error
    assert f"FAILED {killed.variant}" in stream.getvalue()
    work = WorkDir(work_dir_for(out))
    assert [f["key"] for f in work.read_failures()] == [killed.key], "kept for a rerun, naming the variant"
    assert not list(work.entries.glob(".*.tmp")) and killed.key not in set(work.keys())
    with Image(out) as image:
        assert sorted(image.keys()) == sorted(p.key for p in plan[1:])
        assert all(image.read(key) is not None for key in image.keys())  # each entry verified


def test_the_gluon_forward_is_estimated_by_its_tile_and_its_partitions() -> None:
    """flash_fwd_gluon's ping-pong variants compile longer than their tile's volume says (GLUON_FACTOR); a program of
    several query tiles is estimated by one tile (its BLOCK_M is the program's rows), so the longest go out first."""
    from lazytriton.kernels import dispatch
    from lazytriton.kernels.flash_fwd import gluon

    sm90 = Target.parse("sm_90")

    def fwd(head_dim: int, causal: bool, **kw: Any) -> Variant:
        found = gluon.variant("sm_90", "bf16", head_dim, "top_left" if causal else "none", True, False, 16384, 16384,
                              **kw)
        assert found is not None
        return found

    longest = fwd(256, True, tiles=(128, 64, 4), pingpong=True)
    assert estimate_seconds(longest) > 1.5 * estimate_seconds(
        dispatch.kernel_variant("flash_fwd", sm90, "bf16", 256, True, True, 4096, 4096))
    assert estimate_seconds(fwd(128, True, pingpong=True, q_tiles=8)) == estimate_seconds(fwd(128, True, pingpong=True))
    assert estimate_seconds(fwd(128, True, pingpong=True)) > estimate_seconds(fwd(128, False, pingpong=True))
    assert estimate_seconds(fwd(128, False, pingpong=True)) > estimate_seconds(fwd(128, False, tiles=(128, 128, 8)))
    # Split head dims count both chunks: 96 = 64 + 32 between 64 and 128 at the same tiles, 192 = 128 + 64 over 128
    assert estimate_seconds(fwd(64, False, pingpong=True)) < estimate_seconds(fwd(96, False, pingpong=True)) \
        < estimate_seconds(fwd(128, False, pingpong=True))
    assert estimate_seconds(fwd(192, False, tiles=(128, 64, 4), pingpong=True)) > estimate_seconds(
        fwd(128, False, tiles=(128, 64, 4), pingpong=True))
    # The wide tiles (three consumer partitions, GLUON_WIDE_FACTOR): ranked with the ping-pong causal ones, not as plain
    wide = fwd(64, True, tiles=(192, 128, 4), producer=True)
    assert wide.get("BLOCK_M") == 192 and not wide.constexprs.get("PINGPONG")
    assert 0.8 < estimate_seconds(wide) / estimate_seconds(longest) < 1.2
    assert estimate_seconds(fwd(64, False, tiles=(192, 128, 4), producer=True)) > estimate_seconds(
        fwd(128, False, pingpong=True))


def test_the_fused_backward_is_estimated_by_its_held_keys_not_as_unknown() -> None:
    """flash_bwd_fused_gluon (no BLOCK_N field: 128 held keys) compiles about twice as long as the forward of its
    head dim, flash_bwd_prep (a row-wise pass) a fraction of it (schedule.HELD_KEYS, KERNEL_FACTOR)."""
    from lazytriton.kernels import dispatch
    from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch

    sm90 = Target.parse("sm_90")
    for head_dim in (64, 128):
        forward = estimate_seconds(dispatch.kernel_variant("flash_fwd", sm90, "bf16", head_dim, False, True, 4096,
                                                           4096))
        found = bwd_dispatch.flash_bwd_fused_default_variants(sm90, "bf16", head_dim, False, True, False, 4096, 4096)
        assert found is not None
        prep, kernel = (estimate_seconds(v) for v in found)
        assert UNKNOWN_SECONDS not in (prep, kernel)
        assert kernel > 1.5 * forward and prep < 0.5 * forward
