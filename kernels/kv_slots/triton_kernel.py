"""The slot-addressed KV-cache write in Triton: ``kv_slots_kernel`` writes keys and values at their cache slots.

This file is the kernel's source fingerprint. It imports triton: only
``lazytriton.compiler`` may import it.

One program per BLOCK_M rows of (token, key/value head) pairs, row r = t *
heads_k + h (token t, head h: key's own order, so a packed key is read in one
sweep), x chunks of BLOCK_D head-dim columns. Token t lands at slot s =
``slot_mapping[t]`` (``Slots64`` with ``SLOT64``, else ``Slots32``; the other
pointer is never read): row ``s % block_size`` of block ``s // block_size``
of each cache. Keys are head_dim wide, values head_dim_v; a chunk past one's
width writes nothing of it (EVEN_D/EVEN_DV: the width is a multiple of
BLOCK_D, no column mask). Nothing is read back and nothing converted: a plain
copy, bit for bit.

A slot outside ``[0, num_slots)`` (num_blocks x block_size) is not written:
negative slots are padding (vLLM's), and a slot past the cache, which nobody
checked (the slots are never read on the host), cannot make the kernel write
outside the caches.
"""

import triton
import triton.language as tl


@triton.jit
def kv_slots_kernel(
    K, V, KCache, VCache, Slots32, Slots64,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    heads_k, n_rows, head_dim, head_dim_v, block_size, num_slots,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
    SLOT64: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_D
    row_in = offs_r < n_rows
    token = offs_r // heads_k
    head = offs_r % heads_k
    if SLOT64:
        slot = tl.load(Slots64 + token, mask=row_in, other=-1)
    else:
        slot = tl.load(Slots32 + token, mask=row_in, other=-1)
    row_ok = row_in & (slot >= 0) & (slot < num_slots)
    slot = tl.where(row_ok, slot, 0)  # offsets in the slots' width, or the strides' where wider
    block = slot // block_size
    in_block = slot % block_size
    offs_d = col0 + tl.arange(0, BLOCK_D)

    if col0 < head_dim:
        if EVEN_D:
            k_mask = row_ok[:, None]
        else:
            k_mask = row_ok[:, None] & (offs_d < head_dim)[None, :]
        k_rows = token * stride_kt + head * stride_kh
        kc_rows = block * stride_kcb + in_block * stride_kcs + head * stride_kch
        k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=k_mask)
        tl.store(KCache + kc_rows[:, None] + offs_d[None, :], k, mask=k_mask)

    if col0 < head_dim_v:
        if EVEN_DV:
            v_mask = row_ok[:, None]
        else:
            v_mask = row_ok[:, None] & (offs_d < head_dim_v)[None, :]
        v_rows = token * stride_vt + head * stride_vh
        vc_rows = block * stride_vcb + in_block * stride_vcs + head * stride_vch
        v = tl.load(V + v_rows[:, None] + offs_d[None, :], mask=v_mask)
        tl.store(VCache + vc_rows[:, None] + offs_d[None, :], v, mask=v_mask)
