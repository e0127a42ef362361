"""The fused combine (``FUSED_COMBINE=true`` on flash_decode_split): one launch that equals the two kernels.

``dispatch.fusing_combine()`` turns it on for a block of calls. On CPU (Triton's interpreter) the fused call's out
and lse equal, bit for bit, those of the two-kernel call whose combine kernel takes its splits as many a step as
the fused combine does (``dispatch.combine_block_n``: each row's merge is then the same operations in the same
order), over split counts 1..64 (one split never fuses), GQA and MQA, contiguous, paged and gathered pages,
lengths from 1 to a few hundred (sequences shorter than the splits: splits with no key), several query rows and
row blocks, new keys, sinks, softcap, a window, ALiBi; the counters are all zero after every call. The warm path
launches the fused kernel alone, with the counters of the call's stream, and equals the general path bit for bit.
The counters: one buffer a (device, stream), grown by a new zeroed one, a captured call's own (fakes); the torch
op's calls (and so a compiled graph's) take counters of their own and keep none. On a GPU:
real sizes against float64, repeated calls give the same bits, a captured CUDA graph replayed three times, two
streams at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import gpu
from test_kvcache import check_against_reference, serving_cache
from test_kvcache_hot import (
    Interpreting,
    Recording,
    Runtime,
    _named,
    _roles,
    bits,
    cold,
    gpu_path,  # noqa: F401 (a fixture)
    warm,  # noqa: F401 (a fixture)
)

import lazytriton
from lazytriton.kernels.flash_decode import FLASH_DECODE_SPLIT, binding, checks, counters, dispatch
from lazytriton.kernels.request import Request

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")


@pytest.fixture
def fresh_counters(monkeypatch: pytest.MonkeyPatch) -> counters.Counters:
    """The binding's counters, empty for this test."""
    mine = counters.Counters()
    monkeypatch.setattr(counters, "COUNTERS", mine)
    return mine


def _all_zero(tickets: counters.Counters) -> bool:
    return all(int(buffer.abs().sum()) == 0 for buffer in tickets.buffers.values())


def make_call(seed: int, batch: int = 2, heads: tuple[int, int] = (8, 2), dims: tuple[int, int] = (32, 32),
              lens: tuple[int, ...] = (300, 5), page: int = 0, seqlen_q: int = 1, new: int = 0,
              **options: Any) -> dict[str, Any]:
    """A decoding call's arguments: ``lens`` cached keys a sequence, pages of ``page`` keys (0: contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    (hq, hk), (d, dv) = heads, dims
    capacity = max(lens) + new + 7

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    args: dict[str, Any] = {"q": randn(batch, seqlen_q, hq, d),
                            "cache_seqlens": torch.tensor(lens[:batch], dtype=torch.int32)}
    if page:
        per = -(-capacity // page)
        blocks = batch * per + 1
        args["k_cache"], args["v_cache"] = randn(blocks, page, hk, d), randn(blocks, page, hk, dv)
        args["block_table"] = torch.randperm(blocks, generator=gen)[:batch * per].view(batch, per).int()
    else:
        args["k_cache"], args["v_cache"] = randn(batch, capacity, hk, d), randn(batch, capacity, hk, dv)
    if new:
        args["k"], args["v"] = randn(batch, new, hk, d), randn(batch, new, hk, dv)
    if options.pop("sinks", False):
        args["sinks"] = randn(hq)
    if options.pop("alibi", False):
        args["alibi_slopes"] = torch.rand(hq, generator=gen)
    return {**args, **options}


def _stepped_like_the_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's combine kernel takes its splits as many a step as the fused combine (the GPU's rule)."""
    constexprs = binding.interpreter_constexprs

    def stepped(call: checks.Call, fused: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        split, combine = constexprs(call, fused)
        return split, {**combine, "BLOCK_N": dispatch.combine_block_n(combine["BLOCK_D"])}

    monkeypatch.setattr(binding, "interpreter_constexprs", stepped)


def both(args: dict[str, Any], splits: int, tickets: counters.Counters) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(two kernels, fused): each call's (out, lse, k_cache, v_cache) on its own copies; the counters zero after."""
    results = []
    for fused in (False, True):
        mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
        with dispatch.fusing_combine(fused):
            out, lse = lazytriton.flash_attn_with_kvcache(**mine, num_splits=splits, return_softmax_lse=True)
        results.append((out, lse, mine["k_cache"], mine["v_cache"]))
        assert _all_zero(tickets)
    assert bool(tickets.buffers) == (splits > 1), "counters are taken by fused calls of several splits only"
    return results[0], results[1]


def _equal_bits(want: tuple[Any, ...], got: tuple[Any, ...]) -> None:
    for name, w, g in zip(("out", "lse", "k_cache", "v_cache"), want, got, strict=True):
        assert w.dtype == g.dtype and w.shape == g.shape, name
        assert torch.equal(bits(w), bits(g)), name


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 8, 16, 31, 33, 64])
def test_fused_equals_two_kernels_over_split_counts(monkeypatch: pytest.MonkeyPatch,
                                                    fresh_counters: counters.Counters, splits: int) -> None:
    """GQA, a long and a short sequence (5 keys: most splits see none), 1..64 splits."""
    _stepped_like_the_fused(monkeypatch)
    want, got = both(make_call(splits), splits, fresh_counters)
    _equal_bits(want, got)


FEATURES = {
    "mqa-paged-sinks-softcap": dict(heads=(4, 1), page=16, lens=(200, 1), sinks=True, softcap=5.0),
    "gqa-rows-causal-window-alibi": dict(seqlen_q=5, lens=(130, 40), causal=True, window_size=(24, 0), alibi=True),
    "gathered-pages-value-dim": dict(page=3, lens=(90, 17), dims=(32, 16)),
    "new-keys-int-length": dict(batch=3, heads=(6, 3), new=2, lens=(60, 60, 60), causal=True),
    "one-key": dict(batch=1, lens=(1,), heads=(4, 4)),
    "empty-sequence-sinks": dict(lens=(0, 45), sinks=True),
}


@pytest.mark.parametrize("splits", [4, 64])
@pytest.mark.parametrize("name", list(FEATURES))
def test_fused_equals_two_kernels_with_features(monkeypatch: pytest.MonkeyPatch, fresh_counters: counters.Counters,
                                                name: str, splits: int) -> None:
    _stepped_like_the_fused(monkeypatch)
    args = make_call(splits, **FEATURES[name])
    if name.endswith("int-length"):
        args["cache_seqlens"] = 37  # an int: every sequence's cached length
    want, got = both(args, splits, fresh_counters)
    _equal_bits(want, got)


def test_fused_within_flash_attentions_rule_of_the_reference(fresh_counters: counters.Counters) -> None:
    """Against the float64 reference too (the interpreter's own combine steps in the two-kernel call)."""
    args = make_call(11, seqlen_q=3, lens=(150, 9))
    mine = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    with dispatch.fusing_combine():
        out, lse = lazytriton.flash_attn_with_kvcache(**mine, num_splits=7, return_softmax_lse=True, causal=True,
                                                      softcap=8.0)
    check_against_reference(args, (out, lse, mine["k_cache"], mine["v_cache"]), causal=True, softcap=8.0)
    assert _all_zero(fresh_counters) and fresh_counters.buffers


# ---------------------------------------------------------------------------
# The variant and the plan


def test_the_flag_is_written_only_when_on() -> None:
    from lazytriton.target import Target
    from lazytriton.variant import check_fields

    sm90 = Target.parse("sm_90")
    plain = dispatch.decode_variant("flash_decode_split", sm90, "bf16", 128, False, True, 4, 4096)
    fused = dispatch.decode_variant("flash_decode_split", sm90, "bf16", 128, False, True, 4, 4096,
                                    fused_combine=True)
    assert "FUSED_COMBINE" not in str(plain) and "FUSED_COMBINE=true" in str(fused)
    assert str(fused).replace("FUSED_COMBINE=true,", "") == str(plain)  # the same tiles
    assert check_fields(plain) is plain and check_fields(fused) is fused
    combine = dispatch.decode_variant("flash_decode_combine", sm90, "bf16", 128, False, True, 4, 4096,
                                      fused_combine=True)
    assert "FUSED_COMBINE" not in str(combine)
    request = Request("bf16", 128, False, True, 4, 4096)
    with dispatch.fusing_combine():
        assert dispatch.variant("flash_decode_split", sm90, request) == fused
    assert dispatch.variant("flash_decode_split", sm90, request) == plain  # off by default: the two kernels
    assert dispatch.FUSED_COMBINE_BY_DEFAULT is False


def test_a_fused_plan_loads_the_split_kernel_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from lazytriton import launch, runtime

    rt = Runtime()
    loaded: list[str] = []
    monkeypatch.setattr(runtime, "get", lambda: rt)
    monkeypatch.setattr(launch.machine, "target_of_device", lambda device: launch.Target.parse("sm_90"))
    monkeypatch.setattr(launch, "capturing", lambda device_index: False)
    rt.kernel = lambda variant, index: loaded.append(str(variant)) or variant  # type: ignore[attr-defined]
    args = make_call(1)
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], None, None, args["cache_seqlens"], None, None)
    call = checks.check(t, None, False)
    entry = binding.plan(torch.device("cpu"), torch.float32, call, True, False, fused=True)
    assert len(loaded) == 1 and "FUSED_COMBINE=true" in loaded[0]
    assert entry[3:] == (binding.FUSED, binding.FUSED)
    assert binding.memo_key(None, torch.float32, call, True, False, True)[-1] == binding.FUSED_TAG[0]
    assert binding.FUSED_TAG[0] not in binding.memo_key(None, torch.float32, call, True, False)


# ---------------------------------------------------------------------------
# The warm path


def _memoise_fused(rt: Runtime, args: dict[str, Any], split: Any, block_n: int = 16) -> None:
    """The general path's fused plans for a call, both alignments: (split kernel, 16, block_n, FUSED, FUSED)."""
    t = checks.Inputs(args["q"], args["k_cache"], args["v_cache"], args.get("k"), args.get("v"),
                      args.get("cache_seqlens"), None, args.get("block_table"))
    call = checks.check(t, None, args.get("causal", False), num_splits=args.get("num_splits", 0))
    out, _ = binding.empty_outputs(t.q, call)
    _, index64 = binding.layout_flags(t, out)
    for aligned in (False, True):
        rt.plans[binding.memo_key(None, t.q.dtype, call, aligned, index64, True)] = (split, 16, block_n,
                                                                                    binding.FUSED, binding.FUSED)


def _served_call(splits: int) -> dict[str, Any]:
    return {**make_call(splits, lens=(70, 3), page=16), "num_splits": splits, "causal": True}


@pytest.mark.parametrize("splits", [1, 5])
def test_the_warm_path_launches_the_fused_kernel_alone(gpu_path: tuple[Runtime, list[bool]],  # noqa: F811
                                                       splits: int) -> None:
    rt, served = gpu_path
    log: list[tuple[Any, ...]] = []
    args = _served_call(splits)
    _memoise_fused(rt, args, Recording(FLASH_DECODE_SPLIT.name, log, True), block_n=64)
    counters.COUNTERS.buffers.clear()
    with dispatch.fusing_combine(), lazytriton.trusted_indices():
        result = cold(args)
        named = {**_named(args, result), **{b.data_ptr(): "counters" for b in counters.COUNTERS.buffers.values()}}
        want = _roles(log, named)
        for _ in range(2):  # the first call describes the shape, the second finds it
            log.clear()
            result = lazytriton.flash_attn_with_kvcache(**args)
            named = {**_named(args, result), **{b.data_ptr(): "counters" for b in counters.COUNTERS.buffers.values()}}
            assert _roles(log, named) == want
    assert served == [True, True]
    assert [launch[0] for launch in want] == [FLASH_DECODE_SPLIT.name]  # one launch, no combine
    ints = want[0][4]
    pointer = ints[binding.SPLIT_INT_PARAMS.index("Counters")]
    # One split takes no counters: lse's pointer stands in, unread.
    assert pointer == ("counters" if splits > 1 else ints[binding.SPLIT_INT_PARAMS.index("Lse")])


def test_the_warm_path_reads_the_switch_on_every_call(gpu_path: tuple[Runtime, list[bool]]) -> None:  # noqa: F811
    """Fused and two-kernel calls of one shape, interleaved: each finds its own entry and plans."""
    rt, served = gpu_path
    log: list[tuple[Any, ...]] = []
    args = _served_call(5)
    from test_kvcache_hot import memoise, recording

    memoise(rt, args, recording(log, True), tiles=(16, 64, 16))
    _memoise_fused(rt, args, Recording(FLASH_DECODE_SPLIT.name, log, True), block_n=64)
    for fused in (False, True, False, True):
        log.clear()
        with dispatch.fusing_combine(fused), lazytriton.trusted_indices():
            lazytriton.flash_attn_with_kvcache(**args)
        assert len(log) == (1 if fused else 2)
    assert all(served)


def test_warm_fused_calls_equal_the_general_path_bit_for_bit(warm: tuple[Runtime, list[bool]]) -> None:  # noqa: F811
    rt, served = warm
    args = _served_call(6)
    call = checks.check(checks.Inputs(args["q"], args["k_cache"], args["v_cache"], None, None, args["cache_seqlens"],
                                      None, args["block_table"]), None, True, num_splits=6)
    split_c, _ = binding.interpreter_constexprs(call, fused=True)
    _memoise_fused(rt, args, Interpreting(FLASH_DECODE_SPLIT.name, args["q"].dtype, split_c))
    counters.COUNTERS.buffers.clear()
    with dispatch.fusing_combine():
        want = cold(args, return_softmax_lse=True)
        for _ in range(2):
            got = lazytriton.flash_attn_with_kvcache(**args, return_softmax_lse=True)
            assert all(torch.equal(bits(w), bits(g)) for w, g in zip(want, got, strict=True))
            assert _all_zero(counters.COUNTERS)
    assert served == [True, True]


# ---------------------------------------------------------------------------
# The counters


def test_one_buffer_a_stream_grown_by_a_new_zeroed_one() -> None:
    made: list[int] = []

    def zeros(n: int, device: torch.device) -> torch.Tensor:
        made.append(n)
        return torch.zeros(n, dtype=torch.int32)

    tickets = counters.Counters(capturing=lambda index: False, zeros=zeros)
    cuda = torch.device("cuda", 0)
    first = tickets.get(cuda, 0, 11, 10)
    assert tickets.get(cuda, 0, 11, counters.MIN_COUNTERS) is first  # reused while it holds enough
    other = tickets.get(cuda, 0, 12, 10)
    assert other is not first  # another stream: another buffer
    assert tickets.get(cuda, 1, 11, 10) is not first  # another device too
    grown = tickets.get(cuda, 0, 11, counters.MIN_COUNTERS + 1)
    assert grown is not first and tickets.get(cuda, 0, 11, 5) is grown
    assert made == [counters.MIN_COUNTERS] * 3 + [2 * counters.MIN_COUNTERS]


def test_a_captured_call_gets_counters_of_its_own() -> None:
    """Under a CUDA graph capture: a new zeroed buffer a call (the graph's), never the stream's, never kept."""
    capturing = {0: False}
    made: list[torch.Tensor] = []

    def zeros(n: int, device: torch.device) -> torch.Tensor:
        made.append(torch.zeros(n, dtype=torch.int32))
        return made[-1]

    tickets = counters.Counters(capturing=lambda index: capturing[index], zeros=zeros)
    cuda = torch.device("cuda", 0)
    eager = tickets.get(cuda, 0, 7, 64)
    capturing[0] = True
    captured = [tickets.get(cuda, 0, 7, 64) for _ in range(2)]
    assert captured[0] is not captured[1] and all(c is not eager for c in captured)
    assert [c.numel() for c in captured] == [64, 64]  # exactly what the call takes
    assert list(tickets.buffers.values()) == [eager]
    capturing[0] = False
    assert tickets.get(cuda, 0, 7, 64) is eager
    cpu = torch.device("cpu")
    capturing[-1] = True  # never asked for a CPU call
    assert tickets.get(cpu, -1, 0, 8) is tickets.get(cpu, -1, 0, 8)


def test_a_call_of_its_own_gets_new_counters_and_keeps_none() -> None:
    """``own``: a new zeroed buffer of exactly what the call takes, on a GPU or the CPU, never the stream's."""
    made: list[torch.Tensor] = []

    def zeros(n: int, device: torch.device) -> torch.Tensor:
        made.append(torch.zeros(n, dtype=torch.int32))
        return made[-1]

    tickets = counters.Counters(capturing=lambda index: False, zeros=zeros)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    owned = [tickets.get(device, index, 7, 64, own=True) for device, index in ((cuda, 0), (cuda, 0), (cpu, -1))]
    assert len({id(t) for t in owned}) == 3 and [t.numel() for t in owned] == [64] * 3
    assert tickets.buffers == {}, "nothing kept"
    eager = tickets.get(cuda, 0, 7, 64)
    assert tickets.get(cuda, 0, 7, 64, own=True) is not eager and list(tickets.buffers.values()) == [eager]


def _op_read(args: dict[str, Any], splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The read-only torch op of the call (what a compiled graph runs), its arguments in the op's order."""
    from lazytriton import kvcache_op  # noqa: F401 (registers the ops)

    return torch.ops.lazytriton.flash_kvcache_read(args["q"], args["k_cache"], args["v_cache"], None, None,
                                                   args["cache_seqlens"], -1, None, args.get("block_table"),
                                                   args["q"].shape[-1] ** -0.5, False, -1, -1, 0.0, None, splits)


def test_the_ops_calls_keep_no_counters(fresh_counters: counters.Counters) -> None:
    """The op (compiled graphs' form, which cudagraph trees warm up and record) takes counters of its own.

    Its out and lse are the eager call's bit for bit; only the eager call keeps a buffer (its stream's).
    """
    args = make_call(3, page=16, lens=(120, 7))
    with dispatch.fusing_combine():
        got = [_op_read(args, 6) for _ in range(2)]
        assert fresh_counters.buffers == {}, "the op keeps no counters"
        want = lazytriton.flash_attn_with_kvcache(**args, num_splits=6, return_softmax_lse=True)
    assert len(fresh_counters.buffers) == 1 and _all_zero(fresh_counters)
    for g in got:
        assert all(torch.equal(bits(w), bits(x)) for w, x in zip(want, g, strict=True))


def test_a_compiled_fused_call_keeps_no_counters(fresh_counters: counters.Counters) -> None:
    """torch.compile's graph runs the op: the fused call in it keeps no counters, and equals the eager call."""
    torch._dynamo.reset()
    args = make_call(5, lens=(90, 30))

    def read(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,  # type: ignore[no-any-return]
                                                 num_splits=4)

    inputs = (args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"])
    with dispatch.fusing_combine():
        got = torch.compile(read, fullgraph=True, backend="aot_eager")(*inputs)
        assert fresh_counters.buffers == {}, "the compiled call keeps no counters"
        want = read(*inputs)
    assert torch.equal(bits(got), bits(want)) and len(fresh_counters.buffers) == 1


def test_the_c_api_passes_lse_for_the_counters() -> None:
    """The C launcher leaves FUSED_COMBINE off: lse's pointer, unread, as for the key mask."""
    items = binding.c_initializer(FLASH_DECODE_SPLIT.name).split(", ")
    assert items[binding.SPLIT_INT_PARAMS.index("Counters")] == "LT__PTR(p->lse)"


# ---------------------------------------------------------------------------
# On a GPU


@pytest.fixture
def on_gpu() -> Iterator[None]:
    with dispatch.fusing_combine():
        yield


def _gpu_args(batch: int, length: int, paged: bool, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(seed + batch + length)
    q = torch.randn(batch, 1, 32, 128, device="cuda", generator=gen).bfloat16()
    capacity = -(-max(length, 256) // 256) * 256  # whole pages of 256 keys for each sequence
    k_cache, table = serving_cache(batch, capacity, paged, gen)
    lens = torch.randint(1, length + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    lens[0] = length
    return {"q": q, "k_cache": k_cache, "v_cache": torch.randn_like(k_cache), "cache_seqlens": lens,
            "block_table": table}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize(("batch", "length", "splits"), [(1, 1024, 0), (1, 16384, 0), (8, 4096, 0), (1, 4096, 64),
                                                         (4, 333, 37)])
def test_gpu_fused_against_float64(on_gpu: None, paged: bool, batch: int, length: int, splits: int) -> None:
    args = _gpu_args(batch, length, paged)
    out, lse = lazytriton.flash_attn_with_kvcache(**args, num_splits=splits, return_softmax_lse=True)
    cpu = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in args.items()}
    check_against_reference(cpu, (out.cpu(), lse.cpu(), cpu["k_cache"], cpu["v_cache"]))
    assert _all_zero(counters.COUNTERS)


@gpu
@pytest.mark.gpu
def test_gpu_fused_with_sinks_equals_two_kernels() -> None:
    args = _gpu_args(2, 8192, False)
    args["sinks"] = torch.randn(32, device="cuda")
    want = lazytriton.flash_attn_with_kvcache(**args, return_softmax_lse=True)
    with dispatch.fusing_combine():
        got = lazytriton.flash_attn_with_kvcache(**args, return_softmax_lse=True)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)


@gpu
@pytest.mark.gpu
def test_gpu_repeated_fused_calls_give_the_same_bits(on_gpu: None) -> None:
    args = _gpu_args(1, 16384, False)
    first = lazytriton.flash_attn_with_kvcache(**args, return_softmax_lse=True)
    for _ in range(20):
        again = lazytriton.flash_attn_with_kvcache(**args, return_softmax_lse=True)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(first, again, strict=True))
    torch.cuda.synchronize()
    assert _all_zero(counters.COUNTERS)


@gpu
@pytest.mark.gpu
def test_gpu_fused_calls_in_a_cuda_graph_replayed_three_times(on_gpu: None) -> None:
    args = _gpu_args(4, 4096, True)
    lens = args["cache_seqlens"]
    lazytriton.flash_attn_with_kvcache(**args, num_splits=16)  # load
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lazytriton.flash_attn_with_kvcache(**args, num_splits=16)
        again = lazytriton.flash_attn_with_kvcache(**args, num_splits=16)  # two calls, each its own counters
    for step in range(3):
        lens.copy_(torch.randint(1, 4097, lens.shape, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        with dispatch.fusing_combine(False):
            want = lazytriton.flash_attn_with_kvcache(**args, num_splits=16)
        torch.testing.assert_close(out, want, rtol=0, atol=2e-2, msg=f"replay {step}")
        assert torch.equal(bits(out), bits(again))


@gpu
@pytest.mark.gpu
def test_gpu_two_streams_at_once(on_gpu: None) -> None:
    cases = [_gpu_args(2, 8192, paged, seed) for paged, seed in ((False, 1), (True, 2))]
    want = [lazytriton.flash_attn_with_kvcache(**args) for args in cases]
    streams = [torch.cuda.Stream() for _ in cases]
    torch.cuda.synchronize()
    got: list[list[torch.Tensor]] = [[], []]
    for _ in range(20):
        for i, (args, stream) in enumerate(zip(cases, streams, strict=True)):
            with torch.cuda.stream(stream):
                got[i].append(lazytriton.flash_attn_with_kvcache(**args))
    torch.cuda.synchronize()
    for w, outs in zip(want, got, strict=True):
        assert all(torch.equal(bits(w), bits(o)) for o in outs)
    mine = [key for key in counters.COUNTERS.buffers if key[1] in {s.cuda_stream for s in streams}]
    assert len(mine) == 2 and _all_zero(counters.COUNTERS)  # a buffer each stream
