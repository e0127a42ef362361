"""Plain-PyTorch twin of the flash_fwd kernel: the reference the tests compare against.

Same layout, same causal conventions, same answer for a query that sees no
key (output 0, logsumexp -inf). The sliding window and the softcap follow
FlashAttention-2's own test reference (``construct_local_mask`` and
``attention_ref`` in its tests/test_flash_attn.py): the window is aligned
bottom-right (top-left only for a top-left causal call), causal sets its
right side to 0, and the cap applies to the scaled scores. ALiBi follows its
``attn_bias_from_alibi_slopes`` (non-causal form, ``-slope * |i + seqlen_k -
seqlen_q - j|``, also under a causal mask) and is added, like an additive bias,
after the cap. Dropout takes an explicit keep mask (``dropout_keep`` computes the
kernels' own, a torch re-implementation of curand's Philox stream): kept
probabilities are scaled by 1 / (1 - p), and lse stays the undropped one.
Attention sinks follow FlashAttention-3's reference (``attention_ref`` in
hopper/test_util.py of vLLM's fork, ``s_aux``) and transformers' gpt-oss eager
attention: one more column of scores, the head's raw sink logit after the
scale, cap and masks, in the softmax, dropped before the product with v.
FlashAttention-3's ``attention_chunk`` follows its ``construct_chunk_mask``
(hopper/test_util.py): query i sees key j only when j lies in the chunk of
i + offset (floor division, the offset the window's), on top of the other masks.
Computed in the inputs' dtype unless the
caller upcasts, so the tests can measure both a same-precision reference and
a float64 one.
"""

from __future__ import annotations

import math

import torch


def visible(seqlen_q: int, seqlen_k: int, causal: bool | str = False, window_size: tuple[int, int] = (-1, -1),
            device: torch.device | str | None = None, attention_chunk: int = 0) -> torch.Tensor | None:
    """The (seqlen_q, seqlen_k) mask of keys each query sees, or None when it sees them all.

    FlashAttention-2's rule: query i sees key j when
    ``i + offset - left <= j <= i + offset + right`` (-1: that side unbounded),
    offset = seqlen_k - seqlen_q, or 0 for a top-left causal call; causal is
    the window (left, 0). With ``attention_chunk`` C > 0 (FlashAttention-3's),
    also only when ``j // C == (i + offset) // C``.
    """
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0 and attention_chunk <= 0:
        return None
    offset = 0 if causal is True or causal == "top_left" else seqlen_k - seqlen_q
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if attention_chunk > 0:
        keep &= torch.div(cols, attention_chunk, rounding_mode="floor") == torch.div(
            rows + offset, attention_chunk, rounding_mode="floor")
    if right >= 0:
        keep &= cols <= rows + offset + right
    if left >= 0:
        keep &= cols >= rows + offset - left
    return keep


def alibi_bias(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """FlashAttention-2's ALiBi bias, (batch or 1, heads, seqlen_q, seqlen_k): ``-slope * |i + sk - sq - j|``."""
    slopes = slopes if slopes.dim() == 2 else slopes[None]
    rows = torch.arange(seqlen_q, device=slopes.device)[:, None]
    cols = torch.arange(seqlen_k, device=slopes.device)[None, :]
    return -slopes[:, :, None, None] * (rows + seqlen_k - seqlen_q - cols).abs().to(slopes.dtype)


def capped_scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float,
                  causal: bool | str, window_size: tuple[int, int], alibi_slopes: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, attention_chunk: int = 0,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled, capped, biased and masked scores (float32, float64 for float64 inputs), and tanh of the capped ones."""
    scores = q @ k.transpose(-1, -2)
    scores = (scores if q.dtype == torch.float64 else scores.float()) * scale
    tanh = None
    if softcap > 0:
        tanh = torch.tanh(scores / softcap)
        scores = tanh * softcap
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(scores.dtype), q.shape[-2], k.shape[-2])
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    keep = visible(q.shape[-2], k.shape[-2], causal, window_size, q.device, attention_chunk)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores, tanh


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool | str = False,
                        sm_scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                        softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, dropout_p: float = 0.0,
                        keep: torch.Tensor | None = None,
                        sinks: torch.Tensor | None = None,
                        attention_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax(q k^T * scale) v, with GQA, both causal alignments, windows, softcap, ALiBi, a bias.

    With ``keep`` (a boolean (batch, heads_q, seqlen_q, seqlen_k) mask),
    dropout: probabilities outside it are zeroed, the others divided by 1 - dropout_p.
    ``sinks`` ((heads_q,)): each head's sink logit joins every row's softmax
    (and lse) and adds no value; differentiable, for the tests' dsinks.
    ``attention_chunk``: FlashAttention-3's chunked local attention (``visible``).
    """
    hq, d = q.shape[1], q.shape[3]
    hk = k.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    scores = capped_scores(q, k, scale, softcap, causal, window_size, alibi_slopes, bias, attention_chunk)[0]
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)], -1)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows with no key: 0, not NaN
    if sinks is not None:
        probs = probs[..., :-1]
    if keep is not None:
        probs = probs * keep / (1.0 - dropout_p)
    out = (probs.to(v.dtype) @ v).to(q.dtype)
    return out, lse.float()


# Philox 4x32-10 (Salmon et al., Random123; curand's Philox4_32_10 and Triton's ``tl.randint4x``: the same
# rounds, constants and key schedule), on int64 tensors holding uint32 values.
_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mul_hi_lo(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * x for a constant a < 2**32, in 16-bit pieces so nothing overflows int64."""
    t = a * (x & 0xFFFF)
    u = a * (x >> 16)
    return (u + (t >> 16)) >> 16, (((u & 0xFFFF) << 16) + t) & _M32


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Philox 4x32-10 of the four 32-bit counter words (int64 tensors) under the two key words: four words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c2, c1, c3 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1, lo_b, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def philox_uniform(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """Elements ``offsets`` (int64, >= 0) of curand's Philox4_32_10 stream for ``seed``: float32 in (0, 1].

    Subsequence 0; element n is word ``n % 4`` of Philox(counter ``n // 4``, key ``seed``), made a float as
    ``curand_uniform`` does: ``x * 2**-32 + 2**-33`` in float32. The kernels' dropout stream, bit for bit
    (PyTorch's memory-efficient backend draws its own from this stream too).
    """
    block = offsets >> 2
    zero = torch.zeros_like(block)
    words = torch.stack(philox4x32((block & _M32, (block >> 32) & _M32, zero, zero),
                                   (seed & _M32, (seed >> 32) & _M32)))
    x = words.gather(0, (offsets & 3)[None]).squeeze(0)
    return x.to(torch.float32) * torch.tensor(2.0**-32, dtype=torch.float32) + torch.tensor(2.0**-33,
                                                                                            dtype=torch.float32)


def dropout_keep(philox: torch.Tensor, shape: tuple[int, int, int, int], dropout_p: float) -> torch.Tensor:
    """The kernels' keep mask for (batch, heads_q, seqlen_q, seqlen_k), from their [seed, offset] tensor.

    Element (b, h, i, j) is kept when ``philox_uniform(seed, offset + ((b * heads_q + h) * seqlen_q + i) *
    seqlen_k + j) > dropout_p`` (both in float32): PyTorch's memory-efficient attention's rule, so with its
    seed and offset this is its ``_fill_mem_eff_dropout_mask_``.
    """
    seed, offset = (int(x) for x in philox.cpu())
    index = torch.arange(math.prod(shape), dtype=torch.int64) + offset
    kept = philox_uniform(seed % 2**64, index) > torch.tensor(dropout_p, dtype=torch.float32)
    return kept.reshape(shape).to(philox.device)
