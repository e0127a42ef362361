"""The FP8 forward's warm path (kernels/flash_fwd/fp8_hot.py) against its general path: same launch, same checks.

On CPU, the warm path made for CPU tensors (``cuda=False``) launches into a
recording kernel: every integer it passes equals ``fp8.pack``'s for the same
call, V's copy holds V transposed as ``fp8.transposed_v`` writes it (its keys in
the order the plan's kernel reads), a second
identical call runs no check, no packing and no plan, and bad input still
raises the general path's error before any launch. On a GPU, a warm call gives
the general path's outputs bit for bit and FlashAttention-3's rule against
float64.
"""

from __future__ import annotations

import ctypes
import inspect
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_flash_fwd import on_gpu
from test_fp8_fwd import assert_fa3_rule, reference

import lazytriton
from lazytriton import launch
from lazytriton.kernels.flash_fwd import binding, fp8, fp8_hot
from lazytriton.kernels.flash_fwd import grid as fwd_grid

E4M3 = torch.float8_e4m3fn
_V = fp8.INT_PARAMS.index("V")
_LSE = fp8.INT_PARAMS.index("Lse")
_V_STRIDES = tuple(fp8.INT_PARAMS.index(name) for name in ("stride_vb", "stride_vh", "stride_vs"))


class _Recorder:
    """Stands in for a LoadedKernel: records each launch, and V's transposed copy as the kernel would read it."""

    def __init__(self, fast: bool, v_shape: tuple[int, int, int, int]) -> None:
        self.launches: list[tuple[Any, ...]] = []
        self.v_copies: list[torch.Tensor] = []
        self.v_shape = v_shape  # (batch, heads_k, head_dim_v, seqlen_k): the kernel's view of V
        self.fast = self._fast if fast else None

    def _read_v(self, ints: tuple[int, ...]) -> None:
        strides = tuple(ints[i] for i in _V_STRIDES) + (1,)
        extent = 1 + sum((n - 1) * s for n, s in zip(self.v_shape, strides, strict=True))
        raw = torch.frombuffer(bytearray(ctypes.string_at(ints[_V], extent)), dtype=torch.uint8)
        self.v_copies.append(raw.as_strided(self.v_shape, strides).clone())

    def _fast(self, gx: int, gy: int, gz: int, stream: int, ints: tuple[int, ...], floats: tuple[float, ...]) -> int:
        self._read_v(ints)
        self.launches.append(((gx, gy, gz), stream, ints, floats))
        return 0

    def launch(self, grid: Any, stream: int, ints: Any, floats: Any, scratch: Any = None) -> None:
        self._read_v(tuple(ints))
        self.launches.append((tuple(grid), stream, tuple(ints), tuple(floats)))

    def fail(self, status: int, grid: Any) -> None:
        raise AssertionError(status)


class _Runtime:
    def __init__(self) -> None:
        self.plans: dict[Any, Any] = {}


STREAM = 0x5EED


def _warm(rt: _Runtime, spare: torch.Tensor) -> dict[str, Callable[..., Any]]:
    """The module's warm paths, made for CPU tensors against ``rt``'s plans."""
    spares = {-1: (spare.numel(), spare.data_ptr())}
    return {f"{result}_{layout}": fp8_hot.make(layout, result, cuda=False, get_runtime=lambda: rt,
                                               raw_stream=lambda di: STREAM, spare=spares)
            for layout, result in (("bhsd", "forward"), ("bshd", "forward"), ("bshd", "output"))}


def _fp8(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(E4M3)


def _descales(form: str, b: int, hk: int, seed: int) -> tuple[Any, Any, Any]:
    gen = torch.Generator().manual_seed(seed)
    made = [torch.rand(b, hk, generator=gen) * 2 + 0.05 for _ in range(3)]
    return {"none": (None, None, None), "per_head": tuple(made), "one": tuple(m[0, :1] for m in made),
            "scalar": tuple(m[0, 0] for m in made), "mixed": (made[0], None, made[2][0, 0]),
            "strided": tuple(torch.cat([m, m], dim=1)[:, ::2] for m in made)}[form]


def _inputs(layout: str, b: int, hq: int, hk: int, sq: int, sk: int, d: int, dv: int, strided: bool,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in ``layout``, fresh random values; ``strided``: every other head-dim column of a wider tensor."""
    q, k, v = _fp8(b, hq, sq, d, seed=seed), _fp8(b, hk, sk, d, seed=seed + 1), _fp8(b, hk, sk, dv, seed=seed + 2)
    if strided:
        q, k, v = (torch.cat([t, t], dim=-1)[..., :t.shape[-1]] for t in (q, k, v))
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) if strided else t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v


def _view(layout: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return fp8_hot.LAYOUTS[layout]


def _memoise(rt: _Runtime, kernel: _Recorder, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             call: binding.Call, given: tuple[Any, Any, Any], block_m: int = 32,
             operand_order: bool = False) -> tuple[Any, ...]:
    """The plan the general path would memoise for this call (its memo key), as ``kernel``; pack's view of it."""
    out, lse = fp8.empty_outputs(q, call.dv)
    vt = fp8.transposed_v(v, operand_order)
    scales = fp8.descales(given, q, call.shape.batch, call.shape.heads_k)
    ints, aligned, index64 = fp8.pack(q, k, vt, out, lse, call, scales)
    key = fp8.memo_key(None, call, call.shape, aligned, index64, dtype=binding.FP8_DTYPES[q.dtype])
    rt.plans[key] = (kernel, block_m, operand_order)
    return out, lse, vt, scales


# (layout, batch, heads (q, k), seqlens (q, k), head dims (qk, v), causal, scale, descales, features, strided)
CASES = [
    ("bhsd", 2, (4, 2), (70, 70), (64, 64), "bottom_right", None, "per_head", None, False),
    ("bshd", 1, (4, 2), (48, 64), (64, 64), "bottom_right", None, "one", None, False),
    ("bshd", 2, (2, 1), (33, 37), (96, 96), False, 0.3, "none", None, False),  # 37 keys: V's rows padded to 48
    ("bhsd", 1, (2, 2), (40, 90), (128, 64), "top_left", None, "mixed", None, False),  # v's head dim differs
    ("bhsd", 1, (2, 1), (64, 80), (64, 64), "bottom_right", None, "strided", ((20, 0), 3.0, 16), False),
    ("bshd", 2, (3, 3), (17, 33), (32, 32), "bottom_right", None, "scalar", None, True),
    ("bhsd", 1, (2, 2), (9, 5), (16, 16), False, 0.5, "per_head", None, True),
]


@pytest.mark.parametrize("fast", [True, False], ids=["helper", "abi"])
@pytest.mark.parametrize(("case", "result"), [  # out alone: flash_attn_func's layout only
    (case, result) for case in CASES for result in ("forward", "output") if case[0] == "bshd" or result == "forward"],
    ids=str)
def test_warm_fp8_call_launches_what_the_binding_packs(case: tuple[Any, ...], result: str, fast: bool) -> None:
    layout, b, (hq, hk), (sq, sk), (d, dv), causal, scale, form, features, strided = case
    window, softcap, chunk = features or (binding.NO_WINDOW, 0.0, 0)
    seed = sq * 7 + sk
    q, k, v = _inputs(layout, b, hq, hk, sq, sk, d, dv, strided, seed)
    given = _descales(form, b, hk, seed)
    rt, spare = _Runtime(), torch.empty(1 << 14, dtype=torch.float32)
    warm = _warm(rt, spare)[f"{result}_{layout}"]
    view = _view(layout)
    args = (q, k, v, causal, scale, given, window, softcap, chunk)
    call = fp8.checked(view(q), view(k), view(v), causal, scale, binding.NAMES, window, softcap, chunk, given, {})
    assert warm(*args) is None  # described, but no plan memoised yet: the general path's turn
    kernel = _Recorder(fast, (b, hk, dv, sk))
    out0, lse0, vt0, scales = _memoise(rt, kernel, view(q), view(k), view(v), call, given)
    for _ in range(2):  # the first call after the plan finds it, the second is served from the entry as it is
        served = warm(*args)
        assert served is not None
        out, lse = served if result == "forward" else (served, None)
        assert out.dtype == torch.bfloat16 and view(out).shape == out0.shape and view(out).stride() == out0.stride()
        if lse is not None:
            assert lse.shape == lse0.shape and lse.stride() == lse0.stride() and lse.dtype == torch.float32
        grid, stream, ints, floats = kernel.launches[-1]
        expected = list(fp8.pack(view(q), view(k), vt0, view(out), lse0 if lse is None else lse, call, scales)[0])
        expected[_V] = ints[_V]  # the warm path's own copy of V (checked below, byte for byte)
        if lse is None:
            expected[_LSE] = spare.data_ptr()  # out alone: lse written into the spare buffer
        assert ints == tuple(expected), "every int and pointer, in flash_fwd_fp8's order, V's strides included"
        assert torch.equal(kernel.v_copies[-1], view(v).transpose(2, 3).view(torch.uint8))
        assert floats == fp8.floats(call) and grid == fwd_grid(sq, hq, b, 32) and stream == STREAM
    assert len(kernel.launches) == 2


def test_warm_fp8_call_takes_the_unaligned_plan_for_an_unaligned_pointer() -> None:
    rt, spare = _Runtime(), torch.empty(1 << 12, dtype=torch.float32)
    warm = _warm(rt, spare)["forward_bhsd"]
    base = _fp8(2 * 16 * 64 + 1, seed=1)
    q = base[1:].view(1, 2, 16, 64)  # one byte on: the pointer is not 16-byte aligned, the strides are
    k = v = base[:-1].view(1, 2, 16, 64)
    call = fp8.checked(q, k, v, False, None, binding.NAMES, binding.NO_WINDOW, 0.0, 0, (None,) * 3, {})
    kernels = {flag: _Recorder(True, (1, 2, 64, 16)) for flag in (True, False)}
    for flag, kernel in kernels.items():
        rt.plans[fp8.memo_key(None, call, call.shape, flag, False, dtype="e4m3")] = (kernel, 32, False)
    assert warm(q, k, v, False, None, (None,) * 3) is not None
    assert (len(kernels[True].launches), len(kernels[False].launches)) == (0, 1)
    assert warm(k, k, v, False, None, (None,) * 3) is not None  # the same sizes and strides: one entry, both plans
    assert (len(kernels[True].launches), len(kernels[False].launches)) == (1, 1)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_warm_fp8_call_writes_v_in_the_key_order_its_plans_kernel_reads(layout: str) -> None:
    """A plan of flash_fwd_fp8_gluon (its last item True): V's copy in operand order, as the general path writes it."""
    b, hq, hk, sq, sk, d = 2, 4, 2, 16, 96, 32
    q, k, v = _inputs(layout, b, hq, hk, sq, sk, d, d, False, seed=5)
    rt, spare = _Runtime(), torch.empty(1 << 12, dtype=torch.float32)
    warm = _warm(rt, spare)[f"forward_{layout}"]
    view = _view(layout)
    call = fp8.checked(view(q), view(k), view(v), False, None, binding.NAMES, binding.NO_WINDOW, 0.0, 0,
                       (None,) * 3, {})
    assert warm(q, k, v, False, None, (None,) * 3) is None
    kernel = _Recorder(True, (b, hk, d, sk))
    _, _, vt0, _ = _memoise(rt, kernel, view(q), view(k), view(v), call, (None,) * 3, operand_order=True)
    assert warm(q, k, v, False, None, (None,) * 3) is not None
    copied = kernel.v_copies[-1]
    assert torch.equal(copied, vt0.view(torch.uint8))
    assert not torch.equal(copied, view(v).transpose(2, 3).view(torch.uint8))
    # position 16a + 4q + 2b + e of every 32 keys holds key 16a + 8b + 2q + e
    keys = [32 * c + 16 * a + 8 * bb + 2 * qq + e for c in range(sk // 32) for a in range(2) for qq in range(4)
            for bb in range(2) for e in range(2)]
    assert torch.equal(copied, view(v).transpose(2, 3)[..., keys].view(torch.uint8))


def test_an_entry_without_descales_keeps_no_tensor_but_its_host_lse_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """Described in a (faked) CUDA graph capture and without a preload: nothing made for an absent descale.

    cudagraph trees warm up and record the FP8 op, which reaches this warm path, with their allocations in the
    graph's pool: an entry keeps only the host lse template, and the launch passes null descale pointers.
    """
    monkeypatch.setattr(launch, "capturing", lambda device_index: True)
    rt, spare = _Runtime(), torch.empty(1 << 12, dtype=torch.float32)
    warm = _warm(rt, spare)["forward_bhsd"]
    q, k, v = (_fp8(1, 2, 16, 32, seed=i) for i in range(3))
    call = fp8.checked(q, k, v, False, None, binding.NAMES, binding.NO_WINDOW, 0.0, 0, (None,) * 3, {})
    kernel = _Recorder(True, (1, 2, 32, 16))
    _memoise(rt, kernel, q, k, v, call, (None,) * 3)
    assert warm(q, k, v, False, None, (None,) * 3) is not None
    (entry,) = inspect.getclosurevars(warm).nonlocals["shapes"].values()
    kept = [getattr(entry, name) for name in entry.__slots__ if isinstance(getattr(entry, name), torch.Tensor)]
    assert kept == [entry.lse_template] and entry.lse_template.device.type == "cpu"
    ints = kernel.launches[-1][2]
    assert [ints[fp8.INT_PARAMS.index(name)] for name in ("Q_descale", "K_descale", "V_descale")] == [0, 0, 0]


def test_warm_fp8_call_describes_again_after_the_runtime_changes() -> None:
    rt, spare = _Runtime(), torch.empty(1 << 12, dtype=torch.float32)
    warm = _warm(rt, spare)["forward_bhsd"]
    q, k, v = (_fp8(1, 2, 16, 32, seed=i) for i in range(3))
    call = fp8.checked(q, k, v, False, None, binding.NAMES, binding.NO_WINDOW, 0.0, 0, (None,) * 3, {})
    first, second = _Recorder(True, (1, 2, 32, 16)), _Recorder(True, (1, 2, 32, 16))
    _memoise(rt, first, q, k, v, call, (None,) * 3)
    assert warm(q, k, v, False, None, (None,) * 3) is not None
    rt.plans = {}  # a rebuilt runtime's memo
    _memoise(rt, second, q, k, v, call, (None,) * 3)
    assert warm(q, k, v, False, None, (None,) * 3) is not None
    assert (len(first.launches), len(second.launches)) == (1, 1)


@pytest.mark.parametrize("odd", [
    {"causal": 1}, {"causal": "both"}, {"scale": True}, {"scale": 1}, {"scale": float("nan")},
    {"window": (True, 0)}, {"window": [-1, -1]}, {"softcap": 0}, {"chunk": True}, {"q_grad": True},
    {"descale_grad": True}, {"descale_dtype": torch.float64}, {"descale_shape": (2, 2)}, {"k_dtype": torch.bfloat16},
    {"v_rows": 8},
], ids=str)
def test_warm_fp8_call_declines_what_the_general_path_must_see(odd: dict[str, Any]) -> None:
    """Look-alikes of a described call (equal as dict keys, or refused by the checks) are never served."""
    rt, spare = _Runtime(), torch.empty(1 << 12, dtype=torch.float32)
    warm = _warm(rt, spare)["forward_bhsd"]
    q, k, v = (_fp8(1, 2, 16, 32, seed=i) for i in range(3))
    one = torch.ones(1, 2)
    good = dict(causal=True, scale=1.0, window=(1, 0), softcap=0.0, chunk=1)
    kernel = _Recorder(True, (1, 2, 32, 16))
    for causal in (True, False):
        call = fp8.checked(q, k, v, causal, 1.0, binding.NAMES, (1, 0), 0.0, 1, (one,) * 3, {})
        _memoise(rt, kernel, q, k, v, call, (one,) * 3)
    assert warm(q, k, v, given=(one,) * 3, **good) is not None  # described and served
    args = {**good, **{name: value for name, value in odd.items() if name in good}}
    descale = one
    if "descale_grad" in odd:
        descale = one.clone().requires_grad_()
    if "descale_dtype" in odd:
        descale = one.to(odd["descale_dtype"])
    if "descale_shape" in odd:
        descale = torch.ones(odd["descale_shape"])
    if "q_grad" in odd:
        q = q.clone().requires_grad_()
    if "k_dtype" in odd:
        k = k.to(odd["k_dtype"])
    if "v_rows" in odd:
        v = v[:, :, :odd["v_rows"]]
    assert warm(q, k, v, given=(one, one, descale), **args) is None
    assert len(kernel.launches) == 1


# ---------------------------------------------------------------------------
# The public functions and the op, with the CPU warm paths in place


@pytest.fixture
def cpu_warm(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Runtime]:
    """fp8_hot's warm paths made for CPU tensors, in place of the module's; their runtime."""
    rt, spare = _Runtime(), torch.empty(1 << 14, dtype=torch.float32)
    for name, made in _warm(rt, spare).items():
        monkeypatch.setattr(fp8_hot, name, made)
    yield rt


def _count(monkeypatch: pytest.MonkeyPatch, counts: Counter[str]) -> None:
    """Count each call of the checks, the packing, describe, planning and the general path's forward."""
    for module, name in ((fp8, "checked"), (fp8, "pack"), (fp8, "forward"), (fp8, "descales"),
                         (fp8_hot, "describe"), (launch, "plan"), (binding, "check")):
        original = getattr(module, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


def _call_kinds() -> dict[str, Callable[..., Any]]:
    from lazytriton.fp8_op import flash_fwd_fp8_op

    return {
        "flash_attn_func": lambda q, k, v, s: lazytriton.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, q_descale=s[0], k_descale=s[1],
            v_descale=s[2]),
        "flash_attn_func, lse": lambda q, k, v, s: lazytriton.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, q_descale=s[0], k_descale=s[1],
            v_descale=s[2], return_attn_probs=True),
        "attn_fwd": lambda q, k, v, s: lazytriton.attn_fwd(q, k, v, causal="bottom_right", q_descale=s[0],
                                                           k_descale=s[1], v_descale=s[2]),
        "op": lambda q, k, v, s: flash_fwd_fp8_op(q, k, v, *s, 0.125, "bottom_right"),
    }


@pytest.mark.parametrize("form", ["per_head", "none"])
@pytest.mark.parametrize("kind", list(_call_kinds()))
def test_second_identical_fp8_call_runs_no_check_and_no_plan(kind: str, form: str, cpu_warm: _Runtime,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = (_fp8(2, h, 48, 64, seed=i) for i, h in enumerate((4, 2, 2)))  # (B, H, S, D) storage
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # flash_attn_func's memory
    given = _descales(form, 2, 2, seed=5)
    call = fp8.checked(q, k, v, "bottom_right", 0.125, binding.NAMES, binding.NO_WINDOW, 0.0, 0, given, {})
    kernel = _Recorder(True, (2, 2, 64, 48))
    _memoise(cpu_warm, kernel, q, k, v, call, given)
    counts: Counter[str] = Counter()
    _count(monkeypatch, counts)
    run = _call_kinds()[kind]
    run(q, k, v, given)  # the first call of the shape: described (the checks and pack, once), then served
    assert counts == Counter(describe=1, checked=1, check=1, pack=1, descales=1) and len(kernel.launches) == 1
    counts.clear()
    for _ in range(3):
        run(q, k, v, given)
    assert counts == Counter(), "a warm call ran the checks, the packing, a plan or the general path"
    assert len(kernel.launches) == 4
    fresh = [_fp8(2, h, 48, 64, seed=10 + i).transpose(1, 2).contiguous().transpose(1, 2) for i, h in
             enumerate((4, 2, 2))]
    run(*fresh, _descales(form, 2, 2, seed=6))  # other tensors, the same sizes, strides and descale shapes
    assert counts == Counter() and len(kernel.launches) == 5
    assert torch.equal(kernel.v_copies[-1], fresh[2].transpose(2, 3).view(torch.uint8))


@pytest.mark.parametrize(("change", "error", "match"), [
    (dict(q_descale=torch.ones(2, 2, dtype=torch.float64)), TypeError, "q_descale must be float32"),
    (dict(k_descale=torch.ones(2, 4)), ValueError, r"k_descale must have shape \(batch, heads_k\) = \(2, 2\)"),
    (dict(v_descale=torch.ones(2, 2).requires_grad_()), ValueError, "v_descale requires grad"),
    (dict(v_descale=[1.0]), TypeError, "v_descale must be a torch.Tensor"),
    (dict(k="bf16"), TypeError, "k has dtype torch.bfloat16"),
    (dict(dropout_p=0.1), ValueError, "dropout_p is not taken"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(window_size=(True, 0)), TypeError, "window_size must be a pair of ints"),
    (dict(softcap=True), TypeError, "softcap must be a float"),
    (dict(attention_chunk=True), TypeError, "attention_chunk must be an int"),
])
def test_bad_input_after_a_warm_call_is_still_named_before_any_launch(change: dict[str, Any], error: type,
                                                                       match: str, cpu_warm: _Runtime) -> None:
    q, k, v = (_fp8(2, 48, h, 64, seed=i) for i, h in enumerate((4, 2, 2)))  # flash_attn_func's (B, S, H, D)
    good = dict(q=q, k=k, v=v, causal=True, q_descale=torch.ones(2, 2), k_descale=torch.ones(2, 2),
                v_descale=torch.ones(2, 2))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    call = fp8.checked(qt, kt, vt, "bottom_right", None, binding.NAMES, binding.NO_WINDOW, 0.0, 0,
                       (good["q_descale"],) * 3, {})
    kernel = _Recorder(True, (2, 2, 64, 48))
    _memoise(cpu_warm, kernel, qt, kt, vt, call, (good["q_descale"],) * 3)
    lazytriton.flash_attn_func(**good)
    assert len(kernel.launches) == 1  # warm
    if change.get("k") == "bf16":
        change = dict(k=k.to(torch.bfloat16))
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_func(**{**good, **change})
    assert len(kernel.launches) == 1


def test_the_bf16_warm_path_declines_an_fp8_call_before_any_lookup() -> None:
    """flash_attn_func tries hot.py's warm path first when no descale is given: it turns float8 away at once."""
    from lazytriton.kernels.flash_fwd import hot

    allocations: list[Any] = []
    rt = _Runtime()
    rt.plans[("anything",)] = (_Recorder(True, (1, 1, 1, 1)), 16)
    warm = hot.generate("bshd", "output", cuda=False, cpp=False, get_runtime=lambda: rt,
                        empty_like=lambda *args, **kwargs: allocations.append(args))
    q, k, v = (_fp8(1, 16, 2, 32, seed=i) for i in range(3))
    assert warm(q, k, v, True, None) is None and allocations == []  # no entry lookup, no describe


def test_the_module_warm_paths_decline_cpu_tensors() -> None:
    q, k, v = (_fp8(1, 2, 16, 32, seed=i) for i in range(3))
    assert fp8_hot.forward_bhsd(q, k, v, False, None, (None,) * 3) is None  # CPU: the interpreter's call
    assert fp8_hot.output_bshd(q, k, v, False, None, (None,) * 3) is None


# ---------------------------------------------------------------------------
# GPU: the warm path's outputs against the general path's and float64


def _sm90() -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the FP8 forward needs sm_90+ (refused elsewhere: test_fp8_fwd.py)")


GPU_CASES = [  # (batch, heads (q, k), seqlens (q, k), head dim, causal, descales)
    (2, (8, 2), (300, 300), 128, True, "per_head"),
    (1, (4, 4), (77, 513), 64, False, "one"),
    (3, (6, 2), (129, 37), 256, True, "none"),
    (2, (4, 1), (1, 1000), 128, True, "mixed"),
]


@on_gpu
@pytest.mark.parametrize("lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_gpu_warm_fp8_call_equals_the_general_path_and_the_fa3_rule(case: tuple[Any, ...], lse: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _sm90()
    b, (hq, hk), (sq, sk), d, causal, form = case
    torch.manual_seed(sq + sk + d)
    q = torch.randn(b, sq, hq, d, device="cuda").to(E4M3)
    k, v = (torch.randn(b, sk, hk, d, device="cuda").to(E4M3) for _ in range(2))
    given = tuple(None if t is None else t.cuda() for t in _descales(form, b, hk, seed=sq))
    kw = dict(causal=causal, q_descale=given[0], k_descale=given[1], v_descale=given[2], return_attn_probs=lse)
    lazytriton.flash_attn_func(q, k, v, **kw)  # describes the shape, then plans it (the general path)
    counts: Counter[str] = Counter()
    _count(monkeypatch, counts)
    warm = [lazytriton.flash_attn_func(q, k, v, **kw) for _ in range(2)]
    assert counts == Counter(), "a warm call ran the checks, the packing, a plan or the general path"
    for name in ("forward_bhsd", "forward_bshd", "output_bshd"):
        monkeypatch.setattr(fp8_hot, name, lambda *args, **kwargs: None)
    general = lazytriton.flash_attn_func(q, k, v, **kw)
    assert counts["forward"] == 1
    for got in warm:
        for mine, theirs in zip(got if lse else (got,), general if lse else (general,), strict=True):
            assert (mine is None and theirs is None) or torch.equal(mine, theirs)
    out = warm[0][0] if lse else warm[0]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    mode = "bottom_right" if causal else False
    exact = reference(qt, kt, vt, given, mode).transpose(1, 2)
    assert_fa3_rule(out, exact, reference(qt, kt, vt, given, mode, same_precision=True).transpose(1, 2))


@on_gpu
def test_gpu_public_fp8_calls_take_the_warm_path_once_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    _sm90()
    q, k, v = (torch.randn(2, 256, h, 64, device="cuda").to(E4M3) for h in (8, 2, 2))
    one = torch.ones(2, 2, device="cuda")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    calls = [lambda: lazytriton.flash_attn_func(q, k, v, causal=True, q_descale=one, k_descale=one, v_descale=one),
             lambda: lazytriton.flash_attn_func(q, k, v),
             lambda: lazytriton.attn_fwd(qt, kt, vt, causal="bottom_right", k_descale=one)]
    for run in calls:
        run()
        run()  # planned, then described

    def general(*args: Any) -> None:
        raise AssertionError("the general path ran for a warm FP8 call")

    monkeypatch.setattr(fp8, "checked", general)
    monkeypatch.setattr(fp8, "forward", general)
    for run in calls:
        run()
    torch.cuda.synchronize()
