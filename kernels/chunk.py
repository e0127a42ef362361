"""FlashAttention-3's ``attention_chunk`` in Triton: the chunk bounds its kernels share.

A helper module of ``flash_fwd``, ``flash_bwd_dq``, ``flash_bwd_dkdv`` and
``flash_decode_split`` (their ``KernelSpec.helpers``: its text is in their
source fingerprints). It imports triton: only ``lazytriton.compiler`` (through
the kernels' files) may import it.

Query i sees key j when j and p = i + causal_offset lie in the same chunk of
``attention_chunk`` keys: floor(j / C) == floor(p / C), floored below 0 too (a
row left of key 0 has a chunk there, which holds no key). With a sliding window
each row's chunk is cut to its window: the tighter bound wins on each side.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_start(position, attention_chunk):
    """The first key of ``position``'s chunk: position - position mod attention_chunk, floored (also below 0)."""
    return position - ((position % attention_chunk) + attention_chunk) % attention_chunk


@triton.jit
def row_chunks(offs_m, causal_offset, attention_chunk, window_left, window_right, end, full_end,
               BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """The key blocks of query rows ``offs_m`` and each row's window: (begin, full_begin, full_end, end, left, right).

    Blocks of BLOCK_N keys before ``begin`` and from ``end`` on hold no key
    any row sees; those in [full_begin, full_end) are seen whole by every row
    (``end`` and ``full_end`` come in as the causal mask's and leave cut to the
    chunks). ``left``, ``right``: each row's chunk (inside its window) as a
    window of its own, [M, 1], which the masks take in place of the scalars.
    """
    pos = offs_m + causal_offset
    lo = chunk_start(pos, attention_chunk)
    hi = lo + attention_chunk - 1
    if WINDOW:
        lo = tl.maximum(lo, pos - window_left)
        hi = tl.minimum(hi, pos + window_right)
    begin = (tl.maximum(tl.min(lo, 0), 0) // BLOCK_N) * BLOCK_N
    full_begin = ((tl.maximum(tl.max(lo, 0), 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    end = tl.minimum(end, tl.maximum(tl.max(hi, 0) + 1, 0))
    full_end = tl.minimum(full_end, (tl.maximum(tl.min(hi, 0) + 1, 0) // BLOCK_N) * BLOCK_N)
    return begin, full_begin, full_end, end, (pos - lo)[:, None], (hi - pos)[:, None]
