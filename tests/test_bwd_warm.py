"""The backward's warm path (``binding._warm_backward``): a plain call whose geometry was served repeats its launches.

On CPU with fake kernels: the general path (``launch_gpu``) records the
entry, and a later call of the same geometry on other tensors must launch
what the general path would launch for them (the same kernels, grids, floats
and integers, with that call's pointers in their slots), or decline (None)
where the general path would choose otherwise. The GPU case runs both paths
through autograd and checks the gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_flash_bwd import check_grads, grads_of
from test_flash_fwd import make_qkv, on_gpu

import lazytriton
from lazytriton import launch, runtime
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_bwd import fused
from lazytriton.kernels.flash_fwd import binding as fwd

Launch = tuple[str, tuple[int, int, int], tuple[int, ...], tuple[float, ...]]


class FakeKernel:
    def __init__(self, name: str, log: list[Launch]) -> None:
        self.name, self.log = name, log

    def launch(self, grid: tuple[int, int, int], stream: int, ints: tuple[int, ...], floats: tuple[float, ...],
               scratch_alloc: object) -> None:
        assert stream == 7
        self.log.append((self.name, grid, ints, tuple(floats)))


class FakeRuntime:
    def __init__(self) -> None:
        self.plans: dict[tuple[Any, ...], Any] = {}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A runtime of fake kernels: the plan is the fused pair or flash_bwd's two as ``state["fused"]`` says."""
    log: list[Launch] = []
    state: dict[str, Any] = {"fused": True, "log": log, "rt": FakeRuntime()}

    def plan(rt: Any, key: tuple[Any, ...], *args: Any, **kwargs: Any) -> tuple[Any, int, Any, int]:
        if kwargs.get("fused_", args[-1] if len(args) > 12 else False):
            entry = (FakeKernel(fused.PREP, log), fused.PREP_BLOCK_M, FakeKernel(fused.NAME, log), 0)
        else:
            entry = (FakeKernel("flash_bwd_dq", log), 64, FakeKernel("flash_bwd_dkdv", log), 32)
        rt.plans[key] = entry
        return entry

    monkeypatch.setattr(runtime, "get", lambda: state["rt"])
    monkeypatch.setattr(bwd, "plan", plan)
    monkeypatch.setattr(launch, "raw_stream", lambda device_index: 7)
    monkeypatch.setattr(bwd, "fused_fits", lambda *args, **kwargs: state["fused"] and not args[5])
    return state


def _inputs(layout: str, heads: tuple[int, int], seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    b, s, d = 2, 128, 64
    if layout == "bshd":  # (B, H, S, D) views of FlashAttention's layout
        q = torch.randn(b, s, heads[0], d, generator=gen).to(torch.bfloat16).transpose(1, 2)
        k, v = (torch.randn(b, s, heads[1], d, generator=gen).to(torch.bfloat16).transpose(1, 2) for _ in range(2))
    else:
        q = torch.randn(b, heads[0], s, d, generator=gen).to(torch.bfloat16)
        k, v = (torch.randn(b, heads[1], s, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    out, do = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(b, heads[0], s, generator=gen)
    return q, k, v, out, do, lse


def _general(state: dict[str, Any], tensors: tuple[torch.Tensor, ...], call: fwd.Call,
             deterministic: bool = False) -> tuple[list[Launch], bwd.Grads]:
    q, k, v, out, do, lse = tensors
    grads = bwd.empty_grads(q, k, v)
    start = len(state["log"])
    bwd.launch_gpu(q, k, v, out, lse, do, grads, call, deterministic=deterministic)
    return state["log"][start:], grads


def _slots(name: str) -> dict[str, int]:
    spec = {fused.PREP: fused.FLASH_BWD_PREP, fused.NAME: fused.FLASH_BWD_FUSED_GLUON,
            "flash_bwd_dq": bwd.FLASH_BWD_DQ, "flash_bwd_dkdv": bwd.FLASH_BWD_DKDV}[name]
    names = [n for n, kind in spec.params if not kind.startswith("fp")]
    return {n: i for i, n in enumerate(names)}


@pytest.mark.parametrize("fused_plan", [True, False], ids=["fused", "two kernels"])
@pytest.mark.parametrize("layout, heads", [("bhsd", (4, 4)), ("bshd", (4, 2))])
def test_a_warm_call_launches_what_the_general_path_would(fake: dict[str, Any], fused_plan: bool, layout: str,
                                                          heads: tuple[int, int]) -> None:
    fake["fused"] = fused_plan
    first = _inputs(layout, heads, 1)
    call = fwd.check(*first[:3], "bottom_right", 0.3)
    _general(fake, first, call)
    assert len(fake["rt"].plans[bwd.WARM_TAG]) == 1
    second = _inputs(layout, heads, 2)  # the same geometry, other tensors
    q, k, v, out, do, lse = second
    start = len(fake["log"])
    grads = bwd._warm_backward(q, k, v, out, lse, do, call, False)
    assert grads is not None
    warm = fake["log"][start:]
    general, _ = _general(fake, second, call)  # what the general path launches for these tensors
    assert [w[0] for w in warm] == [g[0] for g in general]
    assert [w[1] for w in warm] == [g[1] for g in general] and [w[3] for w in warm] == [g[3] for g in general]
    mine = {"Q": q, "K": k, "V": v, "Out": out, "DO": do, "Lse": lse, "DQ": grads.dq, "DK": grads.dk,
            "DV": grads.dv}
    fresh = {"Delta", "DQA", "DQ", "DK", "DV"}  # allocated by each path
    for (name, _, ints, _), (_, _, expected, _) in zip(warm, general, strict=True):
        slots = _slots(name)
        for param, i in slots.items():
            if param in mine and param not in {"Delta", "DQA"}:
                assert ints[i] == mine[param].data_ptr(), (name, param)
            elif param not in fresh:
                assert ints[i] == expected[i], (name, param)
    if fused_plan:  # one allocation: delta, then dQ's accumulator
        prep, kernel = warm
        delta = prep[2][_slots(fused.PREP)["Delta"]]
        assert prep[2][_slots(fused.PREP)["DQA"]] == delta + 4 * 2 * heads[0] * 128
        assert kernel[2][_slots(fused.NAME)["Delta"]] == delta
        assert grads.dq.shape == q.shape and grads.dk.shape == k.shape


def test_the_warm_path_declines_what_the_general_path_would_serve_otherwise(fake: dict[str, Any]) -> None:
    tensors = _inputs("bhsd", (2, 2), 3)
    q, k, v, out, do, lse = tensors
    call = fwd.check(q, k, v, False, None)
    _general(fake, tensors, call)
    assert bwd._warm_backward(q, k, v, out, lse, do, call, False) is not None
    assert bwd._warm_backward(q, k, v, out, lse, do, call, True) is None  # deterministic: an entry of its own
    fake["fused"] = False  # the tables now choose another plan for it
    assert bwd._warm_backward(q, k, v, out, lse, do, call, False) is None
    fake["fused"] = True
    unaligned = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape).copy_(q)  # 2 bytes past alignment
    assert bwd._warm_backward(unaligned, k, v, out, lse, do, call, False) is None
    other_scale = call._replace(scale=0.5)
    assert bwd._warm_backward(q, k, v, out, lse, do, other_scale, False) is None
    fake["rt"].plans.clear()  # the runtime's plans cleared: the warm entries go with them
    assert bwd._warm_backward(q, k, v, out, lse, do, call, False) is None


def test_a_call_with_features_is_never_warm(fake: dict[str, Any]) -> None:
    tensors = _inputs("bhsd", (2, 2), 4)
    q, k, v, out, do, lse = tensors
    capped = fwd.check(q, k, v, False, None, softcap=5.0)
    _general(fake, tensors, capped)
    assert bwd.WARM_TAG not in fake["rt"].plans
    assert bwd._warm_backward(q, k, v, out, lse, do, capped, False) is None


def test_the_warm_entries_are_bounded(fake: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A geometry is exact (seqlens, not buckets): a run of ever new shapes must not grow the entries forever."""
    monkeypatch.setattr(bwd, "WARM_MAX", 3)
    for s in (64, 128, 192, 256, 320):
        q, k, v, out, do = (torch.randn(1, 2, s, 64).to(torch.bfloat16) for _ in range(5))
        lse = torch.randn(1, 2, s)
        _general(fake, (q, k, v, out, do, lse), fwd.check(q, k, v, False, None))
        assert 1 <= len(fake["rt"].plans[bwd.WARM_TAG]) <= 3
    assert bwd._warm_backward(q, k, v, out, lse, do, fwd.check(q, k, v, False, None), False) is not None


@on_gpu
@pytest.mark.parametrize("dtype, causal, heads, seqlens, head_dim", [
    (torch.bfloat16, True, (4, 2), (2048, 2048), 128),  # the fused plan where its table serves it
    (torch.float16, False, (4, 4), (512, 512), 64),  # flash_bwd's two kernels
    (torch.bfloat16, False, (2, 2), (1024, 1024), 96),
])
def test_a_warm_backward_matches_the_reference_on_gpu(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                      causal: bool, heads: tuple[int, int],
                                                      seqlens: tuple[int, int], head_dim: int) -> None:
    served: list[bool] = []
    warm = bwd._warm_backward

    def spy(*args: Any) -> Any:
        result = warm(*args)
        served.append(result is not None)
        return result

    monkeypatch.setattr(bwd, "_warm_backward", spy)
    for seed in (1, 2):  # the general path, then the warm one on fresh inputs of the same geometry
        q, k, v = make_qkv(2, heads, seqlens, head_dim, dtype, "cuda", seed=seed * 100 + head_dim)
        do = torch.randn(q.shape, device="cuda").to(dtype)
        got = grads_of(lambda *t: lazytriton.attn_fwd(*t, causal=causal)[0], q, k, v, do)
        check_grads(q, k, v, do, got, causal=causal)
    assert served[-1], served
