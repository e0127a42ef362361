"""The decoding kernels (``flash_decode``) as a kernel family: prewarm plans, explain, miss logs and images.

The pure parts run on an empty tuning table; the end-to-end test compiles
the two kernels a decoding call selects (head dim 16, fp16, sm_90) just in
time, turns the miss log into an image, and a fresh process is served both
kernels from it without importing triton.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from served import jit_prewarm_serve

from lazytriton import tuning
from lazytriton.cli import main as cli_main
from lazytriton.kernels import FAMILIES, kv_append
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.prewarm.enumeration import Axes, enumerate_variants, variants_from_misses
from lazytriton.target import Target
from lazytriton.variant import Variant

SM90 = Target.parse("sm_90")
DECODE = FAMILIES["flash_decode"]
EMPTY = tuning.Table(())


def test_the_default_plan_serves_every_decoding_call_of_its_grid() -> None:
    plan = enumerate_variants(Axes((SM90,), kernels=DECODE), EMPTY)
    planned = {p.key for p in plan}
    assert len(planned) == len(plan) and {p.variant.kernel for p in plan} == {*DECODE, "kv_append"}
    assert {p.variant.dtype for p in plan} == {"bf16", "fp16"}
    assert {p.variant.get("BLOCK_D") for p in plan} == {64, 128}
    split = [p.variant for p in plan if p.variant.kernel == "flash_decode_split"]
    assert {dict(v.functional).get("PAGED", False) for v in split} == {False, True}
    assert {v.get("BLOCK_M") for v in split} == {16, 32, 64}
    # Every call on the grid: query rows 1..200 per kv head, contiguous or pages that are multiples of 64.
    for dtype, head_dim, causal, rows, page in itertools.product(("bf16", "fp16"), (64, 128), (False, True),
                                                                 (1, 4, 16, 17, 32, 33, 64, 200), (0, 64, 256, 1024)):
        for kernel in DECODE:
            chosen = decode_dispatch.decode_variant(kernel, SM90, dtype, head_dim, causal, True, rows, 32768,
                                                    page_size=page, paged=page > 0, table=EMPTY)
            assert chosen.key() in planned, chosen
        # A call with new keys launches kv_append first: planned with the decoding kernels.
        assert kv_append.variant(SM90, dtype, head_dim, 0, page > 0, True, False).key() in planned


def test_paged_narrows_the_plan_and_small_pages_are_gathered(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["prewarm", "--target", "sm_90", "--kernel", "flash_decode", "--paged", "paged", "--list"]) == 0
    listed = [Variant.parse(line.split()[2]) for line in capsys.readouterr().out.splitlines()]
    split = [v for v in listed if v.kernel == "flash_decode_split"]
    assert split and all(dict(v.functional).get("PAGED") is True for v in split)
    small = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096, page_size=16,
                                           paged=True)
    assert small.get("PAGE_GATHER") is True and small.get("BLOCK_N") == 64  # a paged call's tile, not 16 keys
    assert small.key() not in {v.key() for v in listed}
    with pytest.raises(SystemExit):
        cli_main(["prewarm", "--target", "sm_90", "--paged", "sometimes", "--list"])


def test_a_miss_log_of_decoding_variants_is_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    every = decode_dispatch.decode_variant("flash_decode_split", SM90, "fp16", 40, True, False, 8, 100, page_size=32,
                                           paged=True, window=True, softcap=True, alibi=True)
    combine = decode_dispatch.decode_variant("flash_decode_combine", SM90, "fp16", 40, True, False, 8, 100)
    lines = [json.dumps({"variant": str(v)}) for v in (every, combine)]
    lines.append(json.dumps({"variant": str(every).replace("BLOCK_M=16", "BLOCK_M=1024")}))
    plan, problems = variants_from_misses(lines, "m.jsonl")
    assert [p.variant for p in plan] == [every, combine]
    assert len(problems) == 1 and "BLOCK_M=1024 is over the cap" in problems[0]
    misses = tmp_path / "misses.jsonl"
    misses.write_text("\n".join(lines[:2]) + "\n")
    assert cli_main(["prewarm", "--from-misses", str(misses), "--kernel", "flash_decode_combine", "--list"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()] == [combine.key()]
    assert cli_main(["prewarm", "--from-misses", str(misses), "--paged", "paged", "--list"]) == 2
    assert "--paged cannot narrow it" in capsys.readouterr().err


def test_explain_names_both_kernels_and_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["cache", "explain", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4",
            "--seqlen-k", "32768", "--target", "sm_90"]
    assert cli_main([*args, "--page-size", "192", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [k["kernel"] for k in report["kernels"]] == list(DECODE)
    split = Variant.parse(report["kernels"][0]["variant"])
    assert split.get("PAGED") is True and 192 % int(split.get("BLOCK_N")) == 0 and report["call"]["page_size"] == 192
    assert report["kernels"][0]["served_by"] == "jit"
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "a contiguous cache" in out and "PAGED" not in out
    assert cli_main([*args, "--page-size", "-24"]) == 2
    assert "--page-size must be >= 0, got -24" in capsys.readouterr().err
    appended = ["cache", "explain", "--kernel", "kv_append", "--dtype", "bf16", "--head-dim", "128", "--head-dim-v",
                "64", "--seqlen-q", "1", "--page-size", "64", "--target", "sm_90", "--json"]
    assert cli_main(appended) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["variant"] == str(kv_append.variant(SM90, "bf16", 128, 64, True, True, False))


RESOLVE_DECODE = """
import json, sys
import torch
from lazytriton import runtime
from lazytriton.kernels.flash_decode import binding, checks
from lazytriton.target import Target
call = checks.Call(2, 8, 2, 1, 16, 1, 4096, 256, 64, -1, False, 0.25)
variants = binding.variants(Target.parse("sm_90"), torch.float16, call._replace(page_size=256), True, False)
rt = runtime.get()
sources = [rt.resolve(v).source for v in variants]
print(json.dumps({"variants": [str(v) for v in variants], "sources": sources, "compiles": rt.compiles,
                  "triton": sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))[:3]}))
"""


def test_a_decoding_miss_is_prewarmed_and_then_served_from_an_image_without_triton(
        tmp_path: Path, cache_dir: Path) -> None:
    report = jit_prewarm_serve(RESOLVE_DECODE, "flash_decode", tmp_path, cache_dir)
    assert [v.split(":")[0] for v in report["variants"]] == list(DECODE)
    assert "PAGED=true" in report["variants"][0]


def test_a_tuned_row_never_gives_the_split_kernel_a_tile_taller_than_the_rows_class() -> None:
    """A row tuned for MQA's 32-row groups serves any rows of its bucket: a group of 8 keeps 16-row tiles."""
    sm90 = Target.parse("sm_90")

    def row(kernel: str, block_m: int) -> tuning.Row:
        return tuning.Row("sm_90", kernel, "bf16", 128, False, 32, 32768, block_m, 128, 4, 3, 0, 1.0, "test", "")

    table = tuning.Table([row("flash_decode_split", 32), row("flash_decode_combine", 1)])
    for rows, block_m in ((8, 16), (16, 16), (32, 32), (64, 32)):
        config, found = decode_dispatch.decode_config("flash_decode_split", sm90, "bf16", 128, False, rows, 32768,
                                                      table=table)
        assert found is not None and (config.block_m, config.block_n) == (block_m, 128), rows
    combine, _ = decode_dispatch.decode_config("flash_decode_combine", sm90, "bf16", 128, False, 8, 32768,
                                               table=table)
    assert combine.block_m == 1


def test_feature_split_variants_keep_the_plain_tiles_occupancy_on_cuda() -> None:
    """A feature's split variant at head dims up to 128 is compiled with at most 128 registers (maxnreg) on CUDA."""
    from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
    from lazytriton.target import Target
    from lazytriton.variant import Variant, check_fields

    sm90, gfx942 = Target.parse("sm_90"), Target.parse("gfx942")

    def split(target: Target, head_dim: int = 128, **features: bool) -> Variant:
        return decode_dispatch.decode_variant("flash_decode_split", target, "bf16", head_dim, False, True, 4, 4096,
                                              **features)

    assert "maxnreg" not in dict(split(sm90).options)
    assert "maxnreg" not in dict(split(sm90, paged=True, page_size=256).options)  # a layout, not a feature
    for feature in ("window", "softcap", "alibi", "leftpad", "rotary", "sinks", "varlen_q", "chunk", "key_mask"):
        capped = split(sm90, **{feature: True})
        assert dict(capped.options)["maxnreg"] == decode_dispatch.FEATURE_MAX_REGISTERS, feature
        assert check_fields(Variant.parse(str(capped))) == capped
        assert "maxnreg" not in dict(split(sm90, 256, **{feature: True}).options), feature  # wider tiles: not capped
        assert "maxnreg" not in dict(split(gfx942, **{feature: True}).options), feature  # a CUDA option
        gathered = split(sm90, paged=True, page_size=32, **{feature: True})  # a pointer a key: never capped
        assert dict(gathered.functional)["PAGE_GATHER"] is True and "maxnreg" not in dict(gathered.options), feature
        assert dict(split(sm90, paged=True, page_size=64, **{feature: True}).options)["maxnreg"] == 128, feature
        unaligned = decode_dispatch.decode_variant("flash_decode_split", sm90, "bf16", 128, False, False, 4, 4096,
                                                   **{feature: True})  # 192-255 registers: the cap would spill
        assert dict(unaligned.functional)["ALIGN16"] is False and "maxnreg" not in dict(unaligned.options), feature
    combine = decode_dispatch.decode_variant("flash_decode_combine", sm90, "bf16", 128, False, True, 4, 4096,
                                             sinks=True)
    assert "maxnreg" not in dict(combine.options)
