"""The slot-addressed KV-cache write (``kernels/kv_slots``, ``lazytriton.write_kvcache_slots``).

vLLM's ``reshape_and_cache_flash`` and SGLang's ``set_kv_buffer``: token t's key and value land at slot
``slot_mapping[t]`` of a paged cache. On the CPU the kernel runs through Triton's interpreter and is compared bit
for bit with the torch twins (``kv_slots/reference.py``: ``index_put_`` and ``index_copy_``): pages of 1 and 16
slots, int32 and int64 slots, skipped slots (negative, past the cache), key and value as views of a fused qkv
tensor, GQA heads, a value head dim of its own, permuted caches. Then bad input (an error naming the argument,
nothing launched), the op under ``torch.compile(fullgraph=True)``, the plan, prewarm, ``cache explain`` and the miss
log; GPU-marked tests at serving sizes, in a CUDA graph and with a cache past 2**31 elements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import gpu, run_python

import lazytriton
from lazytriton import launch, machine, runtime, tuning
from lazytriton.cache_format.image import Image
from lazytriton.cli import main as cli_main
from lazytriton.kernels import FAMILIES, dispatch, get, kv_slots
from lazytriton.kernels.kv_slots import binding, checks
from lazytriton.kernels.kv_slots.reference import write_index_copy, write_reference
from lazytriton.kernels.request import Request
from lazytriton.prewarm.enumeration import Axes, enumerate_variants, variants_from_misses
from lazytriton.prewarm.limits import refusal
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

SM90, GFX942 = Target.parse("sm_90"), Target.parse("gfx942")
SLOTS = FAMILIES["kv_slots"]
EMPTY = tuning.Table(())


def fused_qkv(tokens: int, heads: int, heads_k: int, head_dim: int, head_dim_v: int, dtype: torch.dtype,
              device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """key and value as vLLM has them: views of one (tokens, q + k + v columns) projection, a token stride apart."""
    gen = torch.Generator(device=device).manual_seed(seed)
    width = heads * head_dim + heads_k * (head_dim + head_dim_v)
    qkv = torch.randn(tokens, width, generator=gen, device=device, dtype=torch.float32).to(dtype)
    start = heads * head_dim
    key = qkv[:, start:start + heads_k * head_dim].view(tokens, heads_k, head_dim)
    value = qkv[:, start + heads_k * head_dim:].view(tokens, heads_k, head_dim_v)
    return key, value


def caches(num_blocks: int, block_size: int, heads_k: int, head_dim: int, head_dim_v: int, dtype: torch.dtype,
           device: str = "cpu", seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (never zero) caches: a slot written where it should not be shows."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(num_blocks, block_size, heads_k, d, generator=gen, device=device).to(dtype)
                 for d in (head_dim, head_dim_v))  # type: ignore[return-value]


def slots_of(tokens: int, num_slots: int, dtype: torch.dtype, skipped: bool, device: str = "cpu",
             seed: int = 2) -> torch.Tensor:
    """Distinct slots in random order; with ``skipped``, some padding (-1) and some past the cache."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    if skipped:
        slots[1::4] = -1
        slots[3::5] = num_slots + torch.arange(len(slots[3::5])) * 7
    return slots.to(device=device, dtype=dtype)


def check_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """The public write against the torch twin, bit for bit, over the whole caches."""
    want_k, want_v = key_cache.clone(), value_cache.clone()
    write_reference(key, value, want_k, want_v, slot_mapping)
    assert lazytriton.write_kvcache_slots(key, value, key_cache, value_cache, slot_mapping) is None
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


# --- what the kernel writes (CPU, Triton's interpreter) ------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "block_size", "slot_dtype", "skipped"), [
    (torch.bfloat16, 16, torch.int64, True), (torch.float16, 1, torch.int32, True),
    (torch.float32, 16, torch.int32, False), (torch.bfloat16, 1, torch.int64, False)])
def test_the_write_is_the_torch_twins_bit_for_bit(dtype: torch.dtype, block_size: int, slot_dtype: torch.dtype,
                                                  skipped: bool) -> None:
    heads, heads_k, head_dim = 4, 2, 64  # GQA: two query heads a key/value head
    key, value = fused_qkv(13, heads, heads_k, head_dim, head_dim, dtype)
    assert key.stride() == (heads * head_dim + 2 * heads_k * head_dim, head_dim, 1)  # not contiguous: a view
    key_cache, value_cache = caches(48 // block_size, block_size, heads_k, head_dim, head_dim, dtype)
    check_write(key, value, key_cache, value_cache, slots_of(13, 48, slot_dtype, skipped))


def test_index_copy_and_the_kernel_agree_on_every_slot_in_range() -> None:
    key, value = fused_qkv(11, 2, 2, 32, 32, torch.float16, seed=3)
    key_cache, value_cache = caches(4, 16, 2, 32, 32, torch.float16)
    slots = slots_of(11, 64, torch.int64, skipped=False, seed=4)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    write_index_copy(key, value, want_k, want_v, slots)
    lazytriton.write_kvcache_slots(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@pytest.mark.parametrize(("head_dim", "head_dim_v"), [(192, 128), (40, 72), (8, 8), (256, 256)])
def test_head_dims_of_their_own_and_in_several_chunks(head_dim: int, head_dim_v: int) -> None:
    key, value = fused_qkv(6, 1, 1, head_dim, head_dim_v, torch.bfloat16, seed=head_dim)
    key_cache, value_cache = caches(3, 4, 1, head_dim, head_dim_v, torch.bfloat16)
    check_write(key, value, key_cache, value_cache, slots_of(6, 12, torch.int64, skipped=True))


def test_permuted_caches_and_vllms_stacked_cache() -> None:
    """vLLM's (2, num_blocks, block_size, heads_k, head_dim) cache unbound, and an HND cache seen as NHD."""
    key, value = fused_qkv(9, 4, 2, 16, 16, torch.float16, seed=5)
    stacked = torch.randn(2, 5, 4, 2, 16).half()
    check_write(key, value, *stacked.unbind(0), slots_of(9, 20, torch.int64, skipped=True))
    hnd = torch.randn(5, 2, 4, 16).half().permute(0, 2, 1, 3), torch.randn(5, 2, 4, 16).half().permute(0, 2, 1, 3)
    assert not hnd[0].is_contiguous()
    check_write(key, value, *hnd, slots_of(9, 20, torch.int32, skipped=False, seed=6))


def test_rows_past_the_slot_mapping_are_not_read_and_an_empty_step_writes_nothing() -> None:
    key, value = fused_qkv(8, 2, 2, 32, 32, torch.bfloat16, seed=7)
    key[5:], value[5:] = float("nan"), float("nan")  # vLLM's padding rows: never read
    key_cache, value_cache = caches(2, 16, 2, 32, 32, torch.bfloat16)
    check_write(key, value, key_cache, value_cache, slots_of(5, 32, torch.int64, skipped=False))
    assert not key_cache.isnan().any() and not value_cache.isnan().any()
    before = key_cache.clone(), value_cache.clone()
    lazytriton.write_kvcache_slots(key, value, key_cache, value_cache, torch.empty(0, dtype=torch.int64))
    lazytriton.write_kvcache_slots(key, value, key_cache, value_cache, torch.full((8,), -1))
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


def test_a_strided_slot_mapping_is_read_as_its_values() -> None:
    key, value = fused_qkv(4, 1, 1, 16, 16, torch.float32, seed=8)
    key_cache, value_cache = caches(4, 2, 1, 16, 16, torch.float32)
    every_other = torch.tensor([6, 99, 1, 99, 4, 99, 0, 99])[::2]
    check_write(key, value, key_cache, value_cache, every_other)


def test_meta_tensors_are_checked_and_nothing_is_read_or_launched(no_launch: None) -> None:
    """The slots' values are never read on the host: meta tensors (no values at all) pass through."""
    key, value = torch.empty(7, 8, 128, device="meta", dtype=torch.bfloat16), torch.empty(7, 8, 128, device="meta",
                                                                                          dtype=torch.bfloat16)
    key_cache = torch.empty(100, 16, 8, 128, device="meta", dtype=torch.bfloat16)
    lazytriton.write_kvcache_slots(key, value, key_cache, torch.empty_like(key_cache),
                                   torch.empty(7, device="meta", dtype=torch.int64))


def test_reshape_and_cache_flash_is_the_write_with_vllms_arguments(no_launch: None) -> None:
    key, value = fused_qkv(5, 2, 2, 16, 16, torch.float16)
    key_cache, value_cache = caches(2, 4, 2, 16, 16, torch.float16)
    slots = slots_of(5, 8, torch.int64, skipped=True)
    with pytest.raises(TypeError, match="key_cache must be torch.float8_e4m3fn \\(or uint8 bytes\\) for "
                       "kv_cache_dtype 'fp8', got torch.float16"):
        lazytriton.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "fp8", 1.0, 1.0)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of .*'fp8_e5m2'.*got 'int8'"):
        lazytriton.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "int8", 1.0, 1.0)
    e5m2 = key_cache.to(torch.float8_e5m2), value_cache.to(torch.float8_e5m2)
    with pytest.raises(TypeError, match="key_cache must be torch.float8_e4m3fn"):
        lazytriton.reshape_and_cache_flash(key, value, *e5m2, slots, "fp8_e4m3", 1.0, 1.0)
    with pytest.raises(TypeError, match="k_scale must be a tensor, a float or None"):
        lazytriton.reshape_and_cache_flash(key, value, *e5m2, slots, "fp8_e5m2", "1.0")
    with pytest.raises(TypeError, match="kv_cache_dtype must be a str"):
        lazytriton.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, None)
    with pytest.raises(TypeError, match="k_scale must be a tensor, a float or None"):
        lazytriton.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", "1.0")
    with pytest.raises(TypeError, match="v_scale must be a tensor, a float or None"):
        lazytriton.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", 1.0, True)


def test_reshape_and_cache_flash_writes_as_write_kvcache_slots() -> None:
    key, value = fused_qkv(5, 2, 2, 16, 16, torch.float16)
    key_cache, value_cache = caches(2, 4, 2, 16, 16, torch.float16)
    slots = slots_of(5, 8, torch.int64, skipped=True)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    write_reference(key, value, want_k, want_v, slots)
    one = torch.ones(())
    lazytriton.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", one, one)  # vLLM's call
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


# --- float8 caches: key / k_descale, saturated, rounded to nearest even (CPU, Triton's interpreter) ---------------

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantised(x: torch.Tensor, descale: torch.Tensor | None, fmt: torch.dtype) -> torch.Tensor:
    """torch's statement of the float8 write: x / descale in float32, clamped to the format's range, its bytes."""
    scale = torch.ones(()) if descale is None else descale.reshape(())
    return (x.float() / scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt).view(torch.uint8)


def check_fp8_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_descale: torch.Tensor | None,
                    v_descale: torch.Tensor | None) -> None:
    """The float8 write against torch's quantisation written by the torch twin, byte for byte."""
    fmt = key_cache.dtype
    want_k, want_v = key_cache.view(torch.uint8).clone(), value_cache.view(torch.uint8).clone()
    write_reference(quantised(key, k_descale, fmt), quantised(value, v_descale, fmt), want_k, want_v, slot_mapping)
    assert lazytriton.write_kvcache_slots(key, value, key_cache, value_cache, slot_mapping, k_descale,
                                          v_descale) is None
    assert torch.equal(key_cache.view(torch.uint8), want_k) and torch.equal(value_cache.view(torch.uint8), want_v)


@pytest.mark.parametrize(("fmt", "dtype", "block_size", "slot_dtype", "descales"), [
    (torch.float8_e4m3fn, torch.bfloat16, 16, torch.int64, True),
    (torch.float8_e4m3fn, torch.float16, 1, torch.int32, False),
    (torch.float8_e5m2, torch.bfloat16, 4, torch.int32, True),
    (torch.float8_e5m2, torch.float32, 16, torch.int64, False)])
def test_a_float8_cache_gets_the_quantised_keys_and_values(fmt: torch.dtype, dtype: torch.dtype, block_size: int,
                                                           slot_dtype: torch.dtype, descales: bool) -> None:
    key, value = fused_qkv(13, 4, 2, 64, 64, dtype, seed=11)
    big = FP8_MAX[fmt] / 2  # with the descales below, some keys and values saturate
    key.mul_(big), value.mul_(big)
    key[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    key_cache, value_cache = (c.to(fmt) for c in caches(48 // block_size, block_size, 2, 64, 64, torch.float32))
    k_descale = torch.tensor([0.37]) if descales else None
    v_descale = torch.tensor(1.9) if descales else None
    check_fp8_write(key, value, key_cache, value_cache, slots_of(13, 48, slot_dtype, skipped=True), k_descale,
                    v_descale)
    saturated = key_cache.float().abs() == FP8_MAX[fmt]
    assert saturated.any() and not saturated.all()


@pytest.mark.parametrize(("head_dim", "head_dim_v"), [(40, 72), (192, 128)])
def test_a_float8_cache_of_head_dims_of_their_own_in_chunks(head_dim: int, head_dim_v: int) -> None:
    key, value = fused_qkv(6, 1, 1, head_dim, head_dim_v, torch.float16, seed=head_dim + 1)
    key_cache, value_cache = (c.to(torch.float8_e4m3fn) for c in caches(3, 4, 1, head_dim, head_dim_v,
                                                                         torch.float32))
    check_fp8_write(key, value, key_cache, value_cache, slots_of(6, 12, torch.int64, skipped=True),
                    torch.tensor([0.05]), None)


def test_reshape_and_cache_flash_writes_vllms_fp8_caches() -> None:
    """vLLM's kv_cache_dtype names, its uint8 cache bytes, its scales as () tensors or floats."""
    key, value = fused_qkv(7, 2, 2, 32, 32, torch.bfloat16, seed=12)
    slots = slots_of(7, 16, torch.int64, skipped=True, seed=13)
    for kv_cache_dtype, fmt in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                ("fp8_e5m2", torch.float8_e5m2)):
        for as_bytes, (k_scale, v_scale) in ((False, (torch.tensor(0.5), torch.tensor(0.25))), (True, (2.0, None))):
            key_cache, value_cache = (c.to(fmt) for c in caches(4, 4, 2, 32, 32, torch.float32))
            want_k, want_v = key_cache.view(torch.uint8).clone(), value_cache.view(torch.uint8).clone()
            descale = [None if s is None else torch.tensor(float(s)) for s in (k_scale, v_scale)]
            write_reference(quantised(key, descale[0], fmt), quantised(value, descale[1], fmt), want_k, want_v, slots)
            given = (key_cache.view(torch.uint8), value_cache.view(torch.uint8)) if as_bytes else (key_cache,
                                                                                                    value_cache)
            lazytriton.reshape_and_cache_flash(key, value, *given, slots, kv_cache_dtype, k_scale, v_scale)
            assert torch.equal(key_cache.view(torch.uint8), want_k), (kv_cache_dtype, as_bytes)
            assert torch.equal(value_cache.view(torch.uint8), want_v), (kv_cache_dtype, as_bytes)


def test_the_op_takes_the_descales() -> None:
    from lazytriton.kvcache_slots_op import kvcache_slots_op  # registers lazytriton::kvcache_slots

    key, value = fused_qkv(4, 1, 1, 16, 16, torch.float16, seed=14)
    key_cache, value_cache = (c.to(torch.float8_e5m2) for c in caches(2, 2, 1, 16, 16, torch.float32))
    slots, k_descale, v_descale = torch.tensor([3, 0, -1, 2]), torch.tensor([0.125]), torch.tensor([3.0])
    want_k, want_v = key_cache.view(torch.uint8).clone(), value_cache.view(torch.uint8).clone()
    write_reference(quantised(key, k_descale, torch.float8_e5m2), quantised(value, v_descale, torch.float8_e5m2),
                    want_k, want_v, slots)
    kvcache_slots_op(key, value, key_cache, value_cache, slots, k_descale, v_descale)
    assert torch.equal(key_cache.view(torch.uint8), want_k) and torch.equal(value_cache.view(torch.uint8), want_v)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (key, value, key_cache.half(), value_cache.half(), slots, k_descale)]
    with mode, pytest.raises(ValueError, match="k_descale is given but key_cache is torch.float16"):
        torch.ops.lazytriton.kvcache_slots(*fakes)


def test_the_float8_variant_and_its_plan(sm90: _Runtime) -> None:
    assert str(kv_slots.variant(SM90, "bf16", 128, 0, True, False, True, "e4m3")) == (
        "kv_slots:sm_90:bf16:ALIGN16=true,BLOCK_D=128,EVEN_D=true,INDEX64=false,KV_FP8=e4m3,SLOT64=true:BLOCK_M=16:"
        "num_stages=1,num_warps=4")
    for variant in (kv_slots.variant(SM90, "fp16", 40, 72, True, False, False, "e5m2"),
                    kv_slots.variant(Target.parse("sm_80"), "bf16", 128, 0, True, False, True, "e5m2")):
        assert check_fields(Variant.parse(str(variant))) == variant and refusal(variant) is None
    with pytest.raises(ValueError, match="key_cache is a float8 \\(e4m3\\) cache but sm_80 has no float8_e4m3fn"):
        kv_slots.variant(Target.parse("sm_80"), "bf16", 128, 0, True, False, True, "e4m3")
    device = torch.device("cuda", 0)
    call = checks.Call(32, 8, 128, 0, 16, 1600, True)
    plain = binding.plan(device, torch.bfloat16, call, True, False)[0]
    fp8 = binding.plan(device, torch.bfloat16, call._replace(kv_fp8="e5m2"), True, False)[0]
    assert fp8 == kv_slots.variant(SM90, "bf16", 128, 0, True, False, True, "e5m2") and fp8 != plain


# --- bad input: an error naming the argument, nothing launched -----------------------------------------------------


def _bad_fp8_calls(kc: torch.Tensor, k: torch.Tensor) -> list[tuple[dict[str, Any], type[Exception], str]]:
    fp8 = {"key_cache": kc.to(torch.float8_e4m3fn), "value_cache": kc.to(torch.float8_e4m3fn)}
    return [
        ({**fp8, "k_descale": 1.0}, TypeError, "k_descale must be a torch.Tensor or None, got 1.0"),
        ({**fp8, "k_descale": torch.ones(1, dtype=torch.float64)}, TypeError, "k_descale must be float32"),
        ({**fp8, "v_descale": torch.ones(2)}, ValueError, r"v_descale must hold one value .* got shape \(2,\)"),
        ({**fp8, "v_descale": torch.ones(1, 1)}, ValueError, r"v_descale must hold one value"),
        ({**fp8, "k_descale": torch.ones(1, device="meta")}, ValueError,
         "k_descale is on meta but key_cache is on cpu"),
        ({**fp8, "key": k.to(torch.float8_e4m3fn)}, TypeError,
         "key must be float16, bfloat16 or float32 \\(written into a torch.float8_e4m3fn cache\\)"),
        ({**fp8, "key": k.half()}, TypeError, "value must have key's dtype torch.float16, got torch.bfloat16"),
        ({"key_cache": fp8["key_cache"], "value_cache": kc.to(torch.float8_e5m2)}, TypeError,
         "value_cache has dtype torch.float8_e5m2 but key_cache has torch.float8_e4m3fn"),
    ]


def _bad_calls() -> list[tuple[dict[str, Any], type[Exception], str]]:
    kc = torch.empty(4, 16, 2, 64, dtype=torch.bfloat16)
    k = torch.empty(3, 2, 64, dtype=torch.bfloat16)
    slots = torch.zeros(3, dtype=torch.int64)
    return [
        ({"key": k.float().numpy()}, TypeError, "key must be a torch.Tensor"),
        ({"key": k.half()}, TypeError, "key must have the caches' dtype torch.bfloat16"),
        ({"value": k[:, :1]}, ValueError, r"value must have shape \(num_tokens, 2, 64\)"),
        ({"key": k[:2]}, ValueError, "key must have at least len\\(slot_mapping\\) = 3 rows, got 2"),
        ({"key": k[None]}, ValueError, "key must have 3 dims"),
        ({"key": k.transpose(1, 2).contiguous().transpose(1, 2)}, ValueError, "key must have a contiguous last dim"),
        ({"key": k.to("meta")}, ValueError, "key is on meta but key_cache is on cpu"),
        ({"key_cache": kc.half()}, TypeError, "value_cache has dtype torch.bfloat16 but key_cache has torch.float16"),
        ({"key_cache": kc.int(), "value_cache": kc.int()}, TypeError,
         "key_cache must be float16, bfloat16, float32, float8_e4m3fn or float8_e5m2, got torch.int32"),
        ({"key_cache": kc.to(torch.float8_e4m3fn)}, TypeError,
         "value_cache has dtype torch.bfloat16 but key_cache has torch.float8_e4m3fn"),
        ({"k_descale": torch.ones(1)}, ValueError, "k_descale is given but key_cache is torch.bfloat16, not a float8"),
        ({"v_descale": torch.ones(())}, ValueError, "v_descale is given but key_cache is torch.bfloat16"),
        *_bad_fp8_calls(kc, k),
        ({"value_cache": kc[:2]}, ValueError, r"value_cache must have key_cache's \(num_blocks, block_size, heads_k\)"),
        ({"value_cache": kc[:, :1].expand(4, 16, 2, 64)}, ValueError, "value_cache must not have a broadcast"),
        ({"key_cache": kc[0]}, ValueError, "key_cache must have 4 dims"),
        ({"value_cache": kc.to("meta")}, ValueError, "value_cache is on meta but key_cache is on cpu"),
        ({"key_cache": kc[..., :0], "value_cache": kc[..., :0], "key": k[..., :0], "value": k[..., :0]}, ValueError,
         "block_size and head dims must be >= 1"),
        ({"slot_mapping": [0, 1, 2]}, TypeError, "slot_mapping must be a torch.Tensor"),
        ({"slot_mapping": slots.float()}, TypeError, "slot_mapping must be int32 or int64, got torch.float32"),
        ({"slot_mapping": slots[None]}, ValueError, r"slot_mapping must have 1 dim \(num_tokens,\)"),
        ({"slot_mapping": slots.to("meta")}, ValueError, "slot_mapping is on meta but key_cache is on cpu"),
    ]


@pytest.mark.parametrize(("change", "error", "message"), _bad_calls(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_names_the_argument_before_a_launch(no_launch: None, change: dict[str, Any], error: type,
                                                      message: str) -> None:
    kc = torch.randn(4, 16, 2, 64).bfloat16()
    args = {"key": torch.randn(3, 2, 64).bfloat16(), "value": torch.randn(3, 2, 64).bfloat16(), "key_cache": kc,
            "value_cache": kc.clone(), "slot_mapping": torch.tensor([0, 5, 9])}
    args.update(change)
    with pytest.raises(error, match=message):
        lazytriton.write_kvcache_slots(**args)


def test_too_many_rows_are_refused() -> None:
    huge = torch.empty(2**30, 4, 8, device="meta", dtype=torch.float16)
    kc = torch.empty(1, 1, 4, 8, device="meta", dtype=torch.float16)
    with pytest.raises(ValueError, match="more than .* \\(token, head\\) rows"):
        checks.check(huge, huge, kc, kc, torch.empty(2**30, device="meta", dtype=torch.int64))


# --- torch.compile ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph_traces_the_op_and_keeps_the_write(backend: str) -> None:
    key, value = fused_qkv(6, 2, 2, 32, 32, torch.bfloat16, seed=9)
    key_cache, value_cache = caches(3, 4, 2, 32, 32, torch.bfloat16)
    slots = slots_of(6, 12, torch.int64, skipped=True)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    write_reference(key, value, want_k, want_v, slots)

    def step(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        lazytriton.reshape_and_cache_flash(k, v, kc, vc, s, "auto", None, None)
        return kc.float().sum() + vc.float().sum()  # reads the caches after the write

    torch._dynamo.reset()
    total = torch.compile(step, fullgraph=True, backend=backend)(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
    assert total == want_k.float().sum() + want_v.float().sum()


def test_the_op_is_called_directly_and_its_fake_checks() -> None:
    from lazytriton.kvcache_slots_op import kvcache_slots_op  # registers lazytriton::kvcache_slots

    key, value = fused_qkv(4, 1, 1, 16, 16, torch.float16)
    key_cache, value_cache = caches(2, 2, 1, 16, 16, torch.float16)
    slots = torch.tensor([3, 0, -1, 2])
    want_k, want_v = key_cache.clone(), value_cache.clone()
    write_reference(key, value, want_k, want_v, slots)
    assert kvcache_slots_op is torch.ops.lazytriton.kvcache_slots.default
    torch.ops.lazytriton.kvcache_slots(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in (key, value, key_cache, value_cache, slots.float())]
    with mode, pytest.raises(TypeError, match="slot_mapping must be int32 or int64"):
        torch.ops.lazytriton.kvcache_slots(*fakes)


# --- the variant, the plan, prewarm, explain, the miss log ---------------------------------------------------------


def test_the_variant_string_is_stable_and_its_fields_check() -> None:
    assert str(kv_slots.variant(SM90, "bf16", 128, 0, True, False, True)) == (
        "kv_slots:sm_90:bf16:ALIGN16=true,BLOCK_D=128,EVEN_D=true,INDEX64=false,SLOT64=true:BLOCK_M=16:"
        "num_stages=1,num_warps=4")
    assert str(kv_slots.variant(GFX942, "fp16", 192, 128, False, True, False)) == (
        "kv_slots:gfx942:fp16:ALIGN16=false,BLOCK_D=128,EVEN_D=false,EVEN_DV=true,INDEX64=true,SLOT64=false:"
        "BLOCK_M=16:num_stages=1,num_warps=4,waves_per_eu=2")
    assert [kv_slots.block_d(d, d) for d in (1, 16, 17, 64, 65, 128, 576)] == [16, 16, 32, 64, 128, 128, 128]
    assert kv_slots.block_d(64, 512) == 128 and kv_slots.block_m(64) == 32
    spec = get("kv_slots")
    assert spec is kv_slots.KV_SLOTS and kv_slots.INT_PARAMS == tuple(n for n, _ in spec.params)
    for variant in (kv_slots.variant(SM90, "fp32", 40, 72, True, False, False),
                    kv_slots.variant(SM90, "bf16", 64, 0, True, True, True)):
        assert check_fields(Variant.parse(str(variant))) == variant and refusal(variant) is None
    with pytest.raises(ValueError, match="lacks SLOT64"):
        check_fields(Variant.parse(str(kv_slots.variant(SM90, "bf16", 64, 0, True, False, True)).replace(
            ",SLOT64=true", "")))


class _Runtime:
    """Loads nothing: ``kernel`` returns its variant and counts the loads."""

    def __init__(self) -> None:
        self.plans: dict[Any, Any] = {}
        self.loads: list[Variant] = []

    def loaded(self, variant: Variant, device_index: int) -> Any:
        return None

    def kernel(self, variant: Variant, device_index: int) -> Variant:
        self.loads.append(variant)
        return variant


@pytest.fixture
def sm90(monkeypatch: pytest.MonkeyPatch) -> _Runtime:
    rt = _Runtime()
    monkeypatch.setattr(machine, "target_of_device", lambda device: SM90)
    monkeypatch.setattr(launch, "is_capturing", lambda: False)
    monkeypatch.setattr(launch, "current_device", None)
    monkeypatch.setattr(runtime, "get", lambda: rt)
    return rt


def test_the_plan_is_memoised_by_the_chunk_and_refused_in_a_capture(sm90: _Runtime,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda", 0)
    call = checks.Call(32, 8, 128, 0, 16, 1600, True)
    kernel, rows, cols = binding.plan(device, torch.bfloat16, call, True, False)
    assert kernel == kv_slots.variant(SM90, "bf16", 128, 0, True, False, True) and (rows, cols) == (16, 128)
    assert binding.plan(device, torch.bfloat16, call._replace(num_tokens=1, head_dim=256), True, False)[0] is kernel
    assert len(sm90.loads) == 1
    assert binding.plan(device, torch.bfloat16, call._replace(slot64=False), True, False)[0] != kernel
    monkeypatch.setattr(launch, "is_capturing", lambda: True)
    with pytest.raises(launch.CaptureError, match="run lazytriton.write_kvcache_slots once"):
        binding.plan(device, torch.bfloat16, call._replace(head_dim=64), True, False)


def test_layout_flags_and_the_arguments() -> None:
    key, value = fused_qkv(5, 4, 2, 64, 64, torch.bfloat16)
    key_cache, value_cache = caches(2, 16, 2, 64, 64, torch.bfloat16)
    assert binding.layout_flags(key, value, key_cache, value_cache) == (True, False)
    odd = torch.empty(5, 2, 72, dtype=torch.bfloat16)[..., :64]
    assert binding.layout_flags(odd, value, key_cache, value_cache) == (False, False)
    huge = torch.empty(2**20 + 1, 16, 2, 64, device="meta", dtype=torch.bfloat16)  # 2**31 + 2048 elements
    assert binding.layout_flags(key, value, huge, value_cache)[1]
    slots = torch.tensor([0, 3, 31, -1, 8])
    call = checks.check(key, value, key_cache, value_cache, slots)
    args = dict(zip(kv_slots.INT_PARAMS, binding.ints(key, value, key_cache, value_cache, slots, call), strict=True))
    assert (args["stride_kt"], args["stride_kh"], args["stride_kcb"], args["stride_kcs"]) == (512, 64, 2048, 128)
    assert (args["heads_k"], args["n_rows"], args["block_size"], args["num_slots"]) == (2, 10, 16, 32)
    assert args["Slots32"] == args["Slots64"] == slots.data_ptr()


def test_the_default_plan_serves_a_call_of_its_grid_and_prewarm_lists_it(capsys: pytest.CaptureFixture[str]) -> None:
    plan = enumerate_variants(Axes((SM90,), kernels=SLOTS), EMPTY)
    planned = {p.key for p in plan}
    assert len(plan) == len(planned) == 8 and {p.origin for p in plan} == {"default"}
    for dtype, head_dim, slot64 in ((d, h, s) for d in ("bf16", "fp16") for h in (64, 128, 256) for s in (0, 1)):
        chosen = dispatch.kernel_variant("kv_slots", SM90, dtype, head_dim, False, True, 1, 1)
        if slot64:
            chosen = dispatch.family_dispatch("kv_slots").variant("kv_slots", SM90, Request(
                dtype, head_dim, False, True, 1, 1, slot64=True))
        assert chosen.key() in planned, chosen
    assert any(p.variant.kernel == "kv_slots" for p in enumerate_variants(
        Axes((SM90,), dtypes=("fp16",), head_dims=(64,)), EMPTY)), "every family is planned by default"
    assert cli_main(["prewarm", "--target", "sm_90", "--kernel", "kv_slots", "--dtype", "bf16", "--list"]) == 0
    listed = [line.split() for line in capsys.readouterr().out.splitlines()]
    expected = enumerate_variants(Axes((SM90,), kernels=SLOTS, dtypes=("bf16",)), EMPTY)
    assert [(key, Variant.parse(text)) for key, _, text in listed] == [(p.key, p.variant) for p in expected]


def test_explain_describes_the_write(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["cache", "explain", "--kernel", "kv_slots", "--dtype", "bf16", "--head-dim", "192", "--head-dim-v",
            "128", "--seqlen-q", "32", "--seqlen-k", "4096", "--page-size", "16", "--target", "sm_90"]
    assert cli_main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["variant"] == str(kv_slots.variant(SM90, "bf16", 192, 128, True, False, True))
    assert report["call"]["slot_mapping"] == "int64" and report["config"]["block_m"] == 16
    assert cli_main([*args, "--slot-mapping", "int32"]) == 0
    text = capsys.readouterr().out
    assert "SLOT64=false" in text and "slots past the cache are skipped" in text
    assert cli_main(["cache", "explain", "--kernel", "kv_slots", "--dtype", "bf16", "--head-dim", "64",
                     "--seqlen-q", "1", "--window"]) == 2
    assert "kv_slots writes keys and values at their slots: it takes no --window" in capsys.readouterr().err
    assert cli_main(["cache", "explain", "--kernel", "flash_fwd", "--dtype", "bf16", "--head-dim", "64",
                     "--seqlen-q", "1", "--slot-mapping", "int32"]) == 2
    assert "only kv_slots takes it" in capsys.readouterr().err


def test_float8_caches_are_planned_with_kv_dtype_and_explained(capsys: pytest.CaptureFixture[str]) -> None:
    plain = {p.key for p in enumerate_variants(Axes((SM90,), kernels=SLOTS), EMPTY)}
    both = enumerate_variants(Axes((SM90,), kernels=SLOTS, kv_fp8=("none", "e4m3", "e5m2")), EMPTY)
    assert len(both) == 3 * len(plain) and plain <= {p.key for p in both}
    assert {p.variant.get("KV_FP8") for p in both if p.key not in plain} == {"e4m3", "e5m2"}
    sm80 = enumerate_variants(Axes((Target.parse("sm_80"),), kernels=SLOTS, kv_fp8=("e4m3", "e5m2")), EMPTY)
    assert sm80 and {p.variant.get("KV_FP8") for p in sm80} == {"e5m2"}  # no float8_e4m3fn in Triton below sm_89
    args = ["cache", "explain", "--kernel", "kv_slots", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "32",
            "--seqlen-k", "4096", "--page-size", "16", "--target", "sm_90", "--kv-dtype"]
    assert cli_main([*args, "e4m3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["variant"] == str(kv_slots.variant(SM90, "bf16", 128, 0, True, False, True, "e4m3"))
    assert report["call"]["kv_dtype"] == "e4m3"
    assert cli_main([*args, "e5m2"]) == 0
    assert "KV_FP8=e5m2, keys and values quantised as x / descale" in capsys.readouterr().out
    assert cli_main([*args[:-3], "--target", "sm_80", "--kv-dtype", "e4m3"]) == 2
    assert "sm_80 has no float8_e4m3fn" in capsys.readouterr().err


def test_a_miss_log_line_plans_the_variant() -> None:
    variant = kv_slots.variant(SM90, "fp16", 80, 0, False, False, True)
    plan, problems = variants_from_misses([json.dumps({"variant": str(variant), "kernel": "kv_slots"}),
                                           json.dumps({"variant": str(variant).replace("SLOT64=true", "SLOT64=2")})])
    assert [p.variant for p in plan] == [variant] and len(problems) == 1 and "SLOT64=2" in problems[0]


RESOLVE = """
import json, sys
from lazytriton import runtime
from lazytriton.kernels import kv_slots
from lazytriton.target import Target
variant = kv_slots.variant(Target.parse("sm_90"), "bf16", 128, 0, True, False, True)
rt = runtime.get()
print(json.dumps({"source": rt.resolve(variant).source, "compiles": rt.compiles,
                  "triton": sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))[:3]}))
"""


def test_prewarm_builds_the_family_and_a_write_is_served_from_the_image_without_triton(tmp_path: Path) -> None:
    image = tmp_path / "slots.ltimg"
    args = ["--target", "sm_90", "--kernel", "kv_slots", "--dtype", "bf16", "--head-dim", "128"]
    built = subprocess.run([sys.executable, "-m", "lazytriton.cli", "prewarm", *args, "-j", "2", "--out", str(image)],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, SOURCE_DATE_EPOCH="1700000000"), check=False)
    assert built.returncode == 0 and "0 reused, 2 compiled, 0 failed" in built.stdout, built.stdout + built.stderr
    with Image(image) as served:
        assert len(list(served.keys())) == 2
    served_run = run_python(RESOLVE, {"LAZYTRITON_CACHE_DIR": str(tmp_path / "empty"),
                                      "LAZYTRITON_IMAGES": str(image), "LAZYTRITON_JIT": "0"})
    assert served_run.returncode == 0, served_run.stderr
    report = json.loads(served_run.stdout.splitlines()[-1])
    assert report == {"source": "image", "compiles": 0, "triton": []}


# --- on the GPU, at serving sizes ----------------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 256, 4096])
@pytest.mark.parametrize(("dtype", "block_size", "slot_dtype"), [
    (torch.bfloat16, 16, torch.int64), (torch.float16, 1, torch.int32), (torch.bfloat16, 32, torch.int32)])
def test_the_write_on_the_gpu(tokens: int, dtype: torch.dtype, block_size: int, slot_dtype: torch.dtype) -> None:
    key, value = fused_qkv(tokens + 8, 32, 8, 128, 128, dtype, device="cuda")  # Llama-3-8B's heads, vLLM's padding
    key_cache, value_cache = caches(16384 // block_size, block_size, 8, 128, 128, dtype, device="cuda")
    check_write(key, value, key_cache, value_cache, slots_of(tokens, 16384, slot_dtype, skipped=True, device="cuda"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4096])
@pytest.mark.parametrize(("fmt", "dtype", "slot_dtype"), [
    (torch.float8_e4m3fn, torch.bfloat16, torch.int64), (torch.float8_e5m2, torch.float16, torch.int32)])
def test_a_float8_cache_on_the_gpu(tokens: int, fmt: torch.dtype, dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    """vLLM's FP8 KV cache at Llama-3-8B's heads: torch's quantisation, byte for byte (reshape_and_cache_flash)."""
    key, value = fused_qkv(tokens + 8, 32, 8, 128, 128, dtype, device="cuda", seed=21)
    key.mul_(FP8_MAX[fmt] / 4), value.mul_(FP8_MAX[fmt] / 4)  # some saturate
    key_cache, value_cache = (c.to(fmt) for c in caches(1024, 16, 8, 128, 128, torch.float32, device="cuda"))
    slots = slots_of(tokens, 16384, slot_dtype, skipped=True, device="cuda")
    k_scale, v_scale = torch.tensor(0.5, device="cuda"), torch.tensor(1.5, device="cuda")
    want_k, want_v = key_cache.view(torch.uint8).clone(), value_cache.view(torch.uint8).clone()
    write_reference(quantised(key, k_scale, fmt), quantised(value, v_scale, fmt), want_k, want_v, slots)
    name = "fp8" if fmt == torch.float8_e4m3fn else "fp8_e5m2"
    lazytriton.reshape_and_cache_flash(key, value, key_cache.view(torch.uint8), value_cache, slots, name, k_scale,
                                       v_scale)
    torch.cuda.synchronize()
    assert torch.equal(key_cache.view(torch.uint8), want_k) and torch.equal(value_cache.view(torch.uint8), want_v)


@gpu
@pytest.mark.gpu
def test_the_write_on_the_gpu_mla_widths_and_fp32() -> None:
    key, value = fused_qkv(300, 16, 1, 192, 128, torch.float32, device="cuda")
    key_cache, value_cache = caches(64, 16, 1, 192, 128, torch.float32, device="cuda")
    check_write(key, value, key_cache, value_cache, slots_of(300, 1024, torch.int64, skipped=True, device="cuda"))


@gpu
@pytest.mark.gpu
def test_the_write_in_a_cuda_graph_replayed_with_new_slots_and_compiled() -> None:
    key, value = fused_qkv(64, 32, 8, 128, 128, torch.bfloat16, device="cuda", seed=11)
    key_cache, value_cache = caches(1024, 16, 8, 128, 128, torch.bfloat16, device="cuda")
    slots = slots_of(64, 16384, torch.int64, skipped=True, device="cuda")
    lazytriton.write_kvcache_slots(key, value, key_cache, value_cache, slots)  # loads the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lazytriton.write_kvcache_slots(key, value, key_cache, value_cache, slots)
    fresh_k, fresh_v = fused_qkv(64, 32, 8, 128, 128, torch.bfloat16, device="cuda", seed=12)
    key.copy_(fresh_k)
    value.copy_(fresh_v)
    slots.copy_(slots_of(64, 16384, torch.int64, skipped=True, device="cuda", seed=13))
    want_k, want_v = key_cache.clone(), value_cache.clone()
    write_reference(key, value, want_k, want_v, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
    compiled = torch.compile(lambda *a: lazytriton.reshape_and_cache_flash(*a, "auto", None, None), fullgraph=True)
    slots.copy_(slots_of(64, 16384, torch.int64, skipped=False, device="cuda", seed=14))
    write_reference(key, value, want_k, want_v, slots)
    compiled(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@gpu
@pytest.mark.gpu
def test_a_cache_past_2_31_elements_takes_64_bit_offsets() -> None:
    """A (131100, 16, 8, 128) bf16 cache: 2.15e9 elements (4.3 GB) each; its last slots written, int32 and int64."""
    blocks = 131100
    assert blocks * 16 * 8 * 128 > 2**31
    key, value = fused_qkv(64, 8, 8, 128, 128, torch.bfloat16, device="cuda")
    key_cache = torch.zeros(blocks, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    assert binding.layout_flags(key, value, key_cache, value_cache)[1]
    for slot_dtype in (torch.int64, torch.int32):
        slots = torch.arange(blocks * 16 - 64, blocks * 16, device="cuda").flip(0).to(slot_dtype)
        key.mul_(-1)
        lazytriton.write_kvcache_slots(key, value, key_cache, value_cache, slots)
        torch.cuda.synchronize()
        written = slots.long()
        assert torch.equal(key_cache.view(-1, 8, 128)[written], key)
        assert torch.equal(value_cache.view(-1, 8, 128)[written], value)
