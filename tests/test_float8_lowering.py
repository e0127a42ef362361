"""Triton 3.6's float8 lowering, fixed for a process's first float8 target: the rule, the fresh process, 3.6 itself.

``lazytriton.float8_lowering`` holds the rule (pure, tested here with made-up
versions and targets), ``lazytriton.compiler`` the process's state and the
fallback to a fresh interpreter, ``prewarm.pool`` the workers' binding (its
test is in tests/test_prewarm_fork.py, beside the probe worker it uses). The
last test runs the order that failed under the other Triton (3.6, where CI
installs it: ``$LAZYTRITON_TEST_OTHER_TRITON_PYTHON``).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import deque

import pytest
from conftest import REPO

from lazytriton import compiler, float8_lowering
from lazytriton.kernels import dispatch
from lazytriton.prewarm.enumeration import Planned
from lazytriton.prewarm.pool import take_for
from lazytriton.target import Target
from lazytriton.variant import Variant

OTHER_TRITON = "LAZYTRITON_TEST_OTHER_TRITON_PYTHON"


def decoding(kernel: str, target: str, kv: str, head_dim: int = 128) -> Variant:
    """A paged cache's variant of ``kernel`` (``kv``: its float8 format, or none)."""
    return dispatch.kernel_variant(kernel, Target.parse(target), "bf16", head_dim, False, True, 4, 4096, paged=True,
                                   kv_fp8=kv)


@pytest.mark.parametrize(("version", "fixed"), [("3.6.0", True), ("3.6.1.post1", True), ("3.8.0", True),
                                                ("3.9.0", False), ("3.10.0", False), ("4.0.0", False),
                                                (None, False), ("unknown", False)])
def test_the_versions_that_fix_a_process_float8_lowering(version: str | None, fixed: bool) -> None:
    assert float8_lowering.fixed_per_process(version) is fixed


def test_a_float8_variant_is_one_with_a_float8_dtype_or_cache() -> None:
    fwd = dispatch.kernel_variant("flash_fwd", Target.parse("sm_90"), "e4m3", 128, True, True, 4096, 4096)
    assert fwd.dtype == "e4m3" and float8_lowering.converts_float8(fwd)
    assert float8_lowering.converts_float8(decoding("kv_append", "sm_80", "e5m2"))
    assert float8_lowering.converts_float8(decoding("flash_decode_split", "gfx942", "e4m3"))
    assert not float8_lowering.converts_float8(decoding("kv_append", "sm_80", "none"))
    assert not float8_lowering.converts_float8(decoding("flash_decode_combine", "sm_90", "none"))


def test_only_another_cuda_targets_float8_variant_needs_a_fresh_process() -> None:
    sm80, sm90 = decoding("kv_append", "sm_80", "e5m2"), decoding("kv_append", "sm_90", "e4m3")
    plain80, hip = decoding("kv_append", "sm_80", "none"), decoding("kv_append", "gfx942", "e4m3")
    needs = float8_lowering.needs_fresh_process
    assert needs(sm80, "sm_90", "3.6.0") and needs(sm90, "sm_80", "3.6.0")
    assert not needs(sm80, "sm_80", "3.6.0") and not needs(sm80, None, "3.6.0")
    assert not needs(plain80, "sm_90", "3.6.0") and not needs(hip, "sm_90", "3.6.0")
    assert not needs(sm80, "sm_90", "3.9.0") and not needs(sm80, "sm_90", None)
    assert float8_lowering.bound_elsewhere(plain80, "sm_90", "3.6.0")  # its failure is retried in a fresh one
    assert not float8_lowering.bound_elsewhere(hip, "sm_90", "3.6.0")


def test_the_first_cuda_float8_compile_fixes_the_process() -> None:
    after = float8_lowering.fixed_after
    sm80, sm90 = decoding("kv_append", "sm_80", "e5m2"), decoding("kv_append", "sm_90", "e4m3")
    plain80, hip = decoding("kv_append", "sm_80", "none"), decoding("kv_append", "gfx942", "e4m3")
    assert after(None, sm90, "tt.fp_to_fp") == "sm_90" and after("sm_90", sm80, "tt.fp_to_fp") == "sm_90"
    assert after(None, sm80, None) == "sm_80"  # a failed float8 compile may have lowered before it failed
    assert after(None, plain80, "arith.truncf") is None and after(None, plain80, None) is None
    assert after(None, plain80, "%1 = tt.fp_to_fp %0") == "sm_80"  # a conversion its fields did not foretell
    assert after(None, hip, "tt.fp_to_fp") is None  # HIP's lowering is not fixed


def planned(*variants: Variant) -> deque[Planned]:
    return deque(Planned(v, v.key(), "test") for v in variants)


def test_a_bound_worker_takes_the_first_variant_its_target_allows() -> None:
    sm90_a, sm80_a = decoding("kv_append", "sm_90", "e4m3"), decoding("kv_append", "sm_80", "e5m2")
    sm80_b, plain80 = decoding("flash_decode_split", "sm_80", "e5m2"), decoding("kv_append", "sm_80", "none")
    queue = planned(sm80_a, sm80_b, plain80, sm90_a)
    assert take_for(queue, "sm_90", "3.9.0").variant == sm80_a, "3.9: the order as it is"
    assert take_for(queue, None, "3.6.0").variant == sm80_b, "nothing fixed yet: the first"
    assert take_for(queue, "sm_90", "3.6.0").variant == plain80
    assert take_for(queue, "sm_80", "3.6.0") is None and [p.variant for p in queue] == [sm90_a]
    assert take_for(queue, "sm_90", "3.6.0").variant == sm90_a and not queue


def test_a_fresh_process_compiles_the_entry_this_one_does() -> None:
    """The fallback's child (``lazytriton.compile_child``): the same binary and launch fields, its bytes checked."""
    variant = decoding("kv_append", "sm_80", "e5m2", head_dim=64)
    here = compiler.compile_in_process(variant)
    there = float8_lowering.compile_fresh(variant, variant.key())
    assert there.binary == here.binary and there.arg_types == here.arg_types and there.key == here.key
    assert (there.num_warps, there.shared, there.name) == (here.num_warps, here.shared, here.name)
    e4m3 = Variant.parse(str(variant).replace("KV_FP8=e5m2", "KV_FP8=e4m3"))  # Triton has no e4m3 for sm_80
    with pytest.raises(float8_lowering.FreshCompileError, match="CompileError: compiling kv_append:sm_80"):
        float8_lowering.compile_fresh(e4m3, e4m3.key())


# The order that failed under Triton 3.6 (sm_90's float8 first, then sm_80's), the other way round (sm_80's
# first: sm_90's e5m2 decoding kernel compiled to another binary), and each case alone in its own process.
ORDER = """
import hashlib, json, sys
from lazytriton import compiler
from lazytriton.kernels import dispatch
from lazytriton.target import Target

for case in sys.argv[1:]:
    kernel, target, kv = case.split(":")
    variant = dispatch.kernel_variant(kernel, Target.parse(target), "bf16", 128, False, True, 4, 4096, paged=True,
                                      kv_fp8=kv)
    entry = compiler.compile_variant(variant)
    print("ENTRY " + json.dumps([case, hashlib.sha256(entry.binary).hexdigest(), compiler.float8_fixed_for()]),
          flush=True)
"""
SEQUENCES = {"sm_90 first": ["kv_append:sm_90:e4m3", "kv_append:sm_80:e5m2", "flash_decode_split:sm_80:e5m2"],
             "sm_80 first": ["kv_append:sm_80:e5m2", "flash_decode_split:sm_90:e5m2"],
             "alone 1": ["flash_decode_split:sm_80:e5m2"], "alone 2": ["flash_decode_split:sm_90:e5m2"]}


def test_the_other_triton_compiles_two_targets_float8_variants_as_fresh_processes() -> None:
    python = os.environ.get(OTHER_TRITON)
    if not python:
        pytest.skip(f"set {OTHER_TRITON} to a Python with the other Triton version (3.6 beside 3.9): .ci/run does")
    found: dict[str, list[tuple[str, str, str | None]]] = {}
    for name, cases in SEQUENCES.items():
        done = subprocess.run([python, "-c", ORDER, *cases], capture_output=True, text=True, timeout=900, cwd=REPO,
                              check=False)
        assert done.returncode == 0, name + ": " + done.stdout[-3000:] + done.stderr[-3000:]
        found[name] = [tuple(json.loads(line[6:])) for line in done.stdout.splitlines() if line.startswith("ENTRY ")]
        assert [case for case, _, _ in found[name]] == cases, name
    digest = {name: [d for _, d, _ in rows] for name, rows in found.items()}
    assert digest["sm_90 first"][1] == digest["sm_80 first"][0], "kv_append for sm_80 as alone"
    assert digest["sm_90 first"][2] == digest["alone 1"][0], "the split kernel for sm_80 as alone"
    assert digest["sm_80 first"][1] == digest["alone 2"][0], "the split kernel for sm_90 as alone"
    fixed = {name: rows[-1][2] for name, rows in found.items()}
    version = subprocess.run([python, "-c", "import triton; print(triton.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    if float8_lowering.fixed_per_process(version):  # the later target's compiles ran in fresh processes
        assert fixed == {"sm_90 first": "sm_90", "sm_80 first": "sm_80", "alone 1": "sm_80", "alone 2": "sm_90"}
    else:
        assert set(fixed.values()) == {None}
