"""Host time of a warm ``flash_attn_with_kvcache`` call on CPU with the fake driver (``profile_hot.py --kvcache``).

The batch-1 decoding step of bench_decode.py's rows (bf16, head dim 128, 32/8 heads, one query, a 4k cache) on CPU
tensors, through the CUDA path up to the driver: the runtime's plans hold the split, combine and kv_append
kernels loaded on a fake libcuda (tests/fake_libcuda.py, compiled with the system C compiler) whose
cuLaunchKernel only records its arguments, through the real ``CudaApi`` and ``LoadedKernel``; the SM count is
the H200's (132), so the split heuristic cuts the 4k keys in 32 splits and the combine runs, as on the GPU.
Each case is timed warm (``flash_decode.hot``'s warm path, made for CPU tensors) with its entry lookup and its tail
in C++ (``kernels/flash_decode/_hotpath.cpp``'s serve() and run(), when it and the launch helper are built:
``python -m lazytriton.kernels.flash_decode.hotpath_build``, ``python -m lazytriton.driver.fastlaunch_build``; else
nan; the stream from a Python function here, as a torch without the C stream getter has it), with the lookup in
Python and the C++ tail, with both in Python, and with the warm path off (``kvcache.serve``: the checks, then
``binding.forward``'s GPU launch). Thread CPU time (the machine is shared: its other threads' time is not ours),
the minimum over interleaved rounds of ``calls`` calls (``--rounds``, ``--calls``). Without the launch helper
every launch goes through cffi (~2.5 µs more a launch here).

The cases: a read with an int length, a read with a lengths tensor (its eager value check computes on the
device: one host synchronisation on a GPU), a decoding step (one new key appended, a lengths tensor), the same
step inside ``trusted_indices()`` (a serving loop's mode), the same trusted step on a paged cache (pages of 256
keys) and on a cache whose split count is 1 (``num_splits=1``: no combine).

``--transformers``: a transformers decoding step instead (``integrations.transformers.decoding_step``: its key
mask route, ``kvcache.with_key_mask``), at bench_transformers.py's shape: batch 8 left-padded (pads 0..448),
16/4 heads, head dim 128, bf16, one query against a dynamic cache of 576 keys ((batch, heads_k, kv_len, d),
read as views), beside ``with_key_mask`` alone and the unmasked ``flash_attn_with_kvcache`` read of that shape;
then, in one process with rounds interleaved, the step's two routes: the key mask (warm) and the bias path (the
SDPA drop-in with the mask as a bias: flash_fwd's general launch, its sm_90 variant compiled into
``LAZYTRITON_CACHE_DIR`` on the first call, ``cold_start.route_to_fake_driver``).
"""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import lazytriton
from lazytriton import launch, runtime
from lazytriton.kernels import get
from lazytriton.kernels.flash_decode import FLASH_DECODE_COMBINE, FLASH_DECODE_SPLIT, binding, checks
from lazytriton.kernels.kv_append import KV_APPEND
from lazytriton.kernels.kv_append import binding as append_binding

H200_SMS = 132
BLOCK_M, BLOCK_N = 16, 64  # the split kernel's tiles as a plan would carry them (the split count reads BLOCK_N)


class _Plans:
    def __init__(self) -> None:
        self.plans: dict[Any, Any] = {}


def fake_kernels(directory: Path) -> tuple[Any, dict[str, Any]]:
    """(fake, {kernel name: LoadedKernel}): the three decoding kernels' parameter layouts on the fake driver."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from fake_libcuda import Fake, build
    from test_driver import _entry

    from lazytriton.driver import gpu

    library = build(directory)
    if library is None:
        raise SystemExit("--kvcache needs a C compiler (cc) for the fake libcuda")
    fake, api, kernels = Fake(library), gpu.CudaApi(str(library)), {}
    sizes = []
    for spec in (FLASH_DECODE_SPLIT, FLASH_DECODE_COMBINE, KV_APPEND):
        arg_types = tuple(t for t in get(spec.name).signature("bf16").values() if t != "constexpr")
        kernels[spec.name] = api.load(_entry(arg_types), 0)
        sizes.append([4 if t in ("i32", "fp32") else 8 for t in arg_types])
    fake.configure(min(sizes, key=len))  # the fake reads this many parameters of every launch: the fewest
    return fake, kernels


def _gpu_append(t: checks.Inputs, call: checks.Call) -> None:
    """kv_append.binding.append's GPU branch on CPU tensors (its CPU branch runs the interpreter)."""
    if t.k is not None and call.seqlen_new:
        append_binding.launch_on_device(t, call, launch.raw_stream(-1))


@contextlib.contextmanager
def fake_gpu(kernels: dict[str, Any], plans: _Plans) -> Iterator[None]:
    """CPU tensors take the GPU path: the plans, the stream, the SM count and the launches swapped in."""
    saved = (runtime.get, launch.raw_stream, binding.gpu_slots, binding.run_interpreter, append_binding.append)
    runtime.get = lambda: plans  # type: ignore[assignment]
    launch.raw_stream = lambda device_index: 0  # type: ignore[assignment]
    binding.gpu_slots = lambda device_index, shared=0: H200_SMS * binding.PROGRAMS_PER_SM  # type: ignore[assignment]
    binding.run_interpreter = binding.launch_gpu  # type: ignore[assignment]
    append_binding.append = _gpu_append  # type: ignore[assignment]
    try:
        yield
    finally:
        (runtime.get, launch.raw_stream, binding.gpu_slots, binding.run_interpreter,  # type: ignore[assignment]
         append_binding.append) = saved


def memoise(plans: _Plans, kernels: dict[str, Any], **call: Any) -> None:
    """The plans the general path memoises for a call's shape, each alignment, as the fake kernels."""
    from lazytriton import kvcache

    t = kvcache.inputs(call["q"], call["k_cache"], call["v_cache"], call.get("k"), call.get("v"),
                       call.get("cache_seqlens"), None, call.get("block_table"))._replace(key_mask=call.get("key_mask"))
    c = checks.check(t, num_splits=call.get("num_splits", 0))
    out, _ = binding.empty_outputs(t.q, c)
    _, index64 = binding.layout_flags(t, out)
    for aligned in (True, False):
        plans.plans[binding.memo_key(t.q.device.index, t.q.dtype, c, aligned, index64)] = (
            kernels[FLASH_DECODE_SPLIT.name], BLOCK_M, BLOCK_N, kernels[FLASH_DECODE_COMBINE.name], 16)
        if t.k is not None:
            plans.plans[append_binding.memo_key(t.q.device.index, t.q.dtype, c, aligned, append_binding.layout_flags(
                t)[1])] = (kernels[KV_APPEND.name],)


def cases(batch: int = 1, heads: tuple[int, int] = (32, 8), head_dim: int = 128, keys: int = 4096
          ) -> dict[str, tuple[bool, dict[str, Any]]]:
    """(trusted, the call's arguments) of each case, fresh random tensors."""
    gen = torch.Generator().manual_seed(39)
    hq, hk = heads

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    q, k, v = randn(batch, 1, hq, head_dim), randn(batch, 1, hk, head_dim), randn(batch, 1, hk, head_dim)
    kc, vc = randn(batch, keys, hk, head_dim), randn(batch, keys, hk, head_dim)
    page = 256
    blocks = batch * keys // page
    kp, vp = randn(blocks, page, hk, head_dim), randn(blocks, page, hk, head_dim)
    table = torch.randperm(blocks, generator=gen).view(batch, -1).int()
    lens = torch.full((batch,), keys - 96, dtype=torch.int32)
    read = {"q": q, "k_cache": kc, "v_cache": vc}
    step = {**read, "k": k, "v": v, "cache_seqlens": lens}
    return {"read, int length": (False, {**read, "cache_seqlens": keys - 96}),
            "read, lengths tensor": (False, {**read, "cache_seqlens": lens}),
            "append + lengths tensor": (False, step),
            "trusted append + lengths": (True, step),
            "trusted append, paged 256": (True, {**step, "k_cache": kp, "v_cache": vp, "block_table": table}),
            "trusted append, 1 split": (True, {**step, "num_splits": 1})}


def transformers_cases(batch: int = 8, heads: tuple[int, int] = (16, 4), head_dim: int = 128, keys: int = 576
                       ) -> dict[str, tuple[bool, dict[str, Any]]]:
    """(trusted, arguments) of a transformers decoding step (``step``: decoding_step's) and its kernel calls."""
    gen = torch.Generator().manual_seed(39)
    hq, hk = heads

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    query, key, value = randn(batch, hq, 1, head_dim), *(randn(batch, hk, keys, head_dim) for _ in range(2))
    pads = torch.arange(0, 449, 448 // max(batch - 1, 1))[:batch]
    mask = (torch.arange(keys)[None, :] >= pads[:, None])[:, None, None, :]
    views = {"q": query.transpose(1, 2), "k_cache": key.transpose(1, 2), "v_cache": value.transpose(1, 2)}
    return {"transformers decoding_step, key mask": (False, {**views, "key_mask": mask[:, 0, 0],
                                                             "step": (query, key, value, mask)}),
            "kvcache.with_key_mask": (False, {**views, "key_mask": mask[:, 0, 0]}),
            "flash_attn_with_kvcache, no mask": (False, views)}


ROUTES = ("C++ front", "C++ tail", "Python tail", "off")


def rows(rounds: int = 7, calls: int = 300, made: dict[str, tuple[bool, dict[str, Any]]] | None = None,
         cpp: Any = None, light: bool = False) -> list[tuple[str, float, float, float, float]]:
    """(case, warm µs with the C++ front and tail, with the C++ tail, with neither, warm path off): thread CPU time.

    The minimum over interleaved rounds. ``cpp``: the C++ tail's module (None: ``hot.cpp_tail()``'s; False or none
    built: nan). ``light``: the fake's cuLaunchKernel only counts (the floor: our host cost alone, without the
    fake's record of each launch's parameters, ~2 µs a launch here).
    """
    hot = _warm_module()
    plans = _Plans()
    made = made or cases()
    with tempfile.TemporaryDirectory() as tmp, fake_gpu(*_loaded(Path(tmp), plans, made, light)):
        warm: dict[str, Any] = {}
        if hot:
            tail = hot.cpp_tail() if cpp is None else cpp
            for route, module, front in (("C++ front", tail, True), ("C++ tail", tail, False),
                                         ("Python tail", False, False)):
                if route == "Python tail" or module is not False:
                    warm[route] = hot.make(cuda=False, get_runtime=lambda: plans, raw_stream=lambda device_index: 0,
                                           cpp=module, front=front)
        saved = hot.serve if hot else None
        best: dict[tuple[str, str], float] = {}
        runs = [(name, route, trusted, _timed(args)) for name, (trusted, args) in made.items() for route in ROUTES
                if route == "off" or route in warm]
        try:
            for round_ in range(rounds + 1):  # round 0 warms up (plans, entries)
                for name, on, trusted, fn in runs:
                    if hot:
                        hot.serve = warm.get(on, _off)
                    with lazytriton.trusted_indices() if trusted else contextlib.nullcontext():
                        start = time.thread_time()
                        for _ in range(calls):
                            fn()
                    if round_:
                        spent = (time.thread_time() - start) / calls * 1e6
                        best[name, on] = min(best.get((name, on), math.inf), spent)
        finally:
            if hot:
                hot.serve = saved
    return [(name, *(best.get((name, route), math.nan) for route in ROUTES)) for name in made]


def _off(*args: Any) -> None:
    return None


def _warm_module() -> Any:
    try:
        from lazytriton.kernels.flash_decode import hot
    except ImportError:  # a tree without the warm path: the general path alone
        return None
    return hot


def _loaded(directory: Path, plans: _Plans, made: dict[str, tuple[bool, dict[str, Any]]], light: bool = False
            ) -> tuple[dict[str, Any], _Plans]:
    fake, kernels = fake_kernels(directory)
    fake.lib.fake_set_light(int(light))
    for _, args in made.values():
        memoise(plans, kernels, **{name: x for name, x in args.items() if name != "step"})
    return kernels, plans


def _timed(args: dict[str, Any]) -> Callable[[], object]:
    if "step" in args:
        from lazytriton.integrations import transformers as lt_transformers

        step, query, key, value, mask = lt_transformers.decoding_step, *args["step"]
        return lambda: step(query, key, value, mask, None, {})
    if "key_mask" in args:
        from lazytriton import kvcache

        masked = kvcache.with_key_mask
        return lambda: masked(**args)
    call = lazytriton.flash_attn_with_kvcache
    return lambda: call(**args)


def route_rows(rounds: int = 7, calls: int = 300) -> list[tuple[str, float]]:
    """(route, µs) of one transformers decoding step, key mask (warm) and bias path, interleaved rounds."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cold_start
    from fake_libcuda import build

    from lazytriton.integrations import transformers as lt_transformers
    from lazytriton.kernels.flash_decode import hot

    made = transformers_cases()
    query, key, value, mask = made["transformers decoding_step, key mask"][1]["step"]
    with tempfile.TemporaryDirectory() as tmp:
        cold_start.route_to_fake_driver(str(build(Path(tmp))), "sm_90", backward=False)
        rt = runtime.get()
        (Path(tmp) / "decode").mkdir()
        _, kernels = fake_kernels(Path(tmp) / "decode")
        for _, args in made.values():
            memoise(rt, kernels, **{name: x for name, x in args.items() if name != "step"})  # type: ignore[arg-type]
        binding.gpu_slots = lambda device_index, shared=0: H200_SMS * binding.PROGRAMS_PER_SM  # type: ignore[assignment]
        hot.serve = hot.make(cuda=False, get_runtime=runtime.get, raw_stream=lambda device_index: 0)
        step, saved = lt_transformers.decoding_step, lt_transformers.KEY_MASK_MIN_KEYS
        best: dict[str, float] = {}
        for round_ in range(rounds + 1):  # round 0: plans, entries, the bias path's compile
            for name, least in (("key mask (warm)", 0), ("bias path", 1 << 62)):
                lt_transformers.KEY_MASK_MIN_KEYS = least  # the route's switch: every step, or none
                start = time.thread_time()
                for _ in range(calls):
                    step(query, key, value, mask, None, {})
                if round_:
                    best[name] = min(best.get(name, math.inf), (time.thread_time() - start) / calls * 1e6)
        lt_transformers.KEY_MASK_MIN_KEYS = saved
    return list(best.items())


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transformers", action="store_true", help="a transformers decoding step's cases")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (the minimum is kept)")
    parser.add_argument("--calls", type=int, default=300, help="calls a round")
    parser.add_argument("--light", action="store_true", help="the fake launch only counts (our host cost alone)")
    args = parser.parse_args(argv)
    step = args.transformers
    results = rows(args.rounds, args.calls, made=transformers_cases() if step else None, light=args.light)
    shape = "b8 left-padded, 16/4 heads, hd128, 576 keys" if step else "b1, 32/8 heads, hd128, 4k keys"
    print(f"{'case (' + shape + ')':<52} {'front µs':>8} {'C++ µs':>8} {'Python µs':>9} {'off µs':>8}  (CPU tensors, "
          "fake driver; warm: lookup and tail in C++, C++ tail, Python)")
    for name, front, cpp, python, off in results:
        print(f"{name:<52} {front:8.1f} {cpp:8.1f} {python:9.1f} {off:8.1f}")
    if step:
        print("the step's two routes, one process, interleaved (bias path: flash_fwd on the fake driver)")
        for name, spent in route_rows(args.rounds, args.calls):
            print(f"  decoding_step, {name:<36} {spent:8.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
