"""transformers with attn_implementation="lazytriton" beside "sdpa": the same logits and tokens, and tokens/s.

A random Llama built from a config (no download): by default hidden 2048, 16
query heads and 4 key/value heads of head dim 128, 8 layers, bf16 on the GPU.
One left-padded batch of prompts of mixed lengths goes through both
implementations:

- **logits**: the prompt's logits of each implementation against the same
  model in float32 through "sdpa" (the reference; from ``LONG_PROMPT`` tokens
  on, float32 attention computed in blocks of queries, ``reference_attention``:
  float32 SDPA falls back to its math kernel there, whose score matrix alone
  is 64 GiB at 32k tokens and 16 heads), with FlashAttention's rule
  in its relative form: lazytriton's max error at most 2x sdpa's own (bf16)
  max error plus a floor of the dtype's rounding (``--floor``). Real tokens
  only (padding rows hold whatever each implementation puts there);
- **greedy tokens**: ``generate`` with a KV cache, ``--new-tokens`` each;
  the tokens must agree, except where sdpa's own two best logits at that step
  lie closer than the bf16 noise between the two implementations (a tie, so
  neither answer is wrong): each divergence is reported with that gap and the
  rest of that sequence is not compared;
- **throughput**: prefill ms (a forward over the padded prompts,
  CUDA-synchronised, median of ``--prefill-rounds`` rounds that each time
  both implementations, in alternating order, after a warmup of each) and
  generation tokens/s (all sequences' new tokens over the generate call's
  wall time, CUDA-synchronised, median of ``--reps`` runs after a warmup
  run), for both;
- **the cache** (``--cache``): transformers' ``DynamicCache`` (default), or
  a ``StaticCache`` whose decoding steps ``generate`` compiles with
  ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs; on
  the CPU smoke the "eager" backend, which still traces the whole graph);
  each implementation compiles afresh (``torch._dynamo.reset``) and its
  warmup run pays the compile;
- **the path taken**: which lazytriton entry points a prefill and one
  decoding step call, counted over all layers (a padded batch: one
  ``flash_attn_varlen_func`` call per layer in the prefill and one masked
  call per layer in a decoding step, "decoding_step L, varlen L" for L
  layers; "dense" is ``attn_fwd``, "sdpa_mask" the SDPA drop-in).

Rows go to a long-format CSV (default benchmarks/results/transformers.csv).
The table comes last. ``--cpu-smoke`` runs a tiny float32 model on the CPU
through Triton's interpreter (CI): the same code path, small shapes.

Usage: python benchmarks/bench_transformers.py [--csv PATH] [--batch 8] [--new-tokens 64] [--reps 3]
                                             [--cache dynamic|static] [--min-len 64 --max-len 512] [--profile 25]
                                             [--cprofile 40]
       python benchmarks/bench_transformers.py --cpu-smoke [--cache static]

Long context: ``--min-len 8192 --max-len 32768 --batch 1`` (and ``--batch 4``); the model's position table
grows with the prompts.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import gc
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from csvlog import append_rows

FIELDS = ("time", "device", "torch", "transformers", "config", "batch", "impl", "metric", "value", "check")
PAD = 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", type=Path, default=Path(__file__).parent / "results" / "transformers.csv")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prefill-rounds", type=int, default=15,
                   help="prefill timing rounds, each timing both implementations in alternating order (median)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                   help="static: a StaticCache, decoding steps compiled (reduce-overhead, fullgraph)")
    p.add_argument("--floor", type=float, default=None, help="absolute floor of the logits rule (default: by dtype)")
    p.add_argument("--key-mask-min-keys", type=int, default=None, metavar="N",
                   help="decoding steps of at least N keys take the key-mask route, shorter ones the bias path "
                        "(default: the integration's KEY_MASK_MIN_KEYS); the config column records it")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny float32 model on the CPU (interpreter)")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="after the timing, profile one generate call per implementation (torch.profiler) and print "
                        "its ROWS costliest ops by self CPU time and by self device time")
    p.add_argument("--profile-prefill", type=int, default=0, metavar="ROWS",
                   help="after the timing, profile one prefill forward per implementation (torch.profiler): its ROWS "
                        "costliest ops by self device time, and the attention kernels' share of the device time")
    p.add_argument("--cprofile", type=int, default=0, metavar="ROWS",
                   help="after the timing, one generate call per implementation under cProfile: its ROWS costliest "
                        "Python functions by own time and by cumulative time (where the host time goes)")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace, device: str, dtype: torch.dtype) -> Any:
    import transformers

    torch.manual_seed(0)
    if args.cpu_smoke:
        config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=64, num_hidden_layers=2, vocab_size=100, pad_token_id=PAD)
    else:
        config = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                                          intermediate_size=5632, num_hidden_layers=args.layers, vocab_size=32000,
                                          pad_token_id=PAD,
                                          max_position_embeddings=max(4096, args.max_len + args.new_tokens))
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.float32).eval()
    return model, config


def left_padded_batch(args: argparse.Namespace, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of random lengths in [min_len, max_len], left-padded; fresh random tokens (never the pad id)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g).tolist()
    lengths[0] = args.max_len  # one full-length prompt, so the batch is as long as the longest
    ids = torch.full((args.batch, args.max_len), PAD, dtype=torch.long)
    mask = torch.zeros((args.batch, args.max_len), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, args.max_len - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[row, args.max_len - n:] = 1
    return ids.to(device), mask.to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


REFERENCE = "reference_query_blocks"  # the float32 reference's attention for long prompts
LONG_PROMPT = 8192  # prompts from this length on take it
QUERY_BLOCK = 1024  # queries a block: 16 heads x 1024 x 32k float32 scores are 2 GiB


def reference_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA's result in float32, a block of queries at a time: (batch, q_len, heads, head_dim), no weights.

    ``attention_mask``: the boolean (batch, 1, q_len, kv_len) mask of transformers' SDPA mask function, or None
    for causal attention without padding (bottom-right aligned, as SDPA's ``is_causal`` on a prefill).
    """
    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    k = key.repeat_interleave(groups, dim=1).float()
    v = value.repeat_interleave(groups, dim=1).float()
    kv_len = k.shape[2]
    scale = dim ** -0.5 if scaling is None else scaling
    causal = attention_mask is None and q_len > 1 and getattr(module, "is_causal", True)
    out = query.new_empty(batch, q_len, heads, v.shape[-1], dtype=torch.float32)
    keys = torch.arange(kv_len, device=query.device)
    for start in range(0, q_len, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, q_len)
        scores = query[:, :, start:stop].float() @ k.transpose(-1, -2) * scale
        if attention_mask is not None:
            scores.masked_fill_(~attention_mask[:, :, start:stop].bool(), float("-inf"))
        elif causal:
            rows = torch.arange(start, stop, device=query.device) + (kv_len - q_len)
            scores.masked_fill_(keys[None, :] > rows[:, None], float("-inf"))
        out[:, start:stop] = (scores.softmax(dim=-1).nan_to_num_(0.0) @ v).transpose(1, 2)
    return out.to(query.dtype), None


def register_reference() -> None:
    """``reference_attention`` under ``REFERENCE``, with transformers' SDPA mask function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(REFERENCE, reference_attention)
    AttentionMaskInterface.register(REFERENCE, sdpa_mask)


def logits_of(model: Any, impl: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.float()  # type: ignore[no-any-return]


def timed_prefills(model: Any, impls: Sequence[str], ids: torch.Tensor, mask: torch.Tensor, rounds: int,
                   device: str) -> dict[str, float]:
    """Median ms of a prefill forward per implementation: one warmup each, then ``rounds`` rounds that time every
    implementation once, in alternating order, so a clock still ramping up or a neighbour's load falls on both."""
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    with torch.no_grad():
        for r in range(rounds + 1):
            for impl in (impls if r % 2 == 0 else impls[::-1]):
                model.set_attn_implementation(impl)
                sync(device)
                t0 = time.perf_counter()
                model(input_ids=ids, attention_mask=mask)
                sync(device)
                if r:
                    times[impl].append(time.perf_counter() - t0)
    return {impl: statistics.median(t) * 1e3 for impl, t in times.items()}


def cache_kwargs(cache: str, device: str) -> dict[str, Any]:
    """``generate``'s arguments for the cache: none for a DynamicCache; a StaticCache with compiled decoding steps."""
    if cache == "dynamic":
        return {}
    import transformers

    if device == "cuda":
        compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    else:  # the CPU smoke: dynamo traces the whole step, nothing is generated to compile
        compile_config = transformers.CompileConfig(fullgraph=True, mode=None, backend="eager")
        compile_config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": compile_config}


def generate(model: Any, impl: str, ids: torch.Tensor, mask: torch.Tensor, new: int, device: str,
             cache: str = "dynamic") -> tuple[Any, float]:
    model.set_attn_implementation(impl)
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=PAD, output_scores=True, return_dict_in_generate=True,
                             **cache_kwargs(cache, device))
    sync(device)
    return out, time.perf_counter() - t0


def profile_generate(model: Any, impl: str, ids: torch.Tensor, mask: torch.Tensor, args: argparse.Namespace,
                     device: str) -> None:
    """One generate call under torch.profiler: where its host and device time go, op by op."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        generate(model, impl, ids, mask, args.new_tokens, device, args.cache)
    table = prof.key_averages()
    print(f"--- profile of one generate call, {impl}: by self CPU time")
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.profile, max_name_column_width=60))
    if device == "cuda":
        print(f"--- profile of one generate call, {impl}: by self device time")
        print(table.table(sort_by="self_cuda_time_total", row_limit=args.profile, max_name_column_width=60))


ATTENTION_KERNELS = ("attn", "flash", "fmha", "cudnn", "sdpa", "softmax")  # device op names counted as attention


def attention_share(kernels: Iterable[tuple[str, float]]) -> tuple[float, float]:
    """(all, attention) device µs of a profile's kernel rows (name, self device µs); attention: a name holding one of
    ``ATTENTION_KERNELS`` (lazytriton's ``flash_*``, cuDNN's, FlashAttention's and the mem-efficient ``fmha``)."""
    rows = list(kernels)
    total = sum(us for _, us in rows)
    return total, sum(us for name, us in rows if any(word in name.lower() for word in ATTENTION_KERNELS))


def profile_prefill(model: Any, impl: str, ids: torch.Tensor, mask: torch.Tensor, rows: int) -> float:
    """One prefill forward under torch.profiler: its costliest device ops and the attention kernels' device ms.

    Returns the attention share of the forward's device time (the kernels whose name holds one of
    ``ATTENTION_KERNELS``): the part of the prefill an attention implementation can change at all.
    """
    from torch.profiler import ProfilerActivity, profile

    model.set_attn_implementation(impl)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(input_ids=ids, attention_mask=mask)
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(f"--- profile of one prefill forward, {impl}: by self device time")
    print(table.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70))
    kernels = torch.autograd.DeviceType.CUDA  # the kernels' own rows: an op's row repeats its kernels' time
    total, attention = attention_share((event.key, event.self_device_time_total) for event in table
                                       if event.device_type == kernels)
    print(f"prefill device time, {impl}: {total / 1e3:.2f} ms, attention kernels {attention / 1e3:.2f} ms "
          f"({100 * attention / max(total, 1e-9):.1f}%)")
    return attention / max(total, 1e-9)


class GcMeter:
    """Python's garbage collector inside a block: passes per generation and their total ms (``gc.callbacks``).

    A full pass walks every object of the process (torch's, transformers', the model's): tens of ms each. Which
    implementation's run they land in follows the objects each keeps alive between collections.
    """

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.ms = 0.0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.passes[info["generation"]] += 1
            self.ms += 1e3 * (time.perf_counter() - self._t0)

    def __enter__(self) -> GcMeter:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def settle_helpers() -> str:
    """Wait (at most 300 s) for a background build of the compiled launch helpers to end; where each helper stands.

    The first GPU use of a fresh cache dir starts that build (a call never waits for a compiler); its compiler
    would otherwise run beside the timed loops. The table says which helpers this process loads.
    """
    from lazytriton import runtime
    from lazytriton.cli import launch_fields
    from lazytriton.driver import helpers, helpers_build

    cache_dir = runtime.get().settings.cache_dir
    settled = helpers_build.wait(cache_dir, helpers.running_torch(), 300.0)
    fields = launch_fields(cache_dir)
    late = "" if settled else " (a helper build still running after 300 s)"
    return f"{fields['launch_path']}: {fields['launch_why']}{late}"


def cprofile_generate(model: Any, impl: str, ids: torch.Tensor, mask: torch.Tensor, args: argparse.Namespace,
                      device: str) -> None:
    """One generate call under cProfile: the Python functions its host time goes to."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    generate(model, impl, ids, mask, args.new_tokens, device, args.cache)
    prof.disable()
    for order in ("tottime", "cumtime"):
        print(f"--- cProfile of one generate call, {impl}: by {order}")
        pstats.Stats(prof).sort_stats(order).print_stats(args.cprofile)


def lazytriton_calls(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> str:
    """The lazytriton entry points a prefill and one decoding step call (all layers): "decoding_step 8, varlen 8".

    ``key_mask`` counts the decoding steps served by the decoding kernels under the mask (``kvcache.with_key_mask``).
    """
    import lazytriton
    from lazytriton import kvcache
    from lazytriton.integrations import transformers as lt_transformers
    from lazytriton.integrations import transformers_varlen

    names = {(lazytriton, "attn_fwd"): "dense", (lazytriton, "flash_attn_varlen_func"): "varlen",
             (transformers_varlen, "checked_varlen_call"): "varlen",
             (lazytriton, "scaled_dot_product_attention"): "sdpa_mask",
             (lt_transformers, "decoding_step"): "decoding_step", (kvcache, "with_key_mask"): "key_mask"}
    counts: collections.Counter[str] = collections.Counter()
    saved = {where: getattr(*where) for where in names}

    def counted(where: tuple[Any, str]) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[names[where]] += 1
            return saved[where](*args, **kwargs)
        return call

    model.set_attn_implementation("lazytriton")
    try:
        for module, name in names:
            setattr(module, name, counted((module, name)))
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                           pad_token_id=PAD)
    finally:
        for (module, name), function in saved.items():
            setattr(module, name, function)
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))


def compare_tokens(ref: Any, got: Any, prompt_len: int, noise: float) -> tuple[int, int, list[str]]:
    """(tokens compared, tokens equal, divergences): a divergence at a tie (gap < noise) ends that row's comparison."""
    ref_tokens, got_tokens = ref.sequences[:, prompt_len:], got.sequences[:, prompt_len:]
    compared = equal = 0
    notes = []
    for row in range(ref_tokens.shape[0]):
        for step in range(ref_tokens.shape[1]):
            compared += 1
            if ref_tokens[row, step] == got_tokens[row, step]:
                equal += 1
                continue
            top2 = ref.scores[step][row].float().topk(2).values
            gap = float(top2[0] - top2[1])
            notes.append(f"row {row} step {step}: gap {gap:.4f} ({'tie' if gap < noise else 'NOT a tie'})")
            break
    return compared, equal, notes


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import transformers

    from lazytriton.integrations import transformers as lt_transformers

    lt_transformers.register()
    if args.key_mask_min_keys is not None:
        if args.key_mask_min_keys < 0:
            raise ValueError(f"--key-mask-min-keys must be >= 0, got {args.key_mask_min_keys}")
        lt_transformers.KEY_MASK_MIN_KEYS = args.key_mask_min_keys
    device = "cpu" if args.cpu_smoke or not torch.cuda.is_available() else "cuda"
    if args.cpu_smoke:
        args.batch, args.min_len, args.max_len, args.new_tokens, args.reps, args.prefill_rounds = 3, 3, 9, 4, 1, 1
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    floor = args.floor if args.floor is not None else (1e-4 if dtype == torch.float32 else 0.05)
    model, config = build_model(args, device, dtype)
    ids, mask = left_padded_batch(args, config.vocab_size, device)
    real = mask.bool()

    register_reference()
    long_prompt = ids.shape[1] >= LONG_PROMPT
    reference = logits_of(model, REFERENCE if long_prompt else "sdpa", ids, mask)  # float32 model: the reference
    model = model.to(dtype)
    errors = {impl: float((logits_of(model, impl, ids, mask) - reference)[real].abs().max())
              for impl in ("sdpa", "lazytriton")}
    logits_ok = errors["lazytriton"] <= 2 * errors["sdpa"] + floor

    launch_path = settle_helpers() if device == "cuda" else "interpreter"
    outs, tok_s, gc_meters = {}, {}, {}
    prefill_ms = timed_prefills(model, ("sdpa", "lazytriton"), ids, mask, args.prefill_rounds, device)
    for impl in ("sdpa", "lazytriton"):
        torch._dynamo.reset()  # a compiled step is the implementation's own
        generate(model, impl, ids, mask, args.new_tokens, device, args.cache)  # warmup (and compile)
        with GcMeter() as gc_meters[impl]:
            runs = [generate(model, impl, ids, mask, args.new_tokens, device, args.cache) for _ in range(args.reps)]
        outs[impl] = runs[0][0]
        tok_s[impl] = args.batch * args.new_tokens / statistics.median(t for _, t in runs)
    if args.profile:
        for impl in ("sdpa", "lazytriton"):
            profile_generate(model, impl, ids, mask, args, device)
    if args.profile_prefill and device == "cuda":
        for impl in ("sdpa", "lazytriton"):
            profile_prefill(model, impl, ids, mask, args.profile_prefill)
    if args.cprofile:
        for impl in ("sdpa", "lazytriton"):
            cprofile_generate(model, impl, ids, mask, args, device)
    path = lazytriton_calls(model, ids, mask)
    compared, equal, notes = compare_tokens(outs["sdpa"], outs["lazytriton"], ids.shape[1], 2 * errors["sdpa"] + floor)
    tokens_ok = all("NOT" not in n for n in notes)

    cfg = (f"llama h{config.hidden_size} heads {config.num_attention_heads}/{config.num_key_value_heads} "
           f"layers {config.num_hidden_layers} {str(dtype).removeprefix('torch.')} {args.cache} cache"
           f"{' compiled' if args.cache == 'static' else ''} prompts {args.min_len}-{args.max_len}"
           f"{'' if args.key_mask_min_keys is None else f' key mask from {args.key_mask_min_keys} keys'}")
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    common = {"time": stamp, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "config": cfg, "batch": args.batch}
    rows = [{**common, "impl": impl, "metric": metric, "value": f"{value:.6g}", "check": check}
            for impl in ("sdpa", "lazytriton")
            for metric, value, check in (("logits_max_err_vs_fp32", errors[impl], "ok" if logits_ok else "FAIL"),
                                         ("prefill_ms", prefill_ms[impl], ""), ("gen_tokens_per_s", tok_s[impl], ""),
                                         ("gc_ms_per_generate", gc_meters[impl].ms / args.reps, ""),
                                         ("gc_full_passes_per_generate", gc_meters[impl].passes[2] / args.reps, ""))]
    rows.append({**common, "impl": "lazytriton", "metric": "greedy_tokens_equal_of_compared",
                 "value": f"{equal}/{compared}", "check": "ok" if tokens_ok else "FAIL"})
    rows.append({**common, "impl": "lazytriton", "metric": "calls_prefill_and_one_step", "value": path, "check": ""})
    append_rows(args.csv, FIELDS, rows)

    print(f"{cfg}, batch {args.batch} left-padded, {args.new_tokens} new tokens, {device}")
    print(f"lazytriton calls in a prefill and one decoding step ({config.num_hidden_layers} layers): {path}")
    print(f"launch path: {launch_path}")
    for impl, meter in gc_meters.items():
        print(f"gc in {impl}'s timed generate calls: {meter.passes} passes by generation, "
              f"{meter.ms / args.reps:.1f} ms a call")
    for note in notes:
        print("  divergence:", note)
    print(f"{'impl':<12}{'logits err':>12}{'prefill ms':>12}{'tokens/s':>12}")
    for impl in ("sdpa", "lazytriton"):
        print(f"{impl:<12}{errors[impl]:>12.4g}{prefill_ms[impl]:>12.2f}{tok_s[impl]:>12.1f}")
    print(f"logits rule (<= 2x sdpa + {floor}): {'ok' if logits_ok else 'FAIL'}; greedy tokens equal {equal}/{compared}"
          f" ({'every divergence a tie' if tokens_ok else 'a divergence that is not a tie: FAIL'}); "
          f"tokens/s lazytriton/sdpa {tok_s['lazytriton'] / tok_s['sdpa']:.2f}x")
    return 0 if logits_ok and tokens_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
