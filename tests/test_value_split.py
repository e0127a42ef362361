"""A v of 257..512 columns without qv that the MLA forward cannot serve: flash_fwd over v's pieces (value_split).

FlashAttention-3's tests run q/k of 64 with v of 512 under attention_chunk and seqused_q/seqused_k, which the MLA
forward (kernels/flash_fwd_mla) lacks; those calls run the regular forward on v's first 256 columns and on the
rest, outputs joined, and get the regular backward. Numerics against a float64 reference under FlashAttention's
rule (out and lse at most 2x a same-dtype reference's error, the gradients 3x), on CPU through Triton's
interpreter on small shapes, v of 512 and 320 (256 + 64); then the routing (pieces only where the MLA forward
cannot serve), dropout's one mask, torch.compile, bad input, prewarm and cache explain, and GPU-marked cases.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
from conftest import assert_compiled_grads_equal
from flash_rule import check_rule, references, seed_of
from test_flash_bwd import GRAD_FLOOR
from test_flash_fwd import LSE_FLOOR, OUT_FLOOR, on_gpu
from varlen_cases import cu, packed_reference

import lazytriton
from lazytriton import geometry, mla_calls, value_split
from lazytriton.kernels.flash_fwd.reference import attention_reference
from lazytriton.target import Target

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
SM90 = Target.parse("sm_90")


def test_value_pieces_are_the_first_256_columns_and_the_rest() -> None:
    assert geometry.value_pieces(0) == (0,) and geometry.value_pieces(256) == (256,)
    assert geometry.value_pieces(512) == (256, 256) and geometry.value_pieces(320) == (256, 64)
    assert geometry.value_pieces(257) == (256, 1)
    with pytest.raises(ValueError, match="at most 512"):
        geometry.value_pieces(513)


class Case(NamedTuple):
    dtype: torch.dtype
    dims: tuple[int, int]  # (q/k head dim, v's)
    heads: tuple[int, int]
    seqlens: tuple[int, int]
    causal: bool
    chunk: int = 0
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: bool = False
    alibi: bool = False

    def __str__(self) -> str:
        return (f"{str(self.dtype)[6:]}-d{self.dims[0]}-dv{self.dims[1]}-h{self.heads[0]}x{self.heads[1]}-"
                f"s{self.seqlens[0]}x{self.seqlens[1]}-c{int(self.causal)}-chunk{self.chunk}-w{self.window}-"
                f"cap{self.softcap}-sinks{int(self.sinks)}-alibi{int(self.alibi)}")


CASES = [
    Case(BF16, (64, 512), (4, 1), (33, 47), True, chunk=8),  # FlashAttention-3's d 64 / dv 512 with a chunk
    Case(F16, (32, 320), (2, 2), (40, 25), False, chunk=11),  # 256 + 64
    Case(F32, (32, 512), (4, 2), (17, 29), True),  # a gradient alone sends it to the pieces
    Case(F16, (16, 300), (2, 1), (21, 19), True, chunk=5, window=(6, -1), softcap=4.0),  # 256 + 44
    Case(F32, (32, 320), (2, 2), (18, 24), False, sinks=True),
    Case(BF16, (32, 512), (2, 1), (20, 31), True, alibi=True),
]


def make(case: Case) -> dict[str, Any]:
    """q, k, v, dout in FlashAttention's (batch 2, seqlen, heads, dim) layout, sinks and slopes: fresh values."""
    gen = torch.Generator().manual_seed(seed_of(str(case)))
    (hq, hk), (sq, sk), (d, dv) = case.heads, case.seqlens, case.dims

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(case.dtype)

    return {"q": randn(2, sq, hq, d), "k": randn(2, sk, hk, d), "v": randn(2, sk, hk, dv), "do": randn(2, sq, hq, dv),
            "sinks": torch.randn(hq, generator=gen) if case.sinks else None,
            "alibi_slopes": torch.rand(hq, generator=gen) * 0.5 if case.alibi else None}


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_flash_attn_func_over_vs_pieces_follows_flashattentions_rule(case: Case) -> None:
    inputs = make(case)
    leaves = [inputs[n].clone().requires_grad_() for n in ("q", "k", "v")]
    sinks = None if inputs["sinks"] is None else inputs["sinks"].clone().requires_grad_()
    out, lse, _ = lazytriton.flash_attn_func(*leaves, causal=case.causal, window_size=case.window,
                                             softcap=case.softcap, attention_chunk=case.chunk, sinks=sinks,
                                             alibi_slopes=inputs["alibi_slopes"], return_attn_probs=True)
    assert out.shape == (*inputs["q"].shape[:3], case.dims[1]) and out.dtype == case.dtype
    wrt = (*leaves, sinks) if sinks is not None else leaves
    grads = torch.autograd.grad(out, wrt, inputs["do"])

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  *sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = attention_reference(_bhsd(q), _bhsd(k), _bhsd(v), causal="bottom_right" if case.causal else False,
                                     window_size=case.window, softcap=case.softcap, attention_chunk=case.chunk,
                                     sinks=sink[0].float() if sink else None, alibi_slopes=inputs["alibi_slopes"])
        return _bhsd(o), lse

    given = [inputs[n] for n in ("q", "k", "v")] + ([inputs["sinks"]] if sinks is not None else [])
    exact, same = references(reference, given, inputs["do"])
    check_rule("out", out, exact.out, same.out, OUT_FLOOR[case.dtype])
    finite = torch.isfinite(exact.lse)
    assert torch.equal(torch.isfinite(lse), finite)
    check_rule("lse", lse[finite], exact.lse[finite], same.lse[finite], LSE_FLOOR)
    for name, got, x, s in zip(("dq", "dk", "dv", "dsinks"), grads, exact.grads, same.grads, strict=False):
        check_rule(name, got, x, s, GRAD_FLOOR[case.dtype] if name != "dsinks" else GRAD_FLOOR[F32], 3)


class Packed(NamedTuple):
    dtype: torch.dtype
    dims: tuple[int, int]
    heads: tuple[int, int]
    spans_q: tuple[int, ...]
    spans_k: tuple[int, ...]
    used_q: tuple[int, ...] | None
    used_k: tuple[int, ...] | None
    causal: bool
    chunk: int = 0

    def __str__(self) -> str:
        return (f"{str(self.dtype)[6:]}-d{self.dims[0]}-dv{self.dims[1]}-h{self.heads[0]}x{self.heads[1]}-"
                f"q{self.spans_q}u{self.used_q}-k{self.spans_k}u{self.used_k}-c{int(self.causal)}-chunk{self.chunk}")


PACKED = [
    Packed(BF16, (64, 512), (4, 1), (9, 20, 3), (12, 6, 19), (5, 20, 0), (12, 2, 10), True),  # seqused, causal
    Packed(F16, (32, 320), (2, 2), (13, 7), (18, 21), None, (11, 21), False),  # seqused_k alone
    Packed(F32, (32, 512), (2, 1), (11, 17), (19, 17), None, None, True, chunk=6),  # attention_chunk, packed
    Packed(F16, (16, 320), (2, 1), (14, 9), (20, 9), (10, 9), None, False, chunk=4),  # both
]


def _used_rows(spans: tuple[int, ...], used: tuple[int, ...] | None) -> torch.Tensor:
    return torch.cat([torch.arange(span) < n for span, n in zip(spans, used or spans, strict=True)])


@pytest.mark.parametrize("case", PACKED, ids=str)
def test_flash_attn_varlen_func_over_vs_pieces_follows_flashattentions_rule(case: Packed) -> None:
    gen = torch.Generator().manual_seed(seed_of(str(case)))
    (hq, hk), (d, dv) = case.heads, case.dims
    tq, tk = sum(case.spans_q), sum(case.spans_k)
    q, k, v, do = (torch.randn(shape, generator=gen).to(case.dtype)
                   for shape in ((tq, hq, d), (tk, hk, d), (tk, hk, dv), (tq, hq, dv)))
    used = {name: None if n is None else torch.tensor(n, dtype=torch.int32)
            for name, n in (("seqused_q", case.used_q), ("seqused_k", case.used_k))}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = lazytriton.flash_attn_varlen_func(*leaves, cu(case.spans_q), cu(case.spans_k), max(case.spans_q),
                                                    max(case.spans_k), causal=case.causal, return_attn_probs=True,
                                                    attention_chunk=case.chunk, **used)
    dq, dk, dvg = torch.autograd.grad(out, leaves, do)
    rows_q, rows_k = _used_rows(case.spans_q, case.used_q), _used_rows(case.spans_k, case.used_k)
    assert (out[~rows_q] == 0).all() and (dq[~rows_q] == 0).all() and (dk[~rows_k] == 0).all()

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not case.chunk:
            return packed_reference(q, k, v, case.spans_q, case.spans_k, used_q=case.used_q, used_k=case.used_k,
                                    causal=case.causal)
        outs, lses = [], []  # packed_reference has no chunk: sequence by sequence here
        cq, ck = cu(case.spans_q).tolist(), cu(case.spans_k).tolist()
        uq, uk = case.used_q or case.spans_q, case.used_k or case.spans_k
        for i in range(len(case.spans_q)):
            qs = q[cq[i]:cq[i] + uq[i]].transpose(0, 1)[None]
            ks, vs = (t[ck[i]:ck[i] + uk[i]].transpose(0, 1)[None] for t in (k, v))
            o, l_ = attention_reference(qs, ks, vs, causal="bottom_right" if case.causal else False,
                                        attention_chunk=case.chunk)
            outs.append(o[0].transpose(0, 1))
            lses.append(l_[0])
        return torch.cat(outs), torch.cat(lses, dim=1)

    exact, same = references(reference, (q, k, v), do[rows_q])
    check_rule("out", out[rows_q], exact.out, same.out, OUT_FLOOR[case.dtype])
    no_key = torch.isneginf(exact.lse)
    check_rule("lse", lse[:, rows_q][~no_key], exact.lse[~no_key], same.lse[~no_key], LSE_FLOOR)
    for name, got, x, s, rows in zip(("dq", "dk", "dv"), (dq, dk, dvg), exact.grads, same.grads,
                                     (rows_q, rows_k, rows_k), strict=True):
        check_rule(name, got[rows], x[rows], s[rows], GRAD_FLOOR[case.dtype], 3)


# ---------------------------------------------------------------------------
# The routing: pieces only where the MLA forward cannot serve the call


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which forward served each public call: "pieces" (value_split), "mla" (flash_fwd_mla) or "flash_fwd"."""
    seen: list[str] = []
    for module, name, label in ((value_split, "attention", "pieces"), (value_split, "varlen_attention", "pieces"),
                                (mla_calls.binding, "forward", "mla"), (mla_calls.binding, "varlen_forward", "mla")):
        original = getattr(module, name)

        def spy(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            seen.append(_label)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return seen


def _small(dv: int, grad: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(dv)
    q, k, v = (torch.randn(1, 9, 2, d, generator=gen) for d in (16, 16, dv))
    return (q.requires_grad_(grad), k, v)


@pytest.mark.parametrize(("what", "want"), [
    ("plain", "mla"), ("window and softcap", "mla"), ("chunk", "pieces"), ("grad", "pieces"),
    ("grad under no_grad", "mla"), ("sinks", "pieces"), ("alibi", "pieces"), ("dropout", "pieces"),
    ("qv", "mla"), ("v of 256 with a chunk", "flash_fwd")])
def test_pieces_serve_only_what_the_mla_forward_cannot(what: str, want: str, served: list[str]) -> None:
    q, k, v = _small(256 if "256" in what else 320, grad=what.startswith("grad"))
    qv = torch.randn(*q.shape[:3], v.shape[-1]) if what == "qv" else None
    extra = {"window and softcap": {"window_size": (3, 1), "softcap": 2.0}, "chunk": {"attention_chunk": 4},
             "v of 256 with a chunk": {"attention_chunk": 4}, "sinks": {"sinks": torch.zeros(2)},
             "alibi": {"alibi_slopes": torch.ones(2) * 0.1}, "dropout": {"dropout_p": 0.2}}.get(what, {})
    if what == "grad under no_grad":
        with torch.no_grad():
            lazytriton.flash_attn_func(q, k, v, causal=True)
    else:
        lazytriton.flash_attn_func(q, k, v, causal=True, qv=qv, **extra)
    assert served == ([] if want == "flash_fwd" else [want])


@pytest.mark.parametrize(("what", "want"), [("plain", "mla"), ("seqused_k", "pieces"), ("chunk", "pieces"),
                                            ("grad", "pieces")])
def test_packed_pieces_serve_only_what_the_mla_forward_cannot(what: str, want: str, served: list[str]) -> None:
    q, k, v = (t[0] for t in _small(512))
    q.requires_grad_(what == "grad")
    c = torch.tensor([0, 4, 9], dtype=torch.int32)
    extra = {"seqused_k": {"seqused_k": torch.tensor([3, 5], dtype=torch.int32)},
             "chunk": {"attention_chunk": 2}}.get(what, {})
    lazytriton.flash_attn_varlen_func(q, k, v, c, c, 5, 5, causal=True, **extra)
    assert served == [want]


def test_the_pieces_agree_with_the_mla_forward_where_both_serve() -> None:
    """Without a gradient the MLA forward serves; with one, the pieces: the same attention."""
    q, k, v = _small(512)
    mla = lazytriton.flash_attn_func(q, k, v, causal=True)
    pieces = lazytriton.flash_attn_func(q.clone().requires_grad_(), k, v, causal=True)
    exact, _ = attention_reference(*(_bhsd(t).double() for t in (q, k, v)), causal="bottom_right")
    same, _ = attention_reference(*(_bhsd(t) for t in (q, k, v)), causal="bottom_right")
    for got in (mla, pieces.detach()):
        check_rule("out", _bhsd(got), exact, same, OUT_FLOOR[F32])


def test_dropout_drops_the_same_probabilities_in_both_pieces() -> None:
    """One Philox pair for both calls: the output is the reference's with that one mask."""
    from lazytriton.kernels.flash_fwd import score_mods
    from lazytriton.kernels.flash_fwd.reference import dropout_keep

    q, k, v = _small(320)
    torch.manual_seed(11)
    out = lazytriton.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    torch.manual_seed(11)  # the pair the call drew
    keep = dropout_keep(score_mods.draw_philox(torch.device("cpu"), 0), (1, 2, 9, 9), 0.3)
    exact, _ = attention_reference(*(_bhsd(t).double() for t in (q, k, v)), causal="bottom_right", dropout_p=0.3,
                                   keep=keep)
    same, _ = attention_reference(*(_bhsd(t) for t in (q, k, v)), causal="bottom_right", dropout_p=0.3, keep=keep)
    check_rule("out", _bhsd(out), exact, same, OUT_FLOOR[F32])


def test_torch_compile_traces_the_pieces_with_their_backward() -> None:
    q, k, v = _small(512)
    do = torch.randn(*q.shape[:3], 512, generator=torch.Generator().manual_seed(3))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_func(q * 2, k, v, causal=True, attention_chunk=4) * 3  # type: ignore[no-any-return]

    assert_compiled_grads_equal(fn, (q, k, v), do)


def test_torch_compile_traces_packed_pieces_with_seqused() -> None:
    q, k, v = (t[0] for t in _small(320))
    c, used = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    do = torch.randn(9, 2, 320, generator=torch.Generator().manual_seed(5))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return lazytriton.flash_attn_varlen_func(q, k, v, c, c, 5, 5, causal=True,  # type: ignore[no-any-return]
                                                 seqused_k=used)

    assert_compiled_grads_equal(fn, (q, k, v), do)


def test_the_op_path_gives_the_eager_result() -> None:
    from lazytriton.interface import always_through_op

    q, k, v = _small(320)
    c = torch.tensor([0, 4, 9], dtype=torch.int32)
    eager = lazytriton.flash_attn_func(q, k, v, attention_chunk=3), lazytriton.flash_attn_varlen_func(
        q[0], k[0], v[0], c, c, 5, 5, seqused_q=torch.tensor([4, 2], dtype=torch.int32))
    with always_through_op():
        assert torch.equal(lazytriton.flash_attn_func(q, k, v, attention_chunk=3), eager[0])
        assert torch.equal(lazytriton.flash_attn_varlen_func(
            q[0], k[0], v[0], c, c, 5, 5, seqused_q=torch.tensor([4, 2], dtype=torch.int32)), eager[1])


BAD = {
    "v of 513": (lambda q, k, v: lazytriton.flash_attn_func(q, k, torch.randn(1, 9, 2, 513), attention_chunk=4),
                 ValueError, r"v's head dim .* 1\.\.512, got 513"),
    "chunk type": (lambda q, k, v: lazytriton.flash_attn_func(q, k, v, attention_chunk=2.0), TypeError,
                   "attention_chunk must be an int"),
    "negative chunk": (lambda q, k, v: lazytriton.flash_attn_func(q, k, v, attention_chunk=-1), ValueError,
                       "attention_chunk must be >= 0"),
    "sinks shape": (lambda q, k, v: lazytriton.flash_attn_func(q, k, v, sinks=torch.zeros(3)), ValueError, "sinks"),
    "k and v lengths": (lambda q, k, v: lazytriton.flash_attn_func(q, k, v[:, :5], attention_chunk=4), ValueError,
                        "k and v must have the same shape"),
    "sinks with qv": (lambda q, k, v: lazytriton.flash_attn_func(q, k, v, qv=torch.randn(1, 9, 2, 320),
                                                                 sinks=torch.zeros(2)), ValueError,
                      "sinks is not taken with qv"),
    "seqused shape": (lambda q, k, v: lazytriton.flash_attn_varlen_func(
        q[0], k[0], v[0], torch.tensor([0, 9], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32), 9, 9,
        seqused_k=torch.tensor([1, 2], dtype=torch.int32)), ValueError, "seqused_k"),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_bad_input_is_named_before_anything_runs(what: str, no_launch: None) -> None:
    call, error, match = BAD[what]
    with pytest.raises(error, match=match):
        call(*_small(320, grad=True))


# ---------------------------------------------------------------------------
# Prewarm and cache explain plan the pieces' variants


def test_prewarm_plans_the_pieces_for_flash_fwd_and_flash_bwd() -> None:
    from lazytriton import tuning
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants

    kernels = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv")
    tables = tuning.tables_for(kernels)
    for dim_v, pieces in ((512, ("BLOCK_DV=256",)), (320, ("BLOCK_DV=256", None))):
        axes = Axes(targets=(SM90,), kernels=kernels, dtypes=("bf16",), head_dims=(64,), head_dims_v=(dim_v,),
                    causal=(False,), chunk=(True,))
        planned = [str(p.variant) for p in enumerate_variants(axes, tables)]
        for kernel in kernels:
            ours = [v for v in planned if v.startswith(f"{kernel}:") and "CHUNK=true" in v]
            assert ours and not any("BLOCK_DV=512" in v for v in ours)
            assert any("BLOCK_DV=256" in v for v in ours)
            if None in pieces:  # the 64-column piece is q's head dim: no BLOCK_DV of its own
                assert any("BLOCK_DV" not in v for v in ours)


def test_explain_reports_each_pieces_variant(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from lazytriton.cli import main as cli_main

    args = ["cache", "explain", "--dtype", "bf16", "--head-dim", "64", "--seqlen-q", "1024", "--target", "sm_90",
            "--attention-chunk", "--json"]
    assert cli_main([*args, "--head-dim-v", "512"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [k["v_columns"] for k in report["kernels"]] == [[0, 256], [256, 512]]
    assert all("BLOCK_DV=256" in k["variant"] and "CHUNK=true" in k["variant"] for k in report["kernels"])
    assert cli_main([*args, "--head-dim-v", "320", "--kernel", "flash_bwd"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(k["kernel"], k["v_columns"]) for k in report["kernels"]] == [
        ("flash_bwd_dq", [0, 256]), ("flash_bwd_dq", [256, 320]), ("flash_bwd_dkdv", [0, 256]),
        ("flash_bwd_dkdv", [256, 320])]
    assert cli_main([*args[:-1], "--head-dim-v", "512"]) == 0
    assert "v's 512 columns in two pieces, 0:256 and 256:512" in capsys.readouterr().out
    assert cli_main([*args, "--head-dim-v", "512", "--kernel", "flash_fwd_mla"]) != 0
    assert "flash_fwd_mla takes no --attention-chunk" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# On the GPU: FlashAttention-3's sizes


@on_gpu
@pytest.mark.parametrize("dim_v", [512, 320])
def test_gpu_pieces_with_chunk_and_seqused_follow_flashattentions_rule(dim_v: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(dim_v)
    q, k, v, do = (torch.randn(shape, generator=gen, device="cuda", dtype=BF16)
                   for shape in ((2, 1024, 8, 64), (2, 1024, 2, 64), (2, 1024, 2, dim_v), (2, 1024, 8, dim_v)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = lazytriton.flash_attn_func(*leaves, causal=True, attention_chunk=256)
    grads = torch.autograd.grad(out, leaves, do)

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = attention_reference(_bhsd(q), _bhsd(k), _bhsd(v), causal="bottom_right", attention_chunk=256)
        return _bhsd(o), lse

    exact, same = references(reference, (q, k, v), do)
    check_rule("out", out, exact.out, same.out, OUT_FLOOR[BF16])
    for name, got, x, s in zip(("dq", "dk", "dv"), grads, exact.grads, same.grads, strict=True):
        check_rule(name, got, x, s, GRAD_FLOOR[BF16], 3)
    spans = (300, 724, 1000)
    c = cu(spans).cuda()
    packed = [t.flatten(0, 1)[:sum(spans)] for t in (q, k, v)]
    used = torch.tensor([200, 724, 17], dtype=torch.int32, device="cuda")
    got = lazytriton.flash_attn_varlen_func(*packed, c, c, 1000, 1000, causal=True, seqused_k=used)
    want_exact = packed_reference(*(t.double() for t in packed), spans, spans, used_k=(200, 724, 17), causal=True)
    want_same = packed_reference(*packed, spans, spans, used_k=(200, 724, 17), causal=True)
    check_rule("varlen out", got, want_exact[0], want_same[0], OUT_FLOOR[BF16])
