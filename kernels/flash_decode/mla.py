"""DeepSeek MLA's two forms of a ``flash_attn_with_kvcache`` call: FlashAttention-3's ``qv`` and the latent cache.

Both write the same attention (DeepSeek-V2/V3's decode with the absorbed projections):

- FlashAttention-3's ``qv``: q and k of head dim d (MLA's rotary part, 64), v of head dim dv (the latent, 512)
  and qv (batch, seqlen_q, heads, dv): scores (q . k + qv . v) x softmax_scale, whose default is
  1/sqrt(d + dv) (``hopper/flash_attn_interface.py``).
- FlashMLA's and vLLM's latent cache: one cache (num_blocks, page_size, 1, 576) whose first 512 columns are v,
  passed as k_cache and v_cache = k_cache[..., :512] (a view: no copy), q (..., 576) = [q_nope | q_pe]:
  scores q . k x softmax_scale, default 1/sqrt(576). That is the qv form with qv = q[..., :512], q =
  q[..., 512:] and k = k_cache[..., 512:] (``shared_cache`` recognises it).

Both run the split kernel's QV variant. Each row of its Q holds qv's dv columns, then q's: the cache form's q
is that layout as given; the qv form's q and qv are joined into one tensor (a copy of the queries, never of
the cache). Its K points at the key columns after v's, so the V tile the kernel loads for P . V serves qv . v
too and each key's bytes are read once. ``Call.head_dim`` is then q's width without qv (64), and
``head_dim_v`` v's (512).

New keys with caches that share memory. Reading through both is always fine. Writing is not, unless each
column is written once: in the cache form, k (batch, seqlen_new, heads_k, d) is the new latent row and v
must be k[..., :dv] (the same memory: FlashAttention's signature asks for both), so the append writes v's
columns through v_cache and the rest of k's through k_cache, each once. Caches that overlap in any other way
take no new keys (ValueError naming v_cache). The cache form takes no rotary embedding (FlashAttention's
rotates the first columns of q and k, which are v's here: rotate q_pe and k_pe before the call) and no float8
cache; neither does ``qv``'s float8 (FlashAttention-3's tests skip it too).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from lazytriton import geometry

MAX_CACHE_DIM = geometry.MAX_HEAD_DIM + geometry.MAX_HEAD_DIM_V  # the cache form's head dim: v's and k's own


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether two tensors may share memory; None: cannot tell.

    True when they are views of one storage (meta tensors too) whose element spans intersect: two views
    whose spans are apart, such as vLLM's ``kv_cache.unbind(0)``, do not overlap. Spans that intersect count
    as overlapping even where the strides interleave them. While torch.compile traces the public function,
    storages cannot be read: None then, and the op's body, which runs on the real tensors, checks again.
    """
    if torch.compiler.is_compiling():
        return None
    if StorageWeakRef(a.untyped_storage()) != StorageWeakRef(b.untyped_storage()):
        return False
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a_lo, a_hi), (b_lo, b_hi) = _span(a), _span(b)
    return a_lo < b_hi and b_lo < a_hi


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [first, last + 1) of the storage that ``t`` (non-empty) reaches."""
    size = t.element_size()
    low = high = int(t.storage_offset())
    for extent, stride in zip(t.shape, t.stride(), strict=True):
        reach = (int(extent) - 1) * int(stride)
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return low * size, (high + 1) * size


def leading_columns(part: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``part`` is ``whole[..., :n]`` with n < whole's last dim: one storage, offset, shape and strides.

    While tracing (``overlaps`` None), the shapes and strides alone: the op's body checks the storage and offset.
    """
    if not (part.dim() == whole.dim() == 4 and part.shape[:3] == whole.shape[:3]
            and part.stride()[:3] == whole.stride()[:3] and part.shape[3] < whole.shape[3]):
        return False
    same = overlaps(part, whole)
    return same is None or (same and part.storage_offset() == whole.storage_offset())


def shared_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether v_cache is k_cache[..., :head_dim_v]: MLA's latent cache, served in the qv form."""
    return leading_columns(v_cache, k_cache)


def check_head_dims(head_dim: int, head_dim_v: int, shared: bool) -> None:
    """Refuse q's and v's head dims beyond the kernels' (ValueError naming them)."""
    if not 1 <= head_dim_v <= geometry.MAX_HEAD_DIM_V:
        raise ValueError(f"v_cache's head dim (head_dim_v, v_cache.shape[-1]) must be in "
                         f"1..{geometry.MAX_HEAD_DIM_V}, got {head_dim_v}")
    if shared:
        if not 1 <= head_dim - head_dim_v <= geometry.MAX_HEAD_DIM:
            raise ValueError(f"with v_cache = k_cache[..., :{head_dim_v}] (MLA's latent cache), k_cache's columns "
                             f"after v's (head dim {head_dim} - {head_dim_v}) must number 1..{geometry.MAX_HEAD_DIM}")
    elif not 1 <= head_dim <= geometry.MAX_HEAD_DIM:
        raise ValueError(f"head dim (q.shape[-1]) must be in 1..{geometry.MAX_HEAD_DIM} (up to "
                         f"{MAX_CACHE_DIM} with v_cache = k_cache[..., :head_dim_v], MLA's latent cache), got "
                         f"{head_dim}")


def check_new_keys(k_cache: torch.Tensor, v_cache: torch.Tensor, k: Any, v: Any, shared: bool) -> None:
    """The rule for new keys with caches that share memory (the module's docstring); ValueError naming the culprit."""
    if k is None or overlaps(k_cache, v_cache) is False or (not shared and overlaps(k_cache, v_cache) is None):
        return
    if not shared:
        raise ValueError("k and v (new keys) are given but v_cache shares k_cache's memory other than as "
                         "k_cache[..., :head_dim_v] (MLA's latent cache): the append would write some cache "
                         "columns twice; append to such caches apart, or pass separate caches")
    if not (isinstance(v, torch.Tensor) and isinstance(k, torch.Tensor) and leading_columns(v, k)):
        raise ValueError(f"with v_cache = k_cache[..., :{v_cache.shape[-1]}] (MLA's latent cache), v must be "
                         f"k[..., :{v_cache.shape[-1]}] (a view of the new latent rows k, which are written once)")


def with_qv(call: Any, t: Any, q: torch.Tensor, softmax_scale: Any, shared: bool) -> Any:
    """``call`` (a ``checks.Call``) in the QV variant's terms: q's own head dim, the default scale; ``qv`` checked.

    ``t``: the call's ``checks.Inputs``. ``q`` is q as checked (its head dim d: the cache form's whole row).
    """
    dv = call.value_dim
    if t.qv is not None and shared:
        raise ValueError(f"qv is given but v_cache is k_cache[..., :{dv}] (MLA's latent cache, whose q carries "
                         "its own qv in its first columns): pass one form")
    if call.kv_fp8 != "none":
        raise ValueError(f"{'qv' if t.qv is not None else 'v_cache = k_cache[..., :head_dim_v]'} with a float8 "
                         "cache is not supported (FlashAttention-3 has no such call either)")
    head_dim = call.head_dim - dv if shared else call.head_dim
    if shared and call.rotary:
        raise ValueError("rotary_cos is given with v_cache = k_cache[..., :head_dim_v] (MLA's latent cache): "
                         "FlashAttention's rotary rotates q's and k's first columns, which are v's here; rotate "
                         "q_pe and k_pe before the call, or use the qv form")
    if t.qv is not None:
        _check_qv(t.qv, q, dv)
    scale = call.scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim + dv)
    return call._replace(head_dim=head_dim, scale=scale, qv=True, head_dim_v=0 if dv == head_dim else dv)


def _check_qv(qv: Any, q: torch.Tensor, dv: int) -> None:
    want = (*q.shape[:-1], dv)
    if not isinstance(qv, torch.Tensor):
        raise TypeError(f"qv must be a torch.Tensor or None, got {type(qv).__name__}")
    if tuple(qv.shape) != want:
        raise ValueError(f"qv must have shape {want} (q's, with v_cache's head dim {dv}), got {tuple(qv.shape)}")
    if qv.dtype != q.dtype or qv.device != q.device:
        raise TypeError(f"qv must be {q.dtype} on {q.device} (q's), got {qv.dtype} on {qv.device}")
    if qv.stride(-1) != 1 and dv > 1:
        raise ValueError(f"qv must have a contiguous last dim (stride 1), got strides {qv.stride()}")


def kernel_inputs(t: Any, call: Any) -> Any:
    """The QV variant's tensors (``checks.Inputs``): q as [qv | q], k_cache (and new k) from the columns after v's.

    The cache form's q and caches are views of the caller's; the qv form's q is one new tensor, its caches the
    caller's.
    """
    if t.qv is not None:
        return t._replace(q=torch.cat((t.qv, t.q), dim=-1), qv=None)
    dv = call.value_dim
    k, v = (t.k[..., dv:], t.k[..., :dv]) if t.k is not None else (None, None)
    return t._replace(k_cache=t.k_cache[..., dv:], k=k, v=v)
