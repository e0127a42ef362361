"""The Python half of ``lt_prewarm`` and ``lt_cache_stats``: specs parsed into variants and compiled; the counts.

Also the counters' flush when the library unloads (``lt__py_flush``).

``embedded.attach`` binds these to the library (``attach``). A spec is a
variant string or axes: flash_fwd's (``dtype=e4m3`` or ``e5m2``: the FP8
forward, flash_fwd_fp8), the backward's two (``kernel=flash_bwd``), or the decoding
kernels' (``kernel=flash_decode``: flash_decode_split and
flash_decode_combine, with ``new_keys=1`` kv_append too, ``kv_dtype=e4m3`` or
``e5m2`` for a float8 cache), each chosen as a C call of that shape class
would (``embedded.plan_variant``, ``embedded_kvcache.plan_variants``).
"""

from __future__ import annotations

import re
from typing import Any

from lazytriton.capi.common import INVALID_ARGUMENT, OK, PYTHON, CapiError

_ffi: Any = None

# The names of `lazytriton prewarm`'s axes (prewarm/cli.py: --sinks, --attention-chunk, --dtype e4m3, --kv-dtype).
_AXES = ("kernel", "target", "dtype", "head_dim", "causal", "seqlen_q", "seqlen_k", "aligned", "index64", "varlen",
         "head_dim_v", "window", "softcap", "seqused_q", "seqused_k", "sinks", "attention_chunk", "kv_dtype",
         "kv_pairs", "new_keys")
_KV_DTYPES = ("none", "e4m3", "e5m2")  # kv_dtype: the cache's float8 format (KV_FP8), none for q's dtype
_TRUE = {"1", "true", "yes", "on", "top_left", "bottom_right"}
_FALSE = {"0", "false", "no", "off", "none"}


def _flag(axes: dict[str, str], name: str, default: bool) -> bool:
    raw = axes.get(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected 1/0/true/false")


def _int_axis(axes: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = axes.get(name)
    if raw is None:
        return default
    if not re.fullmatch(r"-?\d{1,12}", raw) or not low <= int(raw) <= high:
        raise ValueError(f"{name}={raw!r}: expected an integer in {low}..{high}")
    return int(raw)


def _parse_axes(text: str) -> dict[str, str]:
    axes: dict[str, str] = {}
    for item in filter(None, re.split(r"[\s,]+", text)):
        name, sep, value = item.partition("=")
        if not sep or name not in _AXES:
            raise ValueError(f"{item!r} is not an axis; expected name=value with a name among "
                             f"{', '.join(_AXES)}, or a whole variant string")
        axes[name] = value
    missing = [name for name in ("target", "dtype", "head_dim") if name not in axes]
    if missing:
        raise ValueError(f"axes {text!r} lack {', '.join(missing)}")
    return axes


def _axes_variants(axes: dict[str, str]) -> tuple[Any, ...]:
    """The variants of axes: flash_fwd's one, or flash_bwd's two (its binding's ``variants``).

    ``sinks=1``: flash_fwd's SINKS variant; with ``kernel=flash_bwd`` the backward's two (the same: they read the
    sinks through lse) and flash_bwd_dsinks, which lt_attn_bwd launches for dsinks on a GPU. ``attention_chunk=1``:
    CHUNK on all three attention kernels.
    """
    from lazytriton import geometry
    from lazytriton.kernels import dispatch
    from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
    from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
    from lazytriton.prewarm.enumeration import MAX_SEQLEN
    from lazytriton.prewarm.limits import known_target

    kernel = axes.get("kernel", "flash_fwd")
    if kernel not in ("flash_fwd", "flash_bwd", "flash_decode"):
        raise ValueError(f"kernel={kernel!r}: expected flash_fwd, flash_bwd (the backward's two kernels) or "
                         "flash_decode (lt_attn_kvcache's kernels)")
    if kernel == "flash_decode":
        return _decode_variants(axes)
    for name in ("kv_dtype", "kv_pairs", "new_keys"):
        if name in axes:
            raise ValueError(f"{name}= is an axis of kernel=flash_decode (lt_attn_kvcache's kernels)")
    head_dim = _int_axis(axes, "head_dim", 0, 1, geometry.MAX_HEAD_DIM)
    head_dim_v = _int_axis(axes, "head_dim_v", head_dim, 1, geometry.MAX_HEAD_DIM)
    dim_v = 0 if head_dim_v == head_dim else head_dim_v
    seqlen_q = _int_axis(axes, "seqlen_q", 4096, 1, MAX_SEQLEN)
    seqlen_k = _int_axis(axes, "seqlen_k", seqlen_q, 1, MAX_SEQLEN)
    causal = _flag(axes, "causal", False)
    aligned = _flag(axes, "aligned", True)
    index64 = _flag(axes, "index64", False)
    varlen = _flag(axes, "varlen", False)
    window, softcap = _flag(axes, "window", False), _flag(axes, "softcap", False)
    used_q, used_k = _flag(axes, "seqused_q", False), _flag(axes, "seqused_k", False)
    sinks, chunk = _flag(axes, "sinks", False), _flag(axes, "attention_chunk", False)
    if (used_q or used_k) and not varlen:
        raise ValueError("seqused_q=1 and seqused_k=1 need varlen=1 (they cut the spans of packed sequences)")
    target = known_target(axes["target"])
    if kernel == "flash_fwd":
        return (fwd_dispatch.flash_fwd_variant(target, axes["dtype"], head_dim, causal, aligned, seqlen_q,
                                               index64=index64, seqlen_k=seqlen_k, varlen=varlen, head_dim_v=dim_v,
                                               window=window, softcap=softcap, seqused_q=used_q,
                                               seqused_k=used_k, sinks=sinks, chunk=chunk),)
    reduction: tuple[Any, ...] = ()
    if sinks:  # lt_attn_bwd with dsinks: the sinks' gradient after the two kernels
        from lazytriton.kernels import flash_bwd_dsinks

        reduction = (flash_bwd_dsinks.variant(target, varlen, varlen and used_q, index64),)
    from lazytriton.kernels.flash_bwd import binding as bwd
    from lazytriton.kernels.flash_fwd import binding as fwd

    dtype = {name: torch_dtype for torch_dtype, name in fwd.DTYPES.items()}.get(axes["dtype"])
    if axes["dtype"] in ("e4m3", "e5m2"):
        raise ValueError(f"dtype={axes['dtype']} with kernel=flash_bwd: the FP8 forward has no backward")
    if dtype is None:
        raise ValueError(f"dtype={axes['dtype']!r}: expected one of {', '.join(fwd.DTYPES.values())}")
    if varlen:
        return (*(dispatch.kernel_variant(name, target, axes["dtype"], head_dim, causal, aligned, seqlen_q,
                                          seqlen_k, index64=index64, varlen=True, head_dim_v=dim_v, window=window,
                                          softcap=softcap, seqused_q=used_q, seqused_k=used_k, chunk=chunk)
                  for name in bwd_dispatch.BWD_KERNELS), *reduction)
    return (*bwd.variants(target, dtype, fwd.Shape(1, 1, 1, seqlen_q, seqlen_k, head_dim), causal, aligned, index64,
                          window, softcap, head_dim_v=dim_v, chunk=chunk), *reduction)


def _decode_variants(axes: dict[str, str]) -> tuple[Any, ...]:
    """lt_attn_kvcache's kernels of axes: (kv_append with ``new_keys=1``,) flash_decode_split, flash_decode_combine.

    ``seqlen_q`` is the query rows a key/value head (group size x seqlen_q; default 1), ``seqlen_k`` the cache's
    capacity (default 4096), ``kv_dtype`` the cache's float8 format (``e4m3``, ``e5m2``; default none: q's
    dtype) and with it ``kv_pairs`` the call's (sequence, key/value head) pairs, batch x heads_k, which a float8
    cache's split tiles follow (default 1); paged caches, rotary and the other features are variant strings' (as
    the miss log prints them).
    """
    from lazytriton import geometry
    from lazytriton.capi import embedded_kvcache
    from lazytriton.prewarm.enumeration import MAX_SEQLEN
    from lazytriton.prewarm.limits import known_target

    target = known_target(axes["target"])
    if target.backend != "cuda":
        raise ValueError(f"target={axes['target']!r}: the C API's decoding serves CUDA targets only")
    codes = {"fp16": 1, "bf16": 2, "fp32": 3}
    if axes["dtype"] not in codes:
        raise ValueError(f"dtype={axes['dtype']!r}: expected the queries' dtype, one of {', '.join(codes)} (a float8 "
                         "cache is kv_dtype=)")
    kv_dtype = axes.get("kv_dtype", "none")
    if kv_dtype not in _KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}: expected one of {', '.join(_KV_DTYPES)}")
    if kv_dtype != "none" and axes["dtype"] == "fp32":
        raise ValueError("kv_dtype= needs dtype=fp16 or bf16 (a float8 cache is read by fp16 or bf16 queries)")
    head_dim = _int_axis(axes, "head_dim", 0, 1, geometry.MAX_HEAD_DIM)
    head_dim_v = _int_axis(axes, "head_dim_v", head_dim, 1, geometry.MAX_HEAD_DIM)
    rows = _int_axis(axes, "seqlen_q", 1, 1, MAX_SEQLEN)
    capacity = _int_axis(axes, "seqlen_k", 4096, 1, MAX_SEQLEN)
    aligned, index64 = _flag(axes, "aligned", True), _flag(axes, "index64", False)
    if "kv_pairs" in axes and kv_dtype == "none":
        raise ValueError("kv_pairs= is a float8 cache's (sequence, key/value head) pairs: it needs kv_dtype=e4m3 or "
                         "e5m2")
    pairs = _int_axis(axes, "kv_pairs", 1, 1, 1 << 32) if kv_dtype != "none" else 0
    capability = target.capability or 0
    split, combine = embedded_kvcache.plan_variants(
        capability, codes[axes["dtype"]], head_dim, _flag(axes, "causal", False), aligned, index64, rows, capacity,
        0, _flag(axes, "window", False), _flag(axes, "softcap", False), False, head_dim_v,
        sinks=_flag(axes, "sinks", False), chunk=_flag(axes, "attention_chunk", False), kv_fp8=kv_dtype,
        kv_pairs=pairs)
    if not _flag(axes, "new_keys", False):
        return split, combine
    append = embedded_kvcache.append_variant(capability, codes[axes["dtype"]], head_dim, head_dim_v, False, aligned,
                                             index64, kv_fp8=kv_dtype)
    return append, split, combine


def parse_specs(text: str) -> tuple[Any, ...]:
    """The Variants of one ``lt_prewarm`` spec: a variant string, or axes (``target=sm_90 dtype=bf16 head_dim=128``).

    Axes name flash_fwd's variant, or with ``kernel=flash_bwd`` the
    backward's two (dq, then dk/dv), chosen as a call of that shape would.
    Either form is checked before anything compiles: a variant string must
    carry every field its kernel needs (``variant.check_fields``), axes must be
    in range, the target must be one prewarm knows, and a variant that cannot
    fit its target is refused (``prewarm.limits``). Every problem is a
    ValueError naming the axis or field, so ``lt_prewarm`` answers
    LT_ERROR_INVALID_ARGUMENT, never a compile of nonsense.
    """
    from lazytriton.prewarm.limits import known_target, refusal
    from lazytriton.variant import Variant, check_fields

    text = text.strip()
    if text.count(":") == 5 and "=" not in text.split(":", 1)[0]:
        variants: tuple[Any, ...] = (check_fields(Variant.parse(text)),)
    else:
        variants = _axes_variants(_parse_axes(text))
    for variant in variants:
        known_target(variant.target)
        why = refusal(variant)
        if why is not None:
            raise ValueError(f"variant {variant} cannot be built: {why}")
    return variants


def parse_spec(text: str) -> Any:
    """The one Variant of a spec (``parse_specs``); a ValueError for a spec naming several (``kernel=flash_bwd``)."""
    variants = parse_specs(text)
    if len(variants) != 1:
        raise ValueError(f"{text!r} names {len(variants)} variants: {', '.join(map(str, variants))}")
    return variants[0]


def prewarm(specs: Any, n_specs: int, compiled: Any, cached: Any) -> int:
    from lazytriton import runtime

    variants: list[Any] = []
    for i in range(n_specs):
        text = _text(specs[i], f"specs[{i}]")
        try:
            variants.extend(parse_specs(text))
        except (ValueError, TypeError) as exc:
            raise CapiError(INVALID_ARGUMENT, f"specs[{i}] ({text!r}): {exc}") from None
    rt = runtime.get()
    for variant in variants:
        if rt.resolve(variant).source == "jit":
            compiled[0] += 1
        else:
            cached[0] += 1
    return OK


def cache_stats(out: Any) -> int:
    from lazytriton import runtime

    rt = runtime.get()
    local = rt.local.stats()
    counters = rt.counters()
    out.local_entries = local.entries
    out.local_bytes = local.bytes
    out.image_entries = rt.images.stats().entries
    out.compiles = counters.get("compiles", 0)
    out.hits = counters.get("hits", 0)
    out.process_compiles = rt.compiles
    out.process_resolved = sum(rt.served.values())
    out.loaded_kernels = len(rt.loaded_kernels())
    return OK


def flush() -> None:
    try:
        from lazytriton import runtime

        current = runtime.current()
        if current is not None:
            current.flush_counters()
    except BaseException:  # at exit: nothing may escape, and nothing is left to report to
        pass


def _text(pointer: Any, name: str) -> str:
    if pointer == _ffi.NULL:
        return ""
    try:
        return str(_ffi.string(pointer).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{name} is not valid UTF-8: {exc}") from None


def attach(ffi: Any, guarded: Any) -> None:
    """Bind ``lt__py_prewarm`` and ``lt__py_cache_stats`` (``guarded`` maps exceptions to statuses)."""
    global _ffi
    _ffi = ffi
    for name, fn in (("lt__py_prewarm", prewarm), ("lt__py_cache_stats", cache_stats)):
        ffi.def_extern(name=name, error=PYTHON)(guarded(fn))
    ffi.def_extern(name="lt__py_flush")(flush)
