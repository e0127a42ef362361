"""The peer shims (tests/peers/shim/): FlashAttention-3's and -2's signatures, forwarding, refusals.

Each shim function must take its peer's parameters in the peer's order with its defaults: compared with the peer's
interface file where a checkout is present (``LAZYTRITON_PEER_DIR``, or ``.peers/flash-attention``; parsed, never
imported), else with the signatures recorded in ``peer_signatures``. A forwarded call gives what lazytriton's own
function gives, bit for bit (the same kernels); an argument lazytriton lacks raises ``MissingFeature`` before
anything is launched.
"""

from __future__ import annotations

import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import REPO

import lazytriton

SHIM = REPO / "tests" / "peers" / "shim"
SHIM_MODULES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn_interface", "peer_shim_common",
                "peer_signatures", "peer_s_dmask")


def peer_dir() -> Path:
    return Path(os.environ.get("LAZYTRITON_PEER_DIR") or REPO / ".peers" / "flash-attention")


@pytest.fixture
def shim(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    """The shim's modules, imported from tests/peers/shim/ and removed from sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(SHIM))
    for name in SHIM_MODULES:
        sys.modules.pop(name, None)
    import flash_attn
    import flash_attn_interface
    import peer_shim_common
    import peer_signatures

    yield types.SimpleNamespace(fa3=flash_attn_interface, fa2=flash_attn.flash_attn_interface, fa2_package=flash_attn,
                                common=peer_shim_common, signatures=peer_signatures)
    for name in SHIM_MODULES:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("peer", ["FA3", "FA2"])
def test_the_shim_takes_the_peers_parameters(shim: types.SimpleNamespace, peer: str) -> None:
    signatures = shim.signatures
    recorded = getattr(signatures, peer)
    module = shim.fa3 if peer == "FA3" else shim.fa2
    interface = peer_dir() / getattr(signatures, f"{peer}_FILE")
    expected = signatures.read(interface, recorded) if interface.is_file() else recorded
    assert set(expected) == set(recorded), f"{interface}: functions {sorted(expected)}"
    for name, parameters in expected.items():
        assert signatures.of(getattr(module, name)) == parameters, name
        assert recorded[name] == parameters, f"{name}: the record differs from {interface}"


def test_the_signature_reader_parses_without_running(tmp_path: Path, shim: types.SimpleNamespace) -> None:
    source = tmp_path / "interface.py"
    source.write_text("raise SystemExit('never run')\n"
                      "def f(q, k=None, *, x=1, dtype=torch.bfloat16):\n    pass\n"
                      "def g(a, window_size=(-1, -1), softcap=0.0):\n    pass\n")
    assert shim.signatures.read(source, ["g", "missing"]) == {
        "g": (("a", None), ("window_size", "(-1, -1)"), ("softcap", "0.0"))}
    assert shim.signatures.read(source, ["f"])["f"] == (("q", None), ("k", "None"))  # positional parameters


def _qkv(batch: int = 1, seqlen: int = 16, heads: int = 2, heads_k: int = 1, dim: int = 32,
         dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(batch, seqlen, heads, dim, dtype=dtype)
    k = torch.randn(batch, seqlen, heads_k, dim, dtype=dtype)
    return q, k, torch.randn_like(k)


def test_fa3_forward_is_lazytritons(shim: types.SimpleNamespace) -> None:
    q, k, v = _qkv()
    out, lse = shim.fa3.flash_attn_func(q, k, v, causal=True, window_size=(4, 0), num_splits=3, pack_gqa=True,
                                        return_attn_probs=True)
    want, want_lse, _ = lazytriton.flash_attn_func(q, k, v, causal=True, window_size=(4, 0), return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert lse.shape == (1, 2, 16) and lse.dtype == torch.float32


def test_fa3_packed_forms_split_into_lazytritons_call(shim: types.SimpleNamespace) -> None:
    q, k, v = _qkv(heads_k=2)
    want = lazytriton.flash_attn_func(q, k, v)
    assert torch.equal(shim.fa3.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2)), want)
    assert torch.equal(shim.fa3.flash_attn_qkvpacked_func(torch.cat([q, k, v], dim=2), num_heads_q=2), want)
    with pytest.raises(ValueError, match="num_heads_q"):
        shim.fa3.flash_attn_qkvpacked_func(torch.cat([q, k, v], dim=2), num_heads_q=3)
    with pytest.raises(TypeError, match="num_heads_q"):
        shim.fa3.flash_attn_qkvpacked_func(torch.cat([q, k, v], dim=2))


def test_fa3_varlen_is_lazytritons(shim: types.SimpleNamespace) -> None:
    q, k, v = (t.reshape(16, *t.shape[2:]) for t in _qkv())
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    out, lse = shim.fa3.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True, num_splits=1,
                                               return_attn_probs=True)
    want, want_lse, _ = lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True,
                                                          return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_fa3_kvcache_takes_page_table_and_scheduler_metadata(shim: types.SimpleNamespace) -> None:
    q = torch.randn(2, 1, 2, 32, dtype=torch.float16)
    k_cache = torch.randn(6, 4, 1, 32, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32)
    seqlens = torch.tensor([9, 12], dtype=torch.int32)
    metadata = shim.fa3.get_scheduler_metadata(2, 1, 12, 2, 1, 32, seqlens, torch.float16, page_size=4)
    assert metadata.dtype == torch.int32 and metadata.device == seqlens.device
    out, lse, *rest = shim.fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                        page_table=page_table, scheduler_metadata=metadata,
                                                        return_softmax_lse=True)
    want, want_lse = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                        block_table=page_table, return_softmax_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and rest == []


def test_fa3_combine_is_lazytritons(shim: types.SimpleNamespace) -> None:
    out_partial = torch.randn(3, 2, 4, 2, 32)
    lse_partial = torch.randn(3, 2, 4, 2)
    out, lse = shim.fa3.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float16)
    want, want_lse = lazytriton.flash_attn_combine(out_partial, lse_partial, out_dtype=torch.float16)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_fa3s_qv_is_lazytritons(shim: types.SimpleNamespace) -> None:
    q, k, _ = _qkv(seqlen=8, heads_k=2)
    v, qv = torch.randn(1, 8, 2, 64, dtype=torch.float16), torch.randn(1, 8, 2, 64, dtype=torch.float16)
    assert torch.equal(shim.fa3.flash_attn_func(q, k, v, qv=qv, causal=True),
                       lazytriton.flash_attn_func(q, k, v, qv=qv, causal=True))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert torch.equal(shim.fa3.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, qv=qv[0]),
                       lazytriton.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, qv=qv[0]))


def test_what_lazytriton_lacks_is_refused_by_name(shim: types.SimpleNamespace, no_launch: None) -> None:
    q, k, v = _qkv()
    with pytest.raises(shim.common.MissingFeature, match=r"flash_attn_with_kvcache has no q_descale="):
        shim.fa3.flash_attn_with_kvcache(q, k, v, q_descale=torch.ones(1, 1))
    assert issubclass(shim.common.MissingFeature, NotImplementedError)


@pytest.mark.parametrize(("hint", "value", "error"), [
    ("num_splits", "2", TypeError), ("num_splits", -1, ValueError), ("num_splits", True, TypeError),
    ("pack_gqa", 1, TypeError), ("sm_margin", 1.5, TypeError), ("sm_margin", -1, ValueError)])
def test_scheduling_hints_are_checked(shim: types.SimpleNamespace, no_launch: None, hint: str, value: object,
                                      error: type[Exception]) -> None:
    q, k, v = _qkv()
    with pytest.raises(error, match=hint):
        shim.fa3.flash_attn_func(q, k, v, **{hint: value})


def test_scheduler_metadata_checks_its_arguments(shim: types.SimpleNamespace) -> None:
    seqlens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(TypeError, match="headdim"):
        shim.fa3.get_scheduler_metadata(1, 1, 8, 2, 1, 32.0, seqlens)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        shim.fa3.get_scheduler_metadata(1, 1, -8, 2, 1, 32, seqlens)
    with pytest.raises(TypeError, match="cache_seqlens"):
        shim.fa3.get_scheduler_metadata(1, 1, 8, 2, 1, 32, [3])
    with pytest.raises(TypeError, match="scheduler_metadata"):
        shim.fa3.flash_attn_with_kvcache(*_qkv(), scheduler_metadata=[0])


def test_fa2_package_forwards_and_packs(shim: types.SimpleNamespace) -> None:
    q, k, v = _qkv(heads_k=2)
    want = lazytriton.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(shim.fa2_package.flash_attn_func(q, k, v, 0.0, None, True), want)
    assert torch.equal(shim.fa2_package.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2), causal=True), want)
    assert torch.equal(shim.fa2_package.flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), causal=True), want)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    packed = torch.stack([q[0], k[0], v[0]], dim=1)
    assert torch.equal(shim.fa2_package.flash_attn_varlen_qkvpacked_func(packed, cu, 16, causal=True), want[0])
    with pytest.raises(ValueError, match="kv"):
        shim.fa2_package.flash_attn_kvpacked_func(q, torch.stack([k, v, v], dim=2))
    assert shim.fa2.USE_TRITON_ROCM is False


def test_fa2_package_reads_the_peers_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "bert_padding.py").write_text("MARK = 'the peer helper'\n")
    monkeypatch.setenv("LAZYTRITON_PEER_DIR", str(tmp_path))
    monkeypatch.syspath_prepend(str(SHIM))
    for name in (*SHIM_MODULES, "flash_attn.bert_padding"):
        sys.modules.pop(name, None)
    try:
        import flash_attn
        from flash_attn.bert_padding import MARK
        assert MARK == "the peer helper"
        assert Path(flash_attn.__file__).parent == SHIM / "flash_attn"
    finally:
        for name in (*SHIM_MODULES, "flash_attn.bert_padding"):
            sys.modules.pop(name, None)


def test_fa3_kvcache_drops_rotary_seqlens_without_rotary_tables(shim: types.SimpleNamespace) -> None:
    q, k_cache, v_cache = _qkv(batch=2, seqlen=12)
    q = q[:, :1]
    lens = torch.tensor([5, 12], dtype=torch.int32)
    out = shim.fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, rotary_seqlens=lens)
    assert torch.equal(out, lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens))


def test_fa2_paged_varlen_takes_cu_seqlens_k_as_the_key_counts(shim: types.SimpleNamespace) -> None:
    q = torch.randn(5, 2, 32, dtype=torch.float16, requires_grad=True)
    k_cache = torch.randn(6, 4, 1, 32, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    table = torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 21], dtype=torch.int32)
    out = shim.fa2_package.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 3, 12, causal=True,
                                                  block_table=table)
    want = lazytriton.flash_attn_varlen_func(q.detach(), k_cache, v_cache, cu_q, None, 3, 12, causal=True,
                                             block_table=table, seqused_k=torch.tensor([9, 12], dtype=torch.int32))
    assert torch.equal(out, want)


def test_fa2s_forward_op_is_the_paged_call_with_its_num_splits_rule(shim: types.SimpleNamespace) -> None:
    """``_flash_attn_varlen_forward`` (FlashAttention-2's own test imports it): the paged call with its key counts
    from seqused_k, (out, lse, S_dmask, rng_state); num_splits > 1 on a paged call refused as FlashAttention-2 does,
    except where it swaps one query's head groups into rows."""
    q = torch.randn(2, 4, 32, dtype=torch.float16)
    k_cache = torch.randn(6, 4, 2, 32, dtype=torch.float16)
    v_cache = torch.randn_like(k_cache)
    table = torch.tensor([[5, 0, 3], [1, 2, 4]], dtype=torch.int32)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    used = torch.tensor([9, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 21], dtype=torch.int32)
    kwargs = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 1, "max_seqlen_k": 12, "dropout_p": 0.0,
              "softmax_scale": 32 ** -0.5, "causal": False, "window_size_left": -1, "window_size_right": 0,
              "block_table": table, "seqused_k": used}
    out, lse, s_dmask, rng_state = shim.fa2._flash_attn_varlen_forward(q, k_cache, v_cache, **kwargs)
    want, want_lse, _ = lazytriton.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, 12,
                                                          window_size=(-1, 0), block_table=table, seqused_k=used,
                                                          return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and s_dmask is None
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
    explicit = shim.fa2._flash_attn_varlen_forward(q, k_cache, v_cache, **kwargs, num_splits=0)[0]
    assert torch.equal(out, explicit)
    with pytest.raises(RuntimeError, match="num_splits > 1 is not supported for varlen paged KV"):
        shim.fa2._flash_attn_varlen_forward(q, k_cache, v_cache, **kwargs, num_splits=2)
    swapped = dict(kwargs, window_size_right=-1)  # one query, GQA, no window: FlashAttention-2 splits these
    assert shim.fa2._flash_attn_varlen_forward(q, k_cache, v_cache, **swapped, num_splits=2)[0].shape == q.shape
    with pytest.raises(NotImplementedError, match="leftpad_k"):
        shim.fa2._flash_attn_varlen_forward(q, k_cache, v_cache, **kwargs, leftpad_k=torch.zeros(2, dtype=torch.int32))


def test_fa2s_forward_op_with_dropout_returns_the_calls_philox_pair_and_s_dmask(shim: types.SimpleNamespace) -> None:
    from lazytriton.kernels.flash_fwd import score_mods

    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, 2, 16, dtype=torch.float16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    torch.manual_seed(11)
    out, lse, s_dmask, rng_state = shim.fa2._flash_attn_varlen_forward(q, k, v, cu, cu, 5, 5, 0.3, 0.25, False,
                                                                        return_softmax=True)
    torch.manual_seed(11)
    want = lazytriton.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, dropout_p=0.3, softmax_scale=0.25)
    torch.manual_seed(11)
    pair = score_mods.draw_philox(q.device, 0)
    assert torch.equal(out, want) and torch.equal(rng_state, pair)
    assert s_dmask is not None and lse.shape == (2, 9)
    torch.manual_seed(11)
    assert shim.fa2._flash_attn_varlen_forward(q, k, v, cu, cu, 5, 5, 0.3, 0.25, False)[2] is None


def _fa2_keep_and_probs(q: torch.Tensor, k: torch.Tensor, causal: bool, window: tuple[int, int],
                        slopes: torch.Tensor | None) -> torch.Tensor:
    """The float64 softmax of (batch, seqlen, heads, d) q and k, as the peer's normalize_flash_attn_S gives it."""
    from lazytriton.kernels.flash_fwd.reference import capped_scores

    qd, kd = (t.double().transpose(1, 2) for t in (q, k))
    kd = kd.repeat_interleave(qd.shape[1] // kd.shape[1], dim=1)
    scores = capped_scores(qd, kd, q.shape[-1] ** -0.5, 0.0, "bottom_right" if causal else False, window,
                           None if slopes is None else slopes.double())[0]
    return torch.softmax(scores, -1).nan_to_num(0.0)


@pytest.mark.parametrize(("causal", "window", "alibi"), [(False, (-1, -1), False), (True, (3, 0), True),
                                                         (False, (2, 4), False)])
def test_fa2_s_dmask_is_lazytritons_keep_mask_over_the_probabilities(shim: types.SimpleNamespace, causal: bool,
                                                                     window: tuple[int, int], alibi: bool) -> None:
    from lazytriton.kernels.flash_fwd import score_mods
    from lazytriton.kernels.flash_fwd.reference import dropout_keep

    q, k, v = _qkv(batch=2, seqlen=10, heads=4, heads_k=2)
    slopes = torch.rand(2, 4) * 0.3 if alibi else None
    torch.manual_seed(11)
    out, lse, s_dmask = shim.fa2.flash_attn_func(q, k, v, 0.3, causal=causal, window_size=torch.tensor(window),
                                                 alibi_slopes=slopes, return_attn_probs=True)
    torch.manual_seed(11)
    want = lazytriton.flash_attn_func(q, k, v, 0.3, causal=causal, window_size=window, alibi_slopes=slopes,
                                      return_attn_probs=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])  # the same Philox pair: the same call
    torch.manual_seed(11)
    keep = dropout_keep(score_mods.draw_philox(q.device, 0), (2, 4, 10, 10), 0.3)
    probs = _fa2_keep_and_probs(q, k, causal, window, slopes)
    seen = probs > 0
    assert s_dmask.shape == (2, 4, 10, 10)
    assert torch.equal((s_dmask >= 0)[seen], keep[seen])
    top = (s_dmask.abs().double() * seen).amax(-1, keepdim=True)  # exp(s - row max): 1 at each row's maximum
    assert torch.allclose(top[seen.any(-1, keepdim=True)], torch.ones(()).double())
    normalised = s_dmask.abs().double() / s_dmask.abs().double().sum(-1, keepdim=True).clamp_min(1e-30)
    assert (normalised - probs).abs().max() < 1e-5
    assert shim.fa2._get_block_size_n(q.device, 32, True, causal) >= 2**31 - 1  # one block a row


def test_fa2_varlen_s_dmask_holds_each_sequences_block(shim: types.SimpleNamespace) -> None:
    from lazytriton.kernels.flash_fwd import score_mods
    from lazytriton.kernels.flash_fwd.reference import dropout_keep

    q, k, v = (t[0] for t in _qkv(batch=1, seqlen=11, heads=2, heads_k=1))
    cu_q, cu_k = torch.tensor([0, 4, 11], dtype=torch.int32), torch.tensor([0, 6, 11], dtype=torch.int32)
    torch.manual_seed(5)
    out, lse, s_dmask = shim.fa2.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, 0.25, causal=True,
                                                        return_attn_probs=True)
    torch.manual_seed(5)
    keep = dropout_keep(score_mods.draw_philox(q.device, 0), (1, 2, 11, 11), 0.25)[0]
    assert s_dmask.shape == (2, 2, 7, 6)
    for b, (q0, q1, k0, k1) in enumerate(((0, 4, 0, 6), (4, 11, 6, 11))):
        probs = _fa2_keep_and_probs(q[None, q0:q1], k[None, k0:k1], True, (-1, -1), None)[0]
        block = s_dmask[b, :, :q1 - q0, :k1 - k0]
        seen = probs > 0
        assert torch.equal((block >= 0)[seen], keep[:, q0:q1, k0:k1][seen])
        assert not s_dmask[b, :, q1 - q0:].any() and not s_dmask[b, :, :, k1 - k0:].any()
