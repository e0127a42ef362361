"""The MLA forward (``kernels/flash_fwd_mla``): FlashAttention-3's ``qv`` and v's head dim up to 512, forward only.

FlashAttention-3's tests (hopper/test_flash_attn.py) run q/k of 64 with v of 256 and 512, with and without qv
(its qv cases: d 64, dv 256 and 512), and MLA's 576/512 is that qv form (q_pe 64 + the latent 512). Numerics
against the float64 reference (``flash_fwd_mla.reference``) under FlashAttention's rule, on CPU through Triton's
interpreter on small shapes: GQA/MQA, both causal alignments, windows, softcap, odd lengths, packed sequences.
Then the backward's refusal, bad input, the variants, prewarm, explain, the miss log, entries compiled for
sm_90 and sm_80 (their shared memory), and GPU-marked tests at real sizes.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import pytest
import torch
from conftest import gpu
from flash_rule import check_rule, seed_of
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR

import lazytriton
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_fwd_mla import binding
from lazytriton.kernels.flash_fwd_mla import dispatch as mla_dispatch
from lazytriton.kernels.flash_fwd_mla.reference import mla_reference
from lazytriton.target import Target

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
SM90, SM80 = Target.parse("sm_90"), Target.parse("sm_80")


class Case(NamedTuple):
    dtype: torch.dtype
    dims: tuple[int, int]  # (q/k head dim, v's)
    qv: bool
    heads: tuple[int, int]
    seqlens: tuple[int, int]
    causal: bool
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0

    def __str__(self) -> str:
        return (f"{str(self.dtype)[6:]}-d{self.dims[0]}-dv{self.dims[1]}-{'qv' if self.qv else 'noqv'}-h{self.heads[0]}"
                f"x{self.heads[1]}-s{self.seqlens[0]}x{self.seqlens[1]}-c{int(self.causal)}-w{self.window}"
                f"-cap{self.softcap}")


# FlashAttention-3's pairs (64 with 256 and 512, qv or not), MLA's 64 + 512 with qv (its 576/512), odd dims.
CASES = [
    Case(BF16, (64, 512), True, (4, 1), (33, 47), True),
    Case(F16, (64, 512), True, (2, 2), (40, 25), False),
    Case(F16, (64, 512), False, (4, 2), (17, 29), True),
    Case(BF16, (64, 256), True, (2, 1), (31, 31), False, (8, 3)),
    Case(F16, (64, 256), True, (3, 3), (20, 45), True, (-1, -1), 5.0),
    Case(F32, (64, 512), True, (2, 1), (9, 33), False),
    Case(BF16, (40, 300), True, (2, 1), (21, 19), True, (6, -1)),
    Case(F16, (64, 64), True, (2, 2), (18, 18), False),
]


def make(case: Case) -> tuple[torch.Tensor, ...]:
    """q, k, v, qv (or None) in FlashAttention's (batch 2, seqlen, heads, dim) layout, fresh normal values."""
    gen = torch.Generator().manual_seed(seed_of(str(case)))
    (hq, hk), (sq, sk), (d, dv) = case.heads, case.seqlens, case.dims

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(case.dtype)

    return randn(2, sq, hq, d), randn(2, sk, hk, d), randn(2, sk, hk, dv), randn(2, sq, hq, dv) if case.qv else None


def bhsd(x: torch.Tensor | None) -> torch.Tensor | None:
    """FlashAttention's (batch, seqlen, heads, dim) as the kernel's (batch, heads, seqlen, dim) view."""
    return None if x is None else x.transpose(1, 2)


def sequence(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    """One packed sequence's rows of a (total, heads, dim) tensor as a (1, heads, rows, dim) view."""
    return None if x is None else x[rows].transpose(0, 1)[None]


def check_against_reference(out: torch.Tensor, lse: torch.Tensor, inputs: tuple[Any, ...], **opts: Any) -> None:
    """out and lse (the kernel's (B, H, S, D) layout) under FlashAttention's rule against the float64 reference."""
    exact = mla_reference(*(None if t is None else t.double() for t in inputs), **opts)
    same = mla_reference(*inputs, **opts)
    check_rule("out", out, exact[0], same[0], OUT_FLOOR[inputs[0].dtype])
    finite = torch.isfinite(exact[1])
    assert torch.equal(torch.isfinite(lse), finite), "rows that see no key: lse -inf"
    check_rule("lse", lse[finite], exact[1][finite], same[1][finite], LSE_FLOOR)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_flash_attn_func_with_qv_and_wide_v_follows_flashattentions_rule(case: Case) -> None:
    q, k, v, qv = make(case)
    out, lse, _ = lazytriton.flash_attn_func(q, k, v, causal=case.causal, window_size=case.window,
                                             softcap=case.softcap, qv=qv, return_attn_probs=True)
    assert out.shape == (*q.shape[:3], v.shape[3]) and out.dtype == q.dtype
    check_against_reference(bhsd(out), lse, (bhsd(q), bhsd(k), bhsd(v), bhsd(qv)),
                            causal="bottom_right" if case.causal else False,
                            window_size=case.window, softcap=case.softcap)


def test_the_latent_form_is_the_qv_form() -> None:
    """MLA's 576/512: q = [q_nope | q_pe] against k = [c_kv | k_pe], v = c_kv, is qv = q_nope, q = q_pe."""
    gen = torch.Generator().manual_seed(576)
    q = torch.randn(1, 24, 4, 576, generator=gen).to(BF16)
    latent = torch.randn(1, 40, 1, 576, generator=gen).to(BF16)
    out = lazytriton.flash_attn_func(q[..., 512:], latent[..., 512:], latent[..., :512], qv=q[..., :512],
                                     causal=True)
    q, latent = q.transpose(1, 2), latent.transpose(1, 2)
    plain, _ = mla_reference(q.double(), latent.double(), latent[..., :512].double(), causal="bottom_right")
    same, _ = mla_reference(q, latent, latent[..., :512], causal="bottom_right")
    check_rule("out", out.transpose(1, 2), plain, same, OUT_FLOOR[BF16])


def test_qvs_default_scale_is_flashattention3s() -> None:
    q, k, v, qv = make(CASES[1])
    given = lazytriton.flash_attn_func(q, k, v, qv=qv, softmax_scale=1.0 / math.sqrt(64 + 512))
    assert torch.equal(lazytriton.flash_attn_func(q, k, v, qv=qv), given)
    qt, kt, vt, qvt = (x.transpose(1, 2) for x in (q, k, v, qv))
    assert binding.check(qt, kt, vt, qvt).attn.scale == pytest.approx(1 / math.sqrt(576))
    assert binding.check(qt, kt, vt, None).attn.scale == pytest.approx(1 / math.sqrt(64))


@pytest.mark.parametrize("qv_on", [True, False])
def test_packed_sequences_follow_flashattentions_rule(qv_on: bool) -> None:
    gen = torch.Generator().manual_seed(7 + qv_on)
    lens_q, hq, d, dv = [5, 0, 37], 2, 64, 512  # key lengths 20, 7, 50
    cu_q = torch.tensor([0, 5, 5, 42], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 27, 77], dtype=torch.int32)
    q, k = torch.randn(42, hq, d, generator=gen).to(BF16), torch.randn(77, 1, d, generator=gen).to(BF16)
    v = torch.randn(77, 1, dv, generator=gen).to(BF16)
    qv = torch.randn(42, hq, dv, generator=gen).to(BF16) if qv_on else None
    out, lse, _ = lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 37, 50, causal=True, window_size=(9, -1),
                                                    qv=qv, return_attn_probs=True)
    assert out.shape == (42, hq, dv) and lse.shape == (hq, 42)
    for i in range(3):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if not lens_q[i]:
            continue
        check_against_reference(sequence(out, rows), lse[None, :, rows],
                                (sequence(q, rows), sequence(k, keys), sequence(v, keys), sequence(qv, rows)),
                                causal="bottom_right", window_size=(9, -1))


def test_the_torch_op_serves_what_the_binding_does() -> None:
    from lazytriton.interface import always_through_op

    q, k, v, qv = make(CASES[0])
    eager = lazytriton.flash_attn_func(q, k, v, qv=qv, causal=True)
    with always_through_op():
        assert torch.equal(lazytriton.flash_attn_func(q, k, v, qv=qv, causal=True), eager)


def test_the_backward_raises_naming_what_is_unsupported() -> None:
    """With qv (a v over 256 columns without qv has the backward of flash_fwd over its pieces: test_value_split)."""
    q, k, v, qv = make(CASES[1])
    q.requires_grad_()
    out = lazytriton.flash_attn_func(q, k, v, qv=qv, causal=True)  # the forward runs
    assert torch.equal(out.detach(), lazytriton.flash_attn_func(q.detach(), k, v, qv=qv, causal=True))
    with pytest.raises(NotImplementedError, match="no backward.*FlashAttention-3 has none"):
        out.sum().backward()


# ---------------------------------------------------------------------------
# Bad input, named before anything runs


def _bad(what: str) -> Any:
    q, k, v, qv = (torch.randn(1, 8, 2, 64), torch.randn(1, 8, 1, 64), torch.randn(1, 8, 1, 512),
                   torch.randn(1, 8, 2, 512))
    calls = {
        "qv shape": lambda: lazytriton.flash_attn_func(q, k, v, qv=qv[..., :300]),
        "qv dtype": lambda: lazytriton.flash_attn_func(q, k, v, qv=qv.half()),
        "qv type": lambda: lazytriton.flash_attn_func(q, k, v, qv=[1.0]),
        "qv strides": lambda: lazytriton.flash_attn_func(q, k, v, qv=torch.randn(1, 8, 2, 1024)[..., ::2]),
        "v head dim": lambda: lazytriton.flash_attn_func(q, k, torch.randn(1, 8, 1, 513)),
        "dropout": lambda: lazytriton.flash_attn_func(q, k, v, qv=qv, dropout_p=0.1),
        "alibi": lambda: lazytriton.flash_attn_func(q, k, v, qv=qv, alibi_slopes=torch.ones(2)),
        "sinks": lambda: lazytriton.flash_attn_func(q, k, v, qv=qv, sinks=torch.zeros(2)),
        "chunk": lambda: lazytriton.flash_attn_func(q, k, v, qv=qv, attention_chunk=-4),
        "chunk type": lambda: lazytriton.flash_attn_func(q, k, v, qv=qv, attention_chunk=4.0),
        "seqused": lambda: lazytriton.flash_attn_varlen_func(
            q[0], k[0], v[0], torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), 8,
            8, qv=qv[0], seqused_k=torch.tensor([4], dtype=torch.int64)),
        "seqused value": lambda: lazytriton.flash_attn_varlen_func(
            q[0], k[0], v[0], torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), 8,
            8, qv=qv[0], seqused_q=torch.tensor([9], dtype=torch.int32)),
        "seqused shape": lambda: lazytriton.flash_attn_varlen_func(
            q[0], k[0], v[0], torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), 8,
            8, qv=qv[0], seqused_k=torch.tensor([4, 4], dtype=torch.int32)),
    }
    return calls[what]


BAD = {"qv shape": (ValueError, r"qv must have shape \(1, 8, 2, 512\)"), "qv dtype": (TypeError, "qv must be"),
       "qv type": (TypeError, "qv must be a torch.Tensor"), "qv strides": (ValueError, "contiguous last dim"),
       "v head dim": (ValueError, r"v's head dim .* 1\.\.512, got 513"), "dropout": (ValueError, "dropout_p"),
       "alibi": (ValueError, "alibi_slopes"), "sinks": (ValueError, "sinks"), "chunk": (ValueError, "attention_chunk"),
       "chunk type": (TypeError, "attention_chunk"), "seqused": (TypeError, "seqused_k"),
       "seqused value": (ValueError, r"seqused_q\[0\] = 9"), "seqused shape": (ValueError, "seqused_k must have shape")}


@pytest.mark.parametrize("what", sorted(BAD))
def test_bad_input_is_named_before_anything_runs(what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def launched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("launched")

    monkeypatch.setattr(binding, "run", launched)
    error, match = BAD[what]
    with pytest.raises(error, match=match):
        _bad(what)()


# ---------------------------------------------------------------------------
# Variants, prewarm, explain, the miss log


def test_the_variant_holds_both_head_dims_and_qv() -> None:
    found = dispatch.kernel_variant("flash_fwd_mla", SM90, "bf16", 64, True, True, 4096, 4096, head_dim_v=512,
                                    qv=True)
    text = str(found)
    assert text.startswith("flash_fwd_mla:sm_90:bf16:") and "QV=true" in text and "BLOCK_DV=512" in text
    assert "BLOCK_D=64" in text and "CAUSAL=true" in text
    assert (found.get("BLOCK_M"), found.get("BLOCK_N"), found.get("num_warps"), found.get("num_stages")) == (64, 32,
                                                                                                              8, 2)
    plain = dispatch.kernel_variant("flash_fwd_mla", SM90, "bf16", 64, False, True, 1, 1, head_dim_v=512)
    assert "QV" not in str(plain) and plain.key() != found.key()
    assert "WINDOW=true" in str(dispatch.kernel_variant("flash_fwd_mla", SM90, "fp16", 64, False, True, 1, 1,
                                                        head_dim_v=256, qv=True, window=True, varlen=True))
    with pytest.raises(ValueError, match="takes no dropout"):
        dispatch.kernel_variant("flash_fwd_mla", SM90, "bf16", 64, False, True, 1, 1, head_dim_v=512, dropout=True)
    assert mla_dispatch.default_config(Target.parse("sm_89"), "bf16", 512).block_n == 16


def test_prewarm_plans_what_calls_select(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton import tuning
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants

    tables = tuning.tables_for(("flash_fwd_mla",))
    assert not enumerate_variants(Axes(targets=(SM90,), kernels=("flash_fwd_mla",)), tables), "asked for only"
    assert not enumerate_variants(Axes(targets=(SM90,), kernels=("flash_fwd_mla",), head_dims_v=(128,)), tables)
    axes = Axes(targets=(SM90,), kernels=("flash_fwd_mla",), dtypes=("bf16",), causal=(True,), head_dims_v=(512, 256))
    planned = {str(p.variant) for p in enumerate_variants(axes, tables)}
    want = dispatch.kernel_variant("flash_fwd_mla", SM90, "bf16", 64, True, True, 4096, 4096, head_dim_v=512)
    assert planned == {str(want)}, "v of 512 without qv (v of 256 without qv is flash_fwd's)"
    with_qv = Axes(targets=(SM90,), kernels=("flash_fwd_mla",), dtypes=("bf16",), causal=(True,), qv=(False, True),
                   head_dims_v=(512, 256))
    planned = {str(p.variant) for p in enumerate_variants(with_qv, tuning.tables_for(("flash_fwd_mla",)))}
    assert len(planned) == 3 and sum("QV=true" in v for v in planned) == 2
    from lazytriton.cli import main as cli_main

    assert cli_main(["prewarm", "--kernel", "flash_fwd_mla", "--target", "sm_90", "--dtype", "bf16", "--head-dim",
                     "64", "--head-dim-v", "512", "--qv", "--list"]) == 0
    listed = capsys.readouterr().out
    assert "flash_fwd_mla:sm_90:bf16:" in listed and "QV=true" in listed and "BLOCK_DV=512" in listed


def test_a_miss_log_line_is_planned() -> None:
    from lazytriton.prewarm.enumeration import variants_from_misses

    found = dispatch.kernel_variant("flash_fwd_mla", SM90, "bf16", 64, True, True, 4096, 4096, head_dim_v=512,
                                    qv=True, varlen=True)
    planned, bad = variants_from_misses([json.dumps({"variant": str(found), "key": found.key(), "compile_s": 1.0})])
    assert not bad and [p.variant for p in planned] == [found]


def test_explain_describes_the_mla_forward(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main as cli_main

    assert cli_main(["cache", "explain", "--kernel", "flash_fwd_mla", "--dtype", "bf16", "--head-dim", "64",
                     "--head-dim-v", "512", "--qv", "--seqlen-q", "4096", "--target", "sm_90"]) == 0
    assert "QV=true" in capsys.readouterr().out
    assert cli_main(["cache", "explain", "--kernel", "flash_fwd_mla", "--dtype", "bf16", "--head-dim", "64",
                     "--head-dim-v", "600", "--seqlen-q", "16", "--target", "sm_90"]) != 0
    assert "1..512" in capsys.readouterr().err


# Shared memory Triton 3.9 reported (Entry.shared) for the default configs, bf16, causal, head dim 64
# (compile_variant on the CPU-only machine): v of 512 with qv at 64 x 32, 2 stages, is 144 KiB of sm_90's 227.
MEASURED_SHARED = [("sm_90", 512, True, 147456), ("sm_90", 512, False, 81920), ("sm_90", 256, True, 122880),
                   ("sm_80", 512, True, 114688)]


@pytest.mark.parametrize(("target", "dim_v", "qv", "shared"), MEASURED_SHARED)
def test_entries_compile_and_fit_shared_memory(target: str, dim_v: int, qv: bool, shared: int,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    """Real entries (Triton's compiler, no GPU): the launch ABI and the shared memory the tiles were sized for."""
    from compiled_once import compiled, shared_dir

    from lazytriton.kernels import get
    from lazytriton.prewarm.limits import KNOWN_TARGETS

    variant = dispatch.kernel_variant("flash_fwd_mla", Target.parse(target), "bf16", 64, True, True, 4096, 4096,
                                      head_dim_v=dim_v, qv=qv)
    entry = compiled(variant, shared_dir(tmp_path_factory))
    assert len(entry.arg_types) == len(get("flash_fwd_mla").params) and entry.num_warps == 8
    assert entry.shared <= KNOWN_TARGETS[target].shared
    assert entry.shared == shared, f"{variant}: Triton reports {entry.shared} bytes (the table above says {shared})"


# ---------------------------------------------------------------------------
# On the GPU, at real sizes


@gpu
@pytest.mark.parametrize(("dv", "qv_on", "causal", "seqlen"), [(512, True, True, 2048), (512, True, False, 1024),
                                                                (256, True, True, 1024), (512, False, True, 2048)])
def test_mla_forward_gpu(dv: int, qv_on: bool, causal: bool, seqlen: int) -> None:
    """FlashAttention-3's shapes on the GPU (bf16, 16 heads, MQA), against float64 and bf16 references there."""
    gen = torch.Generator(device="cuda").manual_seed(dv + seqlen + causal)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cuda").to(BF16)

    q, k, v = randn(2, seqlen, 16, 64), randn(2, seqlen, 1, 64), randn(2, seqlen, 1, dv)
    qv = randn(2, seqlen, 16, dv) if qv_on else None
    out, lse, _ = lazytriton.flash_attn_func(q, k, v, qv=qv, causal=causal, return_attn_probs=True)
    check_against_reference(bhsd(out), lse, (bhsd(q), bhsd(k), bhsd(v), bhsd(qv)),
                            causal="bottom_right" if causal else False)


@gpu
def test_mla_varlen_forward_gpu() -> None:
    """Packed sequences of MLA's prefill (qv 512), GQA 16/1, each sequence against the references."""
    gen = torch.Generator(device="cuda").manual_seed(41)
    lens = [1, 700, 1500, 33]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lens)
    q, k = (torch.randn(total, h, 64, generator=gen, device="cuda").to(BF16) for h in (16, 1))
    v = torch.randn(total, 1, 512, generator=gen, device="cuda").to(BF16)
    qv = torch.randn(total, 16, 512, generator=gen, device="cuda").to(BF16)
    out, lse, _ = lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, qv=qv,
                                                    return_attn_probs=True)
    for i in range(len(lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        check_against_reference(sequence(out, rows), lse[None, :, rows],
                                (sequence(q, rows), sequence(k, rows), sequence(v, rows), sequence(qv, rows)),
                                causal="bottom_right")
