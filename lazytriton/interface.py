"""The public attention functions: FlashAttention-2's and SDPA's signatures, and the lower-level ``attn_fwd``.

Layering is FlashAttention-2's: the torch op (``lazytriton.ops``, with its
fake twin), then autograd on it, then these thin
functions, which alone carry the long docstrings. Each checks its arguments
(a ``TypeError``/``ValueError`` naming the argument before anything runs),
turns its layout into the kernel's (batch, heads, seqlen, head_dim) with
views, never copies, and calls the op; an eager call with plain tensors and
nothing tracing goes to the binding directly, which skips the op's dispatch
(``direct``; cost of each measured in benchmarks/NOTES.md).

``import lazytriton`` does not import this module (it imports torch): the
names are re-exported lazily by ``lazytriton/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lazytriton.forward_routes import WarmPathsLater, fp8_route, mla_route
from lazytriton.kernels.arguments import check_bool, check_dropout, index_tensor
from lazytriton.kernels.flash_fwd import binding, score_mods
from lazytriton.kernels.flash_fwd import sinks as attention_sinks
from lazytriton.launch import CaptureError as CaptureError  # re-exported: lazytriton.CaptureError
from lazytriton.window import window_pair

hot: Any = WarmPathsLater(globals(), "hot")  # kernels/flash_fwd/hot.py once a warm path can serve
_FA_NAMES = binding.Names(q="q", k="k", v="v", causal="causal", scale="softmax_scale")
_is_compiling = torch.compiler.is_compiling
# How many dispatch modes are active (C, ~30 ns; torch.utils._python_dispatch._get_current_dispatch_mode reads
# the same stack from Python, ~0.2 µs).
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None) or (
    lambda: int(torch.utils._python_dispatch._get_current_dispatch_mode() is not None))
_Tensor = torch.Tensor


_through_op = [False]  # always_through_op() sets it


def direct(q: Any, k: Any, v: Any) -> bool:
    """True when the op's dispatch adds nothing: plain tensors, nothing tracing, no dispatch mode."""
    return (type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and not _is_compiling()
            and not _dispatch_modes() and not _through_op[0])


@contextmanager
def always_through_op() -> Iterator[None]:
    """Send every call in this block through the torch op, as tracing does (to measure or test the op path)."""
    saved = _through_op[0]
    _through_op[0] = True
    try:
        yield
    finally:
        _through_op[0] = saved


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: binding.Call,
         deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a checked call; ``deterministic``: its backward bitwise reproducible (the op saves it)."""
    if direct(q, k, v):
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                             or (call.sinks is not None and call.sinks.requires_grad)
                                             or (call.bias is not None and call.bias.requires_grad))):
            return binding.forward(q, k, v, call)
        # Gradients wanted, nothing tracing: the op's forward and backward without its dispatch, whose first
        # call imports torch._dynamo, nor its registration (lazytriton.eager).
        from lazytriton.eager import attention

        return attention(q, k, v, call, deterministic)
    # Registered on first use: torch's custom-op registration costs ~4 ms of import, which an eager
    # process served from an image never needs; dynamo traces this import like any other. The op
    # carries the autograd formula (the backward kernels).
    from lazytriton.ops import flash_fwd_op

    if (call.alibi is None and call.bias is None and call.philox is None and not deterministic and call.sinks is None
            and not call.attention_chunk):
        return flash_fwd_op(  # type: ignore[no-any-return]
            q, k, v, call.scale, call.causal, call.window_left, call.window_right, call.softcap)
    return flash_fwd_op(  # type: ignore[no-any-return]
        q, k, v, call.scale, call.causal, call.window_left, call.window_right, call.softcap, call.alibi, call.bias,
        call.dropout_p, call.philox, deterministic, call.sinks, call.attention_chunk)


def with_mods(call: binding.Call, q: torch.Tensor, alibi_slopes: Any, bias: Any, dropout_p: Any,
               names: binding.Names) -> binding.Call:
    """``call`` with ALiBi, a bias and dropout checked; dropout's Philox [seed, offset] drawn now, on q's device."""
    if alibi_slopes is None and bias is None and (type(dropout_p) is float or type(dropout_p) is int) \
            and dropout_p == 0:
        return call
    p = check_dropout(names.dropout, dropout_p)
    philox = score_mods.draw_philox(q.device, score_mods.dense_elements(call)) if p > 0.0 else None
    return score_mods.with_mods(call, q, index_tensor(alibi_slopes), bias, p, philox, names)


# The defaults. The warm path serves only calls without a window or softcap, and tests
# for them by identity first, inline (16 ns over nothing; == on both: 125 ns, CPython 3.11).
_NO_WINDOW = (-1, -1)
_NO_CAP = 0.0


def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool | str = False,
             sm_scale: float | None = None, window_size: tuple[int, int] = _NO_WINDOW,
             softcap: float = _NO_CAP, alibi_slopes: torch.Tensor | None = None,
             dropout_p: float = 0.0, sinks: torch.Tensor | None = None,
             s_aux: torch.Tensor | None = None, attention_chunk: int = 0, q_descale: torch.Tensor | None = None,
             k_descale: torch.Tensor | None = None,
             v_descale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention forward, FlashAttention-2 style, returning the logsumexp too.

    Args:
        q: queries, shape (batch, heads_q, seqlen_q, head_dim), the SDPA layout,
            float16, bfloat16 or float32, any strides with a contiguous last dim.
        k: keys, shape (batch, heads_k, seqlen_k, head_dim); heads_q must be a
            multiple of heads_k (GQA; heads_k = 1 is MQA).
        v: values, shape (batch, heads_k, seqlen_k, head_dim_v): k's but for
            the head dim, which may differ from q's (DeepSeek's MLA: 192 and 128).
        causal: False; True or "top_left" (key j is seen by query i when j <= i, SDPA's meaning); "bottom_right"
            (j <= i + seqlen_k - seqlen_q, FlashAttention's meaning). A query that sees no key gets output 0 and
            logsumexp -inf.
        sm_scale: the softmax scale; default 1/sqrt(head_dim).
        window_size: FlashAttention-2's sliding window (left, right): query i
            sees key j when i + offset - left <= j <= i + offset + right,
            offset = seqlen_k - seqlen_q (bottom-right, FlashAttention's
            alignment; 0 with causal=True/"top_left", whose window is
            top-left like its mask); -1 leaves that side unbounded, and a causal call's right side is 0. Default
            (-1, -1): no window. A list, or an integer tensor of two (FlashAttention's callers'), reads as the pair.
        softcap: if > 0, the scaled scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2's logit
            softcapping, as FlashAttention-2 applies it). Default 0.0: off.
        alibi_slopes: as in ``flash_attn_func`` (FlashAttention-2's ALiBi, aligned bottom-right whatever
            ``causal`` says). Default None.
        dropout_p: as in ``flash_attn_func``. Default 0.0.
        sinks: as in ``flash_attn_func``. Default None.
        s_aux: ``sinks``' other name, as in ``flash_attn_func``.
        attention_chunk: FlashAttention-3's chunked local attention: if > 0, query i sees key j only when
            j // attention_chunk == (i + offset) // attention_chunk, offset the window's. Default 0 (off).
        q_descale: FlashAttention-3's FP8 forward, for float8_e4m3fn q, k and v, or float8_e5m2 ones (all three one
            dtype; sm_90 and later; CPU tensors through the interpreter): None (1.0) or float32 on q's device,
            (batch, heads_k) or one value ((1,) or ()). The scores are (q . k) * q_descale * k_descale * sm_scale,
            the probabilities are rounded to e4m3 for their product with v (as FlashAttention-3 does; e5m2 inputs
            too), and out (bfloat16) is multiplied by v_descale. No alibi_slopes, dropout or sinks with FP8 inputs,
            and no backward: they must not require grad.
        k_descale: k's, as q_descale.
        v_descale: v's, as q_descale.

    Returns:
        ``(out, lse)``: out has q's shape (but v's head dim) and dtype (bfloat16 for FP8 inputs); lse is the float32
        natural-log logsumexp of the scaled (and capped, ALiBi-biased)
        scores before dropout (and the sink), shape (batch, heads_q, seqlen_q).

    CUDA/ROCm tensors run a compiled kernel from the cache (compiled on first
    use if no tier holds it); CPU tensors run the same kernel through Triton's
    interpreter (for checking results, not for speed); meta and fake tensors
    give outputs of the right shape for tracing. A torch op
    (``torch.ops.lazytriton.flash_fwd``) underneath makes it traceable by
    ``torch.compile(fullgraph=True)`` and ``torch.export``. Bad input raises
    TypeError/ValueError before any launch.

    Differentiable with respect to any of q, k, v: the backward runs
    lazytriton's backward kernels (served from the same cache). The fused
    backward that serves head dims 64, 128 and 256 on sm_90 sums dQ with
    atomic TMA reductions (last bits may differ from run to run); under
    ``torch.use_deterministic_algorithms(True)`` the backward is bitwise
    reproducible (two kernels, no atomics), as is ``flash_attn_func``'s
    with ``deterministic=True``.
    ``lse`` is returned as a constant: no gradient flows through it.

    """
    # direct's test written out (a Python call saved, ~0.1 µs of the 1.5x torch.add budget); is_compiling
    # before the dispatch-mode count, which dynamo cannot trace (it stops at is_compiling, True while tracing)
    if ((softcap is _NO_CAP or (type(softcap) is float and softcap == 0.0))
            and (window_size is _NO_WINDOW or (type(window_size) is tuple and window_size == _NO_WINDOW))
            and alibi_slopes is None and dropout_p == 0.0 and sinks is None and s_aux is None
            and type(attention_chunk) is int and attention_chunk == 0 and q_descale is None and k_descale is None
            and v_descale is None and type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor
            and not _is_compiling() and not _dispatch_modes() and not _through_op[0]):
        warm = hot.forward_bhsd(q, k, v, causal, sm_scale)
        if warm is not None:
            return warm  # type: ignore[no-any-return]
    window_size = window_size if window_size is _NO_WINDOW else window_pair(window_size)
    fp8_calls = fp8_route(q, descales := (q_descale, k_descale, v_descale))
    if fp8_calls is not None:
        return fp8_calls.attention(q, k, v, causal, sm_scale, binding.NAMES, window_size, softcap, attention_chunk,
                                   descales, {"alibi_slopes": alibi_slopes is not None, "dropout_p": dropout_p != 0.0,
                                              "sinks": sinks is not None or s_aux is not None}, direct(q, k, v))
    call = binding.check(q, k, v, causal, sm_scale, window=window_size, softcap=softcap)
    call = binding.with_chunk(attention_sinks.with_sinks(call, q, attention_sinks.given(sinks, s_aux)), attention_chunk)
    return run(q, k, v, with_mods(call, q, alibi_slopes, None, dropout_p, binding.NAMES))


def _check_bshd(name: str, t: Any) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")
    return t


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = _NO_WINDOW, softcap: float = _NO_CAP,
                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False, sinks: torch.Tensor | None = None,
                    s_aux: torch.Tensor | None = None, attention_chunk: int = 0,
                    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                    v_descale: torch.Tensor | None = None, qv: torch.Tensor | None = None) -> Any:
    """FlashAttention-2's ``flash_attn_func``, served from lazytriton's kernel cache.

    A drop-in for ``flash_attn.flash_attn_func``: same arguments, same layout,
    same causal alignment, same return values.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), float16, bfloat16 or float32,
            any strides with a contiguous last dim (no copy is made).
        k: (batch, seqlen_k, heads_k, head_dim); heads_q a multiple of heads_k (GQA/MQA).
        v: k's shape but for the head dim, which may differ from q's
            (head_dim_v, up to 512; out then has it).
        dropout_p: dropout probability in [0, 1), applied whenever it is > 0
            (pass 0.0 for evaluation, as with FlashAttention). The mask is
            curand's Philox stream from the [seed, offset] torch's generator
            gives each call (on a GPU, torch's memory-efficient attention's
            mask): ``torch.manual_seed`` reproduces it, a CUDA graph replays
            with fresh randomness, and the backward regenerates the forward's
            mask. Kept probabilities are scaled by 1 / (1 - dropout_p);
            softmax_lse is that of the undropped scores.
        softmax_scale: default 1/sqrt(head_dim).
        causal: bottom-right aligned, as in FlashAttention 2.1+: query i sees
            key j when j <= i + seqlen_k - seqlen_q; a query that sees no key
            outputs 0.
        window_size: (left, right), FlashAttention-2's sliding window: query
            i sees key j when i + seqlen_k - seqlen_q - left <= j <= i +
            seqlen_k - seqlen_q + right; -1 leaves a side unbounded; causal
            sets right to 0. Key blocks outside every window are skipped. A list, or an integer tensor of two
            (FlashAttention-3's tests pass one), reads as the pair.
        softcap: if > 0, scores s (already scaled) become softcap * tanh(s /
            softcap) before the softmax, as in FlashAttention-2.
        alibi_slopes: float32 (heads_q,) or (batch, heads_q): FlashAttention-2's
            ALiBi, ``-slope * |i + seqlen_k - seqlen_q - j|`` added to the
            scaled (and capped) scores. With ``causal`` the visible part is
            FlashAttention-2's reference bias up to a per-row constant, so
            out and the gradients are its; softmax_lse is that of the bias
            above (FlashAttention-2's CUDA kernel adds ``slope * j`` instead,
            whose lse differs by that constant). No gradient flows to it.
        deterministic: if True (or under
            ``torch.use_deterministic_algorithms(True)``) this call's
            backward computes dQ and dK/dV in two kernels that each own the
            rows they write, with no atomic adds: bitwise identical
            gradients from run to run. Otherwise, on sm_90 at head dims 64,
            128 and 256, the fused backward sums dQ with atomic TMA
            reductions (faster; dQ's last bits may vary).
        return_attn_probs: if True, return ``(out, softmax_lse, None)``
            (softmax_lse: float32, (batch, heads_q, seqlen_q)). The third
            item, FlashAttention-2's S_dmask (its dropout mask and
            probabilities, a testing aid), is always None here.
        sinks: attention sinks (gpt-oss's): float32 (heads_q,) on q's device,
            one logit a query head, compared with the scaled (capped) scores:
            it joins every row's softmax denominator and softmax_lse, and adds
            no value (a query that sees no key outputs 0, lse the sink).
            Differentiable. Default None.
        s_aux: ``sinks``' other name (vLLM's FlashAttention-3 fork, transformers'
            attention interface); pass one of the two.
        attention_chunk: FlashAttention-3's chunked local attention (Llama 4's):
            if > 0, query i sees key j only when j // attention_chunk == (i +
            seqlen_k - seqlen_q) // attention_chunk, on top of causal and the
            window. Key blocks outside every query's chunk are skipped. Default 0 (off).
        q_descale: FlashAttention-3's FP8 forward (float8_e4m3fn or float8_e5m2 q, k and v, out bfloat16), as in
            ``attn_fwd``:
            None or float32 (batch, heads_k), (1,) or (). Forward only.
        k_descale: k's, as q_descale.
        v_descale: v's, as q_descale.
        qv: FlashAttention-3's (DeepSeek's MLA): (batch, seqlen_q, heads_q, head_dim_v), q's dtype; the scores
            become (q . k + qv . v) x softmax_scale, whose default is then 1/sqrt(head_dim + head_dim_v).
            Forward only (``kernels/flash_fwd_mla``); no ALiBi, dropout, sinks or attention_chunk with it. A v of
            257..512 columns without qv runs flash_fwd_mla too, or, with any of those or a gradient, flash_fwd over
            v's first 256 columns and the rest, outputs joined (``lazytriton.value_split``: exact, differentiable).

    Returns:
        ``out`` of shape (batch, seqlen_q, heads_q, head_dim_v) and q's dtype (bfloat16 for FP8 inputs), or
        ``(out, softmax_lse, None)`` with ``return_attn_probs=True``.

    Differentiable with respect to any of q, k, v (softmax_lse is a constant: no gradient flows through it),
    but for qv, whose backward raises NotImplementedError.

    """
    if (type(causal) is bool and dropout_p == 0.0 and alibi_slopes is None and sinks is None and s_aux is None
            and (softcap is _NO_CAP or (type(softcap) is float and softcap == 0.0))
            and (window_size is _NO_WINDOW or (type(window_size) is tuple and window_size == _NO_WINDOW))
            and type(attention_chunk) is int and attention_chunk == 0
            and q_descale is None and k_descale is None and v_descale is None and qv is None
            and type(deterministic) is bool and type(return_attn_probs) is bool
            and direct(q, k, v)):
        if return_attn_probs:
            warm = hot.forward_bshd(q, k, v, "bottom_right" if causal else False, softmax_scale)
            if warm is not None:
                return (*warm, None)
        else:
            warm = hot.output_bshd(q, k, v, "bottom_right" if causal else False, softmax_scale)
            if warm is not None:
                return warm
    window_size = window_size if window_size is _NO_WINDOW else window_pair(window_size)
    if isinstance(q, torch.Tensor) and q.dtype in binding.FP8_DTYPES and direct(q, k, v):  # FP8's warm path
        warm = fp8_route(q, (None,) * 3).flash_attn_warm(
            q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, sinks, s_aux, attention_chunk, q_descale, k_descale, v_descale)
        if warm is not None:
            return warm
    q, k, v = _check_bshd("q", q), _check_bshd("k", k), _check_bshd("v", v)
    check_dropout("dropout_p", dropout_p)
    check_bool("deterministic", deterministic)
    check_bool("return_attn_probs", return_attn_probs)
    check_bool("causal", causal)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    fp8_calls = fp8_route(q, descales := (q_descale, k_descale, v_descale))
    if fp8_calls is not None:
        out, lse = fp8_calls.attention(qt, kt, vt, "bottom_right" if causal else False, softmax_scale, _FA_NAMES,
                                       window_size, softcap, attention_chunk, descales,
                                       {"alibi_slopes": alibi_slopes is not None, "dropout_p": dropout_p != 0.0,
                                        "sinks": sinks is not None or s_aux is not None}, direct(qt, kt, vt))
        return (out.transpose(1, 2), lse, None) if return_attn_probs else out.transpose(1, 2)
    mla_calls = mla_route(v, qv)
    if mla_calls is not None:
        out, lse = mla_calls.attention(
            qt, kt, vt, qv, "bottom_right" if causal else False, softmax_scale, _FA_NAMES, window_size, softcap,
            mla_calls.Extras(alibi_slopes, dropout_p, attention_sinks.given(sinks, s_aux), attention_chunk,
                             deterministic=deterministic), direct(qt, kt, vt), run)
        return (out.transpose(1, 2), lse, None) if return_attn_probs else out.transpose(1, 2)
    call = binding.check(qt, kt, vt, "bottom_right" if causal else False, softmax_scale, _FA_NAMES, window_size,
                         softcap)
    call = attention_sinks.with_sinks(call, qt, attention_sinks.given(sinks, s_aux), _FA_NAMES)
    call = binding.with_chunk(call, attention_chunk)
    out, lse = run(qt, kt, vt, with_mods(call, qt, alibi_slopes, None, dropout_p, _FA_NAMES), deterministic)
    out = out.transpose(1, 2)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = _NO_WINDOW, softcap: float = _NO_CAP,
                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, seqused_q: torch.Tensor | None = None,
                           seqused_k: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                           s_aux: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                           num_splits: int = 0, out: torch.Tensor | None = None, attention_chunk: int = 0,
                           q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                           v_descale: torch.Tensor | None = None, qv: torch.Tensor | None = None) -> Any:
    """FlashAttention-2's ``flash_attn_varlen_func``, served from lazytriton's kernel cache.

    A drop-in for ``flash_attn.flash_attn_varlen_func``: variable-length
    sequences packed one after another, without padding; same arguments,
    layouts and return values.

    Args:
        q: (total_q, heads_q, head_dim), float16, bfloat16 or float32, the queries of every sequence one after
            another; any strides with a contiguous last dim.
        k: (total_k, heads_k, head_dim); heads_q a multiple of heads_k (GQA/MQA).
        v: k's shape but for the head dim, which may differ from q's (head_dim_v; out then has it).
        cu_seqlens_q: int32, (batch + 1,), on q's device (a strided view is copied, a subclass read as the tensor it
            holds): the cumulative query lengths; sequence i's queries are rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] of
            q. cu_seqlens_q[0] must be 0, the entries nondecreasing (empty sequences are allowed) and the last one
            total_q.
        cu_seqlens_k: the same for k and v (batch + 1 entries too, ending at total_k).
        max_seqlen_q: an int >= the longest query sequence: it sizes the grid and picks the kernel's tiles. 0 (every
            sequence empty) launches nothing.
        max_seqlen_k: the same for keys; 0 gives every query output 0 (and logsumexp -inf, zero gradients), with
            nothing launched.
        dropout_p: dropout probability in [0, 1), as ``flash_attn_func``'s: Philox seeded by a [seed, offset] pair
            drawn on q's device from torch's generator at each call (``torch.manual_seed`` reproduces it), the
            backward regenerating the forward's mask. Each element of the packed batch has its own place in the mask:
            (head, packed query row, packed key) of the (heads_q, total_q, total_k) scores.
        softmax_scale: default 1/sqrt(head_dim).
        causal: bottom-right aligned within each sequence, as in FlashAttention 2.1+: query i of a sequence sees key j
            of the same sequence when j <= i + len_k - len_q; a query that sees no key outputs 0.
        window_size: (left, right), FlashAttention-2's sliding window, per sequence: query i sees key j when i + len_k
            - len_q - left <= j <= i + len_k - len_q + right; -1 leaves a side unbounded; causal sets right to 0. A
            list, or an integer tensor of two, reads as the pair.
        softcap: if > 0, scores s (already scaled) become softcap * tanh(s / softcap) before the softmax.
        alibi_slopes: float32 (heads_q,) or (batch, heads_q), batch being the number of sequences: FlashAttention-2's
            ALiBi per sequence, ``-slope * |i + len_k - len_q - j|`` within each sequence (bottom-right), as
            ``flash_attn_func``'s. No gradient flows to it.
        deterministic: accepted for compatibility: the varlen backward is always bitwise reproducible (two kernels
            that each own the rows they write; the fused backward takes no packed sequences).
        return_attn_probs: if True, return ``(out, softmax_lse, None)``; softmax_lse is float32 of shape (heads_q,
            total_q), FlashAttention 2.4+'s varlen layout (-inf for a query that sees no key, where FlashAttention-2
            writes +inf).
        seqused_q: FlashAttention-3's (vLLM's keyword): None, or int32 (batch,) on q's device; sequence i's queries
            are then the first seqused_q[i] rows of its cu_seqlens_q span (0 <= seqused_q[i] <= its length), whose
            causal/window alignment and ALiBi use that length. The rest of the span is never read (it may hold
            anything): its rows of out are 0, of softmax_lse -inf, of dq 0.
        seqused_k: the same for keys: sequence i sees the first seqused_k[i] keys of its cu_seqlens_k span; the rest
            is never read and gets dk and dv 0. With either, max_seqlen_q/max_seqlen_k stay at least the longest
            cu_seqlens span, used or not.
        sinks: as ``flash_attn_func``'s; rows past seqused_q then get softmax_lse the sink.
        s_aux: ``sinks``' other name, as in ``flash_attn_func``.
        block_table: FlashAttention-3's and vLLM's paged form (forward only): k and v are then the paged KV caches
            (num_blocks, page_size, heads_k, head_dim), cu_seqlens_k must be None and seqused_k gives each
            sequence's key count; the decoding kernels serve it (``lazytriton.kvcache_varlen.paged_varlen``).
        num_splits: with block_table, how many pieces each sequence's keys are cut into (0: a heuristic; at most
            256); without it, checked and not used (the packed-keys kernel does not split keys).
        attention_chunk: FlashAttention-3's chunked local attention, per sequence: if > 0, query i sees key j only
            when j // attention_chunk == (i + len_k - len_q) // attention_chunk. Default 0 (off).
        out: optional, vLLM's: a tensor of the output's shape, dtype and device that the output is written into
            (and returned).
        q_descale: FlashAttention-3's FP8 forward (float8_e4m3fn or float8_e5m2 q, k and v, out bfloat16), as in
            ``attn_fwd``,
            batch being the number of sequences. Forward only. Not taken with block_table (its queries are float16
            or bfloat16).
        k_descale: k's, as q_descale; with block_table, a float8 paged cache's (as vLLM calls FlashAttention-3).
        v_descale: v's, as q_descale; with block_table, a float8 paged cache's.
        qv: FlashAttention-3's (DeepSeek's MLA), forward only: (total_q, heads_q, head_dim_v); scores (q . k + qv
            . v) x softmax_scale, default 1/sqrt(head_dim + head_dim_v). With block_table, ``flash_attn_with_kvcache``'s
            qv; without, ``flash_attn_func``'s (no seqused_q/seqused_k), as is a v of 257..512 columns without qv.

    Returns:
        ``out`` of q's shape (v's head dim) and dtype, or ``(out, softmax_lse, None)``.

    Differentiable with respect to any of q, k, v. Every argument is checked before anything runs (a
    TypeError/ValueError naming it), the values of cu_seqlens_q/cu_seqlens_k, seqused_q/seqused_k and
    max_seqlen_q/max_seqlen_k included, which costs one device-to-host read of the small tensors (a stream sync).
    While a CUDA graph is being captured or torch.compile traces, that read is impossible, and only shapes, dtypes and
    devices are checked: the values are then the caller's to get right, as in FlashAttention-2, which never checks
    them; likewise inside ``lazytriton.trusted_indices()``, for a caller whose cu_seqlens are right by construction
    (no sync per call).

    """
    window_size = window_size if window_size is _NO_WINDOW else window_pair(window_size)
    if block_table is not None or out is not None or num_splits != 0:
        from lazytriton import kvcache_varlen

        if block_table is not None:
            return kvcache_varlen.paged_varlen(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, dropout_p=dropout_p,
                softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, deterministic=deterministic, return_attn_probs=return_attn_probs,
                seqused_q=seqused_q, seqused_k=seqused_k, sinks=sinks, s_aux=s_aux, num_splits=num_splits, out=out,
                attention_chunk=attention_chunk, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                qv=qv)
        kvcache_varlen.check_splits_and_out(num_splits, out, q, v)
    p = check_dropout("dropout_p", dropout_p)
    check_bool("deterministic", deterministic)
    check_bool("return_attn_probs", return_attn_probs)
    fp8_calls = fp8_route(q, (q_descale, k_descale, v_descale))
    if fp8_calls is not None:
        res, lse = fp8_calls.varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
            softcap, seqused_q, seqused_k, attention_chunk, (q_descale, k_descale, v_descale),
            {"alibi_slopes": alibi_slopes is not None, "dropout_p": p != 0.0,
             "sinks": sinks is not None or s_aux is not None}, direct(q, k, v))
        res = res if out is None else out.copy_(res)
        return (res, lse, None) if return_attn_probs else res
    mla_calls = mla_route(v, qv)
    if mla_calls is not None:
        res, lse = mla_calls.varlen_attention(
            q, k, v, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_size,
            softcap, mla_calls.Extras(alibi_slopes, p, attention_sinks.given(sinks, s_aux), attention_chunk, seqused_q,
                                      seqused_k, deterministic), direct(q, k, v))
        res = res if out is None else out.copy_(res)
        return (res, lse, None) if return_attn_probs else res
    from lazytriton.kernels.flash_fwd import varlen

    # Plain and contiguous before the checks and the launch: the kernels read these through their pointers.
    cu_seqlens_q, cu_seqlens_k, alibi_slopes = (index_tensor(cu_seqlens_q), index_tensor(cu_seqlens_k),
                                                index_tensor(alibi_slopes))
    seqused_q, seqused_k = index_tensor(seqused_q), index_tensor(seqused_k)
    sinks = attention_sinks.given(sinks, s_aux)
    eager = (direct(q, k, v) and type(cu_seqlens_q) is _Tensor and type(cu_seqlens_k) is _Tensor
             and all(t is None or type(t) is _Tensor for t in (seqused_q, seqused_k))
             and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                                   or (isinstance(sinks, _Tensor) and sinks.requires_grad))))
    # Through the op, the op checks the values (one device-to-host read per call, not two).
    philox = None
    if p > 0.0 and isinstance(q, torch.Tensor):  # drawn only for a call whose q is a tensor: check names the rest
        philox = score_mods.draw_philox(q.device, score_mods.packed_elements(q, k))
    call = varlen.check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                        window_size, softcap, values=None if eager else False, alibi=alibi_slopes, dropout_p=p,
                        philox=philox, seqused_q=seqused_q, seqused_k=seqused_k, sinks=sinks,
                        attention_chunk=attention_chunk)
    if eager:
        res, lse = varlen.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, call)
    else:
        from lazytriton.ops_varlen import flash_varlen_fwd_op

        c = call.call
        mods: tuple[Any, ...] = (c.alibi, c.dropout_p, c.philox, seqused_q, seqused_k, c.sinks)
        if c.attention_chunk:
            mods += (c.attention_chunk,)
        elif c.sinks is None:
            mods = mods[:5] if seqused_q is not None or seqused_k is not None else () \
                if c.alibi is None and c.philox is None else mods[:3]
        res, lse = flash_varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, c.scale,
                                       causal, c.window_left, c.window_right, c.softcap, *mods)
    if out is not None:  # the caller's tensor (checked above)
        res = out.copy_(res)
    return (res, lse, None) if return_attn_probs else res


__all__ = ["CaptureError", "always_through_op", "attn_fwd", "flash_attn_func", "flash_attn_varlen_func"]
