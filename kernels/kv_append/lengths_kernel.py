"""Triton source of ``kv_append_lengths``: each sequence's key count after a packed append, on the device.

lens[b] = cached[b] + (cu_seqlens_k_new[b + 1] - cu_seqlens_k_new[b]), cached[b] cache_seqlens[b] with
``use_seqlens``, else ``seqlen_const``; int32 in, int32 out, BLOCK sequences a program.
"""

import triton
import triton.language as tl


@triton.jit
def kv_append_lengths_kernel(Seqlens, CuSeqlensKNew, Lens, batch, seqlen_const, use_seqlens,
                             BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < batch
    start = tl.load(CuSeqlensKNew + offs, mask=live, other=0)
    end = tl.load(CuSeqlensKNew + offs + 1, mask=live, other=0)
    read = live & ((offs * 0 + use_seqlens) != 0)  # a block of flags: the interpreter takes no scalar in a mask
    cached = tl.load(Seqlens + offs, mask=read, other=0)
    cached = tl.where(read, cached, seqlen_const)
    tl.store(Lens + offs, cached + (end - start), mask=live)
