"""The FP8 forward (flash_fwd_fp8): FlashAttention-3's rule against float64, bad input, dispatch, the sm_90 binary.

Both input formats: float8_e4m3fn and float8_e5m2 (q, k and v of one; the
probabilities rounded to e4m3 in either). CPU tests run the kernel through
Triton's interpreter (whose float -> float8 rounding lazytriton.interpreter
makes round to nearest even and saturate, as sm_90's cvt does). The rule is FlashAttention-3's fp8 test's: the output's
largest error against a float64 reference computed from the dequantised
inputs is at most rtol (2, 3 with softcap) times that of the same math done as
FlashAttention-3's ``attention_ref(upcast=False, intermediate_dtype=fp8)``
does it (dequantised inputs in bf16, probabilities rounded to e4m3), plus
twice bf16's rounding at 0.3.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
import torch
from conftest import gpu

import lazytriton
from lazytriton import compiler
from lazytriton.interpreter import fp8_encode
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_fwd import binding, fp8, grid
from lazytriton.kernels.flash_fwd.fp8_spec import FLASH_FWD_FP8
from lazytriton.kernels.flash_fwd.reference import visible
from lazytriton.target import Target

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def _expand(descale: torch.Tensor | None, heads_q: int) -> torch.Tensor:
    """A (batch, heads_q, 1, 1) float64 factor from a (batch, heads_k), (1,) or () descale (None: 1)."""
    if descale is None:
        return torch.ones((), dtype=torch.float64)
    d = descale.double()
    if d.dim() < 2:
        return d.reshape(())
    return d.repeat_interleave(heads_q // d.shape[1], dim=1)[:, :, None, None]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: tuple, causal: bool | str = False,
              window: tuple[int, int] = (-1, -1), softcap: float = 0.0, chunk: int = 0,
              same_precision: bool = False) -> torch.Tensor:
    """(B, H, Sq, Dv) attention of FP8 (B, H, S, D) tensors: float64, or FlashAttention-3's same-precision math."""
    hq = q.shape[1]
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    qd, kd, vd = (t.double() * _expand(d, hq) for t, d in zip((q, k, v), descales, strict=True))
    if same_precision:
        qd, kd, vd = (t.to(torch.bfloat16).double() for t in (qd, kd, vd))
    scores = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if same_precision:
        scores = scores.to(torch.bfloat16).double()
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    keep = visible(q.shape[2], k.shape[2], causal, window, attention_chunk=chunk)
    if keep is not None:
        scores = scores.masked_fill(~keep.to(scores.device), -math.inf)
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if same_precision:
        p = p.to(E4M3).to(torch.bfloat16).double()
    return p @ vd


def assert_fa3_rule(out: torch.Tensor, exact: torch.Tensor, same: torch.Tensor, softcap: float = 0.0) -> None:
    rounded = exact.to(torch.bfloat16)
    atol = 2 * float((rounded + 0.3 - 0.3 - rounded).abs().max())
    err, base = float((out.double() - exact).abs().max()), float((same - exact).abs().max())
    rtol = 2 if softcap == 0.0 else 3
    assert err <= rtol * base + atol, f"max error {err:.3e} > {rtol} x {base:.3e} + {atol:.1e}"


def fp8_inputs(b: int, sq: int, sk: int, hq: int, hk: int, d: int, scale: float = 1.0,
               dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, ...]:
    q = (torch.randn(b, hq, sq, d) * scale).to(dtype)
    k, v = torch.randn(b, hk, sk, d).to(dtype), torch.randn(b, hk, sk, d).to(dtype)
    return q, k, v


def per_head(b: int, hk: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.rand(b, hk) * 2 + 0.05 for _ in range(3))


@pytest.mark.parametrize(("d", "causal", "hq", "hk", "sq", "sk"), [
    (64, False, 4, 2, 70, 70),
    (64, "bottom_right", 2, 1, 40, 90),
    (128, "top_left", 2, 2, 90, 50),
    (96, "bottom_right", 3, 1, 33, 64),  # a padded head dim (EVEN_D false), MQA
])
def test_dense_matches_float64_by_fa3_rule(d: int, causal: bool | str, hq: int, hk: int, sq: int, sk: int) -> None:
    torch.manual_seed(d + sq)
    q, k, v = fp8_inputs(2, sq, sk, hq, hk, d)
    scales = per_head(2, hk)
    out, lse = lazytriton.attn_fwd(q, k, v, causal=causal, q_descale=scales[0], k_descale=scales[1],
                                   v_descale=scales[2])
    assert out.dtype == torch.bfloat16 and out.shape == (2, hq, sq, d) and lse.shape == (2, hq, sq)
    exact = reference(q, k, v, scales, causal)
    assert_fa3_rule(out, exact, reference(q, k, v, scales, causal, same_precision=True))


@pytest.mark.parametrize("form", ["none", "tensor1", "scalar"])
def test_flash_attn_func_descale_forms_gqa(form: str) -> None:
    torch.manual_seed(1)
    q, k, v = (t.transpose(1, 2) for t in fp8_inputs(1, 48, 64, 4, 2, 64))  # (B, S, H, D)
    one = {"none": None, "tensor1": torch.tensor([0.7]), "scalar": torch.tensor(1.3)}[form]
    scales = (one, one, one)
    out = lazytriton.flash_attn_func(q, k, v, causal=True, q_descale=one, k_descale=one, v_descale=one)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    exact = reference(qt, kt, vt, scales, "bottom_right").transpose(1, 2)
    same = reference(qt, kt, vt, scales, "bottom_right", same_precision=True).transpose(1, 2)
    assert_fa3_rule(out, exact, same)


def test_window_softcap_and_chunk() -> None:
    torch.manual_seed(2)
    q, k, v = fp8_inputs(1, 64, 80, 2, 1, 64, scale=4.0)
    scales = per_head(1, 1)
    kw = dict(q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    out, _ = lazytriton.attn_fwd(q, k, v, causal="bottom_right", window_size=(20, 0), softcap=3.0, **kw)
    exact = reference(q, k, v, scales, "bottom_right", (20, 0), 3.0)
    assert_fa3_rule(out, exact, reference(q, k, v, scales, "bottom_right", (20, 0), 3.0, same_precision=True), 3.0)
    out, _ = lazytriton.attn_fwd(q, k, v, attention_chunk=24, **kw)
    exact = reference(q, k, v, scales, False, chunk=24)
    assert_fa3_rule(out, exact, reference(q, k, v, scales, False, chunk=24, same_precision=True))


def test_varlen_with_seqused_and_per_sequence_descales() -> None:
    torch.manual_seed(3)
    lens_q, lens_k, hq, hk, d = [30, 0, 45], [50, 20, 33], 2, 1, 64
    cu_q = torch.tensor([0, *np.cumsum(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(lens_k)], dtype=torch.int32)
    q = torch.randn(sum(lens_q), hq, d).to(E4M3)
    k, v = torch.randn(sum(lens_k), hk, d).to(E4M3), torch.randn(sum(lens_k), hk, d).to(E4M3)
    scales = per_head(3, hk)
    used_k = torch.tensor([40, 20, 33], dtype=torch.int32)
    out = lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 45, 50, causal=True, seqused_k=used_k,
                                            q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    assert out.dtype == torch.bfloat16 and out.shape == (sum(lens_q), hq, d)
    for i in range(3):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i]) + int(used_k[i]))
        if lens_q[i] == 0:
            continue
        qi, ki, vi = (t[sl].transpose(0, 1)[None] for t, sl in ((q, rows), (k, keys), (v, keys)))
        si = tuple(s[i:i + 1] for s in scales)
        exact = reference(qi, ki, vi, si, "bottom_right")[0].transpose(0, 1)
        same = reference(qi, ki, vi, si, "bottom_right", same_precision=True)[0].transpose(0, 1)
        assert_fa3_rule(out[rows], exact, same)


@pytest.mark.parametrize(("d", "causal", "hq", "hk", "sq", "sk"), [
    (64, False, 4, 2, 70, 70),
    (96, "bottom_right", 3, 1, 33, 64),  # a padded head dim (EVEN_D false), MQA
])
def test_e5m2_dense_matches_float64_by_fa3_rule(d: int, causal: bool | str, hq: int, hk: int, sq: int,
                                                sk: int) -> None:
    torch.manual_seed(d + sq + 1)
    q, k, v = fp8_inputs(2, sq, sk, hq, hk, d, dtype=E5M2)
    scales = per_head(2, hk)
    out, lse = lazytriton.attn_fwd(q, k, v, causal=causal, q_descale=scales[0], k_descale=scales[1],
                                   v_descale=scales[2])
    assert out.dtype == torch.bfloat16 and out.shape == (2, hq, sq, d) and lse.shape == (2, hq, sq)
    exact = reference(q, k, v, scales, causal)
    assert_fa3_rule(out, exact, reference(q, k, v, scales, causal, same_precision=True))


def test_e5m2_varlen_and_flash_attn_func_without_descales() -> None:
    torch.manual_seed(4)
    lens_q, lens_k, hq, hk, d = [30, 45], [50, 33], 2, 1, 64
    cu_q = torch.tensor([0, *np.cumsum(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(lens_k)], dtype=torch.int32)
    q = torch.randn(sum(lens_q), hq, d).to(E5M2)
    k, v = torch.randn(sum(lens_k), hk, d).to(E5M2), torch.randn(sum(lens_k), hk, d).to(E5M2)
    scales = (torch.tensor(0.8), None, torch.rand(2, hk) + 0.5)
    out = lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 45, 50, causal=True, q_descale=scales[0],
                                            v_descale=scales[2])
    assert out.dtype == torch.bfloat16 and out.shape == (sum(lens_q), hq, d)
    for i in range(2):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        qi, ki, vi = (t[sl].transpose(0, 1)[None] for t, sl in ((q, rows), (k, keys), (v, keys)))
        si = (scales[0], None, scales[2][i:i + 1])
        exact = reference(qi, ki, vi, si, "bottom_right")[0].transpose(0, 1)
        same = reference(qi, ki, vi, si, "bottom_right", same_precision=True)[0].transpose(0, 1)
        assert_fa3_rule(out[rows], exact, same)
    dense = (q[:30][None], k[:50][None], v[:50][None])  # (1, S, H, D): flash_attn_func's layout
    out = lazytriton.flash_attn_func(*dense, causal=True)
    qt, kt, vt = (t.transpose(1, 2) for t in dense)
    exact = reference(qt, kt, vt, (None, None, None), "bottom_right").transpose(1, 2)
    assert_fa3_rule(out, exact, reference(qt, kt, vt, (None, None, None), "bottom_right",
                                          same_precision=True).transpose(1, 2))


def test_e5m2_probabilities_are_rounded_to_e4m3() -> None:
    """One key block (the interpreter's BLOCK_N is 32): out is round(exp(s - max)) @ v / sum(exp(s - max)).

    The kernel's out is that model's with P rounded to e4m3 up to bf16's
    rounding, and several times farther from the model that rounds P to e5m2.
    """
    torch.manual_seed(11)
    q, k, v = fp8_inputs(1, 24, 30, 2, 2, 64, scale=3.0, dtype=E5M2)
    out, _ = lazytriton.attn_fwd(q, k, v)
    scores = q.double() @ k.double().transpose(-1, -2) / 8.0
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    err = {fmt: float((out.double() - p.to(fmt).double() @ v.double() / p.sum(-1, keepdim=True)).abs().max())
           for fmt in (E4M3, E5M2)}
    assert err[E4M3] < err[E5M2] / 4, err


def test_a_null_descale_reads_as_one() -> None:
    """The kernel reads a descale whose pointer is null as 1.0 (the C API passes NULL for an absent one on a GPU).

    Through the interpreter: out and lse bit for bit those of the same call with 1.0 tensors (the Python path).
    """
    torch.manual_seed(12)
    q, k, v = fp8_inputs(1, 40, 56, 2, 1, 64, dtype=E5M2)
    k_descale = torch.rand(1, 1) + 0.5
    want, want_lse = lazytriton.attn_fwd(q, k, v, causal="bottom_right", k_descale=k_descale)
    call = binding.check(q, k, v, "bottom_right", None, fp8=True)
    vt = fp8.transposed_v(v)
    out, lse = fp8.empty_outputs(q, call.dv)
    scales = fp8.descales((None, k_descale, None), q, 1, 1)
    ints, _, _ = fp8.pack(q, k, vt, out, lse, call, scales)
    n_pointers = sum(1 for _, kind in FLASH_FWD_FP8.params if kind.startswith("*"))
    null = torch.empty(0, dtype=torch.float32)  # an empty tensor's data pointer is 0
    assert null.data_ptr() == 0
    args = (q, k, vt, out, lse, 0, 0, 0, 0, null, scales.k, null, *ints[n_pointers:], *fp8.floats(call))
    constexprs = fp8.interpreter_constexprs(call, call.shape)
    compiler.interpret(FLASH_FWD_FP8.name, grid(40, 2, 1, constexprs["BLOCK_M"]), args, constexprs)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


_DESCALE_ARGS = tuple(fp8.INT_PARAMS.index(name) for name in ("Q_descale", "K_descale", "V_descale"))
_DESCALE_STRIDES = tuple(fp8.INT_PARAMS.index(f"stride_{t}d{d}") for t in "qkv" for d in "bh")


@pytest.mark.parametrize(("dtype", "packed", "given"), [
    (E4M3, False, ""), (E5M2, True, ""), (E4M3, True, "k"), (E5M2, False, "qv")], ids=str)
def test_an_absent_descale_is_a_null_pointer_that_reads_as_one(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                                packed: bool, given: str) -> None:
    """An absent descale reaches the kernel as a null pointer with strides 0: no tensor is made or kept for it.

    Through the interpreter (an empty tensor, data pointer 0, stands for the null pointer): out and lse bit for bit
    those of the call given a 1.0 for it (one value, broadcast with strides 0).
    """
    torch.manual_seed(13)
    b, hq, hk, sq, sk = 2, 4, 2, 19, 37
    q, k, v = fp8_inputs(b, sq, sk, hq, hk, 32, dtype=dtype)
    made = {name: torch.rand(b, hk) + 0.5 for name in "qkv" if name in given}
    kwargs = {f"{name}_descale": made[name] for name in made}
    ones = {f"{name}_descale": torch.ones(()) for name in "qkv" if name not in made}
    seen: list[tuple[Any, ...]] = []
    interpret = compiler.interpret
    monkeypatch.setattr(compiler, "interpret", lambda name, g, args, c: seen.append(tuple(args)) or interpret(
        name, g, args, c))

    def run(**descales: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not packed:
            return lazytriton.attn_fwd(q, k, v, causal="bottom_right", **descales)  # type: ignore[no-any-return]
        qp, kp, vp = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (q, k, v))
        cu_q, cu_k = (torch.arange(0, b * s + 1, s, dtype=torch.int32) for s in (sq, sk))
        return lazytriton.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, sq, sk, causal=True,  # type: ignore
                                                 return_attn_probs=True, **descales)[:2]

    got = run(**kwargs)
    (args,) = seen
    for name, slot in zip("qkv", _DESCALE_ARGS, strict=True):
        pointer = args[slot]
        assert isinstance(pointer, torch.Tensor) and (pointer.data_ptr() == 0) == (name not in made), name
        if name not in made:
            assert pointer.numel() == 0 and args[_DESCALE_STRIDES[2 * "qkv".index(name)]] == 0
            assert args[_DESCALE_STRIDES[2 * "qkv".index(name) + 1]] == 0
    want = run(**kwargs, **ones)
    assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True))


def test_an_absent_descale_packs_as_null() -> None:
    """``fp8.descales`` leaves an absent one None and ``fp8.pack`` writes 0 for its pointer and its strides."""
    q, k, v = fp8_inputs(2, 16, 16, 2, 1, 32)
    call = binding.check(q, k, v, False, None, fp8=True)
    k_descale = torch.rand(2, 1) + 0.5
    scales = fp8.descales((None, k_descale, None), q, 2, 1)
    assert scales.q is None and scales.v is None and scales.k is k_descale
    out, lse = fp8.empty_outputs(q, call.dv)
    ints = dict(zip(fp8.INT_PARAMS, fp8.pack(q, k, fp8.transposed_v(v), out, lse, call, scales)[0], strict=True))
    assert [ints[n] for n in ("Q_descale", "stride_qdb", "stride_qdh", "V_descale", "stride_vdb", "stride_vdh")] \
        == [0] * 6
    assert (ints["K_descale"], ints["stride_kdb"], ints["stride_kdh"]) == (k_descale.data_ptr(), 1, 1)


def test_interpreter_rounds_to_e4m3_as_the_gpu_does() -> None:
    values = torch.cat([torch.randn(20000) * 5, torch.randn(2000) * 400, torch.rand(2000) * 0.02,
                        torch.tensor([1.99, 1.0625, 464.0, 465.0, 1000.0, -1000.0, 2.0**-10, 3 * 2.0**-10, -0.0])])
    ours = torch.from_numpy(fp8_encode(values.numpy(), "fp8e4nv")).view(E4M3).float()
    assert torch.equal(ours, values.to(E4M3).float())  # torch: nearest even, saturating at 448
    assert torch.isnan(torch.from_numpy(fp8_encode(np.array([np.nan], np.float32), "fp8e4nv")).view(E4M3).float()).all()


def test_interpreter_rounds_to_e5m2_as_the_gpu_does() -> None:
    values = torch.cat([torch.randn(20000) * 5, torch.randn(2000) * 4000, torch.rand(2000) * 2.0**-13,
                        torch.tensor([1.125, 1.375, 57344.0, 2.0**-16, 3 * 2.0**-17, -0.0])])
    ours = torch.from_numpy(fp8_encode(values.numpy(), "fp8e5")).view(E5M2).float()
    assert torch.equal(ours, values.to(E5M2).float())  # in range: torch's nearest even
    past = torch.from_numpy(fp8_encode(np.array([61440.0, -1e6, np.inf], np.float32), "fp8e5")).view(E5M2).float()
    assert past.tolist() == [57344.0, -57344.0, 57344.0]  # satfinite, as sm_90's cvt


def _cpu_fp8(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(E4M3)


@pytest.mark.parametrize(("change", "error", "match"), [
    (dict(k=torch.randn(1, 16, 2, 64, dtype=torch.bfloat16)), TypeError, "k has dtype torch.bfloat16"),
    # one float8 format for q, k and v (the kernel's pointers are of one dtype)
    (dict(k=torch.randn(1, 16, 2, 64).to(E5M2)), TypeError, "k has dtype torch.float8_e5m2 but q has "
                                                            "torch.float8_e4m3fn"),
    (dict(v=torch.randn(1, 16, 2, 64).to(E5M2)), TypeError, "v has dtype torch.float8_e5m2"),
    (dict(q_descale=torch.rand(2, 2)), ValueError, r"q_descale must have shape \(batch, heads_k\) = \(1, 2\)"),
    (dict(k_descale=torch.rand(1, 2, dtype=torch.float16)), TypeError, "k_descale must be float32"),
    (dict(v_descale=[1.0]), TypeError, "v_descale must be a torch.Tensor"),
    (dict(alibi_slopes=torch.rand(4)), ValueError, "alibi_slopes is not taken with float8_e4m3fn"),
    (dict(dropout_p=0.1), ValueError, "dropout_p is not taken"),
])
def test_bad_input_is_named_before_any_launch(change: dict, error: type, match: str) -> None:
    args = dict(q=_cpu_fp8(1, 16, 4, 64), k=_cpu_fp8(1, 16, 2, 64), v=_cpu_fp8(1, 16, 2, 64))
    args.update(change)
    with pytest.raises(error, match=match):
        lazytriton.flash_attn_func(**args)


def test_descales_on_bf16_inputs_are_refused() -> None:
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q_descale is for float8_e4m3fn inputs"):
        lazytriton.flash_attn_func(q, q, q, q_descale=torch.ones(1, 2))
    with pytest.raises(TypeError, match="v_descale is for float8_e4m3fn inputs"):
        lazytriton.attn_fwd(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), v_descale=torch.ones(()))


@pytest.mark.parametrize("target", ["sm_80", "gfx942"])
@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_dispatch_refuses_targets_without_fp8_tensor_cores(target: str, dtype: str) -> None:
    with pytest.raises(ValueError, match=f"dtype {dtype}: {target}"):
        dispatch.kernel_variant("flash_fwd", Target.parse(target), dtype, 128, False, True, 4096, 4096)


def test_dispatch_gives_the_fp8_kernel_and_refuses_its_missing_features() -> None:
    variant = dispatch.kernel_variant("flash_fwd", Target.parse("sm_90"), "e4m3", 96, True, True, 4096, 4096)
    assert variant.kernel == "flash_fwd_fp8" and variant.dtype == "e4m3"
    assert variant.get("BLOCK_D") == 128 and "BLOCK_D2" not in variant.constexprs  # padded, never split
    e5m2 = dispatch.kernel_variant("flash_fwd", Target.parse("sm_90"), "e5m2", 96, True, True, 4096, 4096)
    assert e5m2.kernel == "flash_fwd_fp8" and e5m2.dtype == "e5m2" and e5m2.key() != variant.key()
    assert (e5m2.functional, e5m2.tuned, e5m2.options) == (variant.functional, variant.tuned, variant.options)
    with pytest.raises(ValueError, match="takes no alibi, dropout"):
        dispatch.kernel_variant("flash_fwd", Target.parse("sm_90"), "e4m3", 64, False, True, 64, 64, alibi=True,
                                dropout=True)


@pytest.mark.parametrize(("head_dim", "dtype"), [(64, "e4m3"), (128, "e4m3"), (256, "e4m3"), (128, "e5m2")])
def test_sm90_binary_uses_fp8_wgmma_for_both_products(head_dim: int, dtype: str) -> None:
    """Both dots are float8 wgmma in the PTX (q k: n = BLOCK_N, p v: n = BLOCK_D), none through mma.sync.

    e4m3 inputs: e4m3 x e4m3 for both; e5m2 inputs: e5m2 x e5m2 for q k, and e4m3 (P) x e5m2 (V) for p v.
    """
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lazytriton.compiler import divisibility_hints
    from lazytriton.kernels import get
    from lazytriton.variant import kernel_constexprs

    variant = dispatch.kernel_variant("flash_fwd", Target.parse("sm_90"), dtype, head_dim, True, True, 16384, 16384)
    spec = get(variant.kernel)
    constexprs = kernel_constexprs(variant, spec.constexprs)
    source = ASTSource(getattr(importlib.import_module(spec.module), spec.function),
                       spec.signature(variant.dtype, False, constexprs), constexprs=constexprs,
                       attrs=divisibility_hints(spec, variant))
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(variant.options)).asm["ptx"]
    dots = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.(e[45]m[23]\.e[45]m[23])", ptx))
    assert {(str(variant.get("BLOCK_N")), f"{dtype}.{dtype}"), (str(head_dim), f"e4m3.{dtype}")} <= dots, dots
    assert "mma.sync" not in ptx


# ---------------------------------------------------------------------------
# GPU: real sizes


@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_gpu_16k_tokens_by_fa3_rule(head_dim: int, causal: bool, dtype: torch.dtype) -> None:
    torch.manual_seed(head_dim)
    b, s, hq, hk = 1, 16384 // 4, 16, 4  # 4k per sequence (the float64 reference's scores fit)
    q = torch.randn(b, s, hq, head_dim, device="cuda").to(dtype)
    k, v = (torch.randn(b, s, hk, head_dim, device="cuda").to(dtype) for _ in range(2))
    scales = tuple(torch.rand(b, hk, device="cuda") * 2 + 0.05 for _ in range(3))
    out = lazytriton.flash_attn_func(q, k, v, causal=causal, q_descale=scales[0], k_descale=scales[1],
                                     v_descale=scales[2])
    heads = slice(0, hq // hk)  # the query heads of kv head 0: a float64 reference of one kv head's group
    qt = q[:, :, heads].transpose(1, 2)
    kt, vt = k[:, :, :1].transpose(1, 2), v[:, :, :1].transpose(1, 2)
    sl = tuple(x[:, :1] for x in scales)
    exact = reference(qt, kt, vt, sl, "bottom_right" if causal else False).transpose(1, 2)
    same = reference(qt, kt, vt, sl, "bottom_right" if causal else False, same_precision=True).transpose(1, 2)
    assert_fa3_rule(out[:, :, heads], exact, same)


@gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_gpu_varlen_and_window(dtype: torch.dtype) -> None:
    torch.manual_seed(7)
    lens = [1000, 3000, 17]
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), 8, 128, device="cuda").to(dtype) for _ in range(3))
    out = lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, window_size=(256, 0),
                                            q_descale=torch.tensor(0.5, device="cuda"))
    for i in range(len(lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        qi, ki, vi = (t[rows].transpose(0, 1)[None] for t in (q, k, v))
        sc = (torch.tensor(0.5, device="cuda"), None, None)
        exact = reference(qi, ki, vi, sc, "bottom_right", (256, 0))[0].transpose(0, 1)
        same = reference(qi, ki, vi, sc, "bottom_right", (256, 0), same_precision=True)[0].transpose(0, 1)
        assert_fa3_rule(out[rows], exact, same)


@gpu
def test_gpu_sm80_device_is_refused_before_launch() -> None:
    if torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("this GPU has FP8 tensor cores (sm_90+); the refusal is tested through dispatch on CPU")
    q = torch.randn(1, 64, 2, 64, device="cuda").to(E4M3)
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        lazytriton.flash_attn_func(q, q, q)
