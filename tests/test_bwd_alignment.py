"""The backward's two alignment flags: ALIGN16 (pointers, data strides) and SEQ16 (seqlens, lse strides).

When one flag covered both, any odd length and every varlen call lost all
divisibility hints (130 against 389 TFLOP/s on the H200). These tests pin
the flags each kind of call gets, the parameters each flag marks, the C and
Python rules, the keys (old entries miss), and one real compile for sm_90.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch
import xxhash

from lazytriton import kernels, record
from lazytriton.cli import main
from lazytriton.kernels import dispatch, source_fingerprint
from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV, FLASH_BWD_DQ
from lazytriton.kernels.flash_bwd import binding as bwd
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import FLASH_FWD, varlen
from lazytriton.kernels.flash_fwd import binding as fwd
from lazytriton.prewarm.enumeration import Axes, enumerate_variants
from lazytriton.target import Target
from lazytriton.tuning import Table
from lazytriton.variant import Variant, check_fields

SM90 = Target.parse("sm_90")
BWD = (FLASH_BWD_DQ, FLASH_BWD_DKDV)


def _pack(seqlen_q: int, seqlen_k: int, offset: int = 0, cu: int = 0) -> tuple[bool, bool]:
    """(aligned, seq16) of pack for a (1, 2, sq, 16) fp16 call; ``offset`` elements shift q's pointer."""
    base = torch.zeros(2 * seqlen_q * 16 + offset, dtype=torch.float16)
    q = base[offset:].view(1, 2, seqlen_q, 16)
    k = torch.zeros(1, 2, seqlen_k, 16, dtype=torch.float16)
    call = fwd.check(q, k, k, False, 0.25)
    out, lse = fwd.empty_outputs(q, call.shape)
    grads = bwd.empty_grads(q, k, k)
    _, _, aligned, seq16, _ = bwd.pack(q, k, k, out, out, lse, torch.empty_like(lse), *grads, call, cu, cu)
    return aligned, seq16


@pytest.mark.parametrize(("seqlens", "offset", "cu", "flags"), [
    ((4096, 4096), 0, 0, (True, True)),    # dense, everything a multiple of 16: both, as today's ALIGN16
    ((4096, 4099), 0, 0, (True, False)),   # an odd length: the tensors keep their hints
    ((100, 48), 0, 0, (True, False)),
    ((4096, 4096), 0, 64, (True, False)),  # varlen (a cu_seqlens pointer): never SEQ16
    ((4096, 4096), 1, 0, (False, False)),  # a pointer off 16 bytes: neither
])
def test_pack_computes_both_flags(seqlens: tuple[int, int], offset: int, cu: int, flags: tuple[bool, bool]) -> None:
    assert _pack(*seqlens, offset, cu) == flags
    if not cu:  # dispatch's rule for calls described by their sizes agrees with the binding's
        aligned, seq16 = flags
        assert bwd_dispatch.seq_aligned("flash_bwd_dq", aligned, *seqlens) is seq16


def test_a_varlen_backward_packs_aligned_without_seq16() -> None:
    q = torch.zeros(64, 2, 16, dtype=torch.float16)  # 64 tokens: the total is a multiple of 16, still no SEQ16
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    vc = varlen.check(q, q, q, cu, cu, 34, 34)
    views = [varlen.kernel_view(t) for t in (q, q, q, q, q)]
    lse = torch.zeros(1, 2, 64)
    *_, aligned, seq16, _ = bwd.pack(*views[:4], views[4], lse, lse, *views[:3], vc.call, cu.data_ptr(),
                                     cu.data_ptr())
    assert (aligned, seq16) == (True, False)
    variants = varlen.variants(varlen.BACKWARD, SM90, torch.float16, vc, aligned, False)
    assert all(v.get("ALIGN16") is True and "SEQ16" not in dict(v.functional) for v in variants)
    assert varlen.bwd_memo_key(0, torch.float16, vc, True, False)[-1] != "SEQ16"


def test_variant_strings_of_the_three_alignments_round_trip() -> None:
    seen = {}
    for name, (aligned, sq, sk) in {"both": (True, 4096, 4096), "align16": (True, 4095, 4096),
                                    "none": (False, 4096, 4096)}.items():
        dq, dkdv = bwd.variants(SM90, torch.bfloat16, fwd.Shape(1, 1, 1, sq, sk, 128), False, aligned, False)
        for v in (dq, dkdv):
            assert Variant.parse(str(v)) == check_fields(v)
        seen[name] = str(dq)
    assert "ALIGN16=true" in seen["both"] and "SEQ16=true" in seen["both"]
    assert "ALIGN16=true" in seen["align16"] and "SEQ16" not in seen["align16"]
    assert "ALIGN16=false" in seen["none"] and "SEQ16" not in seen["none"]
    # The forward has no seqlen hints: no SEQ16 whatever the seqlens.
    assert "SEQ16" not in str(dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, False, True, 4096, 4096))


def test_seq16_needs_align16_on_a_backward_kernel() -> None:
    both = str(bwd.variants(SM90, torch.bfloat16, fwd.Shape(1, 1, 1, 64, 64, 64), False, True, False)[0])
    for bad in (both.replace("ALIGN16=true", "ALIGN16=false"), both.replace("ALIGN16=true,", "")):
        with pytest.raises(ValueError, match="SEQ16=true needs ALIGN16=true"):
            check_fields(Variant.parse(bad))
    fwd_text = str(dispatch.kernel_variant("flash_fwd", SM90, "bf16", 64, False, True, 64, 64))
    with pytest.raises(ValueError, match="SEQ16=true needs .* on flash_fwd"):
        check_fields(Variant.parse(fwd_text.replace("INDEX64=false", "INDEX64=false,SEQ16=true")))
    with pytest.raises(ValueError, match="seq16=True needs an aligned call"):
        dispatch.kernel_variant("flash_bwd_dq", SM90, "bf16", 64, False, True, 64, 64, varlen=True, seq16=True)


def test_an_old_backward_string_still_parses_and_its_key_changed() -> None:
    """Before SEQ16, ``ALIGN16=true`` also meant 16-divisible seqlens: its entries must miss, and nothing crashes."""
    old = ("flash_bwd_dq:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,INDEX64=false:"
           "BLOCK_M=128,BLOCK_N=64:num_stages=3,num_warps=8")
    variant = check_fields(Variant.parse(old))  # now: ALIGN16 alone (odd lengths), a safe reading
    assert str(variant) == old
    source_only = xxhash.xxh3_64_hexdigest(FLASH_BWD_DQ.source_path.read_bytes().replace(b"\r\n", b"\n"))
    old_key = xxhash.xxh3_128_hexdigest(variant.canonical(source_only))
    assert variant.key() != old_key  # the fingerprint covers the description's hint lists


def test_the_fingerprint_covers_the_hint_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    fingerprint = source_fingerprint.__wrapped__  # type: ignore[attr-defined]
    before = fingerprint("flash_bwd_dq")
    moved = record.replace(FLASH_BWD_DQ, seq_aligned_params=FLASH_BWD_DQ.seq_aligned_params[:-1])
    monkeypatch.setattr(kernels, "get", lambda name: moved)
    assert fingerprint("flash_bwd_dq") != before


def _marked(spec: kernels.KernelSpec, variant: Variant) -> set[str]:
    from lazytriton import compiler

    attrs = compiler.divisibility_hints(spec, variant)
    assert all(value == [["tt.divisibility", 16]] for value in attrs.values())
    return {spec.params[i][0] for (i,) in attrs}


@pytest.mark.parametrize("spec", BWD, ids=lambda s: s.name)
def test_attrs_mark_exactly_each_flags_parameters(spec: kernels.KernelSpec) -> None:
    tensors = ("q", "k", "v", "o", "do", "dq") if spec is FLASH_BWD_DQ else ("q", "k", "v", "do", "dk", "dv")
    pointers = {name for name, kind in spec.params[:8]}
    strides = {f"stride_{t}{d}" for t in tensors for d in "bhs"}
    if spec is FLASH_BWD_DQ:  # the bias gradient's (BIAS_GRAD; 0 without it), allocated aligned by the binding
        pointers.add("DBias")
        strides |= {f"stride_dbias{d}" for d in "bhm"}
    seq = {"stride_lb", "stride_lh", "seqlen_q", "seqlen_k"}
    by_flags = {}
    for aligned, sq in ((True, 4096), (True, 4095), (False, 4096)):
        variant = dispatch.kernel_variant(spec.name, SM90, "bf16", 128, False, aligned, sq, 4096)
        by_flags[(aligned, sq)] = _marked(spec, variant)
    assert by_flags[(True, 4096)] == pointers | strides | seq  # the same hints as ALIGN16 had before the split
    assert by_flags[(True, 4095)] == pointers | strides
    assert by_flags[(False, 4096)] == set()
    # Indices, as Triton sees them: the pointers first, then the strides after the varlen, score-mod and seqused
    # pointers (and flash_bwd_dq's bias gradient pointer, its strides after the lse strides).
    names = [name for name, _ in spec.params]
    if spec is FLASH_BWD_DQ:
        assert sorted(names.index(n) for n in by_flags[(True, 4095)]) == [*range(8), *range(15, 34), 36, 37, 38]
        assert sorted(names.index(n) for n in seq) == [34, 35, 40, 41]
    else:
        assert sorted(names.index(n) for n in by_flags[(True, 4095)]) == [*range(8), *range(15, 33)]
        assert sorted(names.index(n) for n in seq) == [33, 34, 36, 37]


def test_the_forward_has_no_seqlen_coupling() -> None:
    """flash_fwd's ALIGN16 never covered its seqlens or lse strides: nothing to split there."""
    assert not FLASH_FWD.seq_aligned_params
    assert not {"seqlen_q", "seqlen_k", "stride_lb", "stride_lh"} & set(FLASH_FWD.aligned_params)
    variant = dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, False, True, 4095, 4095)
    assert "seqlen_q" not in _marked(FLASH_FWD, variant) and "Q" in _marked(FLASH_FWD, variant)


def test_memo_keys_tell_4095_from_4096() -> None:
    odd, even = (fwd.Shape(1, 2, 2, n, n, 64) for n in (4095, 4096))
    assert bwd.memo_key(0, torch.float16, odd, False, True, False) == \
        (bwd.FAMILY, *fwd.memo_key(0, torch.float16, odd, False, True, False))
    assert bwd.memo_key(0, torch.float16, even, False, True, False)[-1] == "SEQ16"
    assert bwd.memo_key(0, torch.float16, even, False, True, False, seq16=False) != \
        bwd.memo_key(0, torch.float16, even, False, True, False)


def test_prewarm_builds_both_aligned_backward_forms_and_varlen_without_seq16() -> None:
    axes = Axes((SM90,), kernels=("flash_bwd_dq",), dtypes=("bf16",), head_dims=(128,), causal=(False,),
                seqlens_q=(4096,), varlen=(False, True))
    flags = sorted((v.get("ALIGN16"), "SEQ16" in dict(v.functional), "VARLEN" in dict(v.functional))
                   for v in (p.variant for p in enumerate_variants(axes, Table([]))))
    assert flags == [(True, False, False), (True, False, True), (True, True, False)]
    unaligned = enumerate_variants(Axes((SM90,), kernels=("flash_bwd_dq",), dtypes=("bf16",), head_dims=(128,),
                                        causal=(False,), seqlens_q=(4096,), aligned=(False,)), Table([]))
    assert [p.variant.get("ALIGN16") for p in unaligned] == [False]


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["cache", "explain", "--json", "--kernel", "flash_bwd", "--dtype", "bf16", "--head-dim", "128",
                 "--target", "sm_90", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_cache_explain_shows_seq16(capsys: pytest.CaptureFixture[str]) -> None:
    even = _explain(capsys, "--seqlen-q", "4096")
    odd = _explain(capsys, "--seqlen-q", "4095")
    assert even["call"]["seq16"] is True and all("SEQ16=true" in k["variant"] for k in even["kernels"])
    assert odd["call"]["seq16"] is False and all("SEQ16" not in k["variant"] for k in odd["kernels"])
    assert all("ALIGN16=true" in k["variant"] for k in odd["kernels"])
    assert main(["cache", "explain", "--kernel", "flash_bwd", "--dtype", "bf16", "--head-dim", "128", "--target",
                 "sm_90", "--seqlen-q", "4095"]) == 0
    assert "no SEQ16 (a seqlen is not a multiple of 16" in capsys.readouterr().out


def test_the_c_plan_request_carries_seq16_in_bit_1() -> None:
    from lazytriton.capi import embedded

    shape = fwd.Shape(1, 1, 1, 4096, 4096, 128)
    both = bwd.variants(SM90, torch.bfloat16, shape, False, True, False)
    align16 = bwd.variants(SM90, torch.bfloat16, shape, False, True, False, seq16=False)
    for i, kernel in enumerate(("flash_bwd_dq", "flash_bwd_dkdv")):
        request = (kernel, 90, 2, 128, False, True, False, 4096, 4096, False)
        assert embedded.plan_variant(*request, seq16=True) == both[i]
        assert embedded.plan_variant(*request, seq16=False) == align16[i]
        assert embedded.plan_variant(kernel, 90, 2, 128, False, True, False, 4096, 4096) == both[i]  # the rule


@pytest.mark.slow
def test_an_align16_backward_variant_compiles_for_sm90_with_stride_hints(monkeypatch: pytest.MonkeyPatch) -> None:
    """TTIR of an odd-length (ALIGN16 without SEQ16) dK/dV compiled for cuda:90 here: strides marked, seqlens not."""
    triton = pytest.importorskip("triton")
    from lazytriton import compiler

    seen: list[Any] = []
    real = triton.compile

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(triton, "compile", recording)
    variant = dispatch.kernel_variant("flash_bwd_dkdv", SM90, "fp16", 64, False, True, 4095, 4095)
    assert variant.get("ALIGN16") is True and "SEQ16" not in dict(variant.functional)
    entry = compiler.compile_variant(variant)
    assert entry.kind == "cubin" and seen
    ttir = seen[-1].asm["ttir"]
    header = re.search(r"tt\.func public @flash_bwd_dkdv_kernel\((.*?)\)\s*attributes", ttir, re.S)
    assert header, ttir[:2000]
    names = [name for name, _ in FLASH_BWD_DKDV.params]
    # Triton 3.9 names the arguments (%Q), older versions number them (%arg0).
    args = re.findall(r"%(\w+): ([^{]*?loc|[^{]*?\{[^}]*\})", header[1])
    divisible = {int(a[3:]) if re.fullmatch(r"arg\d+", a) else names.index(a) for a, text in args
                 if "tt.divisibility = 16" in text}
    assert len(args) == len(names)
    for name in ("Q", "DK", "stride_qh", "stride_dks", "stride_dvb"):
        assert names.index(name) in divisible, f"{name} lost its hint"
    for name in ("seqlen_q", "seqlen_k", "stride_lb", "stride_lh", "Cu_seqlens_q"):
        assert names.index(name) not in divisible, f"{name} is marked but the call's value may not be 16-divisible"
