"""lazytriton prewarm: compile variants ahead of time into an image.

Typical runs:

    # every kernel family (forward and backward): the tuning tables' rows for sm_90 and gfx942, plus the default grid
    lazytriton prewarm --target sm_90,gfx942 --out attn.ltimg
    # the forward only, or the backward's two kernels only
    lazytriton prewarm --target sm_90 --kernel flash_fwd --out fwd.ltimg
    lazytriton prewarm --target sm_90 --kernel flash_bwd --list
    # the decoding kernels (flash_attn_with_kvcache), for a paged cache only
    lazytriton prewarm --target sm_90 --kernel flash_decode --paged paged --list
    # ... with pages of 1 key (SGLang's radix cache) and of 16 keys
    lazytriton prewarm --target sm_90 --kernel flash_decode --paged paged --page-size 1,16 --list
    # a few axes only; --list prints the plan and builds nothing
    lazytriton prewarm --target sm_90 --dtype bf16 --head-dim 64,80,128 --causal top_left --list
    # exactly what a production run compiled just in time
    lazytriton prewarm --from-misses ~/.cache/lazytriton/misses.jsonl --out next.ltimg
    # split one build over three machines, then merge
    lazytriton prewarm --target sm_90 --shard 2/3 --out part2.ltimg
    lazytriton prewarm --merge part1.ltimg part2.ltimg part3.ltimg --out attn.ltimg

Without axis flags the plan is, for every kernel of every family (flash_fwd;
flash_bwd = flash_bwd_dq and flash_bwd_dkdv), its tuning table's rows for the
targets plus a default grid for the groups the table lacks: dtype
fp16/bf16/fp32 x head dim 16/32/64/128/256 x causal none/top_left, each at
seqlens 16, 64 and 4096 (the three seqlen classes of the default tile sizes,
of seqlen_q for flash_fwd and flash_bwd_dq, of seqlen_k for flash_bwd_dkdv).
The decoding family (flash_decode = flash_decode_split and
flash_decode_combine) defaults to bf16/fp16 x head dim 64/128 x causal
none/top_left x a contiguous and a paged cache, at 16, 32 and 64 query rows
per key/value head (group size x seqlen_q: its three BLOCK_M classes), its
paged variants serving pages of any multiple of 64 keys (--page-size plans
the page sizes a deployment uses).
An axis flag narrows that axis; --kernel takes families or kernel names.

A killed run, run again, compiles only what it had not built (see OUT.work/).
Exit status: 0 if everything built, 1 if some variant failed (the image holds
the rest; OUT.work/failures.jsonl has the errors), 2 on a usage error. Set
SOURCE_DATE_EPOCH for byte-identical images from the same inputs. The compile
workers are forked from one process that imported Triton once (Linux);
LAZYTRITON_PREWARM_FORK=0 starts each as a fresh interpreter instead.

--helpers also builds the compiled launch helpers (a C compiler, and for the
C++ warm path torch's headers) into the cache dir for this Python and torch,
and a regular install's code pack (lazytriton/codepack.py: the package's
modules in one file, imported without a search): a deployment image that
runs it starts on the fast launch path, and imports faster.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from lazytriton.cli.report import plural

DTYPES = ("fp16", "bf16", "fp32", "e4m3", "e5m2")  # lazytriton.variant.DTYPES, without importing it to build the parser
# --causal takes the causal modes of the API and of ``cache explain`` (geometry.CAUSAL_MODES);
# "causal" is an alias of top_left, as ``causal=True`` is in the API. top_left and
# bottom_right build the same binary (CAUSAL=true): the alignment is a runtime offset.
CAUSAL_MODES = ("none", "top_left", "bottom_right")  # geometry.CAUSAL_MODES, without importing it
_CAUSAL_ALIASES = {"causal": "top_left"}
_AXIS_FLAGS = ("dtype", "head_dim", "head_dim_v", "causal", "seqlen_q", "seqlen_k", "unaligned", "index64", "window",
               "softcap", "paged", "varlen", "seqused", "alibi", "dropout", "attn_mask", "bias_grad", "leftpad",
               "rotary", "sinks", "varlen_q", "attention_chunk", "page_size", "kv_dtype", "qv", "key_mask")
_PAGED = {"both": (False, True), "paged": (True,), "contiguous": (False,)}
# --rotary's choices: the rotary modes planned beside the calls without rotary (geometry.ROTARY_MODES).
_ROTARY = {"interleaved": ("none", "interleaved"), "halves": ("none", "halves"),
           "both": ("none", "interleaved", "halves")}
# --kv-dtype's choices: the float8 KV cache formats planned beside the caches of q's dtype (KV_FP8).
_KV_DTYPES = {"e4m3": ("none", "e4m3"), "e5m2": ("none", "e5m2"), "both": ("none", "e4m3", "e5m2")}


class UsageError(ValueError):
    """A bad combination of flags; the message names them."""


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _targets(text: str) -> list[str]:
    """The targets as given; checked by ``_check_targets`` before any work (one line, exit 2)."""
    return _items(text)


def _check_targets(given: list[str]) -> list[str]:
    """The canonical names of ``--target``'s values, or UsageError naming the bad one and the known targets."""
    from lazytriton.prewarm.limits import known_target

    names = []
    for item in given:
        try:
            names.append(str(known_target(item)))
        except ValueError as exc:
            raise UsageError(f"--target {item}: {exc}") from None
    return names


def _kernels(text: str) -> list[str]:
    """Kernel names from families and kernel names (``flash_fwd,flash_bwd``; ``flash_bwd_dq``)."""
    from lazytriton.prewarm.enumeration import parse_kernels

    try:
        return list(parse_kernels(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _dtypes(text: str) -> list[str]:
    bad = [item for item in _items(text) if item not in DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(DTYPES)}, got {', '.join(bad)}")
    return _items(text)


def _ints(low: int, high: int, what: str) -> Any:
    def parse(text: str) -> list[int]:
        values = []
        for item in _items(text):
            if not item.isdigit() or not low <= int(item) <= high:
                raise argparse.ArgumentTypeError(f"{what} must be integers in {low}..{high}, got {item!r}")
            values.append(int(item))
        return values

    return parse


def _causal(text: str) -> list[str]:
    """Causal modes, normalised (``causal`` is read as ``top_left``, and said so)."""
    modes = []
    for item in _items(text):
        mode = _CAUSAL_ALIASES.get(item.lower(), item.lower())
        if mode not in CAUSAL_MODES:
            raise argparse.ArgumentTypeError(f"--causal must be among {', '.join(CAUSAL_MODES)} "
                                             f"(or causal, an alias of top_left), got {item!r}")
        if mode != item:
            print(f"prewarm: --causal {item} read as {mode}", file=sys.stderr)
        modes.append(mode)
    return modes


def _shard(text: str) -> tuple[int, int]:
    from lazytriton.prewarm.enumeration import parse_shard

    try:
        return parse_shard(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _jobs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"-j must be a positive number of processes, got {text!r}")
    return int(text)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--variant-timeout must be a positive number of seconds, got {text!r}")
    return value


def parse_memory(text: str) -> int:
    """``4G``, ``512MiB``, ``1073741824``; ``0`` for no limit."""
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = raw[-1:] if raw[-1:] in _UNITS else ""
    number = raw[:-1] if unit else raw
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"--variant-memory must be bytes with an optional K/M/G/T suffix "
                                         f"(0: no limit), got {text!r}")
    return int(number) * _UNITS[unit]


def default_jobs() -> int:
    """All the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``prewarm`` on the ``lazytriton`` command's subparsers."""
    p = sub.add_parser("prewarm", help="compile variants ahead of time into an image (any target, no GPU needed)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    axes = p.add_argument_group("what to build (comma-separated lists; a flag may repeat)")
    axes.add_argument("--target", type=_targets, action="extend", help="sm_90,sm_80,gfx942,gfx950, ...")
    axes.add_argument("--kernel", type=_kernels, action="extend",
                      help="kernel families or kernels: flash_fwd, flash_bwd (= flash_bwd_dq,flash_bwd_dkdv), "
                           "flash_decode (= flash_decode_split,flash_decode_combine) "
                           "(default: every family); with --from-misses, it filters the log as --target does")
    axes.add_argument("--dtype", type=_dtypes, action="extend", help="fp16,bf16,fp32")
    axes.add_argument("--head-dim", type=_ints(1, 256, "--head-dim"), action="extend",
                      help="1..256; built at the padded size (16, 32, 64, 128, 256), EVEN_D=false if it differs")
    axes.add_argument("--head-dim-v", type=_ints(1, 512, "--head-dim-v"), action="extend",
                      help="v's head dims, 1..512 (default: each --head-dim's own); a differing one builds "
                           "BLOCK_DV/EVEN_DV variants (DeepSeek's MLA: --head-dim 192 --head-dim-v 128); over "
                           "256 the decoding kernels, kv_append and flash_fwd_mla take them (MLA's decode: "
                           "--head-dim 64 --head-dim-v 512 --qv), and flash_fwd and flash_bwd plan v's two pieces "
                           "(its first 256 columns and the rest: lazytriton.value_split)")
    axes.add_argument("--causal", type=_causal, action="extend",
                      help="none,top_left,bottom_right (both causal modes build one binary; causal = top_left)")
    axes.add_argument("--seqlen-q", type=_ints(1, 2**31 - 1, "--seqlen-q"), action="extend",
                      help="seqlen buckets (a value selects what a call of that length selects)")
    axes.add_argument("--seqlen-k", type=_ints(1, 2**31 - 1, "--seqlen-k"), action="extend")
    axes.add_argument("--unaligned", action="store_true", help="also build the unaligned (ALIGN16=false) variants")
    axes.add_argument("--index64", action="store_true",
                      help="also build the 64-bit-offset (INDEX64=true) variants, for tensors of 2**31+ elements")
    axes.add_argument("--window", action="store_true",
                      help="also build the sliding-window (WINDOW=true) variants: window_size in the API")
    axes.add_argument("--softcap", action="store_true",
                      help="also build the logit-softcapping (SOFTCAP=true) variants: softcap > 0 in the API")
    axes.add_argument("--paged", choices=tuple(_PAGED), default=None,
                      help="flash_decode's KV cache: paged (PAGED=true: a block table), contiguous, or both "
                           "(the default)")
    axes.add_argument("--page-size", type=_ints(1, 2**31 - 1, "--page-size"), action="extend",
                      help="flash_decode's paged cache: its keys a page (1 for SGLang's radix cache; default: pages "
                           "of any multiple of 64). Other page sizes (1, 2, 4, 8, 12, 16, 32, 48, 100...) take the "
                           "gathered variant (PAGE_GATHER=true) that serves them all")
    axes.add_argument("--varlen", action="store_true",
                      help="also build the packed-sequence (VARLEN=true) variants: flash_attn_varlen_func (the "
                           "seqlens are then max_seqlen_q/max_seqlen_k), and kv_append's new keys packed by "
                           "cu_seqlens_k_new (flash_attn_with_kvcache)")
    axes.add_argument("--seqused", action="store_true",
                      help="with --varlen, also build the packed variants with seqused_q, seqused_k or both "
                           "(SEQUSED_Q=true, SEQUSED_K=true): FlashAttention-3's (vLLM's) used lengths")
    axes.add_argument("--alibi", action="store_true", help="also build the ALiBi (ALIBI=true) variants: alibi_slopes")
    axes.add_argument("--dropout", action="store_true",
                      help="also build the dropout (DROPOUT=true) variants: dropout_p > 0 in the API")
    axes.add_argument("--attn-mask", action="store_true",
                      help="also build the additive-bias (BIAS=true) variants: attn_mask in the SDPA drop-in")
    axes.add_argument("--bias-grad", action="store_true",
                      help="with --attn-mask, also build flash_bwd_dq's variants that write the mask's gradient "
                           "(BIAS_GRAD=true): an attn_mask that requires grad")
    axes.add_argument("--leftpad", action="store_true",
                      help="also build the left-padded cache (LEFTPAD=true) variants of flash_decode: cache_leftpad "
                           "in flash_attn_with_kvcache")
    axes.add_argument("--rotary", choices=tuple(_ROTARY), default=None,
                      help="also build the rotary (ROTARY=true) variants of flash_decode's split kernel and kv_append: "
                           "rotary_cos/rotary_sin in flash_attn_with_kvcache, rotary_interleaved=True (interleaved: "
                           "ROTARY_INTERLEAVED=true), False (halves, GPT-NeoX's) or both")
    axes.add_argument("--sinks", action="store_true",
                      help="also build the attention-sink (SINKS=true) variants of the forward kernels (the Gluon "
                           "forward's too) and flash_decode: sinks (s_aux) in the API; the backward takes none")
    axes.add_argument("--varlen-q", action="store_true",
                      help="also build the packed-query (VARLEN_Q=true) variants of flash_decode's split kernel: "
                           "cu_seqlens_q in flash_attn_with_kvcache, flash_attn_varlen_func with a block_table")
    axes.add_argument("--attention-chunk", action="store_true",
                      help="also build the chunked-attention (CHUNK=true) variants of flash_fwd, flash_bwd_dq, "
                           "flash_bwd_dkdv, flash_fwd_mla (with --qv) and flash_decode's split kernel: attention_chunk "
                           "in the API (the chunk size is a runtime argument: one variant serves every size)")
    axes.add_argument("--qv", action="store_true",
                      help="also build the qv (QV=true) variants of flash_decode's split kernel: FlashAttention-3's "
                           "qv in flash_attn_with_kvcache, and MLA's latent cache (v_cache = k_cache[..., :512]), "
                           "which runs them with --head-dim the columns after v's (64) and --head-dim-v 512")
    axes.add_argument("--key-mask", action="store_true",
                      help="also build the key-masked (KEY_MASK=true) variants of flash_decode's split kernel: the "
                           "transformers integration's decoding steps (attn_implementation=\"lazytriton\", a padded "
                           "batch's boolean mask read per key); with --softcap (Gemma 2) and --sinks (gpt-oss) for "
                           "those models' steps")
    axes.add_argument("--kv-dtype", choices=tuple(_KV_DTYPES), default=None,
                      help="also build the float8 KV cache (KV_FP8=e4m3/e5m2) variants of flash_decode's split kernel "
                           "and kv_append: k_cache/v_cache in torch.float8_e4m3fn or float8_e5m2 with "
                           "k_descale/v_descale in flash_attn_with_kvcache; a target without the format (e4m3 below "
                           "sm_89) leaves it out, with a note")
    axes.add_argument("--from-misses", type=Path, action="append", metavar="FILE",
                      help="build exactly the variants of a miss log (misses.jsonl), forward and backward; "
                           "--target and --kernel filter it")
    run = p.add_argument_group("how")
    run.add_argument("-j", "--jobs", type=_jobs, default=None, help="worker processes (default: all cores)")
    run.add_argument("--shard", type=_shard, metavar="I/N", help="build the I-th of N disjoint parts (by key)")
    run.add_argument("--out", type=Path, metavar="FILE", help="the image to write")
    run.add_argument("--list", action="store_true",
                     help="print the plan (key, origin, variant: its kernel first) and exit; the count per kernel "
                          "goes to stderr")
    run.add_argument("--merge", type=Path, nargs="+", metavar="SRC",
                     help="merge images and/or work directories into --out instead of building")
    run.add_argument("--keep-work", action="store_true", help="keep OUT.work/ after a build with no failures")
    run.add_argument("--codec", choices=("zstd-dict", "zstd", "none"), default="zstd-dict",
                     help="how the image stores its entries (default zstd-dict: the smallest); none serves a "
                          "process's first kernel without importing zstandard (~1 ms sooner) from ~4x the bytes")
    run.add_argument("--variant-timeout", type=_seconds, default=None, metavar="SECONDS",
                     help="kill a worker still compiling one variant after this long; the variant fails "
                          "(default: 600)")
    run.add_argument("--variant-memory", type=parse_memory, default=None, metavar="BYTES",
                     help="address space of each worker, e.g. 4G (default: 4G; 0: no limit); a variant "
                          "over it fails")
    run.add_argument("--helpers", nargs="?", const="", default=None, metavar="CACHE_DIR",
                     help="build the compiled launch helpers for this Python and torch into the cache dir "
                          "(LAZYTRITON_CACHE_DIR's, or CACHE_DIR: the one a deployment will run with), so that "
                          "its first process launches through them; alone, or beside an image build")
    p.set_defaults(fn=main)
    return p


def _source_date_epoch() -> float | None:
    raw = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise UsageError(f"SOURCE_DATE_EPOCH must be a non-negative integer (seconds), got {raw!r}")
    return float(raw)


def _plan(args: argparse.Namespace) -> list[Any]:
    from lazytriton import tuning
    from lazytriton.prewarm.enumeration import (
        Axes,
        enumerate_variants,
        left_out,
        select_shard,
        takes_kernel,
        variants_from_miss_log,
    )

    if args.from_misses:
        given = [f"--{name.replace('_', '-')}" for name in _AXIS_FLAGS if getattr(args, name)]
        if given:
            raise UsageError(f"--from-misses builds exactly the logged variants; {', '.join(given)} cannot narrow it "
                             "(only --target and --kernel filter it)")
        plan: dict[str, Any] = {}
        for path in args.from_misses:
            try:
                found, problems = variants_from_miss_log(path)
            except OSError as exc:
                raise UsageError(f"--from-misses {path}: cannot read it ({exc.strerror})") from None
            for problem in problems:
                print(f"prewarm: skipped {problem}", file=sys.stderr)
            for item in found:
                if (not args.target or item.variant.target in args.target) and (
                        not args.kernel or takes_kernel(args.kernel, item.variant.kernel)):
                    plan.setdefault(item.key, item)
        return select_shard(list(plan.values()), args.shard)
    if not args.target:
        raise UsageError("--target is required (e.g. --target sm_90,gfx942), unless --from-misses or --merge")
    if args.seqused and not args.varlen:
        raise UsageError("--seqused builds packed-sequence variants (seqused_q/seqused_k): give --varlen too")
    from lazytriton.prewarm.enumeration import all_kernels
    from lazytriton.target import Target

    kernels = tuple(k for k in all_kernels() if k in args.kernel) if args.kernel else all_kernels()
    if args.page_size and args.paged == "contiguous":
        raise UsageError("--page-size describes a paged cache; --paged contiguous plans none")
    axes = Axes(targets=tuple(Target.parse(t) for t in dict.fromkeys(args.target)), kernels=kernels,
                dtypes=tuple(dict.fromkeys(args.dtype)) if args.dtype else None,
                head_dims=tuple(dict.fromkeys(args.head_dim)) if args.head_dim else None,
                head_dims_v=tuple(dict.fromkeys(args.head_dim_v)) if args.head_dim_v else None,
                causal=tuple(dict.fromkeys(mode != "none" for mode in args.causal)) if args.causal else None,
                seqlens_q=tuple(args.seqlen_q) if args.seqlen_q else None,
                seqlens_k=tuple(args.seqlen_k) if args.seqlen_k else None,
                aligned=(True, False) if args.unaligned else (True,),
                index64=(False, True) if args.index64 else (False,),
                window=(False, True) if args.window else (False,),
                softcap=(False, True) if args.softcap else (False,),
                paged=_PAGED[args.paged] if args.paged else None,
                varlen=(False, True) if args.varlen else (False,),
                seqused=(False, True) if args.seqused else (False,),
                alibi=(False, True) if args.alibi else (False,),
                dropout=(False, True) if args.dropout else (False,),
                bias=(False, True) if args.attn_mask else (False,),
                bias_grad=(False, True) if args.bias_grad else (False,),
                leftpad=(False, True) if args.leftpad else (False,),
                rotary=_ROTARY[args.rotary] if args.rotary else ("none",),
                sinks=(False, True) if args.sinks else (False,),
                varlen_q=(False, True) if args.varlen_q else (False,),
                chunk=(False, True) if args.attention_chunk else (False,),
                qv=(False, True) if args.qv else (False,),
                key_mask=(False, True) if args.key_mask else (False,),
                page_sizes=tuple(dict.fromkeys(args.page_size)) if args.page_size else None,
                kv_fp8=_KV_DTYPES[args.kv_dtype] if args.kv_dtype else ("none",))
    for note in left_out(axes):
        print(f"prewarm: left out {note}", file=sys.stderr)
    return select_shard(enumerate_variants(axes, tuning.tables_for(kernels)), args.shard)


def _cache_lookup() -> Any:
    """The runtime's tiers (images, local cache, shared tier) as a lookup: what a run compiled is reused.

    A miss log lives in a cache dir whose entries hold most of what it names
    (and a shared tier may hold the rest): copying a verified entry beats
    compiling it again. None, with a note, when the settings are unusable.
    """
    from lazytriton import runtime

    try:
        chain = runtime.get().chain
    except ValueError as exc:
        print(f"prewarm: not reusing the cache ({exc}); compiling everything", file=sys.stderr)
        return None

    def lookup(key: str) -> Any:
        found = chain.get(key)
        return None if found is None else found[0]

    return lookup


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _merge(args: argparse.Namespace) -> int:
    from lazytriton.cache_format.image import ImageError
    from lazytriton.prewarm.builder import merge

    if (args.target or args.kernel or args.from_misses or args.shard or args.list
            or any(getattr(args, n) for n in _AXIS_FLAGS)):
        raise UsageError("--merge takes only sources, --out and --codec")
    try:
        info, duplicates = merge(args.merge, args.out, args.codec)
    except (ImageError, OSError) as exc:
        print(f"lazytriton prewarm: merge failed: {exc}", file=sys.stderr)
        return 1
    print(f"merged {plural(len(args.merge), 'source')} into {info.path}: {plural(info.entries, 'entry')}, "
          f"{_mib(info.stored_bytes)} ({plural(duplicates, 'duplicate key')} left out)")
    return 0


def main(args: argparse.Namespace) -> int:
    """Run ``lazytriton prewarm`` with parsed arguments; the exit status."""
    try:
        if args.helpers is None:
            return _main(args)
        status = _build_helpers(args.helpers)
        if not (args.merge or args.target or args.from_misses or args.list):
            return status
        return max(status, _main(args))
    except UsageError as exc:
        print(f"lazytriton prewarm: error: {exc}", file=sys.stderr)
        return 2


def _build_helpers(where: str) -> int:
    """``--helpers``: build what the cache dir lacks for this Python and torch (waits for a background build)."""
    from lazytriton import codepack_build, config
    from lazytriton.driver import helpers, helpers_build

    cache_dir = Path(where).expanduser() if where else config.settings().cache_dir
    results = helpers_build.build(cache_dir, helpers.running_torch() or _import_torch())
    for result in results:
        print(f"helper {result.helper}: {result.message}: {result.path}")
    failed = [result.helper for result in results if not result.ok]
    if failed:
        print(f"lazytriton prewarm: {plural(len(failed), 'helper')} not built ({', '.join(failed)}); calls launch "
              "through the slower path", file=sys.stderr)
    packed, message = codepack_build.build_installed()
    print(f"code pack: {message}")
    if packed is False:
        print("lazytriton prewarm: no code pack; the package imports its modules from their files", file=sys.stderr)
    return 1 if failed or packed is False else 0


def _import_torch() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def _main(args: argparse.Namespace) -> int:
    if args.merge:
        if args.out is None:
            raise UsageError("--merge needs --out FILE")
        return _merge(args)
    created = _source_date_epoch()
    if args.target:  # before any work: a bad target is a usage error, never a failed (or empty) build
        args.target = _check_targets(args.target)
    plan = _plan(args)
    if args.list:
        for item in plan:
            print(f"{item.key} {item.origin.split(' ')[0]:<8} {item.variant}")
        shard = f" (shard {args.shard[0]}/{args.shard[1]})" if args.shard else ""
        per_kernel = Counter(item.variant.kernel for item in plan)
        counts = f": {', '.join(f'{kernel} {n}' for kernel, n in per_kernel.items())}" if len(per_kernel) > 1 else ""
        print(f"{plural(len(plan), 'variant')}{shard}{counts}", file=sys.stderr)
        return 0
    if args.out is None:
        raise UsageError("--out FILE is required to build (or --list to print the plan)")
    from lazytriton.prewarm.builder import build
    from lazytriton.prewarm.pool import Limits, fork_server_wanted

    try:  # before any work: a bad value is a usage error, not a build that stops half-way
        fork_server_wanted(os.environ, True)
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    limits = Limits()
    limits = Limits(limits.timeout if args.variant_timeout is None else args.variant_timeout,
                    limits.memory if args.variant_memory is None else args.variant_memory)
    jobs = args.jobs or default_jobs()
    cached = _cache_lookup() if args.from_misses else None
    report = build(plan, args.out, jobs, created=created, keep_work=args.keep_work, limits=limits, cached=cached,
                   codec=args.codec)
    image = report.image
    if image is None:
        print(f"lazytriton prewarm: all {len(report.failures)} variants failed; no image written; errors in "
              f"{report.work}/failures.jsonl", file=sys.stderr)
        return 1
    ratio = ""
    if image.entries:
        ratio = f", 1/{image.raw_bytes / image.stored_bytes:.1f} of the raw {_mib(image.raw_bytes)}"
    rate = f" ({report.compiled / report.seconds:.2f} variants/s at -j {jobs})" if report.compiled else ""
    print(f"wrote {image.path}: {plural(image.entries, 'entry')}, {_mib(image.stored_bytes)}{ratio}; "
          f"{report.reused} reused, {report.compiled} compiled, {len(report.failures)} failed "
          f"in {report.seconds:.1f} s{rate}")
    if report.failures:
        print(f"lazytriton prewarm: {plural(len(report.failures), 'variant')} failed; errors in "
              f"{report.work}/failures.jsonl",
              file=sys.stderr)
        return 1
    return 0
