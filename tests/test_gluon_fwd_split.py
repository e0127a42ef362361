"""flash_fwd_gluon at head dims that are not its tiles' widths: split chunks (96 = 64 + 32) and padded tiles (224).

Gluon's tensors and shared buffers have power-of-two shapes, so a head dim
such as 96 runs as two chunks, each with its own buffers and descriptors,
and each product as one wgmma per chunk; a head dim that two chunks would not
save anything on (224) runs in its padded tile, TMA reading zeros past the
head dim. On CPU: the tiles ``gluon.chunks`` picks, the variants' fields,
and real sm_90 compiles (shared memory, descriptors, wgmmas, no spill). On
the GPU: calls served by it within FlashAttention's rule, and with row strides
wider than the head dim, the output's columns past it untouched.
"""

from __future__ import annotations

import pytest
import torch
from test_flash_fwd import check_attention, make_qkv, on_gpu, seed_of
from test_gluon_fwd import sm90_ptx

from lazytriton import machine
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd import gluon
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

SM90 = Target.parse("sm_90")


@pytest.mark.parametrize("head_dim, chunks", [
    (64, (64, 0, True)), (128, (128, 0, True)), (256, (256, 0, True)),  # a power of two: one tile, as before
    (80, (64, 16, True)), (96, (64, 32, True)), (160, (128, 32, True)), (192, (128, 64, True)),
    (72, (64, 16, False)),  # the second chunk zero-filled past the head dim
    (40, (32, 16, False)),
    (224, (256, 0, False)),  # 128 + 96 would round to 128 + 128: the padded tile
    (112, (128, 0, False)),  # 64 + 48 -> 64 + 64 likewise
])
def test_chunks_are_split_tiles_where_they_save_work_else_the_padded_tile(head_dim: int,
                                                                           chunks: tuple[int, int, bool]) -> None:
    assert gluon.chunks(head_dim) == chunks
    assert gluon.width(head_dim) == chunks[0] + chunks[1] >= head_dim


@pytest.mark.parametrize("head_dim", [72, 80, 96, 160, 192, 224, 40])
def test_the_variant_writes_the_chunks_as_flash_fwds_split_variant_does(head_dim: int) -> None:
    variant = fwd_dispatch.flash_fwd_gluon_variant(SM90, "bf16", head_dim, True, True, False, 4096, 4096,
                                                   producer=True, pingpong=True)
    assert variant is not None and check_fields(variant) is variant
    assert Variant.parse(str(variant)) == variant
    block_d, block_d2, even = gluon.chunks(head_dim)
    assert variant.get("BLOCK_D") == block_d and variant.get("EVEN_D") is even
    assert variant.constexprs.get("BLOCK_D2", 0) == block_d2
    if block_d2:  # flash_fwd's split variant has the same head-dim fields
        plain = fwd_dispatch.flash_fwd_variant(SM90, "bf16", head_dim, True, True, 4096, seqlen_k=4096)
        assert {k: plain.constexprs[k] for k in ("BLOCK_D", "BLOCK_D2", "EVEN_D")} == \
            {k: variant.constexprs[k] for k in ("BLOCK_D", "BLOCK_D2", "EVEN_D")}
    else:
        assert "BLOCK_D2" not in variant.constexprs


def test_shared_memory_and_stages_count_both_chunks() -> None:
    # 96 = 64 + 32 at 128 x 128: a K tile of 24 KiB, so 2 stages; Q 24 KiB + 2 x 2 x 24 KiB.
    assert gluon.stages(96, 128) == 2 and gluon.shared_bytes(96, 128, 128) == 2 * 96 * (128 + 4 * 128)
    # 192 = 128 + 64 at 128 x 64: 2 stages, 144 KiB; 128 x 128 would need 240 KiB, so the configs leave it out.
    assert gluon.shared_bytes(192, 128, 64) == 2 * 192 * (128 + 4 * 64)
    assert (128, 128, 4) not in gluon.configs(192, pingpong=True) and (128, 64, 4) in gluon.configs(192, pingpong=True)
    assert gluon.shared_bytes(224, 128, 64) == gluon.shared_bytes(256, 128, 64)  # the padded tile's buffers


@pytest.mark.parametrize("head_dim, causal, q_tiles", [(96, False, 1), (192, True, 1), (80, True, 8), (224, True, 1),
                                                      (192, True, 2), (160, True, 2)])
def test_split_and_padded_variants_compile_for_sm90_without_a_spill(head_dim: int, causal: bool,
                                                                    q_tiles: int) -> None:
    """A split variant makes two descriptors a tensor (one at 96, 160 and 192) and issues one wgmma a chunk; a
    padded one is its tile's kernel with the head dim as the descriptors' extent. Descriptors a program
    (ping-pong): each consumer warpgroup's Q (one tile) and Out, the producer's K and V (and Q with several
    tiles)."""
    from lazytriton.compiler import compile_variant

    variant = gluon.variant("sm_90", "bf16", head_dim, "top_left" if causal else "none", True, False, 1024, 1024,
                            pingpong=True, q_tiles=q_tiles)
    assert variant is not None
    entry = compile_variant(variant)
    block_m, block_n, _ = gluon.configs(head_dim, pingpong=True, q_tiles=q_tiles)[0]
    assert 0 <= entry.shared - gluon.shared_bytes(head_dim, block_m, block_n, q_tiles) <= gluon.SHARED_SLACK
    block_d, block_d2, _ = gluon.chunks(head_dim)
    # 192 = 128 + 64 and 96 = 64 + 32, 160 = 128 + 32: the second chunk's rows are one span of its swizzle (128 or
    # 64 bytes), and the first chunk's buffers take that swizzle, so one descriptor a tensor serves both chunks
    # (kernels/gluon_tma.py: made on the device at ~0.7 µs each before the loads they serve)
    shared = block_d2 in (64, 32)
    per_tensor = 2 if block_d2 and not shared else 1
    assert entry.global_scratch_size == per_tensor * (6 if q_tiles == 1 else 5) * 128
    ptx = sm90_ptx(variant)
    assert "ld.local" not in ptx and "st.local" not in ptx
    # Each consumer: the peeled block's QK^T, one or two loops of QK^T + PV, the last PV; k-steps of 16, one
    # wgmma each, per chunk: QK^T reduces over both chunks, PV is one product a chunk over the key block.
    qk = (block_d + block_d2) // 16
    pv = (2 if block_d2 else 1) * block_n // 16
    loops = 2 if causal else 1
    # Causal up to a width of 96 (80, 96): warpgroup 0's half step (QK^T, PV) and its half-wide last PV.
    half = qk + pv + pv // 2 if causal and block_d + block_d2 <= 96 else 0
    assert ptx.count("wgmma.mma_async") == 2 * (qk + loops * (qk + pv) + pv) + half
    # Every chunk goes out through its own TMA store (the first in two boxes of the descriptor both chunks share).
    stores = block_d // (block_d2 if shared else block_d) + (1 if block_d2 else 0)
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared") == 2 * stores


@on_gpu
@pytest.mark.parametrize("dtype, head_dim, causal, heads, seqlens", [
    (torch.bfloat16, 96, False, (4, 4), (1024, 1024)),  # query tiles of the padded tile's rows (4 a program)
    (torch.bfloat16, 96, True, (4, 4), (2048, 2048)),
    (torch.float16, 80, True, (8, 2), (1024, 1024)),  # GQA
    (torch.bfloat16, 160, False, (2, 2), (2048, 2048)),
    (torch.bfloat16, 192, "bottom_right", (2, 2), (512, 1536)),  # causal offset 1024
    (torch.float16, 192, True, (4, 4), (1024, 1024)),
    (torch.bfloat16, 224, True, (4, 4), (1024, 1024)),  # padded: 256's tile
    (torch.float16, 224, False, (2, 2), (2048, 2048)),
], ids=str)
def test_split_and_padded_head_dims_serve_attn_fwd_on_gpu(dtype: torch.dtype, head_dim: int, causal: bool | str,
                                                           heads: tuple[int, int], seqlens: tuple[int, int],
                                                           resolved: list[Variant]) -> None:
    """GLUON_TABLE's rows at split and padded head dims, served by a plain call cold and warm, within
    FlashAttention's rule; then the served variant, launched on (B, S, H, D) views of tensors 32 columns wider
    (row strides that are not the head dim's), writes the same output and leaves the columns past the head dim
    (another tensor's, in a real model) as they were."""
    from lazytriton import flash, runtime
    from lazytriton.kernels.flash_fwd import binding

    runtime.reset()  # plans memoised by another test would hide the variant from the resolve spy
    b = 2
    q, k, v = make_qkv(b, heads, seqlens, head_dim, dtype, "cuda", seed_of("gluon-split", head_dim, causal, seqlens))
    if str(machine.target_of_device(q.device)) != "sm_90":
        pytest.skip("flash_fwd_gluon is built for sm_90")
    for _ in range(2):  # cold (plans the shape), then warm
        out, lse = flash.attn_fwd(q, k, v, causal=causal)
        torch.cuda.synchronize()
        check_attention(q, k, v, out, lse, causal=causal)
    served = [v for v in resolved if v.kernel == "flash_fwd_gluon"]
    assert served and served[-1].get("BLOCK_D") == gluon.chunks(head_dim)[0], served
    assert served[-1].constexprs.get("BLOCK_D2", 0) == gluon.chunks(head_dim)[1]

    def wide(t: torch.Tensor, fill: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.randn(b, t.shape[2], t.shape[1], head_dim + 32, dtype=dtype, device="cuda")
        if fill is not None:
            buf.fill_(fill)
        view = buf[..., :head_dim].transpose(1, 2)
        view.copy_(t)
        return buf, view

    (_, qw), (_, kw), (_, vw) = wide(q), wide(k), wide(v)
    out_buf, out_w = wide(out, fill=float("nan"))
    lse_w = torch.empty_like(lse)
    binding.launch_gpu(qw, kw, vw, out_w, lse_w, binding.check(qw, kw, vw, causal), variant=served[-1])
    torch.cuda.synchronize()
    assert torch.equal(out_w, out) and torch.equal(lse_w, lse)  # the same kernel on the same values
    assert torch.isnan(out_buf[..., head_dim:]).all(), "the output store wrote past the head dim"
