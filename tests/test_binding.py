"""flash_fwd's binding: packing against the description and the C launcher, the memo key against dispatch."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from conftest import REPO

from lazytriton import launch, machine, tuning
from lazytriton.kernels.flash_fwd import FLASH_FWD, binding, score_mods
from lazytriton.target import Target


def _strided(shape: tuple[int, ...], pad: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """A tensor of ``shape`` inside a larger one: every outer stride is odd-sized (last dim contiguous)."""
    big = torch.randn(*(n + pad for n in shape[:-1]), shape[-1] + pad, dtype=torch.float32).to(dtype)
    return big[tuple(slice(1, 1 + n) for n in shape)]


def _expected(name: str, t: dict[str, torch.Tensor], call: binding.Call) -> int | float:
    """Each parameter's value, computed independently of PARAM_SOURCES."""
    b, hq, hk, sq, sk, d = call.shape
    stride = re.fullmatch(r"stride_([qkvo])([bhs])", name)
    if stride:
        return t[stride[1]].stride("bhs".index(stride[2]))
    bias = re.fullmatch(r"stride_bias([bhmn])", name)
    if bias:
        return 0 if call.bias is None else call.bias.stride("bhmn".index(bias[1]))
    if name == "stride_alibi_b":
        return 0 if call.alibi is None or call.alibi.dim() == 1 else call.alibi.stride(0)
    pointers = {"Alibi": call.alibi, "Bias": call.bias, "Philox": call.philox, "Sinks": call.sinks}
    if name in pointers:
        return 0 if pointers[name] is None else pointers[name].data_ptr()
    return {"Q": t["q"].data_ptr(), "K": t["k"].data_ptr(), "V": t["v"].data_ptr(), "Out": t["o"].data_ptr(),
            "Lse": t["lse"].data_ptr(), "stride_lb": t["lse"].stride(0), "stride_lh": t["lse"].stride(1),
            "group_size": hq // hk, "seqlen_q": sq, "seqlen_k": sk, "head_dim": d, "head_dim_v": call.dv,
            "causal_offset": call.offset, "sm_scale": call.scale, "window_left": call.window_left,
            "window_right": call.window_right, "attention_chunk": call.attention_chunk,
            "softcap": call.softcap, "dropout_p": call.dropout_p, "Cu_seqlens_q": 0,
            "Cu_seqlens_k": 0, "Seqused_q": 0, "Seqused_k": 0}[name]


def test_pack_gives_every_parameter_of_the_description_in_order() -> None:
    q, k, v = _strided((2, 4, 5, 32), 3), _strided((2, 2, 7, 32), 5), _strided((2, 2, 7, 32), 2)
    call = binding.check(q, k, v, "bottom_right", 0.3)
    out, lse = binding.empty_outputs(q, call.shape)
    tensors = {"q": q, "k": k, "v": v, "o": out, "lse": lse}
    ints, aligned, index64 = binding.pack(q, k, v, out, lse, call)
    params = [name for name, _ in FLASH_FWD.params]
    assert list(binding.INT_PARAMS) + list(binding.FLOAT_PARAMS) == params
    assert len(ints) == len(binding.INT_PARAMS)
    for name, value in zip(binding.INT_PARAMS, ints, strict=True):
        assert value == _expected(name, tensors, call), name
    assert binding.floats(call) == tuple(_expected(name, tensors, call) for name in binding.FLOAT_PARAMS)
    assert not index64
    assert not aligned  # odd strides: the ALIGN16 variant would be wrong
    # The score modifications: pointers, the slopes' batch stride, the bias's strides (0 where broadcast), dropout_p.
    bias = torch.randn(1, 4, 1, 7, dtype=q.dtype).expand(2, 4, 5, 7)
    modded = score_mods.with_mods(call, q, torch.rand(2, 4), bias, 0.25, score_mods.draw_philox(q.device, 0))
    modded_ints = binding.pack(q, k, v, out, lse, modded)[0]
    for name, value in zip(binding.INT_PARAMS, modded_ints, strict=True):
        assert value == _expected(name, tensors, modded), name
    assert binding.floats(modded) == (0.3, 0.0, 0.25)
    named = dict(zip(binding.INT_PARAMS, modded_ints, strict=True))
    assert (named["stride_biasb"], named["stride_biash"], named["stride_biasm"], named["stride_biasn"]) == (0, 7, 0, 1)
    assert named["stride_alibi_b"] == 4


def test_pack_passes_the_window_and_softcap_in_the_kernels_terms() -> None:
    q, k, v = _strided((2, 4, 5, 32), 3), _strided((2, 2, 7, 32), 5), _strided((2, 2, 7, 32), 2)
    call = binding.check(q, k, v, False, 0.3, window=(3, -1), softcap=2.5)
    out, lse = binding.empty_outputs(q, call.shape)
    ints, _, _ = binding.pack(q, k, v, out, lse, call)
    named = dict(zip(binding.INT_PARAMS, ints, strict=True))
    # FlashAttention's bottom-right offset; the unbounded right side as max(seqlen_q, seqlen_k)
    assert (named["causal_offset"], named["window_left"], named["window_right"]) == (2, 3, 7)
    assert binding.floats(call) == (0.3, 2.5, 0.0)
    plain = binding.check(q, k, v, False, 0.3)
    assert dict(zip(binding.INT_PARAMS, binding.pack(q, k, v, out, lse, plain)[0], strict=True))["window_left"] == -1


def test_pack_alignment_and_index64() -> None:
    q = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    call = binding.check(q, q, q)
    out, lse = binding.empty_outputs(q, call.shape)
    _, aligned, index64 = binding.pack(q, q, q, out, lse, call)
    assert aligned and not index64
    # A stride that spans 2**31 elements needs 64-bit offsets (meta tensors: no memory needed).
    meta = torch.empty(1, 2, 16, 64, device="meta", dtype=torch.float16)
    big = meta.as_strided((1, 2, 16, 64), (2**32, 2**31 - 1024, 64, 1))
    _, _, index64 = binding.pack(big, meta, meta, meta, meta.new_empty((1, 2, 16)), binding.check(big, meta, meta))
    assert index64
    fits = meta.as_strided((1, 2, 16, 64), (2**32, 2**31 - 1024 - 16 * 64, 64, 1))
    _, _, index64 = binding.pack(fits, meta, meta, meta, meta.new_empty((1, 2, 16)), binding.check(fits, meta, meta))
    assert not index64


def _c_initializer_in_source() -> list[str]:
    text = (REPO / "capi" / "lazytriton.c").read_text()
    body = re.search(r"int64_t ints\[LT__KERNEL_INTS \+ LT__MAX_HIDDEN\] = \{(.*?)\};", text, re.S)
    assert body, "lt__launch's argument initializer was not found in lazytriton.c"
    return [" ".join(item.split()) for item in body[1].split(",")]


def test_the_c_launcher_passes_the_description_field_by_field() -> None:
    c_items = _c_initializer_in_source()
    expected = [" ".join(item.split()) for item in binding.c_initializer().split(", ")]
    assert len(c_items) == len(binding.INT_PARAMS)
    for name, c_item, want in zip(binding.INT_PARAMS, c_items, expected, strict=True):
        assert c_item == want, f"lazytriton.c passes {c_item!r} as {name}; the binding says {want!r}"
    defined = re.search(r"#define LT__KERNEL_PARAMS (\d+)", (REPO / "capi" / "lazytriton.c").read_text())
    assert defined and int(defined[1]) == len(FLASH_FWD.params)


# Every power-of-two edge up to 64k, one below and one above, and small values.
EDGES = sorted({n for k in range(17) for n in (2**k - 1, 2**k, 2**k + 1) if n >= 1} | set(range(1, 20)))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 59)])
def test_memo_key_and_dispatch_agree_at_every_bucket_edge(dtype: torch.dtype, head_dim: int, causal: bool) -> None:
    target = Target.parse("sm_90")
    seen: dict[tuple[Any, ...], Any] = {}
    for sq in EDGES:
        for sk in EDGES[::3] + [EDGES[-1]]:
            shape = binding.Shape(1, 1, 1, sq, sk, head_dim)
            key = binding.memo_key(0, dtype, shape, causal, True, False)
            chosen = binding.variant(target, dtype, shape, causal, True, False)
            assert seen.setdefault(key, chosen) == chosen, f"memo key {key} stands for two variants"
    assert len({v for v in seen.values()}) > 1  # the table and defaults really vary with seqlen here


def test_memo_key_buckets_are_dispatchs() -> None:
    for n in EDGES:
        assert 1 << tuning.bucket_index(n) == tuning.bucket(n) >= n
        assert tuning.bucket(n) < 2 * n or n == 1


def test_interpreter_constexprs_and_grid() -> None:
    shape = binding.Shape(2, 3, 1, 33, 7, 40)
    constexprs = binding.interpreter_constexprs(shape, True)
    assert constexprs == {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_D": 64, "EVEN_D": False, "CAUSAL": True,
                          "TMA": False, "WINDOW": False, "SOFTCAP": False, "VARLEN": False, "ALIBI": False,
                          "BIAS": False, "DROPOUT": False, "BLOCK_DV": 64, "EVEN_DV": False, "BLOCK_D2": 0,
                          "SEQUSED_Q": False, "SEQUSED_K": False, "SINKS": False, "CHUNK": False}
    assert set(constexprs) == set(FLASH_FWD.constexprs)
    assert binding.grid(shape, 32) == (2, 3, 2)


class _FakeRuntime:
    def __init__(self) -> None:
        self.plans: dict[Any, Any] = {}
        self.kernel_calls = 0

    def loaded(self, variant: Any, device_index: int) -> Any:
        return None

    def kernel(self, variant: Any, device_index: int) -> Any:
        self.kernel_calls += 1
        raise AssertionError("the driver was reached during a capture")


def test_a_capture_that_would_load_a_kernel_is_refused_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "is_capturing", lambda: True)
    monkeypatch.setattr(machine, "target_of_device", lambda device: Target.parse("sm_90"))
    rt = _FakeRuntime()
    shape = binding.Shape(1, 2, 2, 100, 100, 64)
    with pytest.raises(launch.CaptureError, match=r"flash_fwd:sm_90:bf16.*lazytriton\.preload"):
        binding.plan(rt, ("k",), torch.device("cuda", 0), torch.bfloat16, shape, False, True, False)
    assert rt.kernel_calls == 0 and not rt.plans
    assert issubclass(launch.CaptureError, RuntimeError)


def test_slow_cpu_calls_warn_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(binding, "_warned_slow", False)
    monkeypatch.setattr(binding, "SLOW_CPU_WORK", 1000)
    q = torch.randn(1, 1, 16, 16)
    with caplog.at_level("WARNING", logger="lazytriton.flash"):
        binding.forward(q, q, q, binding.check(q, q, q))
        binding.forward(q, q, q, binding.check(q, q, q))
    assert sum("not for speed" in r.message for r in caplog.records) == 1
