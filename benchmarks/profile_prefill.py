"""Host time and device launches of a transformers prefill's attention, per layer, on CPU with the fake driver.

bench_transformers.py's prefill (random Llama, 16/4 heads, head dim 128, bf16, 8 left-padded prompts) loses to
"sdpa" by ~150 µs a layer on an H100. This measures, on CPU tensors, what each route of the "lazytriton"
attention function costs the host and how many device launches it makes, beside transformers' own
``sdpa_attention_forward``:

- the inputs are a layer's as Llama hands them over: q (batch, heads, q_len, d) a transposed view of
  (batch, q_len, heads, d) memory, k and v a DynamicCache's (batch, heads_k, kv_len, d), the boolean mask of
  ``create_causal_mask`` (the implementation's mask function);
- lazytriton's kernels run on the fake libcuda of the tests (``cold_start.route_to_fake_driver``: the CUDA path
  up to the driver, sm_90's variants compiled into a temporary cache dir on the first call; nothing launches);
- torch's ops run for real on the CPU, so the shapes are small by default (``--max-len 8``): the host's cost of
  an op is its dispatch, the data's size is the GPU's; the op sequence is the same at any size;
- sdpa: transformers' ``sdpa_attention_forward`` with torch's ``scaled_dot_product_attention`` replaced by an
  empty output of its shape (its own dispatch, ~10-20 µs on a GPU, is not counted; what transformers does around
  it is);
- ``device launches``: the aten ops that write memory (a kernel each on a GPU; views, shape reads and empty
  allocations excluded) under a dispatch mode, plus lazytriton's kernel launches on the fake driver.

Thread CPU time (the machine is shared; one intra-op thread), the minimum over interleaved rounds of ``--calls``
calls. Ops that touch memory also pay the CPU's page faults, which a GPU's caching allocator does not. The first
call of each route compiles its sm_90 variants (minutes on a busy 2-core machine): set ``LAZYTRITON_CACHE_DIR``
to keep them for the next run.

Usage: python3 benchmarks/profile_prefill.py [--batch 8] [--min-len 1 --max-len 8] [--rounds 7] [--calls 200]
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
# aten ops that launch nothing on a GPU: views, metadata, allocation without a fill.
_NO_LAUNCH = ("view", "_unsafe_view", "transpose", "t", "expand", "as_strided", "slice", "select", "unsqueeze",
              "squeeze", "permute", "alias", "detach", "_reshape_alias", "empty", "empty_like", "empty_strided",
              "new_empty", "new_empty_strided", "split", "unbind", "sym_size", "sym_stride", "sym_numel",
              "sym_storage_offset", "is_same_size", "lift_fresh", "reshape")


class Launches(TorchDispatchMode):
    """The aten ops a block runs that would launch a kernel on a GPU (those writing memory), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name not in _NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


class Module(torch.nn.Module):
    """What the attention functions read from a Llama attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = groups


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--min-len", type=int, default=1)
    p.add_argument("--max-len", type=int, default=8)
    p.add_argument("--heads", type=int, nargs=2, default=(16, 4), metavar=("Q", "K"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    return p.parse_args(argv)


def padding(args: argparse.Namespace) -> torch.Tensor:
    """bench_transformers.py's left-padded (batch, max_len) mask: lengths drawn the same way, the first full."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g).tolist()
    lengths[0] = args.max_len
    mask = torch.zeros((args.batch, args.max_len), dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, args.max_len - n:] = 1
    return mask


def layer_inputs(args: argparse.Namespace, q_len: int | None = None) -> tuple[torch.Tensor, ...]:
    """q, k, v as a Llama layer hands them over (bf16): q a transposed view, k and v a DynamicCache's tensors."""
    hq, hk = args.heads
    n = args.max_len if q_len is None else q_len
    q = torch.randn(args.batch, n, hq, args.head_dim, dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(args.batch, hk, args.max_len, args.head_dim, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v


def causal_mask(impl: str, pad: torch.Tensor, hidden: int = 64) -> Any:
    """``create_causal_mask``'s mask for ``impl`` (a prefill without a cache), as a Llama forward builds it."""
    import transformers
    from transformers.masking_utils import create_causal_mask

    config = transformers.LlamaConfig(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = impl
    batch, length = pad.shape
    embeds = torch.empty(batch, length, hidden, dtype=torch.bfloat16)
    positions = torch.arange(length)[None].expand(batch, length)
    return create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=pad, cache=None,
                              position_ids=positions)


def timed(cases: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """µs a call of each case: thread CPU time, the minimum over interleaved rounds (round 0 warms up)."""
    best: dict[str, float] = {}
    for round_ in range(rounds + 1):
        for name, case in cases.items():
            start = time.thread_time()
            for _ in range(calls if round_ else 2):
                case()
            if round_:
                best[name] = min(best.get(name, math.inf), (time.thread_time() - start) / calls * 1e6)
    return best


def launches(case: Callable[[], object]) -> tuple[int, int, str]:
    """(aten ops that launch, lazytriton kernel launches, the ops by name) of a warm call of ``case``."""
    from lazytriton.driver import gpu

    count = [0]
    launch = gpu.LoadedKernel.launch

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        count[0] += 1
        return launch(self, *a, **k)

    case()  # warm: what a forward makes once (plans, cu_seqlens) is not a layer's
    gpu.LoadedKernel.launch = counted  # type: ignore[method-assign]
    try:
        with Launches() as mode:
            case()
    finally:
        gpu.LoadedKernel.launch = launch  # type: ignore[method-assign]
    ops = ", ".join(f"{name} {n}" for name, n in sorted(mode.ops.items()))
    return sum(mode.ops.values()), count[0], ops


def cases(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    """Each route's per-layer call, the per-forward mask work, and the packed route's parts."""
    from transformers.integrations import sdpa_attention

    from lazytriton.integrations import transformers as lt_transformers
    from lazytriton.integrations import transformers_varlen as varlen
    from lazytriton.kernels.trust import trusted_indices

    hq, hk = args.heads
    module, scale = Module(hq // hk), args.head_dim ** -0.5
    pad = padding(args)
    q, k, v = layer_inputs(args)
    padded = causal_mask("lazytriton", pad)
    unpadded = causal_mask("lazytriton", torch.ones_like(pad))  # None: no padding
    full = torch.ones(args.batch, 1, args.max_len, args.max_len, dtype=torch.bool).tril()  # a mask, no padding
    attention = lt_transformers.attention_forward
    made: dict[str, Callable[[], object]] = {
        "mask function, sdpa (a forward)": lambda: causal_mask("sdpa", pad),
        "mask function, lazytriton (a forward)": lambda: causal_mask("lazytriton", pad),
        "mask analysis (a forward, one sync; a fresh mask)": lambda: varlen.layout(
            padded.clone(), args.batch, args.max_len, args.max_len, True),
    }
    found = varlen.layout(padded, args.batch, args.max_len, args.max_len, True)
    assert isinstance(found, varlen.Packed), found
    made["layer: lazytriton, padded (in place)"] = lambda: attention(module, q, k, v, padded, scaling=scale)
    gather = gather_route(found)
    made["layer: lazytriton, padded (gather route)"] = lambda: varlen.run_packed(gather, q, k, v, scale, {})
    made.update(packed_parts(gather, q, k, v, scale, trusted_indices))
    made["layer: lazytriton, no mask (attn_fwd)"] = lambda: attention(module, q, k, v, unpadded, scaling=scale)
    varlen.layout(full, args.batch, args.max_len, args.max_len, True)
    made["layer: lazytriton, mask without padding (dense)"] = lambda: attention(module, q, k, v, full,
                                                                                 scaling=scale)
    sdpa_mask = causal_mask("sdpa", pad)
    made["layer: sdpa, torch's sdpa a no-op"] = lambda: sdpa_attention.sdpa_attention_forward(
        module, q, k, v, sdpa_mask, scaling=scale)
    made["layer: sdpa, no mask, torch's sdpa a no-op"] = lambda: sdpa_attention.sdpa_attention_forward(
        module, q, k, v, None, scaling=scale)
    return made


def gather_route(found: Any) -> Any:
    """``found`` without its runs: the gather route's layout."""
    import dataclasses

    return dataclasses.replace(found, runs=None, made={})


def packed_parts(found: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 trusted: Any) -> dict[str, Callable[[], object]]:
    """The packed route's parts: the zeros, the three gathers, the varlen call, the scatter."""
    import lazytriton

    batch, heads, q_len = q.shape[:3]
    qp = q.transpose(1, 2)[found.q_index]
    kp, vp = k.transpose(1, 2)[found.k_index], v.transpose(1, 2)[found.k_index]
    out = q.new_zeros(batch, q_len, heads, v.shape[3])

    def call() -> object:
        with trusted():
            return lazytriton.flash_attn_varlen_func(qp, kp, vp, found.cu_seqlens_q, found.cu_seqlens_k,
                                                     found.max_seqlen_q, found.max_seqlen_k, softmax_scale=scale,
                                                     causal=found.causal, window_size=found.window)

    packed = call()
    return {"  packed: out zeros": lambda: q.new_zeros(batch, q_len, heads, v.shape[3]),
            "  packed: gather q": lambda: q.transpose(1, 2)[found.q_index],
            "  packed: gather k and v": lambda: (k.transpose(1, 2)[found.k_index], v.transpose(1, 2)[found.k_index]),
            "  packed: flash_attn_varlen_func (trusted)": call,
            "  packed: scatter": lambda: out.index_put_(found.q_index, packed)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
    import cold_start
    from fake_libcuda import build
    from transformers.integrations import sdpa_attention

    from lazytriton.integrations import transformers as lt_transformers

    lt_transformers.register()
    # One intra-op thread: on a shared machine a pool thread's spin at a barrier lands in this thread's CPU time.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("LAZYTRITON_CACHE_DIR", str(Path(tmp) / "cache"))  # a set one keeps its compiles
        library = build(Path(tmp))
        if library is None:
            raise SystemExit("needs a C compiler (cc) for the fake libcuda")
        cold_start.route_to_fake_driver(str(library), "sm_90", backward=False)
        from lazytriton.kernels.flash_fwd import varlen

        varlen.run_interpreter = varlen.launch_gpu  # the varlen call's CPU branch too
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def no_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return query.new_empty(*query.shape[:-1], value.shape[-1])

        sdpa_attention.torch.nn.functional.scaled_dot_product_attention = no_op  # type: ignore[assignment]
        try:
            made = cases(args)
            counts = {name: launches(case) for name, case in made.items()}
            best = timed(made, args.rounds, args.calls)
        finally:
            sdpa_attention.torch.nn.functional.scaled_dot_product_attention = sdpa  # type: ignore[assignment]
    hq, hk = args.heads
    print(f"batch {args.batch} left-padded {args.min_len}-{args.max_len}, {hq}/{hk} heads, hd{args.head_dim}, bf16; "
          "CPU tensors, lazytriton on the fake driver (sm_90)")
    print(f"{'case':<52}{'host µs':>9}{'aten':>6}{'kernels':>8}  ops that launch")
    for name, spent in best.items():
        ops, kernels, names = counts[name]
        print(f"{name:<52}{spent:9.1f}{ops:6d}{kernels:8d}  {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
