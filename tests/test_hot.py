"""The warm path (kernels/flash_fwd/hot.py) against the general one: same launch, same result.

On CPU, the warm path's own generated text runs on CPU tensors (``cuda=False``)
with a recording launcher, against ``binding.check``/``pack``/``memo_key``; on
a GPU, against the general path's kernel launch and results.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_flash_fwd import make_qkv, on_gpu

import lazytriton
from lazytriton import runtime, tuning
from lazytriton.kernels.flash_fwd import binding, hot
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch


def test_warm_path_declines_what_it_does_not_serve() -> None:
    q, k, v = make_qkv(1, (2, 2), (8, 8), 16, torch.float16, seed=1)
    assert hot.forward_bhsd(q, k, v, False, None) is None  # CPU tensors: the general path's interpreter
    assert hot.forward_bshd(q, k, v, True, None) is None


CASES = [  # (layout, heads, seqlens, head dim, causal, scale, dtype)
    ("bhsd", (4, 2), (300, 257), 64, "bottom_right", None, torch.bfloat16),
    ("bhsd", (3, 1), (1, 1000), 128, True, 0.3, torch.float16),
    ("bhsd", (2, 2), (129, 129), 40, False, None, torch.float32),
    ("bshd", (8, 2), (77, 513), 128, "bottom_right", None, torch.bfloat16),
    ("bshd", (2, 2), (64, 64), 256, False, 0.05, torch.float16),
]


def _spy_launches(kernel: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Record (grid, ints, floats) of each launch of ``kernel``, through the helper or ``launch``."""
    launches: list[tuple[Any, ...]] = []
    original = type(kernel).launch

    def spy(self: Any, grid: Any, stream: Any, ints: Any, floats: Any, scratch: Any = None) -> None:
        launches.append((tuple(grid), tuple(ints), tuple(floats)))
        original(self, grid, stream, ints, floats, scratch)

    monkeypatch.setattr(type(kernel), "launch", spy)
    fast = kernel.fast
    if fast is not None:
        def fast_spy(gx: int, gy: int, gz: int, stream: int, ints: Any, floats: Any) -> int:
            launches.append(((gx, gy, gz), tuple(ints), tuple(floats)))
            return fast(gx, gy, gz, stream, ints, floats)  # type: ignore[no-any-return]

        monkeypatch.setattr(kernel, "fast", fast_spy)
    return launches


@on_gpu
@pytest.mark.parametrize("result", ["forward", "output"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gpu_warm_path_launches_exactly_what_the_general_path_launches(case: tuple[Any, ...], result: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    layout, heads, seqlens, d, causal, scale, dtype = case
    runtime.reset()
    q, k, v = make_qkv(2, heads, seqlens, d, dtype, device="cuda", seed=sum(seqlens))
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    view = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    call = binding.check(view(q), view(k), view(v), causal, scale)
    general = binding.forward(view(q), view(k), view(v), call)  # fills the memo
    kernel, block_m = next(iter(runtime.get().plans.values()))
    launches = _spy_launches(kernel, monkeypatch)
    warm = getattr(hot, f"{result}_{layout}")(q, k, v, causal, scale)
    assert warm is not None, "a memoised bucket must be served by the warm path"
    out, lse = warm if result == "forward" else (warm, None)
    expected_out = binding.empty_outputs(view(q), call.shape)[0]
    lse_for_pack = lse if lse is not None else general[1]
    ints, _, _ = binding.pack(view(q), view(k), view(v), view(out), lse_for_pack, call)
    grid, launched, floats = launches[0]
    lse_slot = binding.INT_PARAMS.index("Lse")
    if lse is None:  # the spare buffer's address instead of an lse tensor's
        assert launched[lse_slot] == hot.SPARE[q.get_device()][1]
        launched = launched[:lse_slot] + (ints[lse_slot],) + launched[lse_slot + 1:]
    assert launched == ints and floats == binding.floats(call) and grid == binding.grid(call.shape, block_m)
    assert out.shape == q.shape and out.stride() == (expected_out.transpose(1, 2).stride() if layout == "bshd" else
                                                     expected_out.stride())
    torch.cuda.synchronize()
    assert torch.equal(view(out), general[0]) and (lse is None or torch.equal(lse, general[1]))


@on_gpu
def test_gpu_helper_and_abi_paths_launch_the_same_results() -> None:
    from lazytriton.driver import fastlaunch

    if not fastlaunch.available():
        pytest.skip("the launch helper is not built (python -m lazytriton.driver.fastlaunch_build)")
    q, k, v = make_qkv(2, (4, 2), (300, 257), 64, torch.bfloat16, device="cuda", seed=5)
    results = {}
    for on in (True, False):
        previous = fastlaunch.enable(on)
        try:
            runtime.reset()
            lazytriton.attn_fwd(q, k, v, causal="bottom_right")  # loads the kernel under this setting
            kernel, _ = next(iter(runtime.get().plans.values()))
            assert (kernel.fast is not None) == on
            results[on] = (lazytriton.attn_fwd(q, k, v, causal="bottom_right"),
                           lazytriton.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        finally:
            fastlaunch.enable(previous)
    torch.cuda.synchronize()
    (out_a, lse_a), sdpa_a = results[True]
    (out_b, lse_b), sdpa_b = results[False]
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b) and torch.equal(sdpa_a, sdpa_b)
    runtime.reset()


@on_gpu
def test_gpu_graphs_keep_working_after_the_spare_lse_buffer_grows() -> None:
    small = make_qkv(1, (2, 2), (64, 64), 64, torch.float16, device="cuda", seed=6)
    large = make_qkv(4, (8, 8), (1024, 1024), 64, torch.float16, device="cuda", seed=7)
    expected = lazytriton.scaled_dot_product_attention(*small)
    lazytriton.scaled_dot_product_attention(*large)  # warm both shapes
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        lazytriton.scaled_dot_product_attention(*small)
        with torch.cuda.graph(graph):
            captured = lazytriton.scaled_dot_product_attention(*small)
    torch.cuda.current_stream().wait_stream(stream)
    before = hot.SPARE[0]
    hot.spare_lse(0, before[0] * 4)  # the spare buffer grows; the graph still holds the old one's address
    filler = [torch.full((before[0],), 7.0, device="cuda") for _ in range(4)]  # reuse freed memory, if any
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)
    assert all(bool((t == 7.0).all()) for t in filler), "a replay wrote into memory the spare buffer had freed"


@on_gpu
def test_gpu_public_functions_take_the_warm_path_once_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = make_qkv(1, (4, 2), (100, 100), 64, torch.float16, device="cuda", seed=3)
    lazytriton.attn_fwd(q, k, v)
    lazytriton.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    lazytriton.flash_attn_func(qb, kb, vb)

    def general(*args: Any) -> None:
        raise AssertionError("the general path ran for a warm call")

    monkeypatch.setattr(binding, "check", general)
    lazytriton.attn_fwd(q, k, v)
    lazytriton.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    lazytriton.flash_attn_func(qb, kb, vb)


# ---------------------------------------------------------------------------
# CPU: the generated text against the binding, field by field


class _Recorder:
    """Stands in for a LoadedKernel: records what the warm path launches, through ``fast`` or ``launch``."""

    def __init__(self, fast: bool) -> None:
        self.launches: list[tuple[Any, ...]] = []
        self.fast = self._fast if fast else None

    def _fast(self, gx: int, gy: int, gz: int, stream: int, ints: tuple[int, ...], floats: tuple[float, ...]) -> int:
        self.launches.append(((gx, gy, gz), stream, ints, floats))
        return 0

    def launch(self, grid: Any, stream: int, ints: Any, floats: Any, scratch: Any = None) -> None:
        self.launches.append((grid, stream, tuple(ints), tuple(floats)))

    def fail(self, status: int, grid: Any) -> None:
        raise AssertionError(status)


class _Runtime:
    def __init__(self) -> None:
        self.plans: dict[Any, Any] = {}


def _cpu_paths(rt: _Runtime, spare: torch.Tensor) -> dict[str, Callable[..., Any]]:
    scope = {"get_runtime": lambda: rt, "raw_stream": lambda di: 0x5EED, "SPARE": {-1: (spare.numel(),
                                                                                    spare.data_ptr())}}
    return {f"{result}_{layout}": hot.generate(layout, result, cuda=False, **scope)
            for result in ("forward", "output") for layout in ("bhsd", "bshd")}


CPU_CASES = [  # (layout, heads, seqlens, head dim, causal, scale, dtype, make non-contiguous)
    ("bhsd", (4, 2), (300, 257), 64, "bottom_right", None, torch.bfloat16, False),
    ("bhsd", (3, 1), (1, 1000), 128, True, 0.3, torch.float16, False),
    ("bhsd", (2, 2), (129, 129), 40, False, None, torch.float32, True),
    ("bhsd", (2, 2), (17, 33), 8, "top_left", None, torch.float16, True),
    ("bshd", (8, 2), (77, 513), 128, "bottom_right", None, torch.bfloat16, False),
    ("bshd", (2, 2), (64, 64), 256, False, 0.05, torch.float16, True),
    # Shapes dispatch's flash_fwd_gluon rows take (their memo keys end in binding.GLUON_TAIL):
    ("bhsd", (2, 2), (256, 512), 128, "bottom_right", None, torch.bfloat16, False),
    ("bshd", (2, 1), (128, 128), 64, False, None, torch.bfloat16, False),
    ("bshd", (6, 3), (5, 9), 24, False, None, torch.float32, False),
]


def _inputs(case: tuple[Any, ...]) -> tuple[Any, ...]:
    layout, heads, seqlens, d, causal, scale, dtype, strided = case
    q, k, v = make_qkv(2, heads, seqlens, d, dtype, seed=sum(seqlens))
    if strided:  # every other head dim column group of a wider tensor: strides no tensor of this shape has
        q, k, v = (torch.cat([t, t], dim=-1)[..., :d] for t in (q, k, v))
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() if not strided else t.transpose(1, 2) for t in (q, k, v))
    view = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)
    return q, k, v, view


@pytest.mark.parametrize("fast", [True, False], ids=["helper", "abi"])
@pytest.mark.parametrize("result", ["forward", "output"])
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_warm_path_launches_what_the_binding_packs(case: tuple[Any, ...], result: str, fast: bool) -> None:
    layout, _, _, _, causal, scale, dtype, _ = case
    q, k, v, view = _inputs(case)
    rt, spare = _Runtime(), torch.empty(1 << 16, dtype=torch.float32)
    warm = _cpu_paths(rt, spare)[f"{result}_{layout}"]
    call = binding.check(view(q), view(k), view(v), causal, scale)
    assert warm(q, k, v, causal, scale) is None  # nothing memoised yet: the general path's turn
    kernel = _Recorder(fast)
    out0, lse0 = binding.empty_outputs(view(q), call.shape)
    _, aligned, index64 = binding.pack(view(q), view(k), view(v), out0, lse0, call)
    rt.plans[binding.memo_key(-1, dtype, call.shape, call.causal != "none", aligned, index64, offset=call.offset,
                              scale=call.scale)] = (kernel, 64)
    for _ in range(2):  # the first call describes the shape, the second is served from its entry
        served = warm(q, k, v, causal, scale)
        assert served is not None
        out, lse = served if result == "forward" else (served, spare[:call.shape.batch * call.shape.heads_q
                                                                      * call.shape.seqlen_q].view(
            call.shape.batch, call.shape.heads_q, call.shape.seqlen_q))
        assert out.shape == q.shape and out.dtype == q.dtype and view(out).stride() == out0.stride()
        if result == "forward":
            assert lse.shape == lse0.shape and lse.stride() == lse0.stride() and lse.dtype == torch.float32
        ints, expect_aligned, expect_index64 = binding.pack(view(q), view(k), view(v), view(out), lse, call)
        grid, stream, launched_ints, floats = kernel.launches[-1]
        assert (expect_aligned, expect_index64) == (aligned, index64)
        assert launched_ints == ints, "every int/pointer parameter, in FLASH_FWD.params order"
        assert floats == binding.floats(call)
        assert grid == binding.grid(call.shape, 64) and stream == 0x5EED
    assert len(kernel.launches) == 2


def test_warm_path_takes_the_unaligned_plan_for_an_unaligned_pointer() -> None:
    rt, spare = _Runtime(), torch.empty(1 << 12, dtype=torch.float32)
    warm = _cpu_paths(rt, spare)["forward_bhsd"]
    base = torch.randn(2 * 16 * 64 + 1)
    q = base[1:].view(1, 2, 16, 64)  # a 4-byte offset: the pointer is not 16-byte aligned, the strides are
    k = v = base[:-1].view(1, 2, 16, 64)
    call = binding.check(q, k, v)
    aligned_kernel, unaligned_kernel = _Recorder(True), _Recorder(True)
    for flag, kernel in ((True, aligned_kernel), (False, unaligned_kernel)):
        rt.plans[binding.memo_key(-1, q.dtype, call.shape, False, flag, False)] = (kernel, 32)
    assert warm(q, k, v, False, None) is not None
    assert (len(aligned_kernel.launches), len(unaligned_kernel.launches)) == (0, 1)
    assert warm(k, k, v, False, None) is not None  # the same sizes and strides: one entry, both plans
    assert (len(aligned_kernel.launches), len(unaligned_kernel.launches)) == (1, 1)
    assert binding.pack(k, k, v, *binding.empty_outputs(k, call.shape), call)[1] is True


@pytest.mark.parametrize("bad", [
    {"causal": 1}, {"causal": "both"}, {"scale": 1}, {"scale": float("nan")}, {"scale": float("inf")},
    {"dtype_k": torch.float16}, {"head_dim": 1}, {"heads": (3, 2)}, {"grad": True}, {"last_stride": 2},
    {"rank": 3}, {"kv_shapes": True},
], ids=str)
def test_warm_path_declines_what_the_general_path_must_see(bad: dict[str, Any]) -> None:
    rt, spare = _Runtime(), torch.empty(1 << 12, dtype=torch.float32)
    paths = _cpu_paths(rt, spare)
    d = bad.get("head_dim", 32)
    q, k, v = make_qkv(1, bad.get("heads", (2, 2)), (16, 16), d, torch.float32)
    kernel = _Recorder(True)
    for key_d in (d, 32):
        for flag in (True, False):
            for causal in (True, False):
                rt.plans[(-1, torch.float32, key_d, causal, flag, False, 4, 4)] = (kernel, 16)
    if "dtype_k" in bad:
        k = k.to(bad["dtype_k"])
    if bad.get("grad"):
        q.requires_grad_(True)
    if "last_stride" in bad:
        k = torch.cat([k, k], dim=-1)[..., ::2]
    if "rank" in bad:
        q = q[0]
    if "kv_shapes" in bad:
        v = v[:, :, :8]
    for name, warm in paths.items():
        assert warm(q, k, v, bad.get("causal", False), bad.get("scale")) is None, name
    assert kernel.launches == []


def test_warm_path_describes_again_after_the_runtime_changes() -> None:
    rt, spare = _Runtime(), torch.empty(1 << 12, dtype=torch.float32)
    warm = _cpu_paths(rt, spare)["output_bhsd"]
    q, k, v = make_qkv(1, (2, 2), (16, 16), 32, torch.float32)
    first, second = _Recorder(True), _Recorder(True)
    rt.plans[(-1, torch.float32, 32, False, True, False, 4, 4)] = (first, 16)
    assert warm(q, k, v, False, None) is not None
    rt.plans = {(-1, torch.float32, 32, False, True, False, 4, 4): (second, 16)}  # a rebuilt runtime's memo
    assert warm(q, k, v, False, None) is not None
    assert (len(first.launches), len(second.launches)) == (1, 1)


def test_warm_path_memo_buckets_are_tunings() -> None:
    for n in [*range(1, 5000), *(2**e + d for e in range(12, 31) for d in (-1, 0, 1))]:
        assert (n - 1).bit_length() == tuning.bucket_index(n), n


def test_sdpa_without_enable_gqa_is_served_only_for_equal_or_single_kv_heads() -> None:
    rt, spare = _Runtime(), torch.empty(1 << 12, dtype=torch.float32)
    warm = _cpu_paths(rt, spare)["output_bhsd"]
    kernel = _Recorder(True)
    for flag in (True, False):
        rt.plans[(-1, torch.float32, 32, False, flag, False, 4, 4)] = (kernel, 16)
    for heads, gqa, served in (((4, 2), False, False), ((4, 2), True, True), ((4, 1), False, True),
                               ((4, 4), False, True)):
        q, k, v = make_qkv(1, heads, (16, 16), 32, torch.float32)
        assert (warm(q, k, v, False, None, gqa) is not None) == served, (heads, gqa)
    assert len(kernel.launches) == 3


# ---------------------------------------------------------------------------
# lse stocks: small lse tensors handed out from one allocation


def _stocked_path(rt: _Runtime, stream: list[int], capturing: list[bool]) -> Callable[..., Any]:
    return hot.generate("bhsd", "forward", cuda=False, get_runtime=lambda: rt, raw_stream=lambda di: stream[0],
                        is_capturing=lambda: capturing[0])


def _plan_for(rt: _Runtime, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Recorder:
    call = binding.check(q, k, v)
    kernel = _Recorder(True)
    for flag in (True, False):
        rt.plans[binding.memo_key(-1, q.dtype, call.shape, False, flag, False)] = (kernel, 16)
    return kernel


def test_small_lse_tensors_come_from_one_block_each_aligned_and_apart() -> None:
    rt, stream, capturing = _Runtime(), [0x5EED], [False]
    warm = _stocked_path(rt, stream, capturing)
    q, k, v = make_qkv(2, (3, 3), (5, 9), 16, torch.float32)  # lse (2, 3, 5): 30 floats, stepped to 32
    kernel = _plan_for(rt, q, k, v)
    per_block = min(hot.MAX_STOCK, hot.STOCK_BYTES // (4 * 32))
    lses = [warm(q, k, v, False, None)[1] for _ in range(per_block + 3)]
    assert len(kernel.launches) == per_block + 3
    spans = sorted((t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in lses)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False)), "two lse tensors overlap"
    assert all(t.shape == (2, 3, 5) and t.stride() == (15, 5, 1) and t.data_ptr() % 16 == 0 for t in lses)
    blocks = {t.untyped_storage().data_ptr() for t in lses}
    assert len(blocks) == 2, "one allocation per stock of lse tensors"
    launched_lse = {launch[2][binding.INT_PARAMS.index("Lse")] for launch in kernel.launches}
    assert launched_lse == {t.data_ptr() for t in lses}, "each call's kernel writes the lse it returns"


def test_lse_stocks_are_per_stream_and_never_used_during_a_capture() -> None:
    rt, stream, capturing = _Runtime(), [1], [False]
    warm = _stocked_path(rt, stream, capturing)
    q, k, v = make_qkv(1, (2, 2), (4, 4), 16, torch.float32)
    _plan_for(rt, q, k, v)
    on_one = warm(q, k, v, False, None)[1]
    stream[0] = 2
    on_two = warm(q, k, v, False, None)[1]
    assert on_one.untyped_storage().data_ptr() != on_two.untyped_storage().data_ptr()
    capturing[0] = True
    captured = warm(q, k, v, False, None)[1]
    assert captured._base is None and captured.untyped_storage().nbytes() == 4 * captured.numel()
    stream[0] = 1
    capturing[0] = False
    again = warm(q, k, v, False, None)[1]
    assert again.untyped_storage().data_ptr() == on_one.untyped_storage().data_ptr(), "stream 1's stock goes on"


def test_the_default_stream_skips_the_capture_check() -> None:
    rt, stream, capturing = _Runtime(), [0], [True]  # a capture claimed on stream 0, which CUDA never captures
    warm = _stocked_path(rt, stream, capturing)
    q, k, v = make_qkv(1, (2, 2), (4, 4), 16, torch.float32)
    _plan_for(rt, q, k, v)
    assert warm(q, k, v, False, None)[1]._base is not None, "stream 0's stock, without asking"


def test_a_big_lse_is_allocated_alone() -> None:
    rt, stream, capturing = _Runtime(), [1], [False]
    warm = _stocked_path(rt, stream, capturing)
    seqlen = hot.STOCK_BYTES // 4 // hot.MIN_STOCK  # (1, 1, seqlen): too big for MIN_STOCK in a block
    q, k, v = make_qkv(1, (1, 1), (seqlen, 16), 16, torch.float32)
    _plan_for(rt, q, k, v)
    lse = warm(q, k, v, False, None)[1]
    assert lse._base is None and lse.untyped_storage().nbytes() == 4 * seqlen


@on_gpu
def test_gpu_stocked_lse_tensors_keep_their_values() -> None:
    """Many calls' lse tensors (more than a stock holds), kept alive together, each equal to its own call's."""
    inputs = [make_qkv(1, (2, 2), (16, 16), 64, torch.bfloat16, device="cuda", seed=20 + i) for i in range(70)]
    lazytriton.attn_fwd(*inputs[0])
    results = [lazytriton.attn_fwd(*qkv) for qkv in inputs]
    for qkv, (out, lse) in zip(inputs, results, strict=True):
        expect_out, expect_lse = binding.forward(*qkv, binding.check(*qkv))  # the general path
        assert torch.equal(out, expect_out) and torch.equal(lse, expect_lse)


# ---------------------------------------------------------------------------
# Device memory kept across calls: none in an entry, none made during a CUDA graph capture. The "device" here is
# meta (``device_of`` swapped in the generated text's scope): what the warm path allocates on the call's device
# is a meta tensor, what it allocates on the host is a CPU one.

META = torch.device("meta")


def kept_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor ``value`` keeps through its lists, tuples, dicts and bound functions (an entry, a record)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, functools.partial):
        return kept_tensors(value.args) + kept_tensors(value.keywords)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [t for item in items for t in kept_tensors(item)]


def _on_meta(rt: _Runtime, result: str, capturing: list[bool]) -> Callable[..., Any]:
    return hot.generate("bhsd", result, cuda=False, get_runtime=lambda: rt, raw_stream=lambda di: 7,
                        is_capturing=lambda: capturing[0], device_of=lambda di: META)


def test_an_entry_described_during_a_capture_keeps_no_device_memory() -> None:
    rt, capturing = _Runtime(), [True]
    warm = _on_meta(rt, "forward", capturing)
    q, k, v = make_qkv(1, (2, 2), (4, 4), 16, torch.float32)
    _plan_for(rt, q, k, v)
    out, lse = warm(q, k, v, False, None)  # described now, in the (faked) capture
    assert lse.device == META and lse.shape == (1, 2, 4) and lse._base is None, "the call's own lse, on its device"
    (entry,) = warm.__globals__["SHAPES"].values()
    kept = kept_tensors(entry)
    assert kept and all(t.device.type == "cpu" for t in kept), "only host tensors (the lse template)"
    assert entry[hot.FIELD["lse_stocks"]] == {}, "no stock made during the capture"
    assert entry[hot.FIELD["lse_template"]].untyped_storage().nbytes() == 4
    capturing[0] = False
    stocked = warm(q, k, v, False, None)[1]
    assert stocked.device == META and stocked._base is not None, "a stock on the entry's device, once not capturing"
    assert {t.device for t in entry[hot.FIELD["lse_stocks"]][7]} == {META}


def test_the_spare_lse_is_a_temporary_during_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    capturing = [True]
    spare: dict[int, tuple[int, int]] = {}
    kept: list[torch.Tensor] = []
    monkeypatch.setattr(hot, "SPARE", spare)
    monkeypatch.setattr(hot, "_SPARE_KEPT", kept)
    monkeypatch.setattr(hot, "device_of", lambda di: META)
    monkeypatch.setattr(hot.launch, "capturing", lambda di: capturing[0])
    made = hot.spare_lse(0, 100)
    assert made.device == META and made.numel() == 100 and spare == {} and kept == [], "nothing kept in a capture"
    capturing[0] = False
    grown = hot.spare_lse(0, 100)
    assert spare[0][0] == 100 and kept == [grown], "kept, outside a capture"
    capturing[0] = True
    assert hot.spare_lse(0, 1000).numel() == 1000 and spare[0][0] == 100 and kept == [grown]


# ---------------------------------------------------------------------------
# flash_fwd_gluon's bit in the memo key: a gluon plan never serves a shape its tiles do not divide


def _key(sq: int, sk: int, causal: object = True, scale: float | None = None, d: int = 128,
         dtype: torch.dtype = torch.bfloat16, **kw: Any) -> tuple[Any, ...]:
    q, k, v = make_qkv(1, (2, 2), (sq, sk), d, dtype)
    call = binding.check(q, k, v, causal, scale)
    return binding.memo_key(-1, dtype, call.shape, call.causal != "none", True, False, offset=call.offset,
                            scale=call.scale, **kw)


def test_the_gluon_tail_marks_exactly_the_shapes_its_tiles_divide() -> None:
    fits = _key(256, 512)  # bf16, head dim 128, causal: flash_fwd.dispatch.GLUON_TABLE's ping-pong row, 128 x 128 tiles
    assert fits[-2:] == binding.GLUON_TAIL + (2,), "a program walks 2 query tiles (GLUON_Q_TILES' 8, halved to divide)"
    assert binding.gluon_key(fits) and _key(1024, 1024)[-2:] == binding.GLUON_TAIL + (8,)
    assert _key(4096, 4096)[-2:] == binding.GLUON_TAIL + (4,), "4 tiles a program at 4k (causal, paired)"
    assert _key(8192, 8192)[-1:] == binding.GLUON_TAIL, "one tile a program from 8k"
    whole = _key(1024, 1024)  # its bucket-mates: each count of tiles has its own key (and plan, and grid)
    assert _key(768, 1024) == whole[:-1] + (2,) and _key(640, 1024) == whole[:-2] + binding.GLUON_TAIL
    assert _key(250, 512) == fits[:-2]  # a bucket-mate the tiles do not divide: no tail
    assert _key(256, 500) == fits[:-2]
    assert not binding.gluon_key(_key(512, 256, "bottom_right"))  # rows without keys (offset < 0): flash_fwd
    assert binding.gluon_key(_key(256, 512, "bottom_right"))  # offset 256
    assert not binding.gluon_key(_key(256, 512, scale=-0.1))  # the kernel needs a positive scale
    assert binding.gluon_key(_key(256, 512, d=64))  # head dim 64 causal: ping-pong to 1k (GLUON_WIDE's bound)
    assert not binding.gluon_key(_key(256, 512, d=112))  # no row at 112: flash_fwd
    assert not binding.gluon_key(_key(256, 512, dtype=torch.float32))
    assert _key(256, 512, window=True)[-2:] == (True, False)  # windowed keys never carry the tail
    q, k, v = make_qkv(1, (2, 2), (256, 512), 128, torch.bfloat16)
    call = binding.check(q, k, v, True)
    assert binding.memo_key(-1, torch.bfloat16, call.shape, True, True, False) == fits[:-2]  # no offset: no tail


def test_gluon_by_default_false_takes_every_tail_away(monkeypatch: pytest.MonkeyPatch) -> None:


    monkeypatch.setattr(fwd_dispatch, "GLUON_BY_DEFAULT", False)
    assert not binding.gluon_key(_key(256, 512))


def test_the_warm_path_writes_the_gluon_tail_as_memo_key_does() -> None:
    """A plan stored under the key without the tail is not served for a shape that fits: the warm path
    asks for the tailed key (the general path's plan would be flash_fwd_gluon there)."""
    rt, spare = _Runtime(), torch.empty(1 << 16, dtype=torch.float32)
    warm = _cpu_paths(rt, spare)["forward_bhsd"]
    q, k, v = make_qkv(1, (2, 2), (256, 512), 128, torch.bfloat16)
    plain, tailed = _Recorder(True), _Recorder(True)
    key = _key(256, 512)
    rt.plans[key[:-1]] = (plain, 64)
    assert warm(q, k, v, True, None) is None
    rt.plans[key] = (tailed, 64)
    assert warm(q, k, v, True, None) is not None
    assert (len(plain.launches), len(tailed.launches)) == (0, 1)
