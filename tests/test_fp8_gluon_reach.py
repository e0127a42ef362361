"""The Gluon FP8 forward's reach: prewarm plans it, cache explain names it, the miss log and preload carry it.

On sm_90 a dense FP8 call the table and rule take runs ``flash_fwd_fp8_gluon`` (``fp8.variant``); everywhere
the call is described rather than run, the same variant must come out: prewarm's plan (an image built for
sm_90 holds it, so the call never JIT-compiles), ``cache explain`` (its variant, key and tiers), a miss of it
(``prewarm --from-misses`` rebuilds it), ``lazytriton.preload`` (it loads it). The C API keeps flash_fwd_fp8:
the Gluon kernel makes its TMA descriptors on the device, in global scratch memory, which the C API's plans
do not pass (``tests/test_native_choice.py`` holds C to Python on those calls). All on CPU: no kernel runs.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpu, run_python
from served import jit_prewarm_serve

import lazytriton
from lazytriton import compiler, launch, machine, runtime, tuning
from lazytriton.cache_format import Entry, Provenance
from lazytriton.cache_format.image import Image
from lazytriton.capi import embedded
from lazytriton.cli import main as cli_main
from lazytriton.kernels.flash_fwd import binding, fp8, fp8_gluon
from lazytriton.prewarm import limits
from lazytriton.prewarm.enumeration import Axes, enumerate_variants, takes_kernel, variants_from_miss_log
from lazytriton.target import Target
from lazytriton.variant import Variant

SM90 = Target.parse("sm_90")
NAME = fp8_gluon.NAME
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
HEAD_DIMS = (64, 96, 128, 256)  # 96: no table row
SEQLENS = (128, 512, 1024, 4096)  # prewarm's seqlens are bucket bounds: powers of two


@pytest.fixture(autouse=True)
def gluon_fp8_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel served by dispatch at every head dim of its table (the library serves it at
    ``fp8_gluon.DEFAULT_HEAD_DIMS``, those where it measured faster): these tests hold its rule, reach and numbers."""
    monkeypatch.setattr(fp8_gluon, "BY_DEFAULT", True)
    monkeypatch.setattr(fp8_gluon, "DEFAULT_HEAD_DIMS", frozenset(fp8_gluon.HEAD_DIMS))



def dispatched(target: Target, dtype: str, head_dim: int, causal: bool, sq: int, sk: int,
               aligned: bool = True) -> Variant:
    """The variant a dense FP8 call of this shape runs (the binding's choice, FlashAttention's bottom-right causal)."""
    q = torch.empty(1, 2, sq, head_dim, dtype=DTYPES[dtype], device="meta")
    k = torch.empty(1, 2, sk, head_dim, dtype=DTYPES[dtype], device="meta")
    call = binding.check(q, k, k, "bottom_right" if causal else False, None, fp8=True)
    return fp8.variant(target, call, call.shape, aligned, False, dtype=dtype)  # type: ignore[no-any-return]


def plan_of(target: str, dtypes: tuple[str, ...] = ("e4m3", "e5m2")) -> list[Any]:
    axes = Axes(targets=(Target.parse(target),), kernels=("flash_fwd",), dtypes=dtypes, head_dims=HEAD_DIMS,
                seqlens_q=SEQLENS, seqlens_k=SEQLENS)
    return enumerate_variants(axes, tuning.tables_for(["flash_fwd"]))


# ---------------------------------------------------------------------------
# Prewarm


def test_the_sm90_plan_holds_the_variant_each_fp8_call_runs() -> None:
    plan = plan_of("sm_90")
    keys = {planned.key for planned in plan}
    runs = {dispatched(SM90, dtype, d, causal, sq, sk)
            for dtype, d, causal, sq, sk in itertools.product(DTYPES, HEAD_DIMS, (False, True), SEQLENS, SEQLENS)}
    missing = [str(v) for v in runs if v.key() not in keys]
    assert not missing, f"calls that would JIT-compile after an sm_90 prewarm: {missing[:3]}"
    gluon = {str(v) for v in runs if v.kernel == NAME}
    assert {"e4m3", "e5m2"} == {v.dtype for v in runs if v.kernel == NAME}
    assert gluon == {str(p.variant) for p in plan if p.variant.kernel == NAME}, "planned Gluon variants nothing runs"
    assert {p.origin for p in plan if p.variant.kernel == NAME} == {"fp8 gluon table"}
    assert not any(p.variant.kernel == NAME and p.variant.get("BLOCK_D") == 96 for p in plan)


def test_bottom_right_rows_without_keys_plan_no_gluon_variant() -> None:
    plan = plan_of("sm_90", ("e4m3",))
    assert dispatched(SM90, "e4m3", 128, True, 4096, 1024).kernel == "flash_fwd_fp8"
    for planned in plan:  # every planned Gluon variant is run by a causal call with seqlen_q <= seqlen_k
        if planned.variant.kernel == NAME and planned.variant.get("CAUSAL"):
            d = int(planned.variant.get("BLOCK_D"))
            assert any(dispatched(SM90, "e4m3", d, True, sq, sk).key() == planned.key
                       for sq, sk in itertools.product(SEQLENS, SEQLENS) if sq <= sk)


@pytest.mark.parametrize("target", ["sm_80", "sm_100"])
def test_other_targets_plan_no_gluon_fp8_variant(target: str) -> None:
    kernels = {p.variant.kernel for p in plan_of(target)}
    assert NAME not in kernels
    assert kernels == (set() if target == "sm_80" else {"flash_fwd_fp8"})


def test_the_prewarm_cli_lists_the_gluon_twin_for_sm90_only(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["prewarm", "--dtype", "e5m2", "--head-dim", "128", "--seqlen-q", "4096", "--causal", "none", "--list"]
    assert cli_main([*args, "--target", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert f"{NAME}:sm_90:e5m2:" in out and "flash_fwd_fp8:sm_90:e5m2:" in out
    assert cli_main([*args, "--target", "sm_100"]) == 0
    out = capsys.readouterr().out
    assert NAME not in out and "flash_fwd_fp8:sm_100:e5m2:" in out


# ---------------------------------------------------------------------------
# cache explain


def explain_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert cli_main(["cache", "explain", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_explain_reports_the_kernel_the_call_runs(dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = explain_json(capsys, "--dtype", dtype, "--head-dim", "64", "--seqlen-q", "4096", "--seqlen-k",
                          "8192", "--causal", "bottom_right", "--target", "sm_90")
    runs = dispatched(SM90, dtype, 64, True, 4096, 8192)
    assert runs.kernel == NAME
    assert (report["variant"], report["key"]) == (str(runs), runs.key())
    assert [k["kernel"] for k in report["kernels"]] == [NAME] and report["served_by"] == "jit"
    assert report["call"]["fp8_gluon"].startswith("the Gluon FP8 forward serves it")
    assert cli_main(["cache", "explain", "--dtype", dtype, "--head-dim", "64", "--seqlen-q", "4096",
                     "--target", "sm_90"]) == 0
    text = capsys.readouterr().out
    assert f"variant  {NAME}:sm_90:{dtype}:" in text and "fp8_gluon.TABLE's row for head dim 64" in text


@pytest.mark.parametrize(("args", "why"), [
    (("--seqlen-q", "1000"), "must be positive multiples of the tiles"),
    (("--unaligned",), "16-byte aligned"),
    (("--target", "sm_100"), "not one of ('sm_90',)"),
    (("--head-dim", "96"), "no table row for head dim 96"),
    (("--causal", "bottom_right", "--seqlen-k", "1024"), "leaves rows without keys"),
    (("--window",), "window, softcap"),
])
def test_explain_keeps_flash_fwd_fp8_where_the_call_runs_it(args: tuple[str, ...], why: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    given = {"--head-dim": "128", "--seqlen-q": "4096", "--target": "sm_90"}
    flags = [a for a in args if a.startswith("--")]
    base = [x for name, value in given.items() if name not in flags for x in (name, value)]
    report = explain_json(capsys, "--dtype", "e4m3", *base, *args)
    assert report["variant"].startswith("flash_fwd_fp8:") and report["kernels"][0]["kernel"] == "flash_fwd"
    assert why in report["call"]["fp8_gluon"]


def test_served_agrees_with_the_binding_on_every_described_shape() -> None:
    for d, causal, sq, sk, aligned in itertools.product(HEAD_DIMS, (False, True), SEQLENS, SEQLENS, (True, False)):
        runs = dispatched(SM90, "e4m3", d, causal, sq, sk, aligned)
        described = fp8_gluon.served("sm_90", "e4m3", d, d, "bottom_right" if causal else "none", aligned, False,
                                     sq, sk, False)
        assert (described or runs) == runs, (d, causal, sq, sk, aligned)
        twin = fp8_gluon.prewarm_twin("sm_90", "e4m3", d, causal, aligned, False, sq, sk)
        assert twin == described


# ---------------------------------------------------------------------------
# The miss log


def fake_entry(variant: Variant, key: str | None = None) -> Entry:
    return Entry(key=key or variant.key(), variant=str(variant), target=variant.target, kind="cubin",
                 binary=b"\x7fELF" + bytes(4000), name="k", num_warps=4, num_ctas=1, warp_size=32, shared=0,
                 global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
                 arg_types=("i32",), hidden_args=(), provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1))


def test_a_miss_of_the_gluon_variant_is_rebuilt_from_the_log(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(compiler, "compile_variant", fake_entry)
    runs = [dispatched(SM90, dtype, 128, causal, 4096, 4096) for dtype in DTYPES for causal in (False, True)]
    assert {v.kernel for v in runs} == {NAME}
    for variant in runs:
        runtime.get().resolve(variant)  # a JIT compile: the runtime logs the miss
    log = runtime.get().miss_log
    assert [json.loads(line)["variant"] for line in log.read_text().splitlines()] == [str(v) for v in runs]
    planned, problems = variants_from_miss_log(log)
    assert not problems and [(p.variant, p.key) for p in planned] == [(v, v.key()) for v in runs]
    for kernel, listed in (([], True), (["--kernel", "flash_fwd"], True), (["--kernel", "flash_bwd"], False)):
        assert cli_main(["prewarm", "--from-misses", str(log), *kernel, "--list"]) == 0
        out = capsys.readouterr().out
        assert all((str(v) in out) is listed for v in runs), kernel


def test_kernel_filters_take_the_twins_of_their_family() -> None:
    assert takes_kernel(("flash_fwd",), NAME) and takes_kernel(("flash_fwd",), "flash_fwd_fp8")
    assert takes_kernel(("flash_fwd",), "flash_fwd_gluon") and not takes_kernel(("flash_bwd_dq",), NAME)
    assert takes_kernel(("flash_bwd_dkdv",), "flash_bwd_fused_gluon") and not takes_kernel(("flash_fwd",), "kv_append")


@pytest.mark.parametrize(("change", "why"), [
    (("sm_90", "sm_100"), "built for ('sm_90',) only"),
    (("sm_90", "sm_80"), "built for ('sm_90',) only"),
    (("BLOCK_N=128", "BLOCK_N=32"), "tiles (128, 32, 4) are not one of"),
])
def test_miss_lines_the_kernel_cannot_build_are_refused(change: tuple[str, str], why: str, tmp_path: Path) -> None:
    variant = dispatched(SM90, "e4m3", 128, False, 4096, 4096)
    line = str(variant).replace(*change)
    path = tmp_path / "misses.jsonl"
    path.write_text(json.dumps({"variant": line}) + "\n" + json.dumps({"variant": str(variant)}) + "\n")
    planned, problems = variants_from_miss_log(path)
    assert [p.variant for p in planned] == [variant]
    assert len(problems) == 1 and why in problems[0] and problems[0].startswith(f"{path}:1: refused {line}")
    assert limits.refusal(variant) is None


# ---------------------------------------------------------------------------
# preload


def test_preload_loads_the_gluon_variant_the_call_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "target_of_device", lambda device: SM90)
    monkeypatch.setattr(launch, "capturing", lambda device_index: False)
    monkeypatch.setattr(launch, "is_capturing", lambda: False)
    loaded: list[Variant] = []
    monkeypatch.setattr(runtime.Runtime, "kernel", lambda self, variant, index: loaded.append(variant) or object())
    ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *a, **kw: ones(*a, **{**kw, "device": "cpu"}))  # the absent descale
    rt = runtime.get()
    for dtype, name in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")):
        for shape, fits in (((2, 1024, 8, 128), True), ((2, 1000, 8, 128), False)):
            got = lazytriton.preload(shape, (2, shape[1], 2, 128), causal=True, layout="bshd", dtype=dtype,
                                     device="cuda:0")
            runs = dispatched(SM90, name, 128, True, shape[1], shape[1])
            assert got == [str(runs)] and loaded[-1] == runs and (runs.kernel == NAME) == fits
            assert any(plan[0] is not None for key, plan in rt.plans.items() if key[0] == fp8.MARK
                       and key[2] == name and key[-1] is fits)


# ---------------------------------------------------------------------------
# The C API


def test_the_c_api_plans_flash_fwd_fp8_for_calls_python_runs_on_the_gluon_kernel() -> None:
    for code, name in embedded.FP8_CODES.items():
        assert dispatched(SM90, name, 128, True, 4096, 4096).kernel == NAME
        planned = embedded.plan_variant("flash_fwd", 90, code, 128, True, True, False, 4096, 4096)
        assert planned.kernel == "flash_fwd_fp8" and planned.dtype == name


def test_the_gluon_entry_takes_global_scratch_which_c_plans_do_not_pass() -> None:
    variant = dispatched(SM90, "e4m3", 64, False, 4096, 4096)
    entry = compiler.compile_variant(variant)  # Triton compiles for cuda:90 on CPU
    assert variant.kernel == NAME and "global_scratch" in entry.hidden_args
    # Q's, K's and Vt's TMA descriptors made on the device, 128 bytes each: capi/native/lt_runtime.c's
    # ltn_kernel_layout refuses an entry with scratch memory for the C API's plans.
    assert entry.global_scratch_size >= 3 * 128


RESOLVE_FP8_GLUON = """
import json, sys
import torch
from lazytriton import runtime
from lazytriton.kernels.flash_fwd import binding, fp8, fp8_gluon
from lazytriton.target import Target
variants = []
for dtype, name in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")):
    q = torch.empty(1, 2, 256, 64, dtype=dtype, device="meta")
    call = binding.check(q, q, q, False, None, fp8=True)
    variants.append(fp8.variant(Target.parse("sm_90"), call, call.shape, True, False, dtype=name))
rt = runtime.get()
sources = [rt.resolve(v).source for v in variants]
print(json.dumps({"variants": [str(v) for v in variants], "sources": sources, "compiles": rt.compiles,
                  "triton": sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))[:3]}))
"""


def test_a_jit_miss_of_the_gluon_kernel_is_prewarmed_and_then_served_from_an_image(tmp_path: Path,
                                                                                    cache_dir: Path) -> None:
    report = jit_prewarm_serve(RESOLVE_FP8_GLUON, "flash_fwd", tmp_path, cache_dir)  # compiled for sm_90 on CPU
    assert [v.split(":")[:3] for v in report["variants"]] == [[NAME, "sm_90", "e4m3"], [NAME, "sm_90", "e5m2"]]


# A head dim the Gluon FP8 forward serves by default
SERVED_HEAD_DIM = min(fp8_gluon.DEFAULT_HEAD_DIMS)
SERVE_FP8_CALL = f"""
import json, torch, lazytriton
from lazytriton import runtime
torch.manual_seed(0)
q = torch.randn(1, 4096, 8, {SERVED_HEAD_DIM}, device="cuda").to(torch.float8_e4m3fn)
k, v = (torch.randn(1, 4096, 2, {SERVED_HEAD_DIM}, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
out = lazytriton.flash_attn_func(q, k, v, causal=True)
torch.cuda.synchronize()
print(json.dumps({{"compiles": runtime.get().compiles, "finite": bool(out.float().isfinite().all())}}))
"""


@gpu
def test_gpu_an_sm90_prewarmed_image_serves_the_fp8_call_without_a_compile(tmp_path: Path) -> None:
    if str(machine.target_of_device(torch.device("cuda", 0))) != "sm_90":
        pytest.skip("the Gluon FP8 forward serves sm_90 only")
    image = tmp_path / "fp8.ltimg"
    built = subprocess.run([sys.executable, "-m", "lazytriton.cli", "prewarm", "--target", "sm_90", "--dtype",
                            "e4m3", "--head-dim", str(SERVED_HEAD_DIM), "--seqlen-q", "4096", "-j", "4", "--out",
                            str(image)],
                           capture_output=True, text=True, timeout=600, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    with Image(image) as held:
        assert any(held.read(key).variant.startswith(f"{NAME}:sm_90:e4m3:") for key in held.keys())  # type: ignore
    empty = tmp_path / "empty-cache"
    ran = run_python(SERVE_FP8_CALL, {"LAZYTRITON_CACHE_DIR": str(empty), "LAZYTRITON_IMAGES": str(image),
                                      "LAZYTRITON_JIT": "0"})
    assert ran.returncode == 0, ran.stderr  # with the JIT off, a variant the image lacks raises KernelNotFound
    assert json.loads(ran.stdout.splitlines()[-1]) == {"compiles": 0, "finite": True}
    assert not (empty / "misses.jsonl").exists()
