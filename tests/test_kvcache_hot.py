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
from conftest import gpu, syncs_raise

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
                  "i64": torch.int64, "u8": torch.uint8}


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

    t = kvcache.inputs(args["q"], args["k_cache"], args["v_cache"], args.get("k"), args.get("v"),
                       args.get("cache_seqlens"), None, args.get("block_table"))
    return t._replace(key_mask=args.get("key_mask"))


def memoise(rt: Runtime, args: dict[str, Any], kernels: Callable[[checks.Call, torch.dtype], tuple[Any, Any, Any]],
            tiles: tuple[int, int, int] = (16, 16, binding.INTERPRETER_COMBINE_M)) -> None:
    """The plans the general path would memoise for a call (a key-masked one too), both alignments, as
    ``kernels(call, dtype)``'s."""
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
    monkeypatch.setattr(binding, "gpu_slots", lambda device_index, shared=0: binding.INTERPRETER_SMS)
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
    batch, (hq, hk) = pick.choice([1, 2, 3]), pick.choice([(4, 1), (4, 2), (2, 2), (6, 3)])
    d = pick.choice([16, 32, 24])
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


# ---------------------------------------------------------------------------
# The launches, integer for integer


def recording(log: list[tuple[Any, ...]], fast: bool) -> Callable[[checks.Call, torch.dtype], tuple[Any, Any, Any]]:
    def kernels(call: checks.Call, dtype: torch.dtype) -> tuple[Any, Any, Any]:
        return tuple(Recording(spec.name, log, fast) for spec in (FLASH_DECODE_SPLIT, FLASH_DECODE_COMBINE, KV_APPEND))

    return kernels


def _gpu_append(t: checks.Inputs, call: checks.Call) -> None:
    """kv_append.binding.append's GPU branch on CPU tensors (its CPU branch runs the interpreter)."""
    if t.k is not None and call.seqlen_new:
        append_binding.launch_on_device(t, call, launch.raw_stream(-1))


@pytest.fixture
def gpu_path(monkeypatch: pytest.MonkeyPatch, warm: tuple[Runtime, list[bool]]) -> tuple[Runtime, list[bool]]:
    """The general path's GPU launches for CPU tensors, against the warm path's runtime and stream."""
    rt, _ = warm
    from lazytriton import runtime

    monkeypatch.setattr(runtime, "get", lambda: rt)
    monkeypatch.setattr(launch, "raw_stream", lambda device_index: STREAM)
    monkeypatch.setattr(binding, "run_interpreter", binding.launch_gpu)
    monkeypatch.setattr(append_binding, "append", _gpu_append)
    return warm


def _roles(log: list[tuple[Any, ...]], named: dict[int, str]) -> list[tuple[Any, ...]]:
    """Each launch with its pointers by the tensor they point at (``named``), a new allocation's as "fresh"."""
    shown = []
    for name, grid, stream, ints, floats in log:
        kinds = [kind for _, kind in get(name).params if not kind.startswith("fp")]
        shown.append((name, grid, stream, floats, tuple(
            named.get(value, "fresh") if kind.startswith("*") else value for value, kind in zip(ints, kinds,
                                                                                              strict=True))))
    return shown


def _named(args: dict[str, Any], result: Any) -> dict[int, str]:
    named = {x.data_ptr(): n for n, x in args.items() if isinstance(x, torch.Tensor)}
    for n, x in zip(("out", "lse"), result if isinstance(result, tuple) else (result,), strict=False):
        named[x.data_ptr()] = n
    return named


@pytest.mark.parametrize("fast", [True, False], ids=["helper", "abi"])
@pytest.mark.parametrize("seed", range(100, 140))
def test_warm_launches_equal_the_general_paths(gpu_path: tuple[Runtime, list[bool]], seed: int, fast: bool) -> None:
    rt, served = gpu_path
    log: list[tuple[Any, ...]] = []
    args = random_call(seed)
    memoise(rt, args, recording(log, fast), tiles=(16, 64, 16))
    trusted = seed % 2 == 0
    with lazytriton.trusted_indices() if trusted else _nothing():
        result = cold(args)
        want = _roles(log, _named(args, result))
        for _ in range(2):  # the first call describes the shape, the second finds it
            log.clear()
            again = _fresh_out(args)
            result = lazytriton.flash_attn_with_kvcache(**again)
            assert _roles(log, _named(again, result)) == want
    assert served == [True, True]
    split = next(launch for launch in want if launch[0] == FLASH_DECODE_SPLIT.name)
    splits = split[4][binding.SPLIT_INT_PARAMS.index("num_splits")]
    assert [launch[0] for launch in want] == ([KV_APPEND.name] if "k" in args else []) + [FLASH_DECODE_SPLIT.name] + (
        [FLASH_DECODE_COMBINE.name] if splits > 1 else [])


def test_one_split_launches_no_combine(gpu_path: tuple[Runtime, list[bool]]) -> None:
    rt, served = gpu_path
    log: list[tuple[Any, ...]] = []
    args = {**random_call(7), "num_splits": 1}
    memoise(rt, args, recording(log, True))
    for splits, kernels in ((1, 1), (3, 2)):
        args["num_splits"] = splits
        memoise(rt, args, recording(log, True))
        for _ in range(2):
            log.clear()
            lazytriton.flash_attn_with_kvcache(**args)
            assert [name for name, *_ in log if name != KV_APPEND.name] == [
                FLASH_DECODE_SPLIT.name, FLASH_DECODE_COMBINE.name][:kernels]
    assert all(served)


# ---------------------------------------------------------------------------
# What a warm call runs, and what misses the memo


def _base(seed: int = 3, **changes: Any) -> dict[str, Any]:
    """A paged decoding step with new keys and a lengths tensor (every key part present), fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    hk, d, page, per, batch = 2, 32, 16, 3, 2
    blocks = batch * per
    args = {"q": torch.randn(batch, 1, 4, d, generator=gen), "k_cache": torch.randn(blocks, page, hk, d, generator=gen),
            "v_cache": torch.randn(blocks, page, hk, d, generator=gen),
            "k": torch.randn(batch, 1, hk, d, generator=gen),
            "v": torch.randn(batch, 1, hk, d, generator=gen),
            "cache_seqlens": torch.tensor([5, 30], dtype=torch.int32),
            "block_table": torch.randperm(blocks, generator=gen).view(batch, per).int(), "causal": True,
            "out": torch.empty(batch, 1, 4, d)}
    return {**args, **changes}


def test_a_warm_call_runs_no_check_plan_or_packing(gpu_path: tuple[Runtime, list[bool]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the first call, only the eager value check runs (every eager call, as the general path's); trusted, not
    even that."""
    rt, served = gpu_path
    args = _base()
    memoise(rt, args, recording([], True))
    value_checks: list[int] = []
    real = values.check_values
    monkeypatch.setattr(values, "check_values", lambda *a, **k: (value_checks.append(1), real(*a, **k))[1])
    made = hot.make(cuda=False, get_runtime=lambda: rt, raw_stream=lambda device_index: STREAM)
    assert made(*_served_args(args)) is not None  # describes

    def refused(*a: Any, **k: Any) -> None:
        raise AssertionError("ran on a warm call")

    for module, name in ((checks, "check"), (checks, "check_out"), (binding, "memo_key"), (binding, "split_ints"),
                         (binding, "combine_ints"), (binding, "layout_flags"), (binding, "plan"),
                         (binding, "splits_for"), (append_binding, "ints"), (append_binding, "layout_flags"),
                         (append_binding, "plan"), (append_binding, "memo_key"), (hot, "describe")):
        monkeypatch.setattr(module, name, refused)
    value_checks.clear()
    for _ in range(3):
        assert made(*_served_args(args)) is not None
    assert len(value_checks) == 3
    with lazytriton.trusted_indices():
        assert made(*_served_args(args)) is not None
    assert len(value_checks) == 3


def _served_args(args: dict[str, Any]) -> tuple[Any, ...]:
    """``hot.serve``'s arguments for a call given as the public function's keywords."""
    return (args["q"], args["k_cache"], args["v_cache"], args.get("k"), args.get("v"), args.get("cache_seqlens"),
            args.get("block_table"), args.get("softmax_scale"), args.get("causal", False), args.get("num_splits", 0),
            True, args.get("return_softmax_lse", False), args.get("out"))


def _strided(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values in a tensor of other strides (every other element of a wider last dim, or a transposed copy)."""
    if x.dim() == 1:
        return torch.stack([x, x], dim=1)[:, 0]
    return x.transpose(0, 1).contiguous().transpose(0, 1) if x.shape[0] > 1 and x.shape[1] > 1 else torch.cat(
        [x, x], dim=-1)[..., :x.shape[-1]]


# (name, the change, "described": served after a new description; "general": passed on, the general path's result;
#  or the error the general path raises)
KEY_FIELDS: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], Any]] = [
    ("q_strides", lambda a: {**a, "q": torch.cat([a["q"], a["q"]], dim=-1)[..., :32]}, "described"),
    ("q_dtype", lambda a: {**a, "q": a["q"].double()}, (TypeError, "q must be float16")),
    ("k_cache_strides", lambda a: {**a, "k_cache": torch.cat([a["k_cache"]] * 2, dim=1)[:, :16]}, "described"),
    ("k_cache_device", lambda a: {**a, "k_cache": a["k_cache"].to("meta")}, (ValueError, "k_cache is on meta")),
    ("v_cache_dtype", lambda a: {**a, "v_cache": a["v_cache"].half()}, (TypeError, "v_cache has dtype")),
    ("k_strides", lambda a: {**a, "k": _strided(a["k"])}, "described"),
    ("v_strides", lambda a: {**a, "v": torch.cat([a["v"], a["v"]], dim=-1)[..., :32]}, "described"),
    ("no_new_keys", lambda a: {n: x for n, x in a.items() if n not in ("k", "v")}, "described"),
    ("k_alone", lambda a: {**a, "v": None}, (ValueError, "k and v must be given together")),
    ("lens_int", lambda a: {**a, "cache_seqlens": 20}, "described"),
    ("lens_none", lambda a: {n: x for n, x in a.items() if n not in ("k", "v", "cache_seqlens")}, "described"),
    ("lens_bool", lambda a: {**a, "cache_seqlens": True}, (TypeError, "cache_seqlens must be an int")),
    ("lens_int64", lambda a: {**a, "cache_seqlens": a["cache_seqlens"].long()}, (TypeError, "cache_seqlens must be")),
    ("lens_strided", lambda a: {**a, "cache_seqlens": _strided(a["cache_seqlens"])}, "general"),
    ("table_strided", lambda a: {**a, "block_table": _strided(a["block_table"])}, "general"),
    ("table_int64", lambda a: {**a, "block_table": a["block_table"].long()}, (TypeError, "block_table must be")),
    ("no_table", lambda a: {**{n: x for n, x in a.items() if n != "block_table"},
                            "k_cache": a["k_cache"].view(2, 48, 2, 32), "v_cache": a["v_cache"].view(2, 48, 2, 32)},
     "described"),
    ("out_strides", lambda a: {**a, "out": torch.empty(2, 1, 4, 40)[..., :32]}, "described"),
    ("out_none", lambda a: {n: x for n, x in a.items() if n != "out"}, "described"),
    ("out_dtype", lambda a: {**a, "out": a["out"].half()}, (TypeError, "out must be torch.float32")),
    ("out_last_strided", lambda a: {**a, "out": torch.empty(2, 1, 4, 64)[..., ::2]}, "general"),
    ("causal_false", lambda a: {**a, "causal": False}, "described"),
    ("causal_int", lambda a: {**a, "causal": 1}, (TypeError, "causal must be a bool")),
    ("scale_float", lambda a: {**a, "softmax_scale": 0.25}, "described"),
    ("scale_int", lambda a: {**a, "softmax_scale": 1}, "general"),
    ("scale_bool", lambda a: {**a, "softmax_scale": True}, (TypeError, "softmax_scale must be a finite float")),
    ("splits", lambda a: {**a, "num_splits": 2}, "described"),
    ("splits_bool", lambda a: {**a, "num_splits": True}, (TypeError, "num_splits must be an int")),
    ("window_list", lambda a: {**a, "window_size": [-1, -1]}, "general"),
    ("window_floats", lambda a: {**a, "window_size": (-1.0, -1.0)}, (TypeError, "window_size must be a pair of ints")),
    ("softcap_int", lambda a: {**a, "softcap": 0}, "general"),
    ("interleaved_int", lambda a: {**a, "rotary_interleaved": 1}, (TypeError, "rotary_interleaved must be a bool")),
]


@pytest.mark.parametrize(("name", "change", "expect"), KEY_FIELDS, ids=[f[0] for f in KEY_FIELDS])
def test_every_key_field_matters(gpu_path: tuple[Runtime, list[bool]], monkeypatch: pytest.MonkeyPatch,
                                 name: str, change: Callable[[dict[str, Any]], dict[str, Any]], expect: Any) -> None:
    rt, served = gpu_path
    described: list[int] = []
    real = hot.describe
    monkeypatch.setattr(hot, "describe", lambda *a: (described.append(1), real(*a))[1])
    log: list[tuple[Any, ...]] = []
    base = _base()
    memoise(rt, base, recording(log, True))
    lazytriton.flash_attn_with_kvcache(**base)
    lazytriton.flash_attn_with_kvcache(**base)
    assert served == [True, True] and len(described) == 1
    served.clear()
    changed = change(_base())
    if isinstance(expect, tuple):
        error, match = expect
        with pytest.raises(error, match=re.escape(match)):
            cold(changed)
        with pytest.raises(error, match=re.escape(match)):
            lazytriton.flash_attn_with_kvcache(**changed)
        assert served in ([], [False]), served
        return
    memoise(rt, {n: x for n, x in changed.items() if n not in ("window_size", "softcap")}, recording(log, True))
    lazytriton.flash_attn_with_kvcache(**changed)
    if expect == "described":
        assert served == [True] and len(described) == 2
    else:
        assert served in ([], [False]), served


def test_a_cleared_memo_and_a_new_runtime_describe_again(gpu_path: tuple[Runtime, list[bool]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    rt, served = gpu_path
    described: list[int] = []
    real = hot.describe
    monkeypatch.setattr(hot, "describe", lambda *a: (described.append(1), real(*a))[1])
    monkeypatch.setattr(hot, "MAX_SHAPES", 2)
    calls = [_base(), _base(causal=False), _base(softmax_scale=0.5)]
    for args in calls:
        memoise(rt, args, recording([], True))
    for args in (*calls, calls[2], calls[0]):  # the third entry clears the table: the first is described again
        lazytriton.flash_attn_with_kvcache(**args)
    assert all(served) and len(described) == 4
    rt.plans = dict(rt.plans)  # a rebuilt runtime: new plans
    lazytriton.flash_attn_with_kvcache(**calls[0])
    assert all(served) and len(described) == 5


# ---------------------------------------------------------------------------
# Bad input on a warm shape


def _bad_lengths(a: dict[str, Any]) -> dict[str, Any]:
    return {**a, "cache_seqlens": torch.tensor([5, 48], dtype=torch.int32)}


def _bad_block(a: dict[str, Any]) -> dict[str, Any]:
    table = a["block_table"].clone()
    table[1, 0] = 99
    return {**a, "block_table": table}


# (name, a valid call of the warm shape, the same shape made bad, the error, trusted calls check it too)
BAD: list[tuple[str, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], dict[str, Any]], type[Exception], str,
                bool]] = [
    ("int_length_past_the_cache", lambda: _base(cache_seqlens=40), lambda a: {**a, "cache_seqlens": 48}, ValueError,
     "cache_seqlens must be in 0..47", True),
    ("int_length_negative", lambda: _base(cache_seqlens=40), lambda a: {**a, "cache_seqlens": -1}, ValueError,
     "cache_seqlens must be in 0..47", True),
    ("lengths_past_the_cache", _base, _bad_lengths, ValueError, "cache_seqlens[1] = 48", False),
    ("block_past_the_cache", _base, _bad_block, ValueError, "block_table[1, 0] = 99 points past the cache", False),
    ("block_past_the_cache_int_length", lambda: _base(cache_seqlens=20), _bad_block, ValueError,
     "block_table[1, 0] = 99", False),
    ("out_is_q", _base, lambda a: {**a, "out": a["q"]}, ValueError, "out shares memory with q", True),
    ("out_in_the_cache", _base, lambda a: {**a, "out": a["k_cache"].view(-1)[:256].view(2, 1, 4, 32)}, ValueError,
     "out shares memory with k_cache", True),
    ("out_is_k", lambda: _base(q=torch.randn(2, 1, 2, 32), out=torch.empty(2, 1, 2, 32)),
     lambda a: {**a, "out": a["k"]}, ValueError,
     "out shares memory with k", True),
    ("caches_shared", _base, lambda a: {**a, "v_cache": a["k_cache"]}, ValueError, "v_cache shares k_cache's memory",
     True),
]


@pytest.mark.parametrize(("name", "valid", "bad", "error", "match", "trusted"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_on_a_warm_shape_raises_the_general_paths_error(
        gpu_path: tuple[Runtime, list[bool]], name: str, valid: Callable[[], dict[str, Any]],
        bad: Callable[[dict[str, Any]], dict[str, Any]], error: type[Exception], match: str, trusted: bool) -> None:
    rt, served = gpu_path
    log: list[tuple[Any, ...]] = []
    args = valid()
    memoise(rt, args, recording(log, True))
    lazytriton.flash_attn_with_kvcache(**args)
    lazytriton.flash_attn_with_kvcache(**args)
    assert served == [True, True]
    log.clear()
    wrong = bad(args)
    caches = wrong["k_cache"].clone(), wrong["v_cache"].clone()
    with pytest.raises(error, match=re.escape(match)):
        cold(wrong)
    for trust in (False, True) if trusted else (False,):
        with lazytriton.trusted_indices() if trust else _nothing(), pytest.raises(error, match=re.escape(match)):
            lazytriton.flash_attn_with_kvcache(**wrong)
    assert log == []  # nothing launched, nothing written
    assert torch.equal(wrong["k_cache"], caches[0]) and torch.equal(wrong["v_cache"], caches[1])


# ---------------------------------------------------------------------------
# No host read on a warm trusted step

# The CPU stand-ins of a GPU launch (Triton's interpreter) read values on the host by nature: not counted.
_STAND_INS = ("lazytriton.interpreter", "lazytriton.compiler")


def host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each read of a tensor's values back to the host made from lazytriton's code (a synchronisation on a GPU)."""
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero"):
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: object, _real: Any = real, _name: str = name, **kwargs: object) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("lazytriton") and not caller.startswith(_STAND_INS):
                reads.append(f"{_name} in {caller}")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def _steps() -> list[dict[str, Any]]:
    return [_base(), _base(cache_seqlens=20), _base(out=None, return_softmax_lse=True),
            {n: x for n, x in _base().items() if n not in ("k", "v")}, random_call(11), random_call(12)]


def test_a_warm_trusted_step_reads_nothing_back_to_the_host(gpu_path: tuple[Runtime, list[bool]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    rt, served = gpu_path
    steps = _steps()
    for args in steps:
        memoise(rt, args, recording([], True))
    with lazytriton.trusted_indices():
        for args in steps:
            lazytriton.flash_attn_with_kvcache(**args)  # describes
        reads = host_reads(monkeypatch)
        for args in steps:
            lazytriton.flash_attn_with_kvcache(**args)
    assert reads == [] and all(served) and len(served) == 2 * len(steps)
    with pytest.MonkeyPatch.context() as patch:  # the counter is not blind: an eager step reads its values once
        reads = host_reads(patch)
        lazytriton.flash_attn_with_kvcache(**steps[0])
    assert reads == ["tolist in lazytriton.kernels.flash_decode.values"]


# ---------------------------------------------------------------------------
# On a GPU: real sizes, no synchronisation, CUDA graphs


def _gpu_step(batch: int, keys: int, paged: bool, lens: str, new: bool, seed: int) -> dict[str, Any]:
    """bench_decode.py's decoding step (bf16, head dim 128, 32/8 heads, one query) on the GPU, fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    hq, hk, d, page = 32, 8, 128, 256

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).cuda()

    args: dict[str, Any] = {"q": randn(batch, 1, hq, d)}
    if paged:
        blocks = batch * keys // page
        args["k_cache"], args["v_cache"] = randn(blocks, page, hk, d), randn(blocks, page, hk, d)
        args["block_table"] = torch.randperm(blocks, generator=gen).view(batch, -1).int().cuda()
    else:
        args["k_cache"], args["v_cache"] = randn(batch, keys, hk, d), randn(batch, keys, hk, d)
    length = keys - 1 - int(torch.randint(0, keys // 2, (), generator=gen))
    args["cache_seqlens"] = length if lens == "int" else torch.randint(
        keys // 2, keys - 1, (batch,), generator=gen, dtype=torch.int32).cuda()
    if new:
        args["k"], args["v"] = randn(batch, 1, hk, d), randn(batch, 1, hk, d)
    return args


def _warm_counted(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    served: list[bool] = []
    real = hot.serve

    def serve(*args: Any) -> Any:
        result = real(*args)
        served.append(result is not None)
        return result

    monkeypatch.setattr(hot, "serve", serve)
    return served


GPU_CASES = [(batch, keys, paged, lens, new) for batch, keys in ((1, 4096), (1, 16384), (8, 4096))
             for paged in (False, True) for lens, new in (("int", False), ("tensor", False), ("tensor", True))]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "keys", "paged", "lens", "new"), GPU_CASES, ids=str)
def test_gpu_warm_equals_cold_at_real_sizes(monkeypatch: pytest.MonkeyPatch, batch: int, keys: int, paged: bool,
                                            lens: str, new: bool) -> None:
    """Warm (eager and trusted) against the general path: out, lse and the caches bit for bit."""
    served = _warm_counted(monkeypatch)
    args = _gpu_step(batch, keys, paged, lens, new, seed=keys + batch)
    base = _clone(args)
    want = _results(cold(base, return_softmax_lse=True), base)
    for trusted in (False, True):
        for _ in range(2):
            again = _clone(args)
            with lazytriton.trusted_indices() if trusted else _nothing():
                got = _results(lazytriton.flash_attn_with_kvcache(**again, return_softmax_lse=True), again)
            for w, g in zip(want, got, strict=True):
                assert torch.equal(bits(w), bits(g))
    assert served == [True] * 4, served


@gpu
@pytest.mark.gpu
def test_gpu_a_warm_step_never_synchronises_and_captures_in_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm trusted steps under ``set_sync_debug_mode("error")``; then each step captured in a CUDA graph (eager
    and trusted alike: the value check is skipped during a capture) and replayed: the general path's bits."""
    served = _warm_counted(monkeypatch)
    steps = [_gpu_step(1, 4096, paged, lens, new, seed=5) for paged in (False, True)
             for lens, new in (("int", False), ("tensor", True))]
    with lazytriton.trusted_indices():
        for args in steps:
            lazytriton.flash_attn_with_kvcache(**_clone(args))
        with syncs_raise():
            for args in steps:
                lazytriton.flash_attn_with_kvcache(**_clone(args))
    torch.cuda.synchronize()
    assert served and all(served[len(steps):]), served
    for args in steps:
        out = torch.empty_like(args["q"])
        assert replays_cold_bits(args, served, {"out": out}, out=out) == [True]  # described with out= first


def replays_cold_bits(args: dict[str, Any], served: list[Any], describing: dict[str, Any], describe: int = 1,
                      **given: Any) -> list[Any]:
    """What ``served`` (a warm path's count) recorded while ``args``'s step, with ``given``, was captured in a CUDA
    graph, after ``describe`` eager calls with ``describing`` (they make its entry before the capture). The graph is
    replayed on fresh caches: out, lse and the caches must be the general path's bits."""
    base = _clone(args)
    want = _results(cold(base, return_softmax_lse=True), base)
    captured = _clone(args)
    for _ in range(describe):
        lazytriton.flash_attn_with_kvcache(**_clone(args), **describing)
    served.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = lazytriton.flash_attn_with_kvcache(**captured, **given, return_softmax_lse=True)
    during = list(served)
    fresh = _clone(args)
    captured["k_cache"].copy_(fresh["k_cache"])
    captured["v_cache"].copy_(fresh["v_cache"])
    graph.replay()
    torch.cuda.synchronize()
    for w, g in zip(want, [out, lse, captured["k_cache"], captured["v_cache"]], strict=True):
        assert torch.equal(bits(w), bits(g))
    return during
