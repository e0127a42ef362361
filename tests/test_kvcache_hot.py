"""The decoding call's warm path (kernels/flash_decode/hot.py) against the general path: same bits, same checks.

On CPU the warm path is made for CPU tensors (``hot.make(cuda=False)``) and swapped in for the GPU one; the
runtime's plans hold stand-in kernels:

- ``Interpreting``: runs the kernel the plan names through Triton's interpreter, on the very integers the
  warm path passes (each pointer read as the memory it points at), with the constexprs the CPU path uses. Over a
  randomised set of calls (contiguous and paged caches, int, tensor and absent lengths, new keys or none, GQA and
  MQA, causal or not, out= or not, lse or not, forced splits, trusted or eager) the warm call's out, lse and
  caches equal the general path's (the interpreter on CPU, what every CPU call runs) bit for bit.
- ``Recording``: records each launch; the warm call's launches equal the general path's GPU launches
  (``binding.launch_gpu`` and kv_append's, on CPU tensors) integer for integer, pointers by the tensor they
  point at, and a call whose split count is 1 launches no combine.

A second call of a shape runs no check, plan or packing but the eager value check of its index tensors (every
eager call, as the general path); any one changed attribute of the call (a stride, a dtype, a device, a strided
block table, a bool or an int where the other was, a window given as a list) misses the memo and is described
again, or goes to the general path, which raises what it raises; bad values and overlapping memory on a warm
shape raise the general path's errors; a warm trusted step reads nothing back to the host. On a GPU: warm
equals cold bit for bit at real sizes, under ``set_sync_debug_mode("error")`` and in a captured CUDA graph.
"""

from __future__ import annotations

import ctypes
import random
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import gpu

import lazytriton
from lazytriton import compiler, launch
from lazytriton.kernels import get
from lazytriton.kernels.flash_decode import FLASH_DECODE_COMBINE, FLASH_DECODE_SPLIT, binding, checks, hot, values
from lazytriton.kernels.kv_append import BLOCK_M as APPEND_BLOCK_M
from lazytriton.kernels.kv_append import KV_APPEND
from lazytriton.kernels.kv_append import binding as append_binding

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
POINTER_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "i32": torch.int32,
                  "i64": torch.int64}


def _alias(address: int, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor whose data pointer is ``address``: the interpreter reads the memory it points at."""
    size = torch.empty((), dtype=dtype).element_size()
    # 16 bytes of storage whatever the dtype: the interpreter shares one storage among the arguments at one address
    raw = torch.frombuffer((ctypes.c_byte * 16).from_address(address), dtype=torch.uint8)
    return raw[:size].view(dtype)[0:1]


class Interpreting:
    """Stands in for a LoadedKernel: runs the kernel through Triton's interpreter on the integers it is given."""

    fast = None

    def __init__(self, name: str, dtype: torch.dtype, constexprs: dict[str, Any]) -> None:
        self.name, self.constexprs = name, constexprs
        kinds = [kind.replace("{dtype}", DTYPE_NAMES[dtype]) for _, kind in get(name).params]
        self.pointers = [POINTER_DTYPES[kind[1:]] if kind.startswith("*") else None for kind in kinds]
        self.launches = 0

    def launch(self, grid: Any, stream: int, ints: Any, floats: Any, scratch: Any = None) -> None:
        args = [arg if dtype is None else _alias(arg, dtype) for arg, dtype in zip(ints, self.pointers, strict=False)]
        compiler.interpret(self.name, grid, (*args, *floats), self.constexprs)
        self.launches += 1


class Recording:
    """Stands in for a LoadedKernel: records (name, grid, stream, ints, floats) of each launch in ``log``."""

    def __init__(self, name: str, log: list[tuple[Any, ...]], fast: bool) -> None:
        self.name, self.log = name, log
        self.fast = self._fast if fast else None

    def _fast(self, gx: int, gy: int, gz: int, stream: int, ints: Any, floats: Any) -> int:
        self.log.append((self.name, (gx, gy, gz), stream, tuple(ints), tuple(floats)))
        return 0

    def launch(self, grid: Any, stream: int, ints: Any, floats: Any, scratch: Any = None) -> None:
        self.log.append((self.name, tuple(grid), stream, tuple(ints), tuple(floats)))

    def fail(self, status: int, grid: Any) -> None:
        raise AssertionError(status)


class Runtime:
    def __init__(self) -> None:
        self.plans: dict[Any, Any] = {}


STREAM = 0x5EED


def _inputs(args: dict[str, Any]) -> checks.Inputs:
    from lazytriton import kvcache

    return kvcache.inputs(args["q"], args["k_cache"], args["v_cache"], args.get("k"), args.get("v"),
                          args.get("cache_seqlens"), None, args.get("block_table"))


def memoise(rt: Runtime, args: dict[str, Any], kernels: Callable[[checks.Call, torch.dtype], tuple[Any, Any, Any]],
            tiles: tuple[int, int, int] = (16, 16, 16)) -> None:
    """The plans the general path would memoise for a call, both alignments, as ``kernels(call, dtype)``'s."""
    t = _inputs(args)
    call = checks.check(t, args.get("softmax_scale"), args.get("causal", False), num_splits=args.get("num_splits", 0))
    out, _ = binding.empty_outputs(t.q, call)
    _, index64 = binding.layout_flags(t, out)
    split, combine, append = kernels(call, t.q.dtype)
    for aligned in (False, True):
        rt.plans[binding.memo_key(None, t.q.dtype, call, aligned, index64)] = (split, tiles[0], tiles[1], combine,
                                                                                tiles[2])
        if t.k is not None:
            rt.plans[append_binding.memo_key(None, t.q.dtype, call, aligned, append_binding.layout_flags(t)[1])] = (
                append,)


def interpreting(call: checks.Call, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    split_c, combine_c = binding.interpreter_constexprs(call)
    append_c = {**append_binding.interpreter_constexprs(call), "BLOCK_M": APPEND_BLOCK_M}
    return (Interpreting(FLASH_DECODE_SPLIT.name, dtype, split_c), Interpreting(FLASH_DECODE_COMBINE.name, dtype,
                                                                                combine_c),
            Interpreting(KV_APPEND.name, dtype, append_c))


@pytest.fixture
def warm(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Runtime, list[Any]]]:
    """The CPU warm path swapped in (against a runtime of its own), the interpreter's split count on both paths.

    Yields (runtime, served): ``served`` gets True for each call the warm path served, False for each it passed on.
    """
    rt = Runtime()
    made = hot.make(cuda=False, get_runtime=lambda: rt, raw_stream=lambda device_index: STREAM)
    served: list[bool] = []

    def serve(*args: Any) -> Any:
        result = made(*args)
        served.append(result is not None)
        return result

    monkeypatch.setattr(hot, "serve", serve)
    monkeypatch.setattr(binding, "gpu_slots", lambda device_index: binding.INTERPRETER_SMS)
    monkeypatch.setattr(binding, "min_split_keys", lambda head_dim: 0)
    yield rt, served


def cold(args: dict[str, Any], **options: Any) -> Any:
    """The general path's result (the warm path passes every call on)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hot, "serve", lambda *a: None)
        return lazytriton.flash_attn_with_kvcache(**args, **options)


# ---------------------------------------------------------------------------
# Randomised calls


def random_call(seed: int) -> dict[str, Any]:
    """A call of the served kind, fresh random values: its layout, lengths, new keys and options drawn by ``seed``."""
    pick = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = pick.choice([torch.float16, torch.bfloat16, torch.float32])
    batch, (hq, hk), d = pick.choice([1, 2, 3]), pick.choice([(4, 1), (4, 2), (2, 2), (6, 3)]), pick.choice([16, 32, 24])
    dv = pick.choice([d, d, 16])
    sq, new = pick.choice([1, 1, 2, 3]), pick.choice([0, 1, 2])
    paged = pick.random() < 0.5

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    args: dict[str, Any] = {"q": randn(batch, sq, hq, d)}
    if paged:
        page, per = pick.choice([(16, 3), (5, 8), (32, 2)])
        blocks = batch * per + 2
        args["k_cache"], args["v_cache"] = randn(blocks, page, hk, d), randn(blocks, page, hk, dv)
        args["block_table"] = torch.randperm(blocks, generator=gen)[:batch * per].view(batch, per).int()
        capacity = page * per
    else:
        capacity = pick.choice([40, 70])
        args["k_cache"], args["v_cache"] = randn(batch, capacity, hk, d), randn(batch, capacity, hk, dv)
    lens = pick.choice(["int", "tensor", "tensor", "none"]) if not new else pick.choice(["int", "tensor"])
    if lens == "int":
        args["cache_seqlens"] = pick.randrange(0, capacity - new + 1)
    elif lens == "tensor":
        args["cache_seqlens"] = torch.randint(0, capacity - new + 1, (batch,), generator=gen, dtype=torch.int32)
    if new:
        args["k"], args["v"] = randn(batch, new, hk, d), randn(batch, new, hk, dv)
    args["causal"] = pick.random() < 0.5
    args["num_splits"] = pick.choice([0, 0, 1, 3])
    if pick.random() < 0.3:
        args["softmax_scale"] = pick.uniform(0.05, 0.5)
    if pick.random() < 0.3:  # out= with a strided batch (a slice of a wider tensor), last dim contiguous
        args["out"] = torch.empty(batch, sq, hq, dv + 8, dtype=dtype)[..., :dv]
    args["return_softmax_lse"] = pick.random() < 0.5
    return args


def _clone(args: dict[str, Any]) -> dict[str, Any]:
    return {n: x.clone() if isinstance(x, torch.Tensor) and n != "out" else x for n, x in args.items()}


def _fresh_out(args: dict[str, Any]) -> dict[str, Any]:
    if "out" not in args:
        return args
    out = args["out"]
    return {**args, "out": torch.empty(*out.shape[:-1], out.shape[-1] + 8, dtype=out.dtype)[..., :out.shape[-1]]}


def bits(x: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, for comparisons bit for bit (NaN equal to itself, -0.0 apart from 0.0)."""
    return x.contiguous().view(torch.uint8)


def _results(result: Any, args: dict[str, Any]) -> list[torch.Tensor]:
    got = list(result) if isinstance(result, tuple) else [result]
    return [*got, args["k_cache"], args["v_cache"]]


@pytest.mark.parametrize("seed", range(24))
def test_warm_calls_equal_the_general_path_bit_for_bit(warm: tuple[Runtime, list[bool]], seed: int) -> None:
    rt, served = warm
    args = random_call(seed)
    trusted = seed % 3 == 0
    memoise(rt, args, interpreting)
    first, second = _clone(args), _fresh_out(_clone(args))
    with lazytriton.trusted_indices() if trusted else _nothing():
        want = _results(cold(args), args)
        lazytriton.flash_attn_with_kvcache(**first)  # describes the shape
        got = _results(lazytriton.flash_attn_with_kvcache(**second), second)
    assert served == [True, True]
    for w, g in zip(want, got, strict=True):
        assert w.dtype == g.dtype and w.shape == g.shape
        assert torch.equal(bits(w), bits(g)), seed
    if "out" in second:
        assert got[0] is second["out"]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
