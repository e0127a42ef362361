"""Attention geometry: the head dims kernels compile, how a head dim splits into two tiles, causal and rotary modes.

Pure functions of their arguments, importing nothing of lazytriton: dispatch, the kernel families and their
Gluon rules all read the same tiles from here.
"""

from __future__ import annotations

# Head dims are compiled at these sizes and the rest is masked: Triton's
# tl.arange needs a power of two, so 80 and 96 run as 128 (25-38% of the
# matrix work padded) unless split tiles cover them (``split_head_dim``).
HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_HEAD_DIM = HEAD_DIMS[-1]
# v's head dim (head_dim_v) may go one size further in the forward-only paths that take it (the decoding kernels:
# DeepSeek's MLA decodes with v of 512 beside q and k of 64, FlashAttention-3's qv form).
VALUE_HEAD_DIMS = (*HEAD_DIMS, 512)
MAX_HEAD_DIM_V = VALUE_HEAD_DIMS[-1]
CAUSAL_MODES = ("none", "top_left", "bottom_right")
MIN_CHUNK = 16  # tl.dot's smallest inner dimension
# flash_attn_with_kvcache's rotary embedding, as prewarm and cache explain name it: none, rotary_interleaved=True
# (pairs of columns: ROTARY=true, ROTARY_INTERLEAVED=true), rotary_interleaved=False (GPT-NeoX's halves: ROTARY=true).
ROTARY_MODES = ("none", "interleaved", "halves")


def padded_head_dim(head_dim: int) -> int:
    """The compiled head dim that holds ``head_dim`` (the smallest not below it)."""
    for size in HEAD_DIMS:
        if head_dim <= size:
            return size
    raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


def padded_value_dim(head_dim_v: int) -> int:
    """The compiled value head dim that holds ``head_dim_v`` (``VALUE_HEAD_DIMS``: up to 512)."""
    for size in VALUE_HEAD_DIMS:
        if head_dim_v <= size:
            return size
    raise ValueError(f"head_dim_v must be at most {MAX_HEAD_DIM_V}, got {head_dim_v}")


def split_head_dim(head_dim: int) -> tuple[int, int] | None:
    """The two chunks (a power of two, then one of at least 16) that hold ``head_dim`` in less than its padded tile.

    A head dim that is not a power of two runs as two power-of-two chunks
    (96 = 64 + 32) instead of one padded tile (128). None where a split saves
    nothing: powers of two, and dims whose second chunk would round up to the
    first (224 = 128 + 96 -> 128 + 128 = 256, as padded).
    """
    padded = padded_head_dim(head_dim)
    first = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - first
    if rest == 0 or first < MIN_CHUNK:
        return None
    second = max(MIN_CHUNK, 1 << (rest - 1).bit_length())
    return (first, second) if first + second < padded else None


def value_pieces(head_dim_v: int) -> tuple[int, ...]:
    """The widths of the column pieces flash_fwd and its backward run a v of ``head_dim_v`` columns over, in order.

    One piece up to 256 columns; for 257..512, v's first 256 columns and the rest (``lazytriton.value_split``).
    Attention is linear in v, so each piece is an ordinary call at that v head dim and the outputs concatenate.
    The first piece is the widest the kernels take: the rest pads least (320 = 256 + 64, where two halves of 160
    would each pad to 256), and the second piece starts 256 columns in, 16-byte aligned.
    """
    if head_dim_v <= MAX_HEAD_DIM:
        return (head_dim_v,)
    if head_dim_v > 2 * MAX_HEAD_DIM:
        raise ValueError(f"head_dim_v must be at most {2 * MAX_HEAD_DIM} to run as two pieces, got {head_dim_v}")
    return (MAX_HEAD_DIM, head_dim_v - MAX_HEAD_DIM)


def causal_mode(causal: object) -> str:
    """Normalise the ``causal`` argument: False, True (= top_left), "top_left", "bottom_right"."""
    if causal is False or causal is None:
        return "none"
    if causal is True:
        return "top_left"
    if isinstance(causal, str) and causal in CAUSAL_MODES:
        return causal
    raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")


def rotary_flags(mode: str) -> tuple[bool, bool]:
    """(rotary, rotary_interleaved) of a rotary mode (``ROTARY_MODES``)."""
    if mode not in ROTARY_MODES:
        raise ValueError(f"rotary mode must be one of {ROTARY_MODES}, got {mode!r}")
    return mode != "none", mode == "interleaved"
