"""The one plan mechanism (``lazytriton.launch.plan``) and each family's plan through it, on CPU with a fake runtime.

A plan is the miss path of a warm call: the device's target, the family's choice of variants, the capture
guard, the loads, the memo. Each family's entry keeps its own flat form (kernels and the tile fields their
launches read), which its warm call unpacks; these tests pin both the mechanism and every family's entry.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lazytriton import launch, machine, runtime
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_decode import binding as decode
from lazytriton.kernels.flash_decode import checks
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.kernels.kv_append import binding as append
from lazytriton.target import Target
from lazytriton.variant import Variant

SM90 = Target.parse("sm_90")
V1 = Variant.parse("flash_fwd:sm_90:bf16:ALIGN16=true,BLOCK_D=64,CAUSAL=false,EVEN_D=true,INDEX64=false:"
                   "BLOCK_M=128,BLOCK_N=64:num_stages=3,num_warps=8")
V2 = Variant.parse("flash_bwd_dkdv:sm_90:bf16:ALIGN16=true,BLOCK_D=64,CAUSAL=false,EVEN_D=true,INDEX64=false:"
                   "BLOCK_M=32,BLOCK_N=64:num_stages=3,num_warps=4")


class _Kernel:
    def __init__(self, variant: Variant, device_index: int) -> None:
        self.variant, self.device_index = variant, device_index


class _Runtime:
    """Loads nothing: ``kernel`` returns a stand-in naming its variant and counts the loads."""

    def __init__(self, loaded: bool = False) -> None:
        self.plans: dict[Any, Any] = {}
        self.loads: list[str] = []
        self.is_loaded = loaded

    def loaded(self, variant: Variant, device_index: int) -> Any:
        return _Kernel(variant, device_index) if self.is_loaded else None

    def kernel(self, variant: Variant, device_index: int) -> _Kernel:
        self.loads.append(variant.kernel)
        return _Kernel(variant, device_index)


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> _Runtime:
    rt = _Runtime()
    monkeypatch.setattr(machine, "target_of_device", lambda device: SM90)
    monkeypatch.setattr(launch, "is_capturing", lambda: False)
    monkeypatch.setattr(launch, "current_device", None)
    monkeypatch.setattr(runtime, "get", lambda: rt)
    return rt


def test_plan_flattens_each_kernel_and_its_fields_and_memoises_the_entry(sm90: _Runtime) -> None:
    seen: list[Target] = []

    def choose(target: Target) -> launch.Choice:
        seen.append(target)
        return ((V1, ("BLOCK_M", "BLOCK_N")), (V2, ("BLOCK_N", 0)))

    entry = launch.plan(sm90, ("key",), torch.device("cuda", 1), choose, "fix")
    assert seen == [SM90]
    assert [type(item).__name__ for item in entry] == ["_Kernel", "int", "int", "_Kernel", "int", "int"]
    assert entry[0].variant == V1 and entry[0].device_index == 1 and entry[1:3] == (128, 64)
    assert entry[3].variant == V2 and entry[4:] == (64, 0)
    assert sm90.plans[("key",)] is entry and sm90.loads == ["flash_fwd", "flash_bwd_dkdv"]


def test_plan_refuses_a_capture_before_any_load(sm90: _Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "is_capturing", lambda: True)
    with pytest.raises(launch.CaptureError, match=r"flash_bwd_dkdv:sm_90.*not loaded on cuda:0.*run it first"):
        launch.plan(sm90, ("key",), torch.device("cuda", 0), lambda target: ((V2, ()),), "run it first")
    assert sm90.loads == [] and not sm90.plans
    sm90.is_loaded = True  # loaded already: a capture may use it
    launch.plan(sm90, ("key",), torch.device("cuda", 0), lambda target: ((V2, ()),), "run it first")
    assert ("key",) in sm90.plans


def test_the_forward_plan_is_its_kernel_and_block_m(sm90: _Runtime) -> None:
    shape = fwd.Shape(1, 2, 2, 100, 100, 64)
    kernel, block_m = fwd.plan(sm90, ("fwd",), torch.device("cuda", 0), torch.bfloat16, shape, False, True, False)
    assert kernel.variant.kernel == "flash_fwd" and block_m == kernel.variant.get("BLOCK_M")


@pytest.mark.parametrize("fused", [False, True])
def test_the_backward_plan_is_two_kernels_with_their_held_tiles_or_the_fused_pair_marked_0(
        sm90: _Runtime, fused: bool) -> None:
    shape = fwd.Shape(1, 2, 2, 4096, 4096, 128)
    entry = bwd.plan(sm90, ("bwd",), torch.device("cuda", 0), torch.bfloat16, shape, False, True, False,
                     fused_=fused)
    first, held, second, marker = entry
    if fused:
        assert (first.variant.kernel, second.variant.kernel, marker) == ("flash_bwd_prep", "flash_bwd_fused_gluon", 0)
        assert held == first.variant.get("BLOCK_M")
    else:
        assert (first.variant.kernel, second.variant.kernel) == ("flash_bwd_dq", "flash_bwd_dkdv")
        assert held == first.variant.get("BLOCK_M") and marker == second.variant.get("BLOCK_N") > 0


def _decode_call(paged: bool) -> checks.Call:
    q = torch.randn(2, 1, 8, 128, dtype=torch.bfloat16)
    cache = torch.randn(4, 64, 2, 128, dtype=torch.bfloat16) if paged else torch.randn(2, 256, 2, 128,
                                                                                         dtype=torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32) if paged else None
    seqlens = torch.tensor([100, 7], dtype=torch.int32)
    return checks.check(checks.Inputs(q, cache, cache, cache_seqlens=seqlens, block_table=table))


@pytest.mark.parametrize("paged", [False, True])
def test_the_decoding_plan_is_the_split_kernel_with_its_tiles_then_the_combine_kernel(sm90: _Runtime,
                                                                                     paged: bool) -> None:
    call = _decode_call(paged)
    entry = decode.plan(torch.device("cuda", 0), torch.bfloat16, call, True, False)
    split, block_m, block_n, combine, combine_m = entry
    assert (split.variant.kernel, combine.variant.kernel) == ("flash_decode_split", "flash_decode_combine")
    assert (block_m, block_n, combine_m) == (split.variant.get("BLOCK_M"), split.variant.get("BLOCK_N"),
                                             combine.variant.get("BLOCK_M"))
    assert decode.plan(torch.device("cuda", 0), torch.bfloat16, call, True, False) is entry  # memoised
    assert sm90.loads == ["flash_decode_split", "flash_decode_combine"]


def test_the_append_plan_is_its_kernel_on_a_miss_and_on_a_hit(sm90: _Runtime) -> None:
    call = _decode_call(paged=False)
    first = append.plan(torch.device("cuda", 0), torch.bfloat16, call, True, False)
    again = append.plan(torch.device("cuda", 0), torch.bfloat16, call, True, False)
    assert isinstance(first, _Kernel) and first.variant.kernel == "kv_append" and again is first
    assert sm90.loads == ["kv_append"]
