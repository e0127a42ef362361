"""Tests of lazytriton.flash.attn_fwd: numerics, validation, and (on a GPU) the cache path.

Numerics follow FlashAttention's rule: the error of our output against a
float64 reference may be at most twice the error of a same-dtype PyTorch
reference (``attention_reference`` on the inputs as given) against that float64
reference, plus a small floor. On CPU the kernel runs through Triton's
interpreter (a fraction of a second a call), so the shape matrix is a covering
design, not a cartesian product: ``test_cpu_matrix_covers_the_required_pairs``
states which pairs of factors it meets.

Every output is allocated poisoned (NaN, inside NaN guard bands and padded rows)
so that an element the kernel forgets to write, or one it writes out of
bounds, shows up.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from lazytriton import config, flash, runtime
from lazytriton.kernels.flash_fwd import binding, hot
from lazytriton.kernels.flash_fwd.reference import attention_reference

# The interpreter takes log2(0) for rows that see no key, then replaces the
# result with -inf through tl.where: expected, not a bug.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")


def on_gpu(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test ``gpu`` (``-m gpu`` selects it) and skip it with a reason where there is no CUDA GPU.

    The skip is tests/conftest.py's ``gpu``, written out here: ``tests`` is not
    a package, so importing it would depend on pytest's import mode.
    """
    skip = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="needs a CUDA GPU; run on the GPU host (see README, 'GPU tests')")
    return pytest.mark.gpu(skip(test))


def skip_unless_sm90(q: torch.Tensor, kernel: str) -> None:
    """Skip a GPU test of a Hopper-only kernel (Gluon: wgmma, TMA) on any other GPU, naming the kernel."""
    from lazytriton import machine

    if str(machine.target_of_device(q.device)) != "sm_90":
        pytest.skip(f"{kernel} is built for sm_90")


def twin_line(line: str) -> bool:
    """A ``prewarm --list`` line of a Gluon twin (planned for plain calls only, beside the Triton kernels)."""
    return any(f" {kernel}:" in line for kernel in ("flash_fwd_gluon", "flash_bwd_prep", "flash_bwd_fused_gluon"))


DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
HEAD_DIMS = (16, 32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
CAUSAL_MODES: tuple[bool | str, ...] = (False, True, "top_left", "bottom_right")
# (heads_q, heads_k): group sizes 1, 2, 4, and MQA (heads_k = 1).
HEADS = ((2, 2), (4, 2), (8, 2), (3, 1))
# (seqlen_q, seqlen_k): 1, odd, unequal both ways, exact multiples of the
# interpreter's tiles (BLOCK_M 32, BLOCK_N 16) and one past them. Those with
# seqlen_q > seqlen_k have rows that see no key under bottom-right alignment.
SEQLENS = ((1, 1), (1, 77), (77, 1), (17, 33), (33, 17), (64, 64), (65, 127), (128, 31), (31, 128), (16, 48),
           (100, 5), (5, 100))

# Floors on max |error|, added to 2x the same-dtype reference's error. Both
# implementations round their output to the dtype, and where the same-dtype
# reference happens to land on the float64 value (few keys, or luck) twice its
# error is ~0 while ours, summing in another order, may round the other way.
# So the out floor is one unit of rounding of the dtype, eps (fp16 2**-10 ~
# 9.8e-4, bf16 2**-7 ~ 7.8e-3), at the output's magnitude (times max(1, max
# |out|)). For fp32 eps (1.2e-7) is below the error of any sum of a few hundred
# terms; 1e-5 leaves room for a different summation order (online softmax,
# exp2) yet is 100x below fp16's floor, so an fp32 path that computed in half
# precision would fail. Measured on the H200 (bf16, 4k, causal): our out error
# 8.3e-3 against the same-dtype reference's 1.3e-2; fp32: 1.1e-6 against 1.2e-6.
# lse is float32 for every dtype: 1e-5 relative to max(1, max |lse|).
OUT_FLOOR = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-5}
LSE_FLOOR = 1e-5


# ---------------------------------------------------------------------------
# Helpers


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    head_dim: int
    causal: bool | str
    heads: tuple[int, int]
    seqlens: tuple[int, int]
    batch: int = 1

    def __str__(self) -> str:
        (hq, hk), (sq, sk) = self.heads, self.seqlens
        return (f"{DTYPE_NAMES[self.dtype]}-d{self.head_dim}-causal_{self.causal}-h{hq}x{hk}-s{sq}x{sk}"
                f"-b{self.batch}")


def cpu_matrix() -> list[Case]:
    """52 cases: every (head dim, causal mode) pair once, the other factors rotated around them.

    With h the head-dim index (13) and c the causal index (4): dtype (h + c) % 3
    meets every head dim (c runs over 4 >= 3 values) and every causal mode;
    seqlens (5h + c) % 12 meets every causal mode (5 is prime to 12, h runs over
    13 >= 12 values); heads (3h + c) % 4 likewise (3 is prime to 4).
    """
    cases = []
    for h, head_dim in enumerate(HEAD_DIMS):
        for c, causal in enumerate(CAUSAL_MODES):
            cases.append(Case(
                dtype=DTYPES[(h + c) % 3], head_dim=head_dim, causal=causal,
                heads=HEADS[(3 * h + c) % 4], seqlens=SEQLENS[(5 * h + c) % 12],
                batch=2 if (h + c) % 4 == 0 else 1,
            ))
    return cases


def seed_of(*params: object) -> int:
    """A stable seed from a case's parameters (not hash(), which is salted per process)."""
    return zlib.crc32(repr(params).encode())


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def make_qkv(batch: int, heads: tuple[int, int], seqlens: tuple[int, int], head_dim: int, dtype: torch.dtype,
             device: str | torch.device = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    (hq, hk), (sq, sk) = heads, seqlens
    return (randn((batch, hq, sq, head_dim), dtype, device, gen), randn((batch, hk, sk, head_dim), dtype, device, gen),
            randn((batch, hk, sk, head_dim), dtype, device, gen))


class PoisonedTorch:
    """Stands in for ``torch`` inside lazytriton.flash: its output allocations come back NaN.

    A floating-point ``empty``/``empty_like`` returns a view into a NaN buffer
    with 16 spare elements before and after it, and ``empty_like`` adds 16 spare
    columns to every row (16 keeps the 16-byte alignment the GPU dispatch looks
    at). ``check`` asserts that nothing outside the views was written.
    """

    GUARD = 16

    def __init__(self) -> None:
        self.allocations: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *size: Any, dtype: torch.dtype | None = None, device: Any = None, **kwargs: Any) -> torch.Tensor:
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
        dtype = dtype or torch.get_default_dtype()
        if not dtype.is_floating_point or kwargs:
            return torch.empty(shape, dtype=dtype, device=device, **kwargs)
        return self._poisoned(shape, dtype, device, pad=0)

    def empty_like(self, t: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if not t.dtype.is_floating_point or kwargs or t.dim() == 0:
            return torch.empty_like(t, **kwargs)
        return self._poisoned(tuple(t.shape), t.dtype, t.device, pad=self.GUARD)

    def _poisoned(self, shape: tuple[int, ...], dtype: torch.dtype, device: Any, pad: int) -> torch.Tensor:
        padded = shape[:-1] + (shape[-1] + pad,) if shape else shape
        n = math.prod(padded)
        buffer = torch.full((n + 2 * self.GUARD,), float("nan"), dtype=dtype, device=device)
        view = buffer[self.GUARD:self.GUARD + n].view(padded)
        if pad:
            view = view[..., :shape[-1]]
        self.allocations.append((buffer, view))
        return view

    def check(self) -> None:
        for buffer, view in self.allocations:
            outside = torch.ones(buffer.numel(), dtype=torch.bool, device=buffer.device)
            outside.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(False)
            assert torch.isnan(buffer[outside]).all(), "the kernel wrote outside its output tensor"


@pytest.fixture
def attn(monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``attn_fwd`` with poisoned outputs and a check of their guard bands after each call."""

    def call(q: Any, k: Any, v: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        poison = PoisonedTorch()
        with monkeypatch.context() as patch:
            patch.setattr(binding, "torch", poison)
            patch.setattr(hot, "forward_bhsd", lambda *args: None)  # the warm path allocates on its own
            out, lse = flash.attn_fwd(q, k, v, **kwargs)
        assert poison.allocations, "attn_fwd no longer allocates through binding.torch; update PoisonedTorch"
        poison.check()
        return out, lse

    return call


def expected_empty_rows(seqlen_q: int, seqlen_k: int, causal: bool | str) -> int:
    """How many leading query rows see no key at all."""
    if seqlen_k == 0:
        return seqlen_q
    if causal == "bottom_right":
        return max(seqlen_q - seqlen_k, 0)
    return 0


def check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    causal: bool | str = False, sm_scale: float | None = None) -> None:
    """Assert the output's form and FlashAttention's numerics rule for ``out`` and ``lse``."""
    b, hq, sq, d = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32 and lse.device == q.device

    ref_out, ref_lse = attention_reference(q.double(), k.double(), v.double(), causal=causal, sm_scale=sm_scale)
    same_out, same_lse = attention_reference(q, k, v, causal=causal, sm_scale=sm_scale)

    # Rows that see no key: output exactly 0, lse -inf, in the same places as the reference's.
    empty = expected_empty_rows(sq, k.shape[2], causal)
    no_key = torch.isneginf(ref_lse)
    assert (no_key.sum(-1) == empty).all()
    assert torch.equal(torch.isneginf(lse), no_key), "lse is -inf exactly where a row sees no key"
    assert (out[:, :, :empty] == 0).all(), "a row that sees no key must output exactly 0"
    assert torch.isfinite(out).all(), "out has NaN/inf (an element left unwritten?)"
    assert torch.isfinite(lse[~no_key]).all(), "lse has NaN/inf in a row that sees keys"

    def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
        return float((a.double() - ref.double()).abs().max()) if a.numel() else 0.0

    out_err, same_out_err = max_err(out, ref_out), max_err(same_out, ref_out)
    out_floor = OUT_FLOOR[q.dtype] * max(1.0, float(ref_out.abs().max()) if ref_out.numel() else 0.0)
    assert out_err <= 2 * same_out_err + out_floor, (
        f"out: max error {out_err:.3g} > 2 x same-dtype reference's {same_out_err:.3g} + {out_floor:.3g}")

    seen = ~no_key
    lse_err, same_lse_err = max_err(lse[seen], ref_lse[seen]), max_err(same_lse[seen], ref_lse[seen])
    lse_floor = LSE_FLOOR * max(1.0, float(ref_lse[seen].abs().max()) if seen.any() else 0.0)
    assert lse_err <= 2 * same_lse_err + lse_floor, (
        f"lse: max error {lse_err:.3g} > 2 x same-dtype reference's {same_lse_err:.3g} + {lse_floor:.3g}")


# ---------------------------------------------------------------------------
# Numerics on CPU, through Triton's interpreter


def test_cpu_matrix_covers_the_required_pairs() -> None:
    cases = cpu_matrix()
    met = {
        "dtype x head dim": ({(c.dtype, c.head_dim) for c in cases}, len(DTYPES) * len(HEAD_DIMS)),
        "dtype x causal": ({(c.dtype, c.causal) for c in cases}, len(DTYPES) * len(CAUSAL_MODES)),
        "seqlens x causal": ({(c.seqlens, c.causal) for c in cases}, len(SEQLENS) * len(CAUSAL_MODES)),
        "heads x causal": ({(c.heads, c.causal) for c in cases}, len(HEADS) * len(CAUSAL_MODES)),
    }
    for name, (pairs, wanted) in met.items():
        assert len(pairs) == wanted, f"{name}: {len(pairs)} of {wanted} pairs met"
    assert any(c.causal == "bottom_right" and c.seqlens[0] > c.seqlens[1] for c in cases)
    assert any(c.batch > 1 for c in cases)


@pytest.mark.parametrize("case", cpu_matrix(), ids=str)
def test_numerics_cpu(case: Case, attn: Callable[..., Any]) -> None:
    q, k, v = make_qkv(case.batch, case.heads, case.seqlens, case.head_dim, case.dtype, seed=seed_of(case))
    out, lse = attn(q, k, v, causal=case.causal)
    check_attention(q, k, v, out, lse, causal=case.causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES.get)
def test_bottom_right_rows_without_keys(dtype: torch.dtype, attn: Callable[..., Any]) -> None:
    # 50 queries, 20 keys: query i sees keys j <= i - 30, so rows 0..29 see none.
    q, k, v = make_qkv(2, (4, 2), (50, 20), 40, dtype, seed=seed_of("bottom_right", dtype))
    out, lse = attn(q, k, v, causal="bottom_right")
    assert (out[:, :, :30] == 0).all() and torch.isneginf(lse[:, :, :30]).all()
    assert torch.isfinite(lse[:, :, 30:]).all()
    check_attention(q, k, v, out, lse, causal="bottom_right")
    # Top-left on the same inputs: every row sees key 0.
    out, lse = attn(q, k, v, causal="top_left")
    assert torch.isfinite(lse).all()
    check_attention(q, k, v, out, lse, causal="top_left")


def _layout(name: str, b: int, hq: int, hk: int, sq: int, sk: int, d: int, dtype: torch.dtype,
            gen: torch.Generator, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v with the named unusual strides (last dim stride 1 always)."""
    if name == "bshd":  # (B, S, H, D) memory, viewed as (B, H, S, D)
        return (randn((b, sq, hq, d), dtype, device, gen).transpose(1, 2),
                randn((b, sk, hk, d), dtype, device, gen).transpose(1, 2),
                randn((b, sk, hk, d), dtype, device, gen).transpose(1, 2))
    if name == "head_dim_slice":  # rows of a wider buffer, at odd offsets: unaligned pointers and strides
        return (randn((b, hq, sq, d + 7), dtype, device, gen)[..., 3:3 + d],
                randn((b, hk, sk, d + 5), dtype, device, gen)[..., 1:1 + d],
                randn((b, hk, sk, d + 3), dtype, device, gen)[..., :d])
    if name == "packed_kv":  # k and v interleaved in one (B, S, 2, H, D) buffer; q every other head
        kv = randn((b, sk, 2, hk, d), dtype, device, gen)
        return randn((b, 2 * hq, sq, d), dtype, device, gen)[:, ::2], kv[:, :, 0].transpose(1, 2), \
            kv[:, :, 1].transpose(1, 2)
    if name == "expanded_kv":  # one k/v head broadcast to all (stride 0 over heads)
        return (randn((b, hq, sq, d), dtype, device, gen),
                randn((b, 1, sk, d), dtype, device, gen).expand(b, hk, sk, d),
                randn((b, 1, sk, d), dtype, device, gen).expand(b, hk, sk, d))
    raise ValueError(name)


LAYOUTS = ("bshd", "head_dim_slice", "packed_kv", "expanded_kv")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES.get)
def test_noncontiguous_inputs(layout: str, dtype: torch.dtype, attn: Callable[..., Any]) -> None:
    i = LAYOUTS.index(layout) + DTYPES.index(dtype)
    causal = CAUSAL_MODES[i % 4]
    d = (59, 64, 96, 24)[i % 4]
    gen = torch.Generator().manual_seed(seed_of(layout, dtype))
    q, k, v = _layout(layout, 2, 4, 2, 37, 45, d, dtype, gen)
    assert not q.is_contiguous() or not k.is_contiguous()
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    out, lse = attn(q, k, v, causal=causal)
    check_attention(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("sm_scale", [0.05, 0.7, 3.0, -0.4, 2], ids=str)
def test_custom_sm_scale(sm_scale: float, attn: Callable[..., Any]) -> None:
    # 3.0 on unit-variance inputs gives logits up to ~100: a peaked softmax
    # whose running maximum changes from block to block.
    i = [0.05, 0.7, 3.0, -0.4, 2].index(sm_scale)
    dtype, causal = DTYPES[i % 3], CAUSAL_MODES[i % 4]
    q, k, v = make_qkv(1, (2, 1), (40, 70), 48, dtype, seed=seed_of("sm_scale", sm_scale))
    out, lse = attn(q, k, v, causal=causal, sm_scale=sm_scale)
    check_attention(q, k, v, out, lse, causal=causal, sm_scale=sm_scale)
    default_out, _ = attn(q, k, v, causal=causal)
    assert not torch.equal(out, default_out), "sm_scale must change the result"


@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=str)
def test_batch(causal: bool | str, attn: Callable[..., Any]) -> None:
    q, k, v = make_qkv(3, (4, 2), (21, 34), 32, torch.float16, seed=seed_of("batch", causal))
    out, lse = attn(q, k, v, causal=causal)
    check_attention(q, k, v, out, lse, causal=causal)
    # Each batch element on its own gives the same bits: no mixing across the batch.
    one_out, one_lse = attn(q[1:2], k[1:2], v[1:2], causal=causal)
    assert torch.equal(one_out, out[1:2]) and torch.equal(one_lse, lse[1:2])


@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 0, 3, 32), (0, 2, 5, 7, 64), (1, 0, 5, 7, 16)], ids=str)
def test_empty_query(shape: tuple[int, ...], causal: bool | str, attn: Callable[..., Any]) -> None:
    b, hq, sq, sk, d = shape
    q, k, v = make_qkv(b, (hq, 1 if hq == 0 else 2), (sq, sk), d, torch.bfloat16, seed=1)
    out, lse = attn(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and out.numel() == 0
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32


@pytest.mark.parametrize("causal", CAUSAL_MODES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES.get)
def test_empty_keys(dtype: torch.dtype, causal: bool | str, attn: Callable[..., Any]) -> None:
    q, k, v = make_qkv(2, (4, 2), (9, 0), 40, dtype, seed=seed_of("empty_keys", dtype, causal))
    out, lse = attn(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_head_dim_one_with_any_last_stride(attn: Callable[..., Any]) -> None:
    # A last dim of size 1 may carry any stride: attn_fwd accepts it.
    gen = torch.Generator().manual_seed(5)
    q = randn((1, 2, 9, 2), torch.float32, "cpu", gen)[..., 1::2]
    assert q.shape[-1] == 1 and q.stride(-1) == 2
    k = randn((1, 2, 13, 1), torch.float32, "cpu", gen)
    v = randn((1, 2, 13, 1), torch.float32, "cpu", gen)
    out, lse = attn(q, k, v, causal=True)
    check_attention(q, k, v, out, lse, causal=True)


def test_no_grad_inputs_that_require_grad_run(attn: Callable[..., Any]) -> None:
    q, k, v = (t.requires_grad_() for t in make_qkv(1, (2, 2), (8, 8), 16, torch.float32, seed=3))
    with torch.no_grad():
        out, lse = attn(q, k, v)
    check_attention(q.detach(), k.detach(), v.detach(), out, lse)


# ---------------------------------------------------------------------------
# Bad input: a clear error naming the argument, before any launch


def _qkv(**changes: Any) -> dict[str, Any]:
    """Good fp16 arguments (B 1, Hq 4, Hk 2, Sq 5, Sk 6, D 32) with some replaced."""
    q, k, v = make_qkv(1, (4, 2), (5, 6), 32, torch.float16, seed=7)
    args: dict[str, Any] = {"q": q, "k": k, "v": v}
    args.update(changes)
    return args


class _FakeDevice:
    """Not a tensor, though it wraps one: refused by type."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _t(*shape: int, dtype: torch.dtype = torch.float16, device: str = "cpu") -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float32).to(dtype) if device == "cpu" else torch.empty(
        shape, dtype=dtype, device=device)


BAD_INPUTS: list[tuple[str, Callable[[], dict[str, Any]], type[Exception], str]] = [
    ("k_dtype", lambda: _qkv(k=_t(1, 2, 6, 32, dtype=torch.float32)), TypeError, r"\bk\b.*float32"),
    ("v_dtype", lambda: _qkv(v=_t(1, 2, 6, 32, dtype=torch.bfloat16)), TypeError, r"\bv\b.*bfloat16"),
    ("k_device", lambda: _qkv(k=_t(1, 2, 6, 32, device="meta")), ValueError, r"\bk\b.*meta"),
    ("v_device", lambda: _qkv(v=_t(1, 2, 6, 32, device="meta")), ValueError, r"\bv\b.*meta"),
    ("all_mps_like", lambda: {n: _FakeDevice(_t(*s)) for n, s in
                              (("q", (1, 4, 5, 32)), ("k", (1, 2, 6, 32)), ("v", (1, 2, 6, 32)))},
     TypeError, r"\bq\b.*_FakeDevice"),
    ("q_rank3", lambda: _qkv(q=_t(4, 5, 32)), ValueError, r"\bq\b.*4 dims"),
    ("k_rank5", lambda: _qkv(k=_t(1, 1, 2, 6, 32)), ValueError, r"\bk\b.*4 dims"),
    ("q_last_stride", lambda: _qkv(q=_t(1, 4, 5, 64)[..., ::2]), ValueError, r"\bq\b.*stride"),
    ("all_last_stride", lambda: {n: _t(*s[:3], 64)[..., ::2] for n, s in
                                 (("q", (1, 4, 5)), ("k", (1, 2, 6)), ("v", (1, 2, 6)))}, ValueError, r"\bq\b.*stride"),
    ("v_last_stride", lambda: _qkv(v=_t(1, 2, 32, 6).transpose(2, 3)), ValueError, r"\bv\b.*stride"),
    ("head_dim_0", lambda: _qkv(q=_t(1, 4, 5, 0), k=_t(1, 2, 6, 0), v=_t(1, 2, 6, 0)), ValueError, r"head dim.*\b0\b"),
    ("head_dim_257", lambda: _qkv(q=_t(1, 4, 5, 257), k=_t(1, 2, 6, 257), v=_t(1, 2, 6, 257)), ValueError,
     r"head dim.*257"),
    ("heads_not_multiple", lambda: _qkv(q=_t(1, 3, 5, 32)), ValueError, r"heads.*\(3\).*\(2\)"),
    ("heads_k_zero", lambda: _qkv(k=_t(1, 0, 6, 32), v=_t(1, 0, 6, 32)), ValueError, r"heads"),
    ("batch_mismatch", lambda: _qkv(k=_t(2, 2, 6, 32), v=_t(2, 2, 6, 32)), ValueError, r"\bk\b.*batch 2.*\bq\b"),
    ("kv_shape_mismatch", lambda: _qkv(v=_t(1, 2, 7, 32)), ValueError, r"\bk\b and \bv\b.*same shape"),
    ("head_dim_mismatch", lambda: _qkv(k=_t(1, 2, 6, 16), v=_t(1, 2, 6, 16)), ValueError, r"\bk\b.*head dim 16"),
    ("sm_scale_nan", lambda: _qkv(sm_scale=float("nan")), ValueError, r"sm_scale.*nan"),
    ("sm_scale_inf", lambda: _qkv(sm_scale=float("inf")), ValueError, r"sm_scale.*inf"),
    ("sm_scale_-inf", lambda: _qkv(sm_scale=float("-inf")), ValueError, r"sm_scale.*inf"),
    ("sm_scale_str", lambda: _qkv(sm_scale="0.1"), TypeError, r"sm_scale.*str"),
    ("sm_scale_nan_numpy", lambda: _qkv(sm_scale=np.float64("nan")), ValueError, r"sm_scale.*nan"),
    ("sm_scale_bool", lambda: _qkv(sm_scale=True), TypeError, r"sm_scale.*bool"),
    ("sm_scale_tensor", lambda: _qkv(sm_scale=torch.tensor(0.1)), TypeError, r"sm_scale.*Tensor"),
    ("causal_yes", lambda: _qkv(causal="yes"), ValueError, r"causal.*'yes'"),
    ("causal_2", lambda: _qkv(causal=2), ValueError, r"causal.*\b2\b"),
    ("causal_1", lambda: _qkv(causal=1), ValueError, r"causal.*\b1\b"),
    ("q_float64", lambda: _qkv(q=_t(1, 4, 5, 32, dtype=torch.float64)), TypeError, r"\bq\b.*float64"),
    ("all_float64", lambda: {n: _t(*s, dtype=torch.float64) for n, s in
                             (("q", (1, 4, 5, 32)), ("k", (1, 2, 6, 32)), ("v", (1, 2, 6, 32)))},
     TypeError, r"\bq\b.*float64"),
    ("k_int32", lambda: _qkv(k=torch.ones(1, 2, 6, 32, dtype=torch.int32)), TypeError, r"\bk\b.*int32"),
    ("q_list", lambda: _qkv(q=[[1.0]]), TypeError, r"\bq\b.*list"),
    ("v_numpy", lambda: _qkv(v=torch.zeros(1, 2, 6, 32).numpy()), TypeError, r"\bv\b.*ndarray"),
    ("k_none", lambda: _qkv(k=None), TypeError, r"\bk\b.*NoneType"),
]


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(("make", "error", "match"), [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input(make: Callable[[], dict[str, Any]], error: type[Exception], match: str) -> None:
    args = make()
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(error, match=match):
        flash.attn_fwd(q, k, v, **args)


def test_meta_tensors_give_outputs_of_the_right_form(no_launch: None) -> None:
    q, k, v = (_t(*s, device="meta") for s in ((2, 4, 5, 32), (2, 2, 6, 32), (2, 2, 6, 32)))
    out, lse = flash.attn_fwd(q, k, v, causal="bottom_right")
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == q.dtype and out.stride() == q.stride()
    assert lse.device.type == "meta" and lse.shape == (2, 4, 5) and lse.dtype == torch.float32


def test_bad_input_guard_really_catches_launches(no_launch: None) -> None:
    # The guard above must be able to fail: a good CPU call reaches it.
    args = _qkv()
    with pytest.raises(AssertionError, match="launched"):
        flash.attn_fwd(args["q"], args["k"], args["v"])


# ---------------------------------------------------------------------------
# On a GPU: compiled kernels from the cache


@pytest.fixture
def module_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """One cache dir for all GPU numerics tests of this process, so each variant compiles once.

    Each test still starts a fresh runtime (entries are read back from disk).
    """
    shared = tmp_path_factory.getbasetemp() / "flash_fwd_gpu_cache"
    monkeypatch.setenv("LAZYTRITON_CACHE_DIR", str(shared))
    config.reset()


GPU_HEAD_DIMS = (64, 128, 59, 256)
GPU_SEQLENS = ((1, 1), (1, 513), (513, 1), (127, 129), (1000, 333), (333, 1000), (256, 256), (17, 2048))


def gpu_matrix() -> list[Case]:
    """Every dtype x head dim x causal mode (48), seqlens and heads rotated across them."""
    cases = []
    for i, dtype in enumerate(DTYPES):
        for h, head_dim in enumerate(GPU_HEAD_DIMS):
            for c, causal in enumerate(CAUSAL_MODES):
                n = 16 * i + 4 * h + c
                cases.append(Case(dtype, head_dim, causal, HEADS[(n + i) % 4], GPU_SEQLENS[(3 * n + h) % 8],
                                  batch=2 if n % 3 == 0 else 1))
    return cases


@on_gpu
@pytest.mark.parametrize("case", gpu_matrix(), ids=str)
@pytest.mark.usefixtures("module_cache")
def test_numerics_gpu(case: Case, attn: Callable[..., Any]) -> None:
    q, k, v = make_qkv(case.batch, case.heads, case.seqlens, case.head_dim, case.dtype, "cuda", seed_of(case))
    out, lse = attn(q, k, v, causal=case.causal)
    check_attention(q, k, v, out, lse, causal=case.causal)


LONG_CASES = [
    Case(torch.bfloat16, 128, False, (4, 4), (4096, 4096)),
    Case(torch.bfloat16, 128, True, (4, 4), (4096, 4096)),
    Case(torch.float16, 64, "bottom_right", (8, 2), (4000, 4096)),
    Case(torch.float16, 59, "top_left", (8, 1), (4096, 3001)),
    Case(torch.float32, 128, True, (2, 1), (4096, 4096)),
    Case(torch.bfloat16, 256, "bottom_right", (4, 2), (4096, 1)),
]


@on_gpu
@pytest.mark.parametrize("case", LONG_CASES, ids=str)
@pytest.mark.usefixtures("module_cache")
def test_numerics_gpu_long(case: Case, attn: Callable[..., Any]) -> None:
    q, k, v = make_qkv(case.batch, case.heads, case.seqlens, case.head_dim, case.dtype, "cuda", seed_of(case))
    out, lse = attn(q, k, v, causal=case.causal)
    check_attention(q, k, v, out, lse, causal=case.causal)


@on_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_NAMES.get)
@pytest.mark.usefixtures("module_cache")
def test_gpu_tensor_spanning_2_31_elements(dtype: torch.dtype, attn: Callable[..., Any]) -> None:
    # q's second batch element starts 2**31 elements into its storage: offsets
    # need 64 bits there (an i32 offset would wrap to a negative address).
    b, hq, sq, d = 2, 2, 100, 64
    batch_stride = 2**31
    storage = torch.empty(batch_stride + hq * sq * d, dtype=dtype, device="cuda")
    q = storage.as_strided((b, hq, sq, d), (batch_stride, sq * d, d, 1))
    gen = torch.Generator(device="cuda").manual_seed(seed_of("2**31", dtype))
    q.copy_(randn((b, hq, sq, d), dtype, "cuda", gen))
    k, v = randn((b, 1, 150, d), dtype, "cuda", gen), randn((b, 1, 150, d), dtype, "cuda", gen)
    out, lse = attn(q, k, v, causal="bottom_right")
    check_attention(q, k, v, out, lse, causal="bottom_right")


@on_gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES.get)
@pytest.mark.usefixtures("module_cache")
def test_noncontiguous_inputs_gpu(layout: str, dtype: torch.dtype, attn: Callable[..., Any]) -> None:
    i = LAYOUTS.index(layout) + DTYPES.index(dtype)
    causal, d = CAUSAL_MODES[i % 4], (59, 64, 128, 96)[i % 4]
    gen = torch.Generator(device="cuda").manual_seed(seed_of(layout, dtype, "cuda"))
    q, k, v = _layout(layout, 2, 4, 2, 300, 451, d, dtype, gen, "cuda")
    out, lse = attn(q, k, v, causal=causal)
    check_attention(q, k, v, out, lse, causal=causal)


@on_gpu
@pytest.mark.parametrize("case", [
    Case(torch.bfloat16, 128, True, (4, 2), (1024, 1024), batch=2),
    Case(torch.float16, 59, "bottom_right", (4, 2), (333, 1000), batch=2),
    Case(torch.float32, 256, False, (4, 1), (77, 130), batch=2),
], ids=str)
@pytest.mark.usefixtures("module_cache")
def test_gpu_deterministic(case: Case) -> None:
    q, k, v = make_qkv(case.batch, case.heads, case.seqlens, case.head_dim, case.dtype, "cuda", seed_of("det", case))
    out1, lse1 = flash.attn_fwd(q, k, v, causal=case.causal)
    out2, lse2 = flash.attn_fwd(q, k, v, causal=case.causal)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2), "two calls on the same input differ"


@on_gpu
def test_gpu_second_call_does_not_compile() -> None:
    # The autouse fixture gives this test an empty cache dir: the first call is cold.
    q, k, v = make_qkv(2, (4, 2), (300, 300), 64, torch.float16, "cuda", seed_of("warm"))
    rt = runtime.get()
    out1, _ = flash.attn_fwd(q, k, v, causal=True)
    cold = rt.compiles
    assert cold == 1, f"the cold call should compile its one variant, compiled {cold}"
    out2, _ = flash.attn_fwd(q * 1, k, v, causal=True)  # same shape class, new tensors
    assert runtime.get() is rt and rt.compiles == cold, "a warm call compiled"
    assert torch.equal(out1, out2)
    # A new process's view (fresh runtime, same cache dir) reads the entry back from disk.
    config.reset()
    out3, _ = flash.attn_fwd(q, k, v, causal=True)
    assert runtime.get().compiles == 0, "a fresh runtime recompiled an entry already on disk"
    assert torch.equal(out1, out3)



# ---------------------------------------------------------------------------
# TMA variants (TMA=true: Q, K, V and Out through tensor descriptors). The
# interpreters of Triton 3.6 and 3.9 both run descriptors (and check their
# 16-byte alignment), so the CPU checks the kernel's logic; the GPU checks TMA.


def aligned_qkv(case: Case, layout: str, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v that a descriptor takes: rows of a buffer whose last dim is padded to 16 elements (16-byte strides)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    (hq, hk), (sq, sk), b, d = case.heads, case.seqlens, case.batch, case.head_dim
    wide = -(-d // 16) * 16
    if layout == "bshd":
        return tuple(randn((b, s, h, wide), case.dtype, device, gen)[..., :d].transpose(1, 2)  # type: ignore[return-value]
                     for h, s in ((hq, sq), (hk, sk), (hk, sk)))
    if layout == "expanded_kv":
        return (randn((b, hq, sq, wide), case.dtype, device, gen)[..., :d],
                randn((b, 1, sk, wide), case.dtype, device, gen)[..., :d].expand(b, hk, sk, d),
                randn((b, 1, sk, wide), case.dtype, device, gen)[..., :d].expand(b, hk, sk, d))
    return tuple(randn((b, h, s, wide), case.dtype, device, gen)[..., :d]  # type: ignore[return-value]
                 for h, s in ((hq, sq), (hk, sk), (hk, sk)))


def guarded_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out inside a NaN buffer with 16 spare rows and padded columns (a descriptor store must clip), lse, buffer."""
    b, hq, sq, d = q.shape
    buffer = torch.full((b, hq, sq + 16, -(-d // 16) * 16 + 16), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device)
    return buffer[:, :, :sq, :d], lse, buffer


def untouched_outside(out: torch.Tensor, buffer: torch.Tensor) -> bool:
    outside = torch.ones(buffer.shape, dtype=torch.bool, device=buffer.device)
    outside[:, :, :out.shape[2], :out.shape[3]] = False
    return bool(torch.isnan(buffer[outside]).all())


def run_interpreted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool | str,
                    tma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from lazytriton import compiler

    call = binding.check(q, k, v, causal)
    out, lse, buffer = guarded_outputs(q)
    constexprs = {**binding.interpreter_constexprs(call.shape, call.causal != "none"), "TMA": tma}
    compiler.interpret("flash_fwd", binding.grid(call.shape, constexprs["BLOCK_M"]),
                       binding.triton_args(q, k, v, out, lse, call), constexprs)
    assert untouched_outside(out, buffer), "the kernel wrote outside its output tensor"
    return out, lse


TMA_CPU_CASES = [
    (Case(torch.float16, 64, False, (2, 2), (40, 70)), "bhsd"),
    (Case(torch.bfloat16, 59, "bottom_right", (4, 2), (70, 40), batch=2), "bshd"),
    (Case(torch.float32, 16, "top_left", (3, 1), (20, 50)), "expanded_kv"),
    (Case(torch.float16, 128, True, (2, 1), (65, 127)), "bhsd"),
    (Case(torch.bfloat16, 1, "bottom_right", (2, 2), (33, 17)), "bhsd"),
]


@pytest.mark.parametrize(("case", "layout"), TMA_CPU_CASES, ids=str)
def test_tma_kernel_interpreted_matches_pointer_kernel(case: Case, layout: str) -> None:
    q, k, v = aligned_qkv(case, layout, "cpu", seed_of("tma", case, layout))
    out, lse = run_interpreted(q, k, v, case.causal, tma=True)
    check_attention(q, k, v, out, lse, causal=case.causal)
    ptr_out, ptr_lse = run_interpreted(q, k, v, case.causal, tma=False)
    assert torch.equal(out, ptr_out) and torch.equal(lse, ptr_lse), "same arithmetic, only the loads differ"


TMA_GPU_CASES = [
    (Case(torch.bfloat16, 128, False, (4, 4), (4096, 4096)), "bhsd"),
    (Case(torch.bfloat16, 128, True, (4, 4), (4096, 4096)), "bhsd"),
    (Case(torch.float16, 64, "bottom_right", (8, 2), (4000, 4096)), "bshd"),
    (Case(torch.float16, 59, "top_left", (8, 1), (1000, 3001)), "expanded_kv"),
    (Case(torch.bfloat16, 256, "bottom_right", (4, 2), (333, 1000), batch=2), "bhsd"),
    (Case(torch.float16, 16, False, (3, 1), (17, 2048)), "bshd"),
    (Case(torch.bfloat16, 96, True, (2, 2), (8, 8), batch=3), "bhsd"),
    (Case(torch.float32, 64, True, (2, 1), (513, 1)), "bhsd"),
]


@on_gpu
@pytest.mark.parametrize(("case", "layout"), TMA_GPU_CASES, ids=str)
@pytest.mark.usefixtures("module_cache")
def test_tma_and_pointer_variants_on_gpu(case: Case, layout: str) -> None:
    """The TMA and pointer variants of one config, forced through the binding, both under FlashAttention's rule."""
    from lazytriton import geometry, machine
    from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch

    q, k, v = aligned_qkv(case, layout, "cuda", seed_of("tma-gpu", case, layout))
    call = binding.check(q, k, v, case.causal)
    target = machine.target_of_device(q.device)
    if str(target) != "sm_90":
        pytest.skip(f"TMA variants are built for sm_90, this GPU is {target}")
    even_d = case.head_dim == geometry.padded_head_dim(case.head_dim)
    if not even_d:  # measured: the descriptor store wrote past head dim 59 of a 64-wide tile (Triton 3.6)
        with pytest.raises(ValueError, match="power-of-two head dim"):
            fwd_dispatch.flash_fwd_variant(target, DTYPE_NAMES[case.dtype], case.head_dim, call.causal != "none", True,
                                           call.shape.seqlen_q, seqlen_k=call.shape.seqlen_k, tma=True)
    for tma in (False, True) if even_d else (False,):
        variant = fwd_dispatch.flash_fwd_variant(target, DTYPE_NAMES[case.dtype], case.head_dim, call.causal != "none",
                                                 True, call.shape.seqlen_q, seqlen_k=call.shape.seqlen_k, tma=tma)
        out, lse, buffer = guarded_outputs(q)
        assert binding.pack(q, k, v, out, lse, call)[1], "the test's tensors must be aligned for TMA"
        binding.launch_gpu(q, k, v, out, lse, call, variant)
        torch.cuda.synchronize()
        assert untouched_outside(out, buffer), f"TMA={tma}: the kernel wrote outside its output tensor"
        check_attention(q, k, v, out, lse, causal=case.causal)
    if even_d:
        assert runtime.get().kernel(variant, q.device.index).entry.global_scratch_size > 0
