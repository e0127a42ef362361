"""kv_append_lengths: each sequence's key count after new keys packed by cu_seqlens_k_new, on the device.

Through Triton's interpreter on the CPU it equals the plain-PyTorch twin (``reference.lengths_reference``) and
``flash_decode.values.lengths`` (what Python's decoding path reads), for a tensor of cached lengths and for a
constant one, on several programs; prewarm plans its one variant with the packed appends (``--varlen``), and only
then; the C API's arguments (``lengths.c_initializer``) are lt_kvcache.c's, field by field; the C planner (embedded
and native) picks the variant Python plans. On a GPU (marked): the compiled kernel equals the twin.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import gpu

from lazytriton import tuning
from lazytriton.kernels.kv_append import lengths, reference
from lazytriton.prewarm.enumeration import Axes, enumerate_variants
from lazytriton.target import Target

SM90 = Target.parse("sm_90")
ROOT = Path(__file__).resolve().parents[1]


def _case(batch: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.randint(0, 9, (batch,), dtype=torch.int32)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = counts.cumsum(0)
    seqlens = torch.randint(1, 1000, (batch,), dtype=torch.int32)
    return seqlens.to(device), cu.to(device)


@pytest.mark.parametrize("batch", [1, 3, 4, 9])
def test_the_interpreted_kernel_is_the_reference(batch: int) -> None:
    torch.manual_seed(batch)
    seqlens, cu = _case(batch)
    assert torch.equal(lengths.lengths(seqlens, cu, batch), reference.lengths_reference(seqlens, cu, batch))
    assert torch.equal(lengths.lengths(None, cu, batch, 37), reference.lengths_reference(37, cu, batch))
    out = torch.full((batch,), -5, dtype=torch.int32)
    assert lengths.lengths(seqlens, cu, batch, out=out) is out
    assert torch.equal(out, reference.lengths_reference(seqlens, cu, batch))


def test_the_kernel_is_what_the_decoding_path_reads() -> None:
    from lazytriton.kernels.flash_decode import checks, values

    torch.manual_seed(1)
    seqlens, cu = _case(5)
    t = checks.Inputs(q=torch.randn(5, 4, 32), k_cache=torch.randn(5, 64, 2, 32), v_cache=torch.randn(5, 64, 2, 32),
                      k=torch.randn(int(cu[-1]), 2, 32), v=torch.randn(int(cu[-1]), 2, 32), cache_seqlens=seqlens,
                      cu_seqlens_k_new=cu)
    call = checks.Call(5, 1, 4, 2, 32, int(cu[-1]), 64, 0, 5, -1, False, 0.1, varlen_new=True)
    assert torch.equal(lengths.lengths(seqlens, cu, 5), values.lengths(t, call).to(torch.int32))


def test_empty_batch_launches_nothing() -> None:
    assert lengths.lengths(None, torch.zeros(1, dtype=torch.int32), 0).shape == (0,)


def _planned(**axes: object) -> list[str]:
    kernels = ("flash_decode_split", "flash_decode_combine", "kv_append")
    chosen = Axes(targets=(SM90,), kernels=kernels, dtypes=("bf16",), head_dims=(128,), seqlens_q=(16,),
                  seqlens_k=(4096,), paged=(True,), **axes)  # type: ignore[arg-type]
    return [str(p.variant) for p in enumerate_variants(chosen, tuning.tables_for(kernels))]


def test_prewarm_plans_the_lengths_with_the_packed_appends_only() -> None:
    assert str(lengths.variant(SM90)) in _planned(varlen=(False, True))
    assert str(lengths.variant(SM90)) in _planned(varlen=(True,))
    assert not any(v.startswith("kv_append_lengths") for v in _planned())


def test_family_dispatch_and_explain_give_the_one_variant() -> None:
    from lazytriton.kernels import dispatch, family_of

    assert family_of("kv_append_lengths") == "kv_append"
    rules = dispatch.family_dispatch("kv_append_lengths")
    assert str(rules.variant("kv_append_lengths", SM90, None)) == "kv_append_lengths:sm_90:fp32::BLOCK=256:" \
                                                                  "num_stages=1,num_warps=1"


def test_the_c_launch_passes_the_bindings_arguments() -> None:
    text = (ROOT / "capi" / "lt_kvcache.c").read_text()
    start = text.index("static lt_status lt__kv_lengths_launch")
    body = text[text.index("= {", start) + 3:text.index("};", start)]
    assert " ".join(body.split()) == lengths.c_initializer()


def test_the_embedded_planner_asks_the_pythons_variants() -> None:
    from lazytriton.capi import embedded_kvcache
    from lazytriton.kernels import kv_append

    chosen = embedded_kvcache.append_variant(90, 2, 128, 128, True, True, False, varlen=True)
    assert chosen == kv_append.variant(SM90, "bf16", 128, 0, True, True, False, varlen=True)
    assert "VARLEN=true" in str(chosen)


@gpu
@pytest.mark.gpu
def test_the_compiled_kernel_is_the_reference_on_a_gpu(cache_dir: Path) -> None:
    torch.manual_seed(2)
    for batch in (1, 300, 65535):
        seqlens, cu = _case(batch, "cuda")
        assert torch.equal(lengths.lengths(seqlens, cu, batch), reference.lengths_reference(seqlens, cu, batch))
        assert torch.equal(lengths.lengths(None, cu, batch, 5), reference.lengths_reference(5, cu, batch))
