"""transformers integration: an attention implementation named "lazytriton".

Usage::

    from lazytriton.integrations import transformers as lt_transformers

    lt_transformers.register()  # once per process; idempotent
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="lazytriton")
    model.set_attn_implementation("lazytriton")  # or switch a model already built

Every attention layer then runs through lazytriton, one call per layer and
forward (below): unpadded and padded batches (left or right padding),
prefill and generation with a KV cache (``DynamicCache`` or ``StaticCache``,
their sliding-window layers included), bidirectional encoders with padding
(BERT), grouped-query attention (key/value heads passed as they come, never
repeated), the layer's ``scaling``, sliding windows (Mistral, Qwen2's sliding layers, Gemma 2 and 3:
the window transformers' masks draw, ``sliding_window`` keys up to and
including the query's own) and attention logit softcapping (Gemma 2's
``softcap=``, passed to the kernels: FlashAttention-2's semantics, which are
those of transformers' "eager" implementation; SDPA refuses it).
Differentiable.

How the mask reaches the kernels. transformers builds the mask once per
forward with the implementation's *mask function* and hands it to every
layer; registering only an attention function is not enough (the model would
then build no mask at all for an unknown name and padded batches would be
silently wrong). The mask function registered here hands over what
transformers' own ``sdpa_mask`` builds, so the attention function sees
exactly what the "sdpa" implementation sees, and remembers beside it which
query rows are real tokens (from the 2D padding mask). A decoding step under
the plain causal mask (one query, no window or chunk) gets the same boolean
(batch, 1, 1, kv_len) mask read straight off the 2D padding mask
(``_decoding_step_mask``: a few tensor ops against ``sdpa_mask``'s ~0.5 ms
of host time a step; never None, so no step reads the padding back to see
whether it could skip the mask). Each layer then makes one call:

- ``None``: no padding. It means what it means for SDPA: causal
  (``q_len == kv_len``, and an empty static cache's prefill, where SDPA crops
  the keys to the queries) or, for a single query or a non-causal module, no
  mask. One dense call for the whole batch. For a sliding layer
  transformers builds no mask only where the window does not cut in; should
  a model's ``sliding_window=`` cut in without a mask, a causal call (or a
  single query) applies it as ``window_size=(sliding_window - 1, 0)``, and a
  bidirectional one raises (its extent is ambiguous there).
- a boolean (batch, 1, q_len, kv_len) mask that is padding (left, right, or
  between a prompt and its new tokens) combined with causal or bidirectional
  attention and a sliding window, in prefill or decoding against a cache:
  **one** ``flash_attn_varlen_func`` call on the packed tokens, or one dense
  ``attn_fwd`` call on a key slice where no sequence is padded
  (``transformers_varlen``: how the tokens and the window are inferred from
  the mask, and checked against it element for element). A causal layer's
  pad queries give zeros: a left-padded one sees nothing (SDPA gives zeros
  too); a right-padded one sees the real keys in SDPA but gives zeros here,
  as in transformers' flash_attention_2 (its output feeds no real token; a
  right-padded prompt's first generated token comes from it, which
  transformers warns is wrong). A bidirectional layer's pad queries are
  packed too (SDPA's output).
- a decoding step (one query a sequence) with a boolean mask: **one** call
  of the decoding kernels (``kvcache.with_key_mask``: split-KV, the GQA group
  packed so each key is read once) on the cache's tensors as views, with the
  mask's (batch, kv_len) view as their key mask (KEY_MASK: SDPA's boolean
  mask, read per key tile), softcap and sinks passed on; served by the
  decoding call's warm path where it has no softcap or sinks. Where that
  route does not apply (gradients wanted, a tensor subclass, an unusual
  layout), one call of the SDPA drop-in with the mask as an
  additive bias, made once per forward and mask (every layer reuses it);
  with a softcap, the drop-in's body with the cap applied before the bias
  (``sdpa.masked``). Either way nothing is read back to the host, whatever
  the mask (left or right padding, holes, a static cache's empty slots), so
  a decoding step never waits for the GPU; the keys are read in place from
  the cache.
- any other mask (chunks, packed documents, several queries whose window
  spans pads between real keys, custom 4D masks, per-head or additive float
  masks): one call of
  the SDPA drop-in ``lazytriton.scaled_dot_product_attention`` with the mask
  as ``attn_mask``. That drop-in has no softcap, so a softcapped layer (Gemma
  2) with such a boolean mask runs the per-sequence plan of
  ``transformers_plan`` instead (one launch per sequence or run of queries),
  or raises NotImplementedError where the mask has holes.

Sliding windows (Mistral, Qwen2's sliding layers, Gemma 2 and 3: the window
transformers' masks draw, ``sliding_window`` keys up to and including the
query's own) use the window kernels, their own cache entries (``prewarm
--window``, ``--softcap``), only where the window cuts in. The analysis of a
mask runs once per forward and mask (all layers share the mask object) and
reads one small summary to the host (a sync): a prefill pays it once per
forward, a decoding step never; each layer's ``flash_attn_varlen_func``
call then trusts the cu_seqlens the analysis made (no sync per layer).

Attention sinks (gpt-oss passes each layer's as ``s_aux``) go to every path
above as the kernels' ``sinks`` (float32; a bf16 parameter is converted, its
gradient kept).

Not supported (NotImplementedError): dropout > 0 (set ``model.eval()`` or
``attention_dropout=0``),
``position_bias`` (T5-style relative bias), sparse ``indices``, softcap with
a mask whose queries see keys with holes. The data-dependent mask analysis
makes ``torch.compile`` break the graph at each layer with a mask. Tested
with transformers 5.24-5.25 (Llama, BERT, Mistral, Qwen2, Gemma 2 and 3, gpt-oss).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

import lazytriton
from lazytriton import interface, kvcache, sdpa
from lazytriton.integrations import transformers_plan, transformers_varlen

NAME = "lazytriton"
# Keyword arguments some models pass to their attention function that change the math and that lazytriton
# does not implement yet; SDPA ignores them, lazytriton refuses them.
_UNSUPPORTED_KWARGS = ("indices", "block_indices")
_NO_WINDOW = transformers_varlen.NO_WINDOW  # lazytriton.attn_fwd's default: no sliding window


def register(name: str = NAME) -> None:
    """Register lazytriton's attention and mask functions with transformers under ``name``.

    Both are needed (see the module docstring). Idempotent; registration is
    process-wide (transformers' global attention and mask interfaces).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask)


def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function: transformers' ``sdpa_mask``, whose output ``attention_forward`` reads.

    A boolean (batch, 1, q_len, kv_len) mask, or None where SDPA's own
    ``is_causal`` handling would do (no padding). Kept as our own function so
    that the contract between the two halves is ours: beside the mask it
    records which query rows are real tokens, which a causal mask does not
    say of a right-padded sequence's pad queries (they see the real keys).
    """
    from transformers.masking_utils import sdpa_mask

    if not args:
        step = _decoding_step_mask(kwargs)
        if step is not None:
            return step
    # Older transformers, on torch < 2.6, unmask a query row that sees no key (SDPA then gave NaN there);
    # that would break the padding pattern, and lazytriton gives such a row zeros anyway. Later versions
    # ignore the argument.
    kwargs.setdefault("allow_torch_fix", False)
    built: torch.Tensor | None = sdpa_mask(*args, **kwargs)
    padding, q_len = kwargs.get("attention_mask"), kwargs.get("q_length")
    if built is not None and isinstance(padding, torch.Tensor) and padding.dim() == 2 and isinstance(q_len, int):
        bools = padding.to(torch.bool)
        real = _real_queries(bools, q_len, kwargs)
        if real is not None:
            transformers_varlen.remember_queries(built, real)
        if not args and _causal_prefill(kwargs, bools.shape[1]):
            transformers_varlen.remember_prefill(built, bools)
    return built


def _causal_prefill(kwargs: dict[str, Any], padding_len: int) -> bool:
    """Whether ``sdpa_mask``'s arguments are a causal prefill without a cache (``remember_prefill``'s mask)."""
    from transformers.masking_utils import causal_mask_function

    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    return (kwargs.get("mask_function", causal_mask_function) is causal_mask_function
            and kwargs.get("local_size") is None and type(q_offset) is int and q_offset == 0
            and type(kv_offset) is int and kv_offset == 0
            and kwargs.get("q_length") == kwargs.get("kv_length") == padding_len)


def _decoding_step_mask(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A decoding step's (batch, 1, 1, kv_length) boolean mask, read off the 2D padding mask; None: not one.

    One query (``q_length`` 1) under transformers' plain causal mask function
    (no window, chunk or extra mask function) with a 2D padding mask:
    ``sdpa_mask``'s answer is then the padding mask's columns of the keys
    (``kv_offset`` on, False past its end: a static cache's empty slots) cut
    at the query's position (``q_offset``, an int or, in a static cache's
    compiled step, a tensor). Made here in one to three tensor ops, where
    ``sdpa_mask`` takes ~0.5 ms of host time a step (and, when it may skip the
    mask, reads the padding back to the host to see whether it can); never
    None, so a step never reads anything back.
    """
    from transformers.masking_utils import causal_mask_function

    padding, kv_len = kwargs.get("attention_mask"), kwargs.get("kv_length")
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    if (kwargs.get("q_length") != 1 or type(kv_len) is not int or kv_len < 1 or type(kv_offset) is not int
            or kv_offset < 0 or kwargs.get("mask_function", causal_mask_function) is not causal_mask_function
            or kwargs.get("local_size") is not None or not isinstance(padding, torch.Tensor) or padding.dim() != 2
            or kwargs.get("batch_size", padding.shape[0]) != padding.shape[0]
            or not (type(q_offset) is int or (isinstance(q_offset, torch.Tensor) and q_offset.numel() == 1))):
        return None
    keys = padding[:, kv_offset:kv_offset + kv_len].to(torch.bool)
    if keys.shape[1] < kv_len:  # columns past the 2D mask: no token there yet
        keys = torch.nn.functional.pad(keys, (0, kv_len - keys.shape[1]), value=False)
    if isinstance(q_offset, torch.Tensor):
        keys = keys & (torch.arange(kv_offset, kv_offset + kv_len, device=keys.device) <= q_offset.reshape(()))
    elif q_offset - kv_offset + 1 < kv_len:  # keys after the query's position
        keys = keys & (torch.arange(kv_offset, kv_offset + kv_len, device=keys.device) <= q_offset)
    return keys[:, None, None, :]


def _real_queries(padding: torch.Tensor, q_len: int, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Which queries are real tokens, (batch, q_len) booleans: the 2D padding mask at the queries' positions.

    Query i is the token at absolute position ``q_offset + i``, whose column in the 2D mask (absolute
    positions, as transformers' own padding mask function reads it) says whether it is a pad. Usually the
    last q_len columns, but not for every cache (a static cache's 2D mask may reach past the tokens, MTP and
    speculative caches shift the queries). A position past the 2D mask (malformed input) counts as real: its
    row is then checked against the mask like any other.
    """
    q_offset = kwargs.get("q_offset")
    if not isinstance(q_offset, (int, torch.Tensor)):
        return padding[:, -q_len:] if 0 < q_len <= padding.shape[1] else None
    extended = torch.nn.functional.pad(padding, (0, q_len), value=True)
    positions = (torch.arange(q_len, device=padding.device) + q_offset).clamp(0, extended.shape[1] - 1)
    return extended.index_select(1, positions)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function, with transformers' signature (that of ``sdpa_attention_forward``).

    query (batch, heads_q, q_len, head_dim), key/value (batch, heads_k, kv_len,
    head_dim), heads_q a multiple of heads_k; returns (attention output as
    (batch, q_len, heads_q, head_dim), None), the second being the attention
    weights, which no flash kernel materialises.
    """
    _check_supported(dropout, position_bias, kwargs)
    softcap = kwargs.get("softcap")
    features: dict[str, Any] = {} if softcap is None else {"softcap": softcap}  # None (and 0.0): off
    sinks = _sinks(kwargs)
    if sinks is not None:
        features["sinks"] = sinks
    module_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if attention_mask is None:
        out = _unmasked(module_causal, query, key, value, scaling, kwargs.get("sliding_window"), features)
        return out.transpose(1, 2).contiguous(), None
    batch, _, q_len = query.shape[:3]
    if q_len == 1 and _one_boolean_mask(attention_mask):
        return decoding_step(query, key, value, attention_mask, scaling, features, bshd=True), None
    found = transformers_varlen.layout(attention_mask, batch, q_len, key.shape[2], module_causal)
    if isinstance(found, transformers_varlen.Packed):
        return transformers_varlen.run_packed(found, query, key, value, scaling, features), None
    if isinstance(found, transformers_varlen.Dense):
        out = transformers_varlen.run_dense(found, query, key, value, scaling, features)
    elif "softcap" in features:  # the SDPA drop-in has no softcap
        out = transformers_plan.attention(query, key, value, attention_mask, scaling, features)
    else:
        out = _arbitrary(query, key, value, attention_mask, scaling, features)
    return out.transpose(1, 2).contiguous(), None


def _sinks(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The layer's attention sinks (gpt-oss passes its ``sinks`` parameter as ``s_aux``), float32, or None.

    The kernels take float32 sinks; a bf16 parameter is converted here (the
    conversion is differentiable, so its gradient reaches the parameter).
    """
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    elif kwargs.get("sinks") is not None:
        raise TypeError("lazytriton attention: s_aux and sinks are two names of one argument (attention sinks): "
                        "pass one of them")
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"lazytriton attention: s_aux (attention sinks) must be a tensor, got {type(sinks).__name__}")
    return sinks if sinks.dtype == torch.float32 else sinks.float()


def _one_boolean_mask(mask: torch.Tensor) -> bool:
    """Whether ``mask`` is one boolean (batch, 1, q_len, kv_len) mask for every head (the mask function's)."""
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1


class _Decoding(NamedTuple):
    """A decoding step's additive bias for one live mask object, and the checked calls that ran with it."""

    mask: weakref.ReferenceType[torch.Tensor]
    version: int
    dtype: torch.dtype
    bias: torch.Tensor
    calls: dict[tuple[Any, ...], Any]  # (sizes, strides, device, scale, cap) -> sdpa.prepared's call


# Every layer of a forward gets the same mask object, so its bias is made once a forward, and the checks of a
# layer's call (shapes, strides, the bias) run once a layout: the other layers run the checked call again.
# Replaced, never mutated; weak references to the masks.
_decodings: list[_Decoding] = []
_KEPT = 8


def decoding_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  scaling: float | None, features: dict[str, Any], bshd: bool = False) -> torch.Tensor:
    """One query a sequence against a cache under a boolean (batch, 1, 1, kv_len) mask: (batch, heads, 1, d_v).

    ``bshd``: (batch, 1, heads, d_v) contiguous instead (what the attention function returns).
    Without gradients, the decoding kernels with the mask as their key mask (``_with_key_mask``; under
    ``torch.compile`` through their torch op). Otherwise (``_biased_step``) the mask as an additive bias (0
    where it attends, -inf elsewhere), made on the mask's device: nothing is read back to the host. Cached for the
    mask object, its version (an in-place edit makes it again) and the dtype, with the call checked for each
    layout that ran with it, so each further layer of the forward launches its kernel without the checks; made in
    the graph under ``torch.compile`` (the compiler fuses it, and a cache of Python objects would break the graph).
    """
    compiling = torch.compiler.is_compiling()
    routed = _with_key_mask(query, key, value, mask, scaling, features, compiling)
    if routed is not None:
        return routed if bshd else routed.transpose(1, 2)
    if compiling:
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
        out = _arbitrary(query, key, value, bias, scaling, features)
    else:
        out = _biased_step(query, key, value, mask, scaling, features)
    return out.transpose(1, 2).contiguous() if bshd else out


def _biased_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                 scaling: float | None, features: dict[str, Any]) -> torch.Tensor:
    """``decoding_step`` through the SDPA drop-in with the mask's bias, each layout's checked call kept."""
    entry = _decoding(mask, query.dtype)
    softcap, sinks = features.get("softcap"), features.get("sinks")
    layout = (query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(), query.device,
              scaling, softcap)
    call = entry.calls.get(layout)
    if call is None:
        capped = {} if softcap is None else {"softcap": softcap}
        q4, k4, v4, call, out_shape = sdpa.prepared(query, key, value, entry.bias, 0.0, False, scaling, True,
                                                    **capped)
        if q4 is not query or k4 is not key or v4 is not value:  # broadcast batch dims: views of their own
            out = interface.run(q4, k4, v4, sdpa.with_sinks(call, q4, sinks))[0]
            return out if out.shape == out_shape else out.reshape(out_shape)
        entry.calls[layout] = call
    # Each layer has sinks of its own: the cached call holds none, each call gets its layer's (a cheap check).
    return interface.run(query, key, value, sdpa.with_sinks(call, query, sinks))[0]


_KEY_MASK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_Tensor = torch.Tensor
# The fewest keys a decoding step takes the key-mask route from (shorter steps: the bias path). On the H200
# (experiments/probe_decode_step.py: batch 8 left-padded, 16/4 heads, hd128, bf16; µs a layer's step, back to
# back) the route is faster at every length measured: 45.8 against the bias path's 92.8 at 64 keys, 46.4 / 93.2
# at 576, 30.8 / 59.8 at 2048, 35.6 / 69.6 at 32k (SDPA: 57.7, 66.8, 44.6, 50.7). So every step takes it.
KEY_MASK_MIN_KEYS = 0


def _with_key_mask(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   scaling: float | None, features: dict[str, Any], compiling: bool = False) -> torch.Tensor | None:
    """A decoding step through the decoding kernels with the mask as their key mask, or None where it does not apply.

    transformers' caches hold (batch, heads_k, kv_len, d): the kernels read them as (batch, kv_len, heads_k, d)
    views (``transpose(1, 2)``), the whole cache (cache_seqlens None) under the mask's (batch, kv_len) view; q
    likewise. Returns (batch, 1, heads, d_v), contiguous. Plain tensors with no gradient wanted, one dtype
    and device (CUDA, or the CPU's interpreter), contiguous last dims, q's and k's head dim up to 256 (v's up to
    512); else None: the bias path. Every check reads sizes and flags only (a few µs: this runs every layer).
    ``compiling`` (inside ``torch.compile``'s trace): the mask's view is made in the graph, not kept in
    ``_key_masks`` (a cache of Python objects would break the graph).
    """
    sinks, softcap = features.get("sinks"), features.get("softcap")
    if not (type(query) is _Tensor and type(key) is _Tensor and type(value) is _Tensor and type(mask) is _Tensor
            and (sinks is None or type(sinks) is _Tensor)):
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return None  # the decoding kernels have no backward
    dtype, device = query.dtype, query.device
    if (dtype not in _KEY_MASK_DTYPES or key.dtype is not dtype or value.dtype is not dtype
            or not (device == key.device == value.device == mask.device) or key.dim() != 4 or value.dim() != 4
            or not (query.is_cuda or query.is_cpu)):
        return None
    batch, heads, _, dim = query.shape
    kv_len = key.shape[2]
    if (key.shape[0] != batch or value.shape[:3] != key.shape[:3] or key.shape[3] != dim or dim > 256
            or value.shape[3] > 512 or heads % key.shape[1] or mask.shape[0] not in (1, batch)
            or mask.shape[1:] != (1, 1, kv_len) or kv_len == 0 or kv_len < KEY_MASK_MIN_KEYS
            or query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1):
        return None
    if not (scaling is None or type(scaling) is float) and not isinstance(scaling, (int, float)):
        return None
    if not (softcap is None or isinstance(softcap, (int, float))):
        return None
    keys = mask[:, 0, 0].expand(batch, kv_len) if compiling else _key_mask(mask, batch)
    if softcap is None and sinks is None:
        return kvcache.with_key_mask(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                     keys, None, None, None, None,
                                     None if scaling is None else float(scaling))  # type: ignore[no-any-return]
    return kvcache.with_key_mask(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),  # type: ignore
                                 keys, softmax_scale=None if scaling is None else float(scaling),
                                 softcap=0.0 if softcap is None else float(softcap), sinks=sinks)


# The (batch, kv_len) views of the last few masks (every layer of a forward gets the same mask object): (weak
# reference, version, batch, view); each view keeps its mask alive (a few bytes a key) until _KEPT newer ones
# push it out. Replaced, never mutated.
_key_masks: list[tuple[weakref.ReferenceType[torch.Tensor], int, int, torch.Tensor]] = []


def _key_mask(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """The (batch, kv_len) view of a (batch or 1, 1, 1, kv_len) mask, made once per mask object and version."""
    global _key_masks
    for ref, version, rows, view in _key_masks:
        if ref() is mask and version == mask._version and rows == batch:
            return view
    view = mask[:, 0, 0].expand(batch, mask.shape[3])
    _key_masks = [*[e for e in _key_masks if e[0]() is not None][-(_KEPT - 1):], (weakref.ref(mask), mask._version,
                                                                                  batch, view)]
    return view


def _decoding(mask: torch.Tensor, dtype: torch.dtype) -> _Decoding:
    """The cache entry of ``mask`` (its object, version and ``dtype``), made with its bias if there is none."""
    global _decodings
    for entry in _decodings:
        if entry.mask() is mask and entry.version == mask._version and entry.dtype == dtype:
            return entry
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    entry = _Decoding(weakref.ref(mask), mask._version, dtype, bias, {})
    _decodings = [*[e for e in _decodings if e.mask() is not None][-(_KEPT - 1):], entry]
    return entry


def _check_supported(dropout: float, position_bias: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
    if dropout != 0.0:
        raise NotImplementedError(f"lazytriton attention: dropout={dropout!r} is not supported yet; "
                                  "call model.eval() or set the config's attention dropout to 0")
    if position_bias is not None:
        raise NotImplementedError("lazytriton attention: position_bias (relative position bias) is not supported")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"lazytriton attention: {name}= is not supported yet")


def _unmasked(module_causal: bool, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              scaling: float | None, sliding_window: int | None, features: dict[str, Any]) -> torch.Tensor:
    """No mask: SDPA's meaning, exactly as ``sdpa_attention_forward`` computes it, within ``sliding_window``."""
    q_len = query.shape[2]
    causal = q_len > 1 and module_causal  # a single query sees every key (decoding)
    if causal and key.shape[2] > q_len:
        # Only an empty static cache's prefill gets here: SDPA aligns top-left, i.e. the keys past the
        # queries (empty cache slots) are never seen; crop them, as sdpa_attention_forward does.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    window = _window(sliding_window, key.shape[2], module_causal)
    if window != _NO_WINDOW:
        features = {**features, "window_size": window}
    return lazytriton.attn_fwd(query, key, value, causal=causal, sm_scale=scaling, **features)[0]


def _window(sliding_window: int | None, kv_len: int, causal: bool) -> tuple[int, int]:
    """The window_size of a causal module's call without a mask, for a model's ``sliding_window``.

    transformers' mask function builds no mask for a sliding layer only where its window does not cut in
    (fewer keys than the window), so this is (-1, -1) there. Elsewhere, the window transformers' masks draw:
    ``sliding_window`` keys up to and including the query's own position (FlashAttention-2's ``left =
    sliding_window - 1``, as transformers passes it to flash-attn).
    """
    if sliding_window is None:
        return _NO_WINDOW
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be None or an int >= 1 (keys seen, the query's own included), "
                         f"got {sliding_window!r}")
    if kv_len <= sliding_window:
        return _NO_WINDOW
    if not causal:
        raise NotImplementedError(f"lazytriton attention: sliding_window={sliding_window} on bidirectional "
                                  "attention without a mask (its extent is ambiguous); pass the mask")
    return (sliding_window - 1, 0)


def _arbitrary(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
               scaling: float | None, features: dict[str, Any] | None = None) -> torch.Tensor:
    """Any other mask, boolean (True = attend) or additive float: one call of the SDPA drop-in with ``attn_mask``.

    With a softcap or sinks (``features``), the drop-in's checked body with
    them (``sdpa.masked``): the cap applied before the mask's bias, as
    "eager" does, the sinks after it.
    """
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must have 4 dims (batch, heads, q_len, kv_len), got shape "
                         f"{tuple(attention_mask.shape)}")
    if features:
        return sdpa.masked(query, key, value, attention_mask, 0.0, False, scaling, True, **features)
    return lazytriton.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                   enable_gqa=True)
