"""Varlen variants in the cache: they compile for a GPU target, prewarm's ``--varlen`` axis, ``cache explain
--varlen``, and a JIT miss that ``prewarm --from-misses`` plans again.

No GPU needed: Triton compiles for sm_90 here, and the interpreter (which
compiles nothing) is not involved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lazytriton import runtime, tuning
from lazytriton.cli import main as cli_main
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.target import Target

SM90 = Target.parse("sm_90")


@pytest.mark.parametrize("kernel", ["flash_fwd", *bwd_dispatch.BWD_KERNELS])
def test_varlen_variants_compile_with_the_two_pointers_after_the_kernels_own(kernel: str) -> None:
    from lazytriton.compiler import compile_variant
    from lazytriton.kernels import get

    variant = dispatch.kernel_variant(kernel, SM90, "bf16", 64, True, True, 2048, 2048, varlen=True, window=True)
    entry = compile_variant(variant)
    spec = get(kernel)
    assert entry.binary[:4] == b"\x7fELF" and entry.variant == str(variant)
    assert entry.arg_types == tuple(t for t in spec.signature("bf16", False).values() if t != "constexpr")
    first = [name for name, _ in spec.params].index("Cu_seqlens_q")  # after the kernel's own pointers
    assert all(kind.startswith("*") for _, kind in spec.params[:first])
    assert entry.arg_types[first:first + 2] == ("*i32", "*i32")


def test_prewarm_varlen_axis_adds_varlen_variants(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.prewarm.enumeration import Axes, all_kernels, enumerate_variants

    narrow = {"targets": (SM90,), "dtypes": ("bf16",), "head_dims": (128,), "causal": (True,), "seqlens_q": (2048,),
              "kernels": ("flash_fwd", *bwd_dispatch.BWD_KERNELS)}  # decoding has no varlen, dropout or bias variants
    table = tuning.tables_for(all_kernels())
    plain = enumerate_variants(Axes(**narrow), table)
    both = enumerate_variants(Axes(**narrow, varlen=(False, True)), table)
    # One varlen variant a kernel: the backward's dense aligned calls have two (with and without SEQ16), a packed
    # call never has SEQ16.
    n_kernels = len(narrow["kernels"])
    assert len(both) == len(plain) + n_kernels and {p.key for p in plain} < {p.key for p in both}
    assert sum(p.variant.constexprs.get("VARLEN") is True for p in both) == n_kernels
    common = ["prewarm", "--kernel", "flash_fwd,flash_bwd", "--target", "sm_90",
              "--dtype", "bf16", "--head-dim", "128", "--causal", "causal",
              "--seqlen-q", "2048", "--list"]
    assert cli_main(common) == 0
    listed_plain = capsys.readouterr().out.splitlines()
    assert cli_main([*common, "--varlen"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(listed_plain) + n_kernels
    assert sum("VARLEN=true" in line for line in listed) == n_kernels


def test_cache_explain_describes_a_varlen_call(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["cache", "explain", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4096", "--target", "sm_90",
            "--causal", "bottom_right", "--kernel", "flash_bwd"]
    assert cli_main([*args, "--varlen", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    wanted = [dispatch.kernel_variant(k, SM90, "bf16", 128, True, True, 4096, 4096, varlen=True)
              for k in bwd_dispatch.BWD_KERNELS]
    assert report["call"]["varlen"] is True
    assert [k["variant"] for k in report["kernels"]] == [str(v) for v in wanted]
    assert [k["key"] for k in report["kernels"]] == [v.key() for v in wanted]
    assert cli_main([*args, "--varlen"]) == 0
    assert "varlen: packed sequences (VARLEN=true)" in capsys.readouterr().out
    assert cli_main([*args, "--json"]) == 0
    assert all("VARLEN" not in k["variant"] for k in json.loads(capsys.readouterr().out)["kernels"])


def test_a_varlen_jit_miss_is_logged_and_prewarm_from_misses_plans_it(
        cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    variant = dispatch.kernel_variant("flash_fwd", SM90, "fp16", 16, True, True, 64, 64, varlen=True)
    assert runtime.get().resolve(variant).source == "jit"
    misses = cache_dir / "misses.jsonl"
    logged = [json.loads(line)["variant"] for line in misses.read_text().splitlines()]
    assert logged == [str(variant)]
    assert cli_main(["prewarm", "--from-misses", str(misses), "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed == [f"{variant.key()} misses   {variant}"]
