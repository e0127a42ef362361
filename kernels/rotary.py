"""Rotary embeddings in Triton: ``rotate``, shared by ``flash_decode_split`` (the query) and ``kv_append`` (new keys).

A helper module of both kernels (their ``KernelSpec.helpers``: its text is
in both source fingerprints). It imports triton: only
``lazytriton.compiler`` (through the kernels' files) may import it.

FlashAttention's rotary embedding (``flash_attn.layers.rotary.apply_rotary_emb``):
the first ``rotary_dim`` columns of a row at position p are rotated by the
angles of row p of cos and sin (``(seqlen_ro, rotary_dim / 2)``); the other
columns are kept. ``INTERLEAVED`` pairs columns (0, 1), (2, 3), ...;
otherwise column j is paired with j + rotary_dim / 2 (GPT-NeoX's halves).
With x1, x2 a pair and c, s its angle's cosine and sine: x1 c - x2 s, x2 c
+ x1 s, in float32, rounded once to the row's dtype (FlashAttention's
kernels do the same). A row whose position is outside ``[0, seqlen_ro)``
reads no cos or sin and is kept as it is: positions nobody checked (the C
API's device memory, a CUDA graph's replays, ``trusted_indices``) cannot
make a kernel read past the tables. Checked calls never have such positions.
"""

import triton
import triton.language as tl


@triton.jit
def rotate(x, row_ptrs, rows_ok, positions, offs_d, Cos, Sin, rotary_dim, seqlen_ro, INTERLEAVED: tl.constexpr):
    """``x`` (rows, BLOCK_D), loaded from ``row_ptrs[:, None] + offs_d``, rotated at ``positions`` (rows,).

    The pair of each column is loaded again from ``row_ptrs`` (a row is a few hundred bytes, already in cache).
    """
    half = rotary_dim // 2
    if INTERLEAVED:
        pair = offs_d ^ 1
        angle = offs_d // 2
        first = offs_d % 2 == 0
    else:
        first = offs_d < half
        pair = tl.where(first, offs_d + half, offs_d - half)
        angle = tl.where(first, offs_d, offs_d - half)
    rotated = offs_d < rotary_dim
    at = rows_ok & (positions >= 0) & (positions < seqlen_ro)
    table = positions[:, None] * half + angle[None, :]
    known = at[:, None] & rotated[None, :]
    cos = tl.load(Cos + table, mask=known, other=1.0).to(tl.float32)
    sin = tl.load(Sin + table, mask=known, other=0.0).to(tl.float32)
    sin = tl.where(first[None, :], -sin, sin)
    other = tl.load(row_ptrs[:, None] + pair[None, :], mask=rows_ok[:, None] & rotated[None, :], other=0.0)
    return (x.to(tl.float32) * cos + other.to(tl.float32) * sin).to(x.dtype)
