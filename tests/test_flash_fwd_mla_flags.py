"""flash_fwd_mla's CHUNK and SEQUSED_Q/SEQUSED_K: FlashAttention-3's attention_chunk and seqused with ``qv``.

Numerics on CPU through Triton's interpreter against the float64 reference (``flash_fwd_mla.reference``) under
FlashAttention's rule, tiny shapes: chunks with causal masks and windows (chunks smaller, larger and not a
multiple of the interpreter's 16-key blocks), qv with v of 512 and 256, GQA; seqused_q/seqused_k on packed
sequences and on a padded batch (every span the same length); the torch op; then bad input, the variants (off
flags keep today's strings), the memo key, prewarm, explain, the miss log, and GPU-marked tests at real sizes.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import pytest
import torch
from conftest import gpu
from flash_rule import seed_of
from test_flash_fwd_mla import bhsd, check_against_reference, sequence

import lazytriton
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_fwd_mla import binding
from lazytriton.target import Target

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
F16, BF16 = torch.float16, torch.bfloat16
SM90 = Target.parse("sm_90")


class ChunkCase(NamedTuple):
    dtype: torch.dtype
    dv: int
    heads: tuple[int, int]
    seqlens: tuple[int, int]
    causal: bool
    chunk: int
    window: tuple[int, int] = (-1, -1)

    def __str__(self) -> str:
        return (f"{str(self.dtype)[6:]}-dv{self.dv}-h{self.heads[0]}x{self.heads[1]}-s{self.seqlens[0]}x"
                f"{self.seqlens[1]}-c{int(self.causal)}-chunk{self.chunk}-w{self.window}")


CHUNK_CASES = [
    ChunkCase(BF16, 512, (4, 1), (33, 47), True, 16),
    ChunkCase(F16, 256, (2, 2), (40, 25), False, 7),
    ChunkCase(BF16, 256, (4, 2), (29, 29), True, 20, (9, -1)),
    ChunkCase(F16, 512, (2, 1), (21, 50), False, 12, (5, 3)),
    ChunkCase(BF16, 256, (3, 1), (45, 18), True, 40),
    ChunkCase(F16, 256, (2, 1), (17, 33), False, 64, (4, 4)),
]


def _randn(gen: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("case", CHUNK_CASES, ids=str)
def test_chunks_with_qv_follow_flashattentions_rule(case: ChunkCase) -> None:
    gen = torch.Generator().manual_seed(seed_of(str(case)))
    (hq, hk), (sq, sk) = case.heads, case.seqlens
    q, k = _randn(gen, case.dtype, 2, sq, hq, 64), _randn(gen, case.dtype, 2, sk, hk, 64)
    v, qv = _randn(gen, case.dtype, 2, sk, hk, case.dv), _randn(gen, case.dtype, 2, sq, hq, case.dv)
    out, lse, _ = lazytriton.flash_attn_func(q, k, v, qv=qv, causal=case.causal, window_size=case.window,
                                             attention_chunk=case.chunk, return_attn_probs=True)
    assert out.shape == (2, sq, hq, case.dv)
    check_against_reference(bhsd(out), lse, (bhsd(q), bhsd(k), bhsd(v), bhsd(qv)),
                            causal="bottom_right" if case.causal else False, window_size=case.window,
                            attention_chunk=case.chunk)


def test_a_chunk_changes_the_result_and_one_past_the_keys_does_not() -> None:
    """The chunk is read: a small one differs from none, one covering every key is none."""
    gen = torch.Generator().manual_seed(11)
    q, k, v, qv = (_randn(gen, BF16, 1, 24, 2, d) for d in (64, 64, 256, 256))
    plain = lazytriton.flash_attn_func(q, k, v, qv=qv, causal=True)
    assert not torch.equal(lazytriton.flash_attn_func(q, k, v, qv=qv, causal=True, attention_chunk=8), plain)
    assert torch.equal(lazytriton.flash_attn_func(q, k, v, qv=qv, causal=True, attention_chunk=64), plain)


def _packed(gen: torch.Generator, dtype: torch.dtype, spans_q: list[int], spans_k: list[int], hq: int, hk: int,
            dv: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, qv packed by the spans, cu_seqlens_q, cu_seqlens_k; rows past the used lengths are garbage too."""
    cu_q = torch.tensor([0, *torch.tensor(spans_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(spans_k).cumsum(0).tolist()], dtype=torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q, k = _randn(gen, dtype, tq, hq, 64), _randn(gen, dtype, tk, hk, 64)
    v, qv = _randn(gen, dtype, tk, hk, dv), _randn(gen, dtype, tq, hq, dv)
    return q, k, v, qv, cu_q, cu_k


def _check_used(out: torch.Tensor, lse: torch.Tensor, inputs: tuple[torch.Tensor, ...], used_q: list[int],
                used_k: list[int], **opts: Any) -> None:
    """Each sequence's used rows against the references on its used keys; the rest of each span out 0, lse -inf."""
    q, k, v, qv, cu_q, cu_k = inputs
    for i, (nq, nk) in enumerate(zip(used_q, used_k, strict=True)):
        start_q, start_k, end_q = int(cu_q[i]), int(cu_k[i]), int(cu_q[i + 1])
        rows, keys = slice(start_q, start_q + nq), slice(start_k, start_k + nk)
        if nq and nk:
            check_against_reference(sequence(out, rows), lse[None, :, rows], (sequence(q, rows), sequence(k, keys),
                                    sequence(v, keys), sequence(qv, rows)), **opts)
        elif nq:
            assert torch.equal(out[rows], torch.zeros_like(out[rows])) and torch.isneginf(lse[:, rows]).all()
        rest = slice(start_q + nq, end_q)
        assert torch.equal(out[rest], torch.zeros_like(out[rest])), f"sequence {i}'s unused rows: out 0"
        assert torch.isneginf(lse[:, rest]).all(), f"sequence {i}'s unused rows: lse -inf"


SEQUSED_CASES = [  # (spans_q, spans_k, used_q or None, used_k or None, causal, window, chunk, dv)
    ([20, 7, 33], [40, 9, 30], [13, 0, 33], [25, 9, 17], True, (-1, -1), 0, 512),
    ([18, 30], [18, 44], None, [11, 44], False, (6, 2), 0, 256),
    ([25, 12], [31, 12], [25, 5], None, True, (-1, -1), 8, 256),
    ([24, 24, 24], [24, 24, 24], [24, 9, 17], [20, 24, 3], True, (7, -1), 10, 512),  # a padded batch
]


@pytest.mark.parametrize(("spans_q", "spans_k", "used_q", "used_k", "causal", "window", "chunk", "dv"),
                         SEQUSED_CASES)
def test_seqused_with_qv_follows_flashattentions_rule(spans_q: list[int], spans_k: list[int],
                                                      used_q: list[int] | None, used_k: list[int] | None,
                                                      causal: bool, window: tuple[int, int], chunk: int,
                                                      dv: int) -> None:
    gen = torch.Generator().manual_seed(seed_of(f"{spans_q}{spans_k}{used_q}{used_k}{chunk}"))
    inputs = _packed(gen, BF16, spans_q, spans_k, 4, 2, dv)
    q, k, v, qv, cu_q, cu_k = inputs
    given = {name: None if used is None else torch.tensor(used, dtype=torch.int32)
             for name, used in (("seqused_q", used_q), ("seqused_k", used_k))}
    out, lse, _ = lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(spans_q), max(spans_k), causal=causal,
                                                    window_size=window, attention_chunk=chunk, qv=qv,
                                                    return_attn_probs=True, **given)
    assert out.shape == (q.shape[0], 4, dv) and lse.shape == (4, q.shape[0])
    _check_used(out, lse, inputs, used_q or spans_q, used_k or spans_k,
                causal="bottom_right" if causal else False, window_size=window, attention_chunk=chunk)


def test_keys_past_seqused_are_never_read() -> None:
    """NaN in the unused keys and values changes nothing (the kernel never loads them)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, qv, cu_q, cu_k = _packed(gen, F16, [9, 14], [20, 16], 2, 1, 256)
    used_k = torch.tensor([12, 16], dtype=torch.int32)
    first = lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 14, 20, qv=qv, seqused_k=used_k, causal=True)
    k[12:20], v[12:20] = float("nan"), float("nan")
    assert torch.equal(lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 14, 20, qv=qv, seqused_k=used_k,
                                                         causal=True), first)


def test_the_torch_ops_serve_what_the_binding_does() -> None:
    from lazytriton.interface import always_through_op

    gen = torch.Generator().manual_seed(3)
    q, k, v, qv = (_randn(gen, BF16, 1, 20, 2, d) for d in (64, 64, 256, 256))
    packed = _packed(gen, BF16, [10, 12], [16, 12], 2, 1, 256)
    used = torch.tensor([7, 12], dtype=torch.int32)

    def calls() -> tuple[torch.Tensor, torch.Tensor]:
        pq, pk, pv, pqv, cu_q, cu_k = packed
        return (lazytriton.flash_attn_func(q, k, v, qv=qv, causal=True, attention_chunk=6),
                lazytriton.flash_attn_varlen_func(pq, pk, pv, cu_q, cu_k, 12, 16, qv=pqv, causal=True,
                                                  attention_chunk=5, seqused_q=used, seqused_k=used))

    eager = calls()
    with always_through_op():
        through = calls()
    assert all(torch.equal(a, b) for a, b in zip(eager, through, strict=True))


def test_without_qv_a_wide_v_with_these_flags_still_runs_over_vs_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    def launched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("flash_fwd_mla launched without qv")

    monkeypatch.setattr(binding, "run", launched)
    gen = torch.Generator().manual_seed(9)
    q, k, v = (_randn(gen, BF16, 1, 16, 1, d) for d in (64, 64, 300))
    assert lazytriton.flash_attn_func(q, k, v, causal=True, attention_chunk=4).shape == (1, 16, 1, 300)


# ---------------------------------------------------------------------------
# Bad input (test_flash_fwd_mla's table holds the public functions' errors), variants, keys, prewarm, explain


def test_seqused_without_packed_sequences_is_refused_by_the_family() -> None:
    with pytest.raises(ValueError, match="seqused_q/seqused_k need packed sequences"):
        dispatch.kernel_variant("flash_fwd_mla", SM90, "bf16", 64, True, True, 1, 1, head_dim_v=512, qv=True,
                                seqused_k=True)


def test_off_flags_keep_todays_strings_and_on_flags_are_written() -> None:
    plain = dispatch.kernel_variant("flash_fwd_mla", SM90, "bf16", 64, True, True, 4096, 4096, head_dim_v=512,
                                    qv=True, varlen=True)
    assert str(plain) == ("flash_fwd_mla:sm_90:bf16:ALIGN16=true,BLOCK_D=64,BLOCK_DV=512,CAUSAL=true,EVEN_D=true,"
                          "EVEN_DV=true,INDEX64=false,QV=true,VARLEN=true:BLOCK_M=64,BLOCK_N=32:num_stages=2,"
                          "num_warps=8")
    chunked = dispatch.kernel_variant("flash_fwd_mla", SM90, "bf16", 64, True, True, 4096, 4096, head_dim_v=512,
                                      qv=True, varlen=True, chunk=True, seqused_q=True, seqused_k=True)
    text = str(chunked)
    assert "CHUNK=true" in text and "SEQUSED_Q=true" in text and "SEQUSED_K=true" in text
    assert text.replace("CHUNK=true,", "").replace(",SEQUSED_K=true,SEQUSED_Q=true", "") == str(plain)
    assert len({plain.key(), chunked.key()}) == 2


def test_the_memo_key_grows_only_with_the_flags() -> None:
    qt, kt, vt, qvt = (torch.empty(1, 2, 16, d, device="meta") for d in (64, 64, 512, 512))
    call = binding.check(qt, kt, vt, qvt, "bottom_right")
    short = binding.memo_key(0, torch.bfloat16, call, call.attn.shape, True, False)
    assert len(short) == 14
    chunked = binding.check(qt, kt, vt, qvt, "bottom_right", attention_chunk=8)
    assert chunked.attn.attention_chunk == 8 and chunked.attn.offset == 0
    assert binding.memo_key(0, torch.bfloat16, chunked, call.attn.shape, True, False) == (*short, binding.CHUNK_TAG)
    used = binding.memo_key(0, torch.bfloat16, call, call.attn.shape, True, False, True, (False, True))
    assert used[:13] == short[:13] and used[13:] == (True, "seqused", False, True)


def test_prewarm_plans_chunk_and_seqused_for_qv_calls_only() -> None:
    from lazytriton import tuning
    from lazytriton.prewarm.enumeration import Axes, enumerate_variants

    axes = Axes(targets=(SM90,), kernels=("flash_fwd_mla",), dtypes=("bf16",), causal=(True,), head_dims_v=(512,),
                qv=(False, True), varlen=(False, True), seqused=(False, True), chunk=(False, True))
    planned = [str(p.variant) for p in enumerate_variants(axes, tuning.tables_for(("flash_fwd_mla",)))]
    assert not [v for v in planned if ("CHUNK" in v or "SEQUSED" in v) and "QV=true" not in v]
    assert not [v for v in planned if "SEQUSED" in v and "VARLEN=true" not in v]
    # qv: dense (chunk or not) 2, packed 2 x 4 seqused modes 8; without qv: dense and packed 2.
    assert len(planned) == 12 and sum("CHUNK=true" in v for v in planned) == 5
    assert sum("SEQUSED_Q=true" in v for v in planned) == 4


def test_explain_and_the_miss_log_take_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main as cli_main
    from lazytriton.prewarm.enumeration import variants_from_misses

    base = ["cache", "explain", "--kernel", "flash_fwd_mla", "--dtype", "bf16", "--head-dim", "64", "--head-dim-v",
            "512", "--seqlen-q", "4096", "--target", "sm_90", "--attention-chunk"]
    assert cli_main([*base, "--qv", "--varlen", "--seqused-q", "--seqused-k"]) == 0
    shown = capsys.readouterr().out
    assert all(flag in shown for flag in ("CHUNK=true", "SEQUSED_Q=true", "SEQUSED_K=true", "QV=true"))
    assert cli_main(base) != 0 and "--attention-chunk" in capsys.readouterr().err, "without qv: v's pieces"
    found = dispatch.kernel_variant("flash_fwd_mla", SM90, "bf16", 64, True, True, 4096, 4096, head_dim_v=256,
                                    qv=True, varlen=True, chunk=True, seqused_k=True)
    planned, bad = variants_from_misses([json.dumps({"variant": str(found), "key": found.key(), "compile_s": 1.0})])
    assert not bad and [p.variant for p in planned] == [found]


@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
def test_the_flagged_entry_compiles_and_fits_shared_memory(target: str,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Triton's compiler, no GPU: CHUNK, SEQUSED_Q and SEQUSED_K with qv at v of 512 build within the target's limit."""
    from compiled_once import compiled, shared_dir

    from lazytriton.kernels import get
    from lazytriton.prewarm.limits import KNOWN_TARGETS

    variant = dispatch.kernel_variant("flash_fwd_mla", Target.parse(target), "bf16", 64, True, True, 4096, 4096,
                                      head_dim_v=512, qv=True, varlen=True, chunk=True, seqused_q=True,
                                      seqused_k=True, window=True)
    entry = compiled(variant, shared_dir(tmp_path_factory))
    assert len(entry.arg_types) == len(get("flash_fwd_mla").params)
    assert entry.shared <= KNOWN_TARGETS[target].shared


# ---------------------------------------------------------------------------
# On the GPU, at real sizes


@gpu
@pytest.mark.parametrize(("dv", "causal", "chunk", "window"), [(512, True, 1024, (-1, -1)), (256, False, 333, (-1, -1)),
                                                               (512, True, 256, (300, -1))])
def test_mla_chunk_forward_gpu(dv: int, causal: bool, chunk: int, window: tuple[int, int]) -> None:
    """FlashAttention-3's chunk loop with qv (bf16, 16 heads, MQA) against the references on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(dv + chunk)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cuda").to(BF16)

    q, k, v, qv = randn(2, 1500, 16, 64), randn(2, 2048, 1, 64), randn(2, 2048, 1, dv), randn(2, 1500, 16, dv)
    out, lse, _ = lazytriton.flash_attn_func(q, k, v, qv=qv, causal=causal, window_size=window,
                                             attention_chunk=chunk, return_attn_probs=True)
    check_against_reference(bhsd(out), lse, (bhsd(q), bhsd(k), bhsd(v), bhsd(qv)),
                            causal="bottom_right" if causal else False, window_size=window, attention_chunk=chunk)


@gpu
def test_mla_seqused_forward_gpu() -> None:
    """FlashAttention-3's add_unused_qkv with qv 512 (and a chunk), GQA 16/2, each sequence against the references."""
    gen = torch.Generator(device="cuda").manual_seed(42)
    spans, used_q, used_k = [1, 700, 1500, 33], [1, 500, 1500, 0], [1, 650, 900, 33]
    cu = torch.tensor([0, *torch.tensor(spans).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(spans)
    q, k = (torch.randn(total, h, 64, generator=gen, device="cuda").to(BF16) for h in (16, 2))
    v = torch.randn(total, 2, 512, generator=gen, device="cuda").to(BF16)
    qv = torch.randn(total, 16, 512, generator=gen, device="cuda").to(BF16)
    tensors = {name: torch.tensor(x, dtype=torch.int32, device="cuda")
               for name, x in (("seqused_q", used_q), ("seqused_k", used_k))}
    out, lse, _ = lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, max(spans), max(spans), causal=True, qv=qv,
                                                    attention_chunk=256, return_attn_probs=True, **tensors)
    _check_used(out, lse, (q, k, v, qv, cu, cu), used_q, used_k, causal="bottom_right", attention_chunk=256)
