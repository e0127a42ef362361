"""Any kernel's variant and config for a call described by its sizes: the kernel's family answers.

Prewarm, ``cache explain``, tune and the C API describe calls by their sizes and ask here. The family comes
from the registry (``kernels.FAMILIES``), and its ``dispatch`` module has ``variant(kernel, target, request)``
(the call as one ``kernels.request.Request``) and ``kernel_config`` with ``kernel_config``'s signature below; a
new family adds its folder and its line in the registry, nothing here.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from lazytriton import tuning
from lazytriton.kernels import attention, family_of
from lazytriton.kernels.request import Request
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant


@functools.cache
def family_dispatch(kernel: str) -> ModuleType:
    """The ``dispatch`` module of ``kernel``'s family (ValueError: an unknown kernel, or one without choices)."""
    family = family_of(kernel)
    try:
        return importlib.import_module(f"{__package__}.{family}.dispatch")
    except ModuleNotFoundError:
        raise ValueError(f"kernel {kernel!r} has no dispatch rules (its family {family} chooses its variant "
                         "in its binding)") from None


def kernel_config(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, seqlen_q: int,
                  seqlen_k: int, table: tuning.Table | None = None, paged: bool = False,
                  split: bool | None = None) -> tuple[Config, tuning.Row | None]:
    """The config of any kernel for a call: its tuning table's row, else its default; and the row used.

    ``paged``: a decoding call on a paged cache; ``split``: whether the
    variant runs in split tiles (None: as this head dim's call does by default).
    """
    return family_dispatch(kernel).kernel_config(  # type: ignore[no-any-return]
        kernel, target, dtype, head_dim, causal, seqlen_q, seqlen_k, table, paged, split)


def kernel_variant(kernel: str, target: Target, dtype: str, head_dim: int, causal: bool, aligned: bool,
                   seqlen_q: int, seqlen_k: int, config: Config | None = None, index64: bool = False,
                   table: tuning.Table | None = None, tma: bool | None = None, window: bool = False,
                   softcap: bool = False, alibi: bool = False, bias: bool = False, dropout: bool = False,
                   paged: bool = False, varlen: bool = False, head_dim_v: int = 0,
                   split_d: bool | None = None, seq16: bool | None = None, leftpad: bool = False,
                   page_size: int = 0, seqused_q: bool = False, seqused_k: bool = False, rotary: bool = False,
                   rotary_interleaved: bool = False, sinks: bool = False, bias_grad: bool = False,
                   varlen_q: bool = False, chunk: bool = False, kv_fp8: str = "none",
                   qv: bool = False, key_mask: bool = False, kv_pairs: int = 0) -> Variant:
    """The variant of any kernel serving a call (pure, given the table): its family's ``variant`` of the ``Request``.

    Every attention kernel has the same functional fields (padded head dim,
    causal, EVEN_D, ALIGN16, INDEX64) and sees seqlens only through their
    buckets, so the hot paths' memo keys may stand for them. The feature flags
    (``window``, ``softcap``, ``alibi``, ``bias``, ``dropout``, ``varlen``;
    ``paged`` for the decoding kernels) are written ``NAME=true`` only when
    set, so the strings of calls without them are unchanged; the window and the
    cap themselves are runtime arguments, and the tiles are the plain call's.
    The tiles of a call whose v has another head dim (``head_dim_v``, DeepSeek's
    MLA: q/k 192, v 128) are those of the larger head dim. Each family adds its
    own: flash_fwd's ``tma`` (``kernels.flash_fwd.dispatch``), the backward's
    ``seq16`` (``kernels.flash_bwd.dispatch``), the decoding kernels'
    ``leftpad`` (cache_leftpad), ``rotary`` and ``rotary_interleaved`` (rotary_cos
    and rotary_sin, pairs or halves: also kv_append's) and ``page_size`` (with ``paged``: the page's
    keys, which cap BLOCK_N or, under flash_decode's ``GATHER_BELOW``, set
    PAGE_GATHER; 0: a page every BLOCK_N divides), the attention kernels'
    ``seqused_q`` and ``seqused_k`` (with ``varlen``: FlashAttention-3's used
    lengths, SEQUSED_Q and SEQUSED_K, written only when set), ``sinks`` (attention sinks,
    SINKS: flash_fwd's and the decoding kernels'), the backward's ``bias_grad`` (with
    ``bias``: flash_bwd_dq's BIAS_GRAD), ``varlen_q`` (the decoding split kernel's
    queries packed by cu_seqlens_q, VARLEN_Q), ``chunk`` (FlashAttention-3's attention_chunk,
    CHUNK: the attention kernels' and the decoding split kernel's), ``kv_fp8`` (a float8 KV cache, KV_FP8:
    the decoding split kernel's and kv_append's), ``qv`` (FlashAttention-3's qv, QV: the decoding split
    kernel's), ``key_mask`` (a per-(batch, key) boolean mask, KEY_MASK: the decoding split kernel's),
    ``kv_pairs`` (a decoding call's (sequence, key/value head) pairs, which a float8 cache's split tiles follow); the
    decoding kernels read
    ``seqlen_q`` as query rows per key/value head and ``seqlen_k`` as the
    cache's capacity (``kernels.flash_decode.dispatch``). ``Request`` says what
    each argument means.
    """
    request = Request(dtype, head_dim, causal, aligned, seqlen_q, seqlen_k, config, index64, table, tma, window,
                      softcap, alibi, bias, dropout, paged, varlen, head_dim_v, split_d, seq16, page_size=page_size,
                      leftpad=leftpad, seqused_q=seqused_q, seqused_k=seqused_k, rotary=rotary,
                      rotary_interleaved=rotary_interleaved, sinks=sinks, bias_grad=bias_grad, varlen_q=varlen_q,
                      chunk=chunk, kv_fp8=kv_fp8, qv=qv, key_mask=key_mask, kv_pairs=kv_pairs)
    return family_dispatch(kernel).variant(kernel, target, request)  # type: ignore[no-any-return]


def choice(kernel: str, target: Target, call: Request) -> tuple[Variant, Config, tuning.Row | None]:
    """The variant of ``kernel`` serving ``call``, its config and the tuning row it came from (None: the default).

    ``lazytriton cache explain`` describes its call as a ``Request`` with v's
    head dim and, for a paged cache, its page size. A family's ``dispatch``
    answers with its ``explained`` where it has one (the decoding kernels read
    the page size; kv_append has one config); the attention kernels' way
    otherwise: the config of the larger head dim, in split tiles where the
    head dim's default call has them.
    """
    rules = family_dispatch(kernel)
    explained = getattr(rules, "explained", None)
    if explained is not None:
        return explained(kernel, target, call)  # type: ignore[no-any-return]
    dim_v = call.head_dim_v or call.head_dim
    config, row = kernel_config(kernel, target, call.dtype, max(call.head_dim, dim_v), call.causal, call.seqlen_q,
                                call.seqlen_k, split=attention.split_chunks(kernel, call.head_dim, dim_v) is not None)
    return rules.variant(kernel, target, call), config, row
