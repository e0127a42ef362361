"""``lazytriton cache explain``'s refusals: a described call checked by the API's own checks, before any lookup.

Each call is built from meta tensors (shapes only) and given to the check its entry point runs, so explain
refuses what the API would refuse, with the API's words.
"""

from __future__ import annotations

from typing import Any


def check_call(kernels: tuple[str, ...], dtype: str, head_dim: int, head_dim_v: int, seqlen_q: int, seqlen_k: int,
               causal: str, varlen: bool, page: int, flags: dict[str, bool], rotary: str = "none",
               kv_dtype: str = "none") -> None:
    """Refuse a described call the API would refuse, with the API's own checks: a ValueError saying why.

    The call is built from meta tensors (shapes only, nothing allocated) and
    given to the check its entry point runs: ``flash_fwd.binding.check`` for
    the attention kernels, ``varlen.check`` for packed sequences (one
    sequence of seqlen_q queries and seqlen_k keys), ``flash_decode.checks.check``
    for decoding and the cache append (seqlen_q query rows of one key/value
    head; a cache of seqlen_k keys, paged when ``page``; one new key with
    kv_append). A window and a softcap are checked as set (their sizes do not
    matter here); ALiBi, dropout and a mask change no shape rule. A left pad
    (cache_leftpad) and rotary embeddings (``rotary``: a ``geometry.ROTARY_MODES``
    mode; rotary_cos/rotary_sin over every head dim column, with one new key,
    as rotary needs) are the decoding call's alone. Sinks (one per query head)
    are checked as given, on the call's one head; attention_chunk as a chunk of one key. A float8
    cache (``kv_dtype``: e4m3, e5m2) is the decoding call's alone, its caches of that format.
    """
    import torch

    from lazytriton import geometry
    from lazytriton.kernels.flash_decode import checks as decode
    from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
    from lazytriton.kernels.flash_fwd import binding
    from lazytriton.kernels.flash_fwd import sinks as attention_sinks
    from lazytriton.kernels.flash_fwd import varlen as packed
    from lazytriton.kernels.flash_fwd_mla.binding import check_head_dim_v

    used = [f"--{name.replace('_', '-')}" for name in ("seqused_q", "seqused_k") if flags.get(name)]
    if used and not varlen:
        raise ValueError(f"{' and '.join(used)} need --varlen: seqused_q/seqused_k cut the spans of packed sequences")
    sizes = {"--head-dim": head_dim, "--head-dim-v": head_dim_v, "--seqlen-k": seqlen_k, "--page-size": page}
    negative = next(((flag, n) for flag, n in sizes.items() if n < 0), None)
    if negative is not None:
        raise ValueError(f"{negative[0]} must be >= 0, got {negative[1]}")
    fp8 = dtype in binding.FP8_DTYPES.values()
    if fp8 and set(kernels) != {"flash_fwd"}:
        raise ValueError(f"--dtype {dtype} is the FP8 forward's (flash_fwd only: FlashAttention-3's has no "
                         f"backward, and the decoding kernels' FP8 caches are not an e4m3 call), not "
                         f"{', '.join(kernels)}'s")
    torch_dtype = {name: t for t, name in (*binding.DTYPES.items(), *binding.FP8_DTYPES.items())}[dtype]

    def meta(*shape: int, of: torch.dtype = torch_dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=of, device="meta")

    window = (1, 0) if flags["window"] else binding.NO_WINDOW
    chunk = 1 if flags.get("chunk") else 0
    sinks = meta(1, of=torch.float32) if flags["sinks"] else None
    softcap = 1.0 if flags["softcap"] else 0.0
    decoding = any(name in decode_dispatch.DECODE_KERNELS or name == "kv_append" for name in kernels)
    if flags["bias_grad"] and not (flags["bias"] and not varlen):
        raise ValueError("--bias-grad is the gradient of an attn_mask: it needs --attn-mask, on dense sequences "
                         "(no --varlen)")
    if varlen and decoding and "kv_append" not in kernels:
        raise ValueError(f"--varlen with the decoding kernels is kv_append's new keys packed by cu_seqlens_k_new "
                         f"(--kernel kv_append), not {', '.join(kernels)}'s; packed queries are --varlen-q")
    if flags["leftpad"] and not decoding:
        raise ValueError(f"--leftpad is flash_attn_with_kvcache's cache_leftpad: only flash_decode and kv_append "
                         f"take it, not {', '.join(kernels)}")
    if flags["varlen_q"] and not decoding:
        raise ValueError(f"--varlen-q is flash_attn_with_kvcache's cu_seqlens_q: only flash_decode and kv_append "
                         f"take it, not {', '.join(kernels)}")
    if rotary != "none" and not decoding:
        raise ValueError(f"--rotary is flash_attn_with_kvcache's rotary_cos/rotary_sin: only flash_decode and "
                         f"kv_append take it, not {', '.join(kernels)}")
    mla = kernels == ("flash_fwd_mla",)  # flash_attn_func's qv, or v's head dim over 256
    if flags.get("qv") and not (decoding or mla):
        raise ValueError(f"--qv is flash_attn_with_kvcache's qv (MLA): only flash_decode and kv_append take it, not "
                         f"{', '.join(kernels)} (flash_attn_func's qv is flash_fwd_mla's)")
    if flags.get("key_mask") and not decoding:
        raise ValueError(f"--key-mask is the decoding kernels' key mask (transformers' decoding steps): only "
                         f"flash_decode and kv_append take it, not {', '.join(kernels)}")
    if kv_dtype != "none" and not decoding:
        raise ValueError(f"--kv-dtype is flash_attn_with_kvcache's float8 cache: only flash_decode and kv_append "
                         f"take it, not {', '.join(kernels)}")
    try:
        v_dim = head_dim_v if decoding or mla or head_dim_v <= geometry.MAX_HEAD_DIM else \
            geometry.value_pieces(check_head_dim_v(meta(head_dim_v), "v"))[0]  # flash_fwd's first piece of v
        if decoding:
            cache_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(kv_dtype, torch_dtype)
            _check_decode(decode, meta, kernels, head_dim, head_dim_v, seqlen_q, seqlen_k, causal, page, flags,
                          window, softcap, rotary, chunk, cache_dtype, varlen)
        elif mla:
            from lazytriton.kernels.flash_fwd_mla import binding as mla_binding

            lacks = [flag for name, flag in (("alibi", "--alibi"), ("dropout", "--dropout"), ("sinks", "--sinks"),
                                             ("chunk", "--attention-chunk"), ("seqused_q", "--seqused-q"),
                                             ("seqused_k", "--seqused-k")) if flags.get(name)
                     and (name in ("alibi", "dropout", "sinks") or not flags.get("qv"))]
            if lacks:  # attention_chunk and seqused with --qv are its CHUNK and SEQUSED_Q/SEQUSED_K
                raise ValueError(f"flash_fwd_mla takes no {', '.join(lacks)} here (without --qv such a call runs "
                                 "flash_fwd over v's pieces: --kernel flash_fwd or flash_bwd)")
            qv = meta(1, 1, seqlen_q, head_dim_v) if flags.get("qv") else None
            mla_binding.check(meta(1, 1, seqlen_q, head_dim), meta(1, 1, seqlen_k, head_dim),
                              meta(1, 1, seqlen_k, head_dim_v), qv, False if causal == "none" else causal,
                              window=window, softcap=softcap, attention_chunk=chunk)
        elif varlen:
            cu = meta(2, of=torch.int32)
            one = meta(1, of=torch.int32)
            packed.check(meta(seqlen_q, 1, head_dim), meta(seqlen_k, 1, head_dim), meta(seqlen_k, 1, v_dim),
                         cu, cu, seqlen_q, seqlen_k, causal != "none", None, window, softcap, values=False,
                         seqused_q=one if flags.get("seqused_q") else None,
                         seqused_k=one if flags.get("seqused_k") else None, sinks=sinks, attention_chunk=chunk,
                         fp8=fp8)
        else:
            q = meta(1, 1, seqlen_q, head_dim)
            call = binding.check(q, meta(1, 1, seqlen_k, head_dim), meta(1, 1, seqlen_k, v_dim),
                                 False if causal == "none" else causal, None, window=window, softcap=softcap,
                                 fp8=fp8)
            binding.with_chunk(attention_sinks.with_sinks(call, q, sinks), chunk)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the API refuses this call: {exc}") from None


def check_slots_call(dtype: str, head_dim: int, head_dim_v: int, seqlen_q: int, seqlen_k: int, causal: str,
                     varlen: bool, page: int, flags: dict[str, bool], rotary: str, slots: str,
                     kv_dtype: str = "none") -> None:
    """Refuse a described slot write the API would refuse: ``kv_slots.checks.check`` on meta tensors.

    seqlen_q tokens (one key/value head) written into a cache of seqlen_k
    slots in blocks of ``page`` (0: one slot a block); ``slots`` is
    slot_mapping's dtype; ``kv_dtype`` the caches' float8 format (e4m3,
    e5m2; none: --dtype's). The attention flags do not apply to a write.
    """
    import torch

    from lazytriton.kernels.kv_slots import checks

    given = [name for name, on in (("--causal", causal != "none"), ("--varlen", varlen), ("--rotary", rotary != "none"),
                                   *((f"--{name.replace('_', '-')}", on) for name, on in flags.items())) if on]
    if given:
        raise ValueError(f"kv_slots writes keys and values at their slots: it takes no {', '.join(given)}")
    sizes = {"--head-dim": head_dim, "--head-dim-v": head_dim_v, "--seqlen-k": seqlen_k, "--page-size": page}
    negative = next(((flag, n) for flag, n in sizes.items() if n < 0), None)
    if negative is not None:
        raise ValueError(f"{negative[0]} must be >= 0, got {negative[1]}")
    of = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype)
    if of is None:
        raise ValueError(f"kv_slots writes fp16, bf16 or fp32 caches, not --dtype {dtype}")
    block = page or 1
    blocks = -(-max(seqlen_k, 1) // block)
    cache = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}.get(kv_dtype, of)
    try:
        checks.check(torch.empty(seqlen_q, 1, head_dim, dtype=of, device="meta"),
                     torch.empty(seqlen_q, 1, head_dim_v, dtype=of, device="meta"),
                     torch.empty(blocks, block, 1, head_dim, dtype=cache, device="meta"),
                     torch.empty(blocks, block, 1, head_dim_v, dtype=cache, device="meta"),
                     torch.empty(seqlen_q, dtype=getattr(torch, slots), device="meta"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the API refuses this call: {exc}") from None


def _check_decode(decode: Any, meta: Any, kernels: tuple[str, ...], head_dim: int, head_dim_v: int, seqlen_q: int,
                  seqlen_k: int, causal: str, page: int, flags: dict[str, bool], window: tuple[int, int],
                  softcap: float, rotary: str, chunk: int = 0, cache_dtype: Any = None,
                  varlen: bool = False) -> None:
    """``flash_decode.checks.check`` on a described decoding call (kv_append, or rotary: with one new key).

    ``varlen``: kv_append's new keys packed by cu_seqlens_k_new (one sequence's one new key).
    """
    import torch

    append = "kv_append" in kernels or rotary != "none"
    if page:
        blocks = -(-max(seqlen_k, 1) // page)
        cache = (blocks, page)
        table = meta(1, blocks, of=torch.int32)
    else:
        cache, table = (1, max(seqlen_k, 1) if append else seqlen_k), None
    new = (meta(1, 1, 1, head_dim), meta(1, 1, 1, head_dim_v)) if append else (None, None)
    cu_new = meta(2, of=torch.int32) if append and varlen else None
    if cu_new is not None and new[0] is not None and new[1] is not None:
        new = (new[0][0], new[1][0])  # (total_new, heads_k, head_dim)
    lens = max(seqlen_k - 1, 0) if append else None
    slopes = meta(1, of=torch.float32) if flags["alibi"] else None
    pads = meta(1, of=torch.int32) if flags["leftpad"] else None
    tables = ((meta(max(seqlen_k, 1) + seqlen_q, head_dim // 2),) * 2 if rotary != "none" else (None, None))
    sinks = meta(1, of=torch.float32) if flags["sinks"] else None
    packed = flags["varlen_q"]  # one sequence of seqlen_q queries, packed by cu_seqlens_q
    q = meta(seqlen_q, 1, head_dim) if packed else meta(1, seqlen_q, 1, head_dim)
    caches = (meta(*cache, 1, head_dim, of=cache_dtype), meta(*cache, 1, head_dim_v, of=cache_dtype)) if cache_dtype \
        else (meta(*cache, 1, head_dim), meta(*cache, 1, head_dim_v))
    qv = meta(*q.shape[:-1], head_dim_v) if flags.get("qv") else None
    capacity = blocks * page if page else cache[1]
    key_mask = meta(1, capacity, of=torch.bool) if flags.get("key_mask") else None
    inputs = decode.Inputs(q, *caches, *new, lens, None, table, slopes,
                           pads, *tables, sinks=sinks, cu_seqlens_q=meta(2, of=torch.int32) if packed else None, qv=qv,
                           cu_seqlens_k_new=cu_new, key_mask=key_mask)
    decode.check(inputs, None, causal != "none", window, softcap, rotary_interleaved=rotary == "interleaved",
                 max_seqlen_q=seqlen_q if packed else None, attention_chunk=chunk)
