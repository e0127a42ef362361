"""The decoding call of ``bench_capi.py --kernel kvcache``: its shape, tensors, kernels and bare launches, and its
GPU run, lt_attn_kvcache's host time per call beside its bare launches and beside the Python call, in one process.

On a GPU (``gpu_kvcache``):

- builds liblazytriton.so (``lazytriton capi build`` into a temporary prefix, unless ``--prefix`` names a built
  one) and ``capi_decode_bench.c`` as a shared library against it, loads both (ctypes) and calls lt_init;
- allocates the call's tensors on device 0 (torch, bf16, ``SHAPE``: one new key appended, cache_seqlens a device
  tensor), with a contiguous and with a paged cache, and describes them in an lt_attn_kvcache_params (cffi, from
  the header);
- resolves the kernels the C plan launches (capi/embedded_kvcache.py's variants, loaded by lazytriton's runtime)
  and builds their bare launches from the binding's arguments (``kv_append.binding.ints``,
  ``flash_decode.binding.split_ints`` and ``combine_ints``: the orders capi/lt_kvcache.c passes), then checks that
  they write the call's out bit for bit;
- times on one stream: ``bare_launches`` and ``lt_attn_kvcache`` in C (capi_decode_bench.c, no Python in the timed
  span), and ``flash_attn_with_kvcache`` (time.perf_counter, as benchmarks/bench_host.py) as an eager call checks
  its index values (one host read a call) and inside ``trusted_indices()`` as a serving loop runs it: each over
  rounds of ``CALLS`` calls, few enough that no launch waits for the GPU, a synchronize between rounds outside the
  timed span.

The parts that need no GPU (the tensors, the variants, the bare launches' arguments, their ctypes table, the loops'
build) take a device or a library: ``--fake-driver`` builds its image from ``variants_on("meta", ...)``, and
tests/test_bench_capi_decode.py runs the rest on the CPU and the fake libcuda.
"""

from __future__ import annotations

import ctypes
import datetime as dt
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from csvlog import append_rows

HERE = Path(__file__).resolve().parent
SHAPE = (1, 32, 8, 128, 4096, 1, 256)  # batch, heads q, heads k, head dim, cache keys, new keys, page size (paged)
SHAPE_NAME = "b{} hq{} hk{} d{} cache{} new{}".format(*SHAPE[:6])  # the CSV's shape ("paged256" added for paged)
CALLS = 64  # calls a round: 3 launches each, far under the driver's launch queue (about 1000)
WARMUP = 200  # calls before the timed rounds (the first makes the plan)
LAYOUTS = ("contiguous", "paged")


class BenchLaunch(ctypes.Structure):
    """bench_launches.h's bench_launch: one launch of a kernel, its parameter array built once."""

    _fields_ = [("function", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint),
                ("shared", ctypes.c_uint), ("dependent", ctypes.c_int), ("params", ctypes.POINTER(ctypes.c_void_p))]


class Arguments(NamedTuple):
    """A kernel's launch as the call makes it: its variant, grid, pointer/integer and fp32 arguments."""

    variant: Any
    grid: tuple[int, int, int]
    ints: tuple[int, ...]
    floats: tuple[float, ...]


class Loaded(NamedTuple):
    """What cuLaunchKernel needs of a loaded kernel beside its arguments."""

    function: int
    block: int
    shared: int
    dependent: bool
    hidden: int


def decode_tensors(shape: Sequence[int], paged: bool, device: str) -> dict[str, Any]:
    """The call's tensors (bf16; cache_seqlens half the cache, int32): q, the caches, new k and v, out, lse."""
    import torch

    def bf16(*size: int) -> Any:
        return torch.randn(*size, dtype=torch.bfloat16, device=device)

    b, hq, hk, d, keys, new, page = shape
    tensors: dict[str, Any] = {"q": bf16(b, 1, hq, d)}
    if paged:
        blocks = b * keys // page
        tensors["k_cache"] = bf16(blocks, page, hk, d)
        tensors["block_table"] = torch.arange(blocks, dtype=torch.int32, device=device).reshape(b, keys // page)
    else:
        tensors["k_cache"] = bf16(b, keys, hk, d)
    tensors["v_cache"] = torch.randn_like(tensors["k_cache"])
    tensors["k"], tensors["v"] = bf16(b, new, hk, d), bf16(b, new, hk, d)
    tensors["cache_seqlens"] = torch.full((b,), keys // 2, dtype=torch.int32, device=device)
    tensors["out"] = torch.empty(b, 1, hq, d, dtype=torch.bfloat16, device=device)
    tensors["lse"] = torch.empty(b, hq, 1, dtype=torch.float32, device=device)
    return tensors


def checked_call(tensors: dict[str, Any]) -> tuple[Any, Any]:
    """(Inputs, Call) of the tensors' call, as flash_attn_with_kvcache checks it."""
    from lazytriton.kernels.flash_decode import checks

    t = checks.Inputs(tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors.get("k"), tensors.get("v"),
                      tensors["cache_seqlens"], block_table=tensors.get("block_table"))
    return t, checks.check(t)


def plan_variants(t: Any, call: Any, out: Any, capability: int) -> list[Any]:
    """The kernels' variants the C plan loads, as it chooses them: kv_append's (with new keys), then the split
    kernel's and the combine kernel's."""
    from lazytriton.capi import embedded_kvcache
    from lazytriton.kernels.flash_decode import binding
    from lazytriton.kernels.kv_append import binding as append_binding

    aligned, index64 = binding.layout_flags(t, out)
    split, combine = embedded_kvcache.plan_variants(capability, 2, call.head_dim, call.causal, aligned, index64,
                                                    call.rows, call.capacity, call.page_size, False, False, False,
                                                    call.value_dim)
    if call.seqlen_new == 0:
        return [split, combine]
    append_aligned, append_index64 = append_binding.layout_flags(t)
    return [embedded_kvcache.append_variant(capability, 2, call.head_dim, call.value_dim, call.paged,
                                            append_aligned, append_index64), split, combine]


def variants_on(device: str, paged: bool, capability: int) -> list[Any]:
    """``plan_variants`` of SHAPE's call with its tensors on ``device`` (meta: no memory; the fake driver's image)."""
    tensors = decode_tensors(SHAPE, paged, device)
    t, call = checked_call(tensors)
    return plan_variants(t, call, tensors["out"], capability)


def bare_arguments(t: Any, call: Any, out: Any, lse: Any, workspace: Any, variants: Sequence[Any],
                   slots: int) -> list[Arguments]:
    """The call's launches (pure): kv_append where it has new keys, the split kernel, the combine kernel where it
    splits the keys. ``variants``: ``plan_variants``'.

    The workspace as capi/lt_kvcache.c lays it out: the partial outputs from its start, then their lse;
    ``slots``: the split programs the GPU runs at once (``binding.gpu_slots``).
    """
    from lazytriton.kernels import kv_append
    from lazytriton.kernels.flash_decode import binding, combine_grid, split_grid
    from lazytriton.kernels.kv_append import binding as append_binding

    split, combine = variants[-2:]
    block_m, block_n = int(split.get("BLOCK_M")), int(split.get("BLOCK_N"))
    splits = binding.splits_for(call, block_m, block_n, slots, binding.min_split_keys(call.head_dim))
    launches = []
    if call.seqlen_new > 0:
        append = variants[0]
        grid = kv_append.grid(call.seqlen_new, call.heads_k, call.batch, int(append.get("BLOCK_M")))
        launches.append(Arguments(append, grid, append_binding.ints(t, call), ()))
    rows = call.lse_rows * splits
    part_out = workspace[:rows * call.value_dim] if splits > 1 else lse
    part_lse = workspace[rows * call.value_dim:rows * (call.value_dim + 1)] if splits > 1 else lse
    launches.append(Arguments(split, split_grid(call.rows, block_m, splits, call.heads_k, call.batch, call.packed_rows),
                              binding.split_ints(t, out, lse, part_out, part_lse, call, splits),
                              binding.floats(call)))
    if splits > 1:
        launches.append(Arguments(combine, combine_grid(call.lse_rows, int(combine.get("BLOCK_M"))),
                                  binding.combine_ints(part_out, part_lse, out, lse, call, splits), ()))
    return launches


def launch_table(launches: Sequence[tuple[Loaded, Arguments]]) -> tuple[Any, list[Any]]:
    """A ctypes array of BenchLaunch, each parameter array built once (pointers to int64 integers, fp32 floats and
    zero hidden arguments, as capi/lt_kvcache.c passes them), and the buffers it points into (keep them)."""
    table = (BenchLaunch * len(launches))()
    keep: list[Any] = []
    for row, (kernel, args) in zip(table, launches, strict=True):
        ints = (ctypes.c_int64 * (len(args.ints) + kernel.hidden))(*args.ints)
        floats = (ctypes.c_float * max(len(args.floats), 1))(*args.floats)
        n_ints, n_floats = len(args.ints), len(args.floats)
        params = (ctypes.c_void_p * (n_ints + n_floats + kernel.hidden))()
        for i in range(n_ints):
            params[i] = ctypes.addressof(ints) + 8 * i
        for i in range(n_floats):
            params[n_ints + i] = ctypes.addressof(floats) + 4 * i
        for h in range(kernel.hidden):
            params[n_ints + n_floats + h] = ctypes.addressof(ints) + 8 * (n_ints + h)  # zero: NULL scratch
        row.function, row.grid[:], row.block, row.shared = kernel.function, args.grid, kernel.block, kernel.shared
        row.dependent = int(kernel.dependent)
        row.params = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        keep += [ints, floats, params]
    return table, keep


def compile_loops(header_dir: Path, library: Path, out: Path) -> Path:
    """capi_decode_bench.c as a shared library linked to ``library`` (liblazytriton.so or liblazytriton_native.so),
    against ``header_dir``'s lazytriton.h."""
    from lazytriton.capi import native_build

    subprocess.run([native_build.compiler(), "-O2", "-std=c99", "-D_POSIX_C_SOURCE=200809L", "-shared", "-fPIC",
                    f"-I{header_dir}", "-o", str(out), str(HERE / "capi_decode_bench.c"), f"-L{library.parent}",
                    f"-Wl,-rpath,{library.parent}", "-l:" + library.name, "-ldl"], check=True)
    return out


class CApi:
    """liblazytriton (ctypes) and the loops library, with cffi's layout of the header's structs."""

    def __init__(self, library: Path, loops: Path, header: Path) -> None:
        from cffi import FFI

        from lazytriton.capi import build

        self.lib = ctypes.CDLL(str(library))
        self.lib.lt_last_error.restype = ctypes.c_char_p
        self.loops = ctypes.CDLL(str(loops))
        self.ffi = FFI()
        self.ffi.cdef(build.header_cdef(header.read_text()))
        if self.loops.decode_bench_open() != 0:
            raise SystemExit("capi_decode_bench: libcuda.so.1 lacks cuLaunchKernel or cuCtxSynchronize")

    def address(self, cdata: Any) -> ctypes.c_void_p:
        return ctypes.c_void_p(int(self.ffi.cast("uintptr_t", cdata)))

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise SystemExit(f"{what} failed: status {status} ({(self.lib.lt_last_error() or b'').decode()})")

    def params(self, tensors: dict[str, Any], workspace_device: Any) -> tuple[Any, Any]:
        """lt_attn_kvcache_params describing ``tensors`` as device 0's memory (device_type CUDA), and its workspace:
        fp32, as lt_attn_kvcache_workspace_size asks, on ``workspace_device``."""
        import torch

        codes = {torch.bfloat16: 2, torch.float32: 3, torch.int32: 4}
        p = self.ffi.new("lt_attn_kvcache_params *")
        self.check(self.lib.lt_attn_kvcache_params_init(self.address(p)), "lt_attn_kvcache_params_init")

        def describe(view: Any, t: Any) -> None:
            view.data = self.ffi.cast("void *", t.data_ptr())
            view.dtype, view.ndim, view.device_type, view.device_index = codes[t.dtype], t.dim(), 2, 0
            for i in range(t.dim()):
                view.sizes[i], view.strides[i] = t.shape[i], t.stride(i)

        for name, t in tensors.items():
            describe(getattr(p, name), t)
        size = ctypes.c_size_t(0)
        self.check(self.lib.lt_attn_kvcache_workspace_size(self.address(p), ctypes.byref(size)),
                   "lt_attn_kvcache_workspace_size")
        workspace = torch.empty(max(size.value // 4, 1), dtype=torch.float32, device=workspace_device)
        describe(p.workspace, workspace)
        return p, workspace

    def time(self, provider: int, table: Any, p: Any, stream: int, rounds: int) -> tuple[float, float, float]:
        """(p50, mean, min) µs a call: the bare launches (provider 0) or lt_attn_kvcache (1), in C."""
        out = (ctypes.c_double * 3)()
        status = self.loops.decode_bench_time(provider, table, len(table), self.address(p), ctypes.c_void_p(stream),
                                              rounds, CALLS, WARMUP, out)
        self.check(status, "bare launches" if provider == 0 else "lt_attn_kvcache")
        return out[0], out[1], out[2]


def python_host_us(call: Callable[[], Any], synchronize: Callable[[], Any], rounds: int,
                   calls: int = CALLS) -> tuple[float, float, float]:
    """(p50, mean, min) µs of ``call``'s host time: rounds of ``calls`` calls, synchronized outside the timed span."""
    times = []
    for _ in range(rounds):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    synchronize()
    return statistics.median(times), statistics.fmean(times), min(times)


def _loaded(api: CApi, variant: Any) -> Loaded:
    """``variant`` resolved and loaded on device 0 by lazytriton's runtime (compiled into the cache if need be)."""
    from lazytriton import runtime

    kernel = runtime.get().kernel(variant, 0)
    return Loaded(int(api.ffi.cast("uintptr_t", kernel.function)), kernel.block, kernel.shared,
                  bool(kernel.dependent), len(kernel.entry.hidden_args))


def _checked_against_the_call(api: CApi, p: Any, table: Any, out: Any, stream: Any) -> str:
    """One lt_attn_kvcache, then the bare launches into a zeroed out: whether they wrote the same out."""
    import torch

    api.check(api.lib.lt_attn_kvcache(api.address(p), ctypes.c_void_p(stream.cuda_stream)), "lt_attn_kvcache")
    torch.cuda.synchronize()
    by_call = out.clone()
    out.zero_()
    api.check(api.loops.decode_bench_launch(table, len(table), ctypes.c_void_p(stream.cuda_stream)),
              "the bare launches")
    torch.cuda.synchronize()
    if torch.equal(by_call, out):
        return "equals lt_attn_kvcache's"
    return f"DIFFERS from lt_attn_kvcache's (max difference {float((by_call.float() - out.float()).abs().max())})"


def _layout(api: CApi, shape: Sequence[int], paged: bool, stream: Any,
            rounds: int) -> dict[str, tuple[float, float, float]]:
    """One layout's three providers on ``stream``; the bare launches checked against the call first."""
    import torch

    import lazytriton
    from lazytriton.kernels.flash_decode import binding
    from lazytriton.kvcache import trusted_indices

    tensors = decode_tensors(shape, paged, "cuda")
    p, workspace = api.params(tensors, "cuda")
    t, call = checked_call(tensors)
    major, minor = torch.cuda.get_device_capability(0)
    variants = plan_variants(t, call, tensors["out"], 10 * major + minor)
    loaded = {v.key(): _loaded(api, v) for v in variants}
    arguments = bare_arguments(t, call, tensors["out"], tensors["lse"], workspace, variants,
                               binding.gpu_slots(0, loaded[variants[-2].key()].shared))
    table, keep = launch_table([(loaded[a.variant.key()], a) for a in arguments])
    kv = (tensors["q"], tensors["k_cache"], tensors["v_cache"], tensors["k"], tensors["v"])
    options = {"cache_seqlens": tensors["cache_seqlens"], "block_table": tensors.get("block_table")}
    with torch.cuda.stream(stream):
        said = _checked_against_the_call(api, p, table, tensors["out"], stream)
        print(f"{'paged' if paged else 'contiguous'}: {len(arguments)} bare launches "
              f"({', '.join(a.variant.kernel for a in arguments)}); their out {said}")
        found = {"bare_launches": api.time(0, table, p, stream.cuda_stream, rounds),
                 "lt_attn_kvcache": api.time(1, table, p, stream.cuda_stream, rounds),
                 "flash_attn_with_kvcache": python_host_us(lambda: lazytriton.flash_attn_with_kvcache(*kv, **options),
                                                           torch.cuda.synchronize, rounds)}
        with trusted_indices():  # as a serving loop calls it: the index values not read back
            found["flash_attn_with_kvcache_trusted"] = python_host_us(
                lambda: lazytriton.flash_attn_with_kvcache(*kv, **options), torch.cuda.synchronize, rounds)
    del keep
    return found


def gpu_kvcache(prefix: Path | None, csv: Path, rounds: int, fields: Sequence[str], target_us: float) -> int:
    """``--kernel kvcache`` on device 0: a table, a target line, rows to ``csv``."""
    import torch

    import lazytriton
    from lazytriton.capi import build

    with tempfile.TemporaryDirectory(prefix="lazytriton-bench-capi-decode-") as tmp:
        work = Path(tmp)
        prefix = prefix or build.build(work / "prefix").prefix
        library = prefix / "lib" / build.LIBRARY
        loops = compile_loops(prefix / "include", library, work / "libcapi_decode_bench.so")
        api = CApi(library, loops, prefix / "include" / "lazytriton.h")
        api.check(api.lib.lt_init(None), "lt_init")
        stream = torch.cuda.Stream()
        found = {layout: _layout(api, SHAPE, layout == "paged", stream, rounds) for layout in LAYOUTS}
    gpu_name = torch.cuda.get_device_name(0)
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    print(f"\nhost time per call, bf16 {SHAPE_NAME}, cache_seqlens on the device, {gpu_name}; {rounds} rounds of "
          f"{CALLS} calls")
    print(f"{'layout':<12}{'provider':<26}{'p50 µs':>10}{'mean µs':>10}{'min µs':>10}")
    rows = []
    for layout, providers in found.items():
        for provider, (p50, mean, low) in providers.items():
            print(f"{layout:<12}{provider:<26}{p50:>10.2f}{mean:>10.2f}{low:>10.2f}")
            rows.append({"kernel": "flash_decode", "provider": provider + ("_paged" if layout == "paged" else ""),
                         "mode": "host_per_call", "dtype": "bf16",
                         "shape": SHAPE_NAME + (f" paged{SHAPE[-1]}" if layout == "paged" else ""),
                         "p50_us": f"{p50:.3f}", "mean_us": f"{mean:.3f}", "min_us": f"{low:.3f}",
                         "target_us": target_us if provider == "lt_attn_kvcache" else "", "gpu": gpu_name,
                         "lazytriton": lazytriton.__version__, "timestamp": stamp})
    for layout, providers in found.items():
        over = providers["lt_attn_kvcache"][0] - providers["bare_launches"][0]
        python = providers["flash_attn_with_kvcache"][0] / providers["lt_attn_kvcache"][0]
        trusted = providers["flash_attn_with_kvcache_trusted"][0] / providers["lt_attn_kvcache"][0]
        print(f"{layout}: lt_attn_kvcache over its bare launches {over:.2f} µs "
              f"({'within' if over <= target_us else 'OVER'} the {target_us} µs target); "
              f"flash_attn_with_kvcache {python:.1f}x lt_attn_kvcache (its index values checked: one host read), "
              f"{trusted:.1f}x inside trusted_indices()")
    append_rows(csv, fields, rows)
    print(f"rows appended to {csv}")
    return 0
