"""``lazytriton cache explain``: for a described call, its variant, tuning row, key, and which tier serves it.

``lazytriton.cli.cache`` registers the command; like the other cache reports
it computes one report and renders it through ``report.emit``. A call the API
would refuse is refused here too, by the API's own checks (``explain_checks``),
and a ``--target`` must be one prewarm knows (``prewarm.limits.known_target``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lazytriton.cli.explain_checks import check_call, check_slots_call
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


def add_arguments(ex: argparse.ArgumentParser) -> None:
    """The described call's flags on ``lazytriton cache explain``'s parser (``cli.cache`` registers the command)."""
    from lazytriton.geometry import CAUSAL_MODES, ROTARY_MODES
    from lazytriton.kernels import FAMILIES
    from lazytriton.variant import DTYPES

    kernels = tuple(dict.fromkeys((*FAMILIES, *(k for ks in FAMILIES.values() for k in ks))))
    ex.add_argument("--kernel", choices=kernels, default="flash_fwd",
                    help="the family (flash_fwd, flash_bwd: both backward kernels, flash_decode: split and combine) "
                         "or one kernel (default: flash_fwd)")
    ex.add_argument("--dtype", choices=DTYPES, required=True)
    ex.add_argument("--head-dim", type=int, required=True)
    ex.add_argument("--head-dim-v", type=int, default=None,
                    help="v's head dim, if it differs from --head-dim (up to 512 for flash_decode, kv_append and "
                         "flash_fwd_mla; flash_fwd and flash_bwd over 256: v's two pieces, lazytriton.value_split)")
    ex.add_argument("--seqlen-q", type=int, required=True)
    ex.add_argument("--seqlen-k", type=int, help="default: seqlen-q")
    ex.add_argument("--causal", choices=CAUSAL_MODES, default="none")
    ex.add_argument("--target", help="sm_90, gfx942, ... (default: the GPU here, else sm_90)")
    ex.add_argument("--unaligned", action="store_true", help="some pointer or stride is not 16-byte aligned")
    ex.add_argument("--index64", action="store_true", help="some tensor spans 2**31 elements or more")
    ex.add_argument("--page-size", type=int, default=None,
                    help="flash_decode: a paged cache with pages of this many keys (default: a contiguous cache)")
    ex.add_argument("--varlen", action="store_true", help="packed sequences (flash_attn_varlen_func, VARLEN=true); "
                    "--seqlen-q/--seqlen-k are then max_seqlen_q/max_seqlen_k; with --kernel kv_append, new keys "
                    "packed by cu_seqlens_k_new")
    for flag in ("seqused-q", "seqused-k"):
        ex.add_argument(f"--{flag}", action="store_true",
                        help=f"with --varlen: the call gives {flag.replace('-', '_')} (FlashAttention-3's used "
                             f"lengths, SEQUSED_{flag[-1].upper()}=true)")
    for flag, what in (("window", "a sliding window (window_size)"), ("softcap", "a logit softcap"),
                       ("alibi", "ALiBi slopes (alibi_slopes)"), ("dropout", "dropout_p > 0"),
                       ("attn-mask", "an attn_mask (the kernels' additive bias)"),
                       ("bias-grad", "with --attn-mask: a mask that requires grad (flash_bwd_dq writes its "
                                     "gradient, BIAS_GRAD=true)"),
                       ("leftpad", "flash_decode: a left-padded cache (cache_leftpad)"),
                       ("sinks", "attention sinks (sinks/s_aux: SINKS=true on the forward and decoding kernels)"),
                       ("varlen-q", "flash_decode: queries packed by cu_seqlens_q (VARLEN_Q=true)"),
                       ("attention-chunk", "FlashAttention-3's attention_chunk (CHUNK=true on flash_fwd, flash_bwd "
                                           "and flash_decode's split kernel; the size is a runtime argument)"),
                       ("qv", "flash_decode: FlashAttention-3's qv (QV=true on the split kernel; MLA's latent "
                              "cache, 576/512, is --head-dim 64 --head-dim-v 512 --qv)"),
                       ("key-mask", "flash_decode: a key mask (KEY_MASK=true: transformers' decoding steps)")):
        ex.add_argument(f"--{flag}", action="store_true", help=f"the call has {what}")
    ex.add_argument("--rotary", choices=ROTARY_MODES, default="none",
                    help="flash_decode and kv_append: the call has rotary_cos/rotary_sin, rotary_interleaved=True "
                         "(interleaved) or False (halves, GPT-NeoX's)")
    ex.add_argument("--kv-dtype", choices=("none", "e4m3", "e5m2"), default="none",
                    help="flash_decode and kv_append: a float8 KV cache (torch.float8_e4m3fn or float8_e5m2, with "
                         "k_descale/v_descale: KV_FP8 on the split kernel and kv_append); --dtype is q's")
    ex.add_argument("--kv-pairs", type=int, default=None,
                    help="flash_decode with --kv-dtype: the call's (sequence, key/value head) pairs, batch x "
                         "heads_k, which a float8 cache's split tiles follow (default 1)")
    ex.add_argument("--slot-mapping", choices=("int64", "int32"), default=None,
                    help="kv_slots: slot_mapping's dtype (default int64, vLLM's and SGLang's); --seqlen-q is the "
                         "tokens written, --seqlen-k the cache's slots, --page-size its block size")


def cmd_explain(args: argparse.Namespace) -> int:
    emit(args, explain_report(args), print_explain)
    return 0
