"""``lazytriton cache explain``: for a described call, its variant, tuning row, key, and which tier serves it.

``lazytriton.cli.cache`` registers the command; like the other cache reports
it computes one report and renders it through ``report.emit``. A call the API
would refuse is refused here too, by the API's own checks (``check_call``),
and a ``--target`` must be one prewarm knows (``prewarm.limits.known_target``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lazytriton.cli.report import Report, emit, image_paths, open_runtime
from lazytriton.record import asdict, replace

# The backward's kernels, whose variants a call's sinks leave as they are.
BACKWARD_KERNELS = ("flash_bwd_dq", "flash_bwd_dkdv")
# The kernels that take attention_chunk (CHUNK=true): the attention kernels', the MLA forward's (with --qv) and
# the decoding split kernel.
CHUNK_KERNELS = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv", "flash_fwd_mla", "flash_decode_split")
# Kernels a family launches only for packed new keys (--varlen): the lengths after kv_append's packed append.
VARLEN_ONLY_KERNELS = ("kv_append_lengths",)


def _explain_target(text: str | None) -> tuple[Any, str]:
    from lazytriton.prewarm.limits import known_target
    from lazytriton.target import Target

    if text:
        return known_target(text), "given"  # prewarm's list: a target nothing can be built for is refused
    try:
        import torch

        if torch.cuda.is_available():
            from lazytriton.machine import target_of_device

            return target_of_device(torch.cuda.current_device()), "detected"
    except ImportError:
        pass
    return Target.parse("sm_90"), "no GPU detected; sm_90 assumed"


MEMORY_REASON = "empty in a new process (a running one keeps what it has loaded)"


def value_columns(kernel: str, head_dim_v: int) -> list[tuple[int, int]]:
    """(first column, width) of each piece of v that ``kernel`` runs a call over: one, or two for a split v.

    Two where its family takes a v over 256 columns as two pieces (``prewarm_head_dims_v``: flash_fwd's,
    flash_bwd's; ``lazytriton.value_split``).
    """
    from lazytriton.kernels import dispatch

    pieces = getattr(dispatch.family_dispatch(kernel), "prewarm_head_dims_v", None)
    widths = (head_dim_v,) if pieces is None else pieces(head_dim_v)
    return [(sum(widths[:i]), width) for i, width in enumerate(widths)]


def explain_kernels(name: str) -> tuple[str, ...]:
    """The kernels ``--kernel`` names, in launch order: a family's (``flash_bwd``: dq, then dK/dV), or one."""
    from lazytriton.kernels import FAMILIES

    return FAMILIES.get(name, (name,))


def explain_report(args: argparse.Namespace) -> Report:
    """The call as understood and, for each kernel it launches, its variant, key, config, tuning row and tiers.

    ``kernels`` lists one report per kernel (``flash_bwd``: ``flash_bwd_dq``
    then ``flash_bwd_dkdv``), each with its variant, key, config, tuning row
    (None: the default), tiers and ``served_by``. A single kernel's report
    (``flash_fwd``, the default) also carries those fields at the top level.
    """
    from lazytriton import geometry
    from lazytriton.kernels import dispatch
    from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
    from lazytriton.kernels.request import Request

    target, how = _explain_target(args.target)
    causal = geometry.causal_mode(args.causal if args.causal != "none" else False) != "none"
    seqlen_k = args.seqlen_q if args.seqlen_k is None else args.seqlen_k
    if args.seqlen_q < 1:  # a call without queries launches nothing: there is no kernel to explain
        raise ValueError(f"--seqlen-q must be >= 1, got {args.seqlen_q}")
    kernel = getattr(args, "kernel", "flash_fwd")
    varlen = bool(getattr(args, "varlen", False))
    kernels = tuple(name for name in explain_kernels(kernel) if varlen or name not in VARLEN_ONLY_KERNELS)
    if not kernels:
        raise ValueError(f"--kernel {kernel} runs only with packed new keys (cu_seqlens_k_new): add --varlen")
    rt = None
    reports = []
    page = getattr(args, "page_size", None) or 0
    flags = _features(args)
    rotary = getattr(args, "rotary", "none")
    kv_dtype = getattr(args, "kv_dtype", None) or "none"
    kv_pairs = getattr(args, "kv_pairs", None)
    if kv_pairs is not None and (kv_dtype == "none" or kv_pairs < 1):
        raise ValueError(f"--kv-pairs is a float8 cache's (sequence, key/value head) pairs: it needs --kv-dtype "
                         f"e4m3 or e5m2 and a count >= 1, got {kv_pairs}" + (" without --kv-dtype"
                                                                              if kv_dtype == "none" else ""))
    kv_pairs = 1 if kv_pairs is None else kv_pairs
    head_dim_v = args.head_dim if getattr(args, "head_dim_v", None) is None else args.head_dim_v
    slots = getattr(args, "slot_mapping", None)
    if "kv_slots" in kernels:
        check_slots_call(args.dtype, args.head_dim, head_dim_v, args.seqlen_q, seqlen_k, args.causal, varlen, page,
                         flags, rotary, slots or "int64", kv_dtype)
    elif slots is not None:
        raise ValueError(f"--slot-mapping is the slot write's slot_mapping: only kv_slots takes it, not {kernel}")
    else:
        check_call(kernels, args.dtype, args.head_dim, head_dim_v, args.seqlen_q, seqlen_k, args.causal, varlen,
                   page, flags, rotary, kv_dtype)
    described = Request(args.dtype, args.head_dim, causal, not args.unaligned, args.seqlen_q, seqlen_k,
                        index64=args.index64, window=flags["window"], softcap=flags["softcap"], alibi=flags["alibi"],
                        bias=flags["bias"], dropout=flags["dropout"], paged=page > 0, varlen=varlen,
                        seqused_q=flags["seqused_q"], seqused_k=flags["seqused_k"],
                        head_dim_v=head_dim_v, page_size=page, leftpad=flags["leftpad"],
                        rotary=rotary != "none", rotary_interleaved=rotary == "interleaved", sinks=flags["sinks"],
                        bias_grad=flags["bias_grad"], varlen_q=flags["varlen_q"], chunk=flags["chunk"],
                        kv_fp8=kv_dtype, slot64=(slots or "int64") == "int64", qv=flags["qv"],
                        key_mask=flags["key_mask"], kv_pairs=kv_pairs if kv_dtype != "none" else 0)
    runs = [(name, start, dim_v) for name in kernels for start, dim_v in value_columns(name, head_dim_v)]
    for name, start, dim_v in runs:  # each kernel's family answers (kernels.dispatch.choice), for each piece of v
        # The backward kernels take no sinks: their variants are the plain call's (the sinks are in the lse).
        request = described if name not in BACKWARD_KERNELS else replace(described, sinks=False)
        if name not in CHUNK_KERNELS:  # the combine and kv_append see no scores: their variants hold no chunk
            request = replace(request, chunk=False)
        variant, config, row = dispatch.choice(name, target, replace(request, head_dim_v=dim_v))
        rt = rt or open_runtime()
        key = variant.key()
        piece = {"v_columns": [start, start + dim_v]} if dim_v != head_dim_v else {}
        reports.append({"kernel": name, **piece, "variant": str(variant), "key": key, "config": asdict(config),
                        "tuning": None if row is None else asdict(row), **tier_verdicts(rt, key)})
    call = {"kernel": kernel, "kernels": list(kernels), "dtype": args.dtype, "head_dim": args.head_dim,
            "head_dim_v": head_dim_v,
            "padded_head_dim": geometry.padded_head_dim(args.head_dim), "seqlen_q": args.seqlen_q,
            "seqlen_k": seqlen_k, "causal": args.causal, "aligned": not args.unaligned, "index64": args.index64,
            "seq16": any(bwd_dispatch.seq_aligned(name, not args.unaligned, args.seqlen_q, seqlen_k, varlen)
                         for name in kernels), "varlen": varlen, "target": str(target), "target_source": how, **flags,
            "rotary": rotary, "kv_dtype": kv_dtype, **({"kv_pairs": kv_pairs} if kv_dtype != "none" else {}),
            **({"page_size": page} if page else {}),
            **({"slot_mapping": slots or "int64"} if "kv_slots" in kernels else {})}
    if args.dtype in ("e4m3", "e5m2"):  # the FP8 forward's other kernel: its line (kernels/flash_fwd/fp8_gluon.py)
        from lazytriton.kernels.flash_fwd import fp8_gluon

        described_fp8 = (str(target), args.dtype, args.head_dim, head_dim_v, args.causal, not args.unaligned,
                         args.index64, args.seqlen_q, seqlen_k,
                         varlen or flags["window"] or flags["softcap"] or flags["chunk"])
        call["fp8_gluon"] = fp8_gluon.explain(*described_fp8)
        gluon_variant = fp8_gluon.served(*described_fp8)
        if gluon_variant is not None:  # the kernel the call runs: its variant, key and tiers, not flash_fwd_fp8's
            key = gluon_variant.key()
            fields = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
            tiles = {name.lower(): int(gluon_variant.get(name)) for name in fields}
            reports = [{"kernel": fp8_gluon.NAME, "variant": str(gluon_variant), "key": key,
                        "config": {**tiles, "waves_per_eu": 0}, "tuning": None, "table": "fp8_gluon.TABLE",
                        **tier_verdicts(rt or open_runtime(), key)}]
    report: Report = {"call": call, "kernels": reports}
    if len(reports) == 1:
        report.update({name: value for name, value in reports[0].items() if name != "kernel"})
    return report


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


def _features(args: argparse.Namespace) -> dict[str, bool]:
    """The described call's feature flags, as ``dispatch.kernel_variant`` takes them (attn_mask: the kernels' bias).

    From ``--window``, ``--softcap``, ``--alibi``, ``--dropout``, ``--attn-mask``, ``--bias-grad``,
    ``--leftpad``, ``--seqused-q``, ``--seqused-k``, ``--sinks``, ``--varlen-q``, ``--attention-chunk``,
    ``--qv`` and ``--key-mask``.
    """
    return {name: bool(getattr(args, attr, False)) for name, attr in
            (("window", "window"), ("softcap", "softcap"), ("alibi", "alibi"), ("dropout", "dropout"),
             ("bias", "attn_mask"), ("bias_grad", "bias_grad"), ("leftpad", "leftpad"), ("seqused_q", "seqused_q"),
             ("seqused_k", "seqused_k"), ("sinks", "sinks"), ("varlen_q", "varlen_q"), ("chunk", "attention_chunk"),
             ("qv", "qv"), ("key_mask", "key_mask"))}


def tier_verdicts(rt: Any, key: str) -> Report:
    """Each tier in the order the runtime reads them (memory, the chain, jit): what it holds, whether it serves, why.

    ``state`` is what a tier holds for the key (present, absent, damaged, unusable, unknown; ``on``/``off`` for
    jit); ``reason`` is ``store.probe.explain``'s; ``served_by`` is the tier that serves (None: KernelNotFound).
    """
    from lazytriton.store.image import ImageTier
    from lazytriton.store.probe import PRESENT, explain, probe_images, probe_tier

    probes = []
    for tier in rt.chain.tiers:
        if isinstance(tier, ImageTier):
            probes.extend(probe_images(image_paths(rt), key, tier.name))
        else:
            probes.append(probe_tier(tier, key))
    verdict = explain(probes, rt.settings.jit)
    served = next((p for p in probes if p.state == PRESENT), None)  # explain's rule: the first present one
    tiers: list[Report] = [{"tier": "memory", "where": None, "state": "empty", "serves": False,
                            "reason": MEMORY_REASON}]
    tiers += [{"tier": p.tier, "where": p.where, "state": p.state, "serves": p is served, "reason": reason}
              for p, (_, reason) in zip(probes, verdict.reasons[:-1], strict=True)]
    tiers.append({"tier": "jit", "where": None, "state": "on" if rt.settings.jit else "off",
                  "serves": verdict.source == "jit", "reason": verdict.reasons[-1][1]})
    return {"tiers": tiers, "served_by": verdict.source}


def print_explain(report: Report) -> None:
    call = report["call"]
    dim_v = f" head_dim_v={call['head_dim_v']}" if call.get("head_dim_v", call["head_dim"]) != call["head_dim"] else ""
    print(f"call     {call['kernel']} {call['dtype']} head_dim={call['head_dim']}{dim_v} seqlen_q={call['seqlen_q']} "
          f"seqlen_k={call['seqlen_k']} causal={call['causal']} {'aligned' if call['aligned'] else 'unaligned'} "
          f"target={call['target']} ({call['target_source']})")
    if call["kernel"].startswith("flash_decode"):
        gathered = any("PAGE_GATHER=true" in kernel["variant"] for kernel in report["kernels"])
        print("         flash_decode: seqlen_q counts query rows per key/value head (group size x seqlen_q), "
              "seqlen_k the cache's length per sequence"
              + (f"; pages of {call['page_size']} key{'s' if call['page_size'] > 1 else ''}" if call.get("page_size")
                 else "; a contiguous cache")
              + ("; pages not a multiple of 64 keys are read key by key, each key's page from the block table "
                 "(PAGE_GATHER=true)"
                 if gathered else "")
              + ("; left-padded (cache_leftpad, LEFTPAD=true)" if call.get("leftpad") else "")
              + ("; queries packed by cu_seqlens_q (VARLEN_Q=true on the split kernel; seqlen_q: max_seqlen_q)"
                 if call.get("varlen_q") else "")
              + (f"; rotary embeddings ({call['rotary']}: ROTARY=true"
                 + (", ROTARY_INTERLEAVED=true" if call["rotary"] == "interleaved" else "")
                 + ", q rotated in the split kernel, new keys in kv_append)" if call.get("rotary", "none") != "none"
                 else "")
              + (f"; a float8 cache ({call['kv_dtype']}: KV_FP8={call['kv_dtype']} on the split kernel, which "
                 f"dequantises in registers, and kv_append, which quantises new keys as x / descale; its split "
                 f"tiles for {call.get('kv_pairs', 1)} (sequence, key/value head) pairs)"
                 if call.get("kv_dtype", "none") != "none" else "")
              + ("; qv (QV=true on the split kernel): the scores add qv . v, the V tile read once for both "
                 "products; MLA's latent cache (v_cache = k_cache[..., :512], head dim 576) runs this variant at "
                 "head_dim 64" if call.get("qv") else "")
              + ("; a key mask (KEY_MASK=true on the split kernel): a (batch, key) byte read per key tile, 0 "
                 "masks the key (SDPA's boolean mask: transformers' decoding steps)" if call.get("key_mask") else "")
              + "; the combine runs only when a call splits its keys")
    if call["kernel"] == "kv_slots":
        print(f"         kv_slots: seqlen_q counts the tokens written, seqlen_k the cache's slots; slot_mapping "
              f"{call['slot_mapping']} (SLOT64={'true' if call['slot_mapping'] == 'int64' else 'false'}); one config "
              "a column chunk; negative slots and slots past the cache are skipped, never read on the host"
              + (f"; a float8 cache ({call['kv_dtype']}: KV_FP8={call['kv_dtype']}, keys and values quantised as "
                 "x / descale on the way in)" if call.get("kv_dtype", "none") != "none" else ""))
    if call.get("varlen") and "kv_append" in call["kernels"]:
        print("         varlen: kv_append's new keys packed by cu_seqlens_k_new (VARLEN=true): k (total_new, heads_k, "
              "head_dim), each row finding its sequence in cu_seqlens_k_new; one config, no seqlen axis")
    elif call.get("varlen"):
        print("         varlen: packed sequences (VARLEN=true); the seqlens are max_seqlen_q/max_seqlen_k, whose "
              "buckets pick the tiles, and causal is bottom-right within each sequence"
              + "".join(f"; {name} (SEQUSED_{name[-1].upper()}=true): each sequence uses the first {name}[i] "
                        f"{'queries' if name[-1] == 'q' else 'keys'} of its span"
                        for name in ("seqused_q", "seqused_k") if call.get(name)))
    elif call["causal"] == "bottom_right":
        print("         bottom_right runs the causal variant with a runtime offset (seqlen_k - seqlen_q)")
    if call.get("sinks"):
        print("         sinks (SINKS=true): one logit a query head joins every row's denominator and lse, in the "
              "epilogue; the Gluon forward carries them too (a call its table serves runs flash_fwd_gluon with "
              "SINKS=true); the decoding kernels add them once (one split, or the combine); the backward's "
              "kernels take none (the sinks reach them through the lse)")
    if call.get("dtype") in ("e4m3", "e5m2"):
        print(f"         {call['dtype']} (FlashAttention-3's FP8 forward): flash_fwd_fp8, its own kernel "
              f"({call['dtype']} q, k, v; P rounded to e4m3; V read "
              "from its transpose; q_descale/k_descale/v_descale; bf16 out), sm_90 and later; on sm_90 "
              f"flash_fwd_fp8_gluon where its rule holds: {call['fp8_gluon']}")
    if call.get("chunk"):
        print("         attention_chunk (CHUNK=true, the chunk size a runtime argument): each query sees the keys of "
              "its own chunk, key blocks outside every query's chunk skipped; the Gluon forward, the Gluon dK/dV and "
              "the fused backward take no chunk, so a chunked call runs flash_fwd and flash_bwd's two Triton "
              "kernels (flash_decode_split with the KV cache, flash_fwd_mla with qv; the combine sees no scores)")
    if any(name in call["kernels"] for name in ("flash_bwd_dq", "flash_bwd_dkdv")) and call["aligned"]:
        print("         backward: ALIGN16 marks pointers and strides 16-divisible; "
              + ("SEQ16 also the seqlens and lse strides (both seqlens are multiples of 16)" if call["seq16"] else
                 "no SEQ16 (a seqlen is not a multiple of 16, or packed sequences): the seqlens get no hint"))
    if call.get("bias_grad"):
        print("         bias gradient: flash_bwd_dq writes dS, the mask's gradient, from the tiles its dQ loop "
              "computes (BIAS_GRAD=true); a call with a bias runs flash_bwd's two Triton kernels, never the fused or "
              "Gluon backward, which take no bias")
    pieces = sorted({tuple(kernel["v_columns"]) for kernel in report["kernels"] if "v_columns" in kernel})
    if pieces:
        print(f"         v's {call['head_dim_v']} columns in two pieces, {' and '.join(f'{a}:{b}' for a, b in pieces)} "
              "(lazytriton.value_split): a call without qv that flash_fwd_mla cannot serve (ALiBi, dropout, sinks, "
              "attention_chunk, seqused, a gradient) runs these kernels once a piece; any other, flash_fwd_mla")
    several = len(report["kernels"]) > 1
    if several:
        print(f"         a call launches {', then '.join(call['kernels'])}" + (", each once a piece" if pieces else ""))
    for kernel in report["kernels"]:
        if several:
            columns = kernel.get("v_columns")
            print(f"\n{kernel['kernel']}" + (f" (v's columns {columns[0]}:{columns[1]})" if columns else ""))
        _print_kernel(call, kernel)


def _print_kernel(call: Report, report: Report) -> None:
    c, row = report["config"], report["tuning"]
    print(f"variant  {report['variant']}")
    tuned = f"BLOCK_M={c['block_m']} BLOCK_N={c['block_n']} num_warps={c['num_warps']} num_stages={c['num_stages']}"
    if report.get("table"):  # a Gluon table's row (the FP8 Gluon forward's), not the tuning CSV's
        print(f"tuning   {report['table']}'s row for head dim {call['head_dim']}: {tuned}")
    elif row is None:
        print(f"tuning   default config (no tuning row for {call['target']} {report['kernel']} {call['dtype']} "
              f"head dim {call['padded_head_dim']} causal={call['causal'] != 'none'}): {tuned}")
    else:
        print(f"tuning   row seqlen_q<={row['seqlen_q']} seqlen_k<={row['seqlen_k']}: {tuned} "
              f"({row['tflops']} TFLOP/s on {row['gpu']}, {row['measured']})")
    print(f"key      {report['key']}")
    print("tiers, in the order the runtime reads them:")
    for tier in report["tiers"]:
        name = tier["tier"] if tier["where"] is None else f"{tier['tier']} {tier['where']}"
        print(f"  {name:<40} {tier['reason']}")
    print(f"served by {report['served_by'] or 'nothing: KernelNotFound'}")


def cmd_explain(args: argparse.Namespace) -> int:
    emit(args, explain_report(args), print_explain)
    return 0
