"""flash_fwd's warm path: one generated function per layout and result, from the binding's description.

A warm eager call (GPU tensors, a shape bucket whose plan is memoised, the
common arguments) is served here in one Python frame. Everything the tensors'
sizes and strides decide (the checks, the constant parameters written out
from ``binding.PARAM_SOURCES`` in ``FLASH_FWD.params`` order, index64, the
memo keys: dispatch's buckets, as ``binding.memo_key``) is worked out once per
(sizes, strides, dtype, device, causal, scale) by a generated ``describe``
and kept in an entry; a call then reads those, looks the entry up, allocates
its outputs, reads the pointers (their alignment picks the aligned or
unaligned plan) and launches. Anything else (a first call, CPU or meta
tensors, an unusual argument, bad input, inputs that require grad) returns
None, and the caller takes the general path (``binding.check`` then
``binding.forward``), which raises the errors and fills the memo.
tests/test_hot.py checks both paths agree on every field (on CPU with the
generated text itself, on a GPU end to end).

Its callers send only calls without a sliding window or softcap here: the
window parameters are written in as constants (-1, -1; softcap 0.0) and the
memo key is the plain call's (``binding.memo_key`` lengthens it for the
others), so a windowed or capped plan is never served from here.

``gqa=False`` (the SDPA drop-in without ``enable_gqa``) serves only calls
whose key/value heads equal the query's or are 1 (torch broadcasts those);
others take the general path, which raises torch's error.

``bshd`` takes FlashAttention's (batch, seqlen, heads, head_dim) tensors and
reads their strides in the kernel's order, so no transposed view is made.

``forward_*`` return ``(out, lse)``; ``output_*`` return ``out`` alone, for
callers that drop lse (the SDPA drop-in, ``flash_attn_func`` without
``return_attn_probs``). Those skip lse's allocation (3.0 µs of a 19.7 µs
call on the H200 host): the kernel writes lse into a per-device spare buffer
that nobody reads (``spare_lse``), which only grows and is never freed, so a
CUDA graph that captured its address stays valid.

An entry holds no device memory (its lse template is on the host:
``lse_template``), so describing a shape inside a CUDA graph capture leaves
nothing in the graph's private pool. What is kept across calls on the device
(the spare buffer, the lse stocks) is never allocated during a capture: a
captured call gets a temporary instead, freed with the call's other
temporaries. Only eager calls reach this module: the torch ops that
torch.compile's graphs call (and cudagraph trees warm up and record) take
``binding.forward``.

The launch goes through the compiled helper (``LoadedKernel.fast``,
lazytriton/driver/fastlaunch.py) when it is built, else ``LoadedKernel.launch``.
When the C++ tail is built for the running torch too (lazytriton/driver/
hotpath.py: in the package folder, or in the cache dir by the background
build of a process before this one, lazytriton/driver/helpers.py), the
generated text hands it everything after the entry lookup (``run_cpp``:
allocations, pointers, plan choice, launch; from the entry's
``cpp_record``); the Python tail stays for what it declines.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import struct
import threading
from typing import Any

import torch

from lazytriton import geometry, launch, runtime
from lazytriton.driver import fastlaunch
from lazytriton.kernels.flash_fwd import FLASH_FWD, binding, hotpath, hotpath_record
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch

# Per call: the checks that need no arithmetic, one lookup of everything the tensors' sizes and strides
# decide (``describe``'s entry), the allocations, the pointers and the launch.
_TEMPLATE = """
def {name}(q, k, v, causal, scale, gqa=True):
    {front}if not ({device_check}) or q.requires_grad or k.requires_grad or v.requires_grad:
        return None
    dtype = q.dtype
    di = q.get_device()
    if dtype not in DTYPES:  # float8 too (its own warm path: fp8_hot), before any lookup
        return None
    if k.dtype is not dtype or v.dtype is not dtype or k.get_device() != di or v.get_device() != di:
        return None
    if not (causal is False or causal is True or type(causal) is str) or not (scale is None or type(scale) is float):
        return None
    plans = get_runtime().plans
    call = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), dtype, di, causal, scale, gqa is True)
    known = SHAPES.get(call)
    {lookup}
    {lse}
    {pointers}
    if known[strides_aligned] and not ({pointer_or}) & 15:
        launch = known[launch_aligned] or plan_of(known, launch_aligned)
    else:
        launch = known[launch_unaligned] or plan_of(known, launch_unaligned)
    if launch is None:
        return None
    kernel, grid = launch
    tails = known[tails]
    ints = {ints}
    fast = kernel.fast
    if fast is None:
        kernel.launch(grid, stream, ints, known[floats], scratch_alloc)
    else:
        status = fast(grid[0], grid[1], grid[2], stream, ints, known[floats])
        if status:
            kernel.fail(status, grid)
    return {result}
"""

# The entry ``describe`` makes once per (sizes, strides, dtype, device, causal, scale, gqa), read on every call: its
# fields in order, each with the expression describe fills it with. This is the one place that orders them: the
# templates name a field (``known[floats]``), written out as its index when the text is generated (``indexed``),
# and ``cpp_record`` and ``plan_of`` take the indices from ``FIELD``.
ENTRY: dict[str, str] = {
    "plans": "plans",  # the runtime's plans when the entry was made: a cleared runtime makes the entry again
    "lse_stocks": "lse_stocks(template)",  # forward_* with a small lse: lse tensors made ahead; else None
    "lse_numel": "b * hq * sq",
    "floats": "({floats},)",  # the kernel's float parameters
    "tails": "({tails},)",  # the constant runs of its int parameters (binding.PLAIN_INTS_SOURCE's order)
    "strides_aligned": "strides_aligned",  # the alignment rule's part the strides decide
    "dims": "(sq, hq, b)",
    "launch_aligned": "None",  # (kernel, grid) for 16-byte aligned pointers, once its plan is memoised
    "launch_unaligned": "None",  # and for the others
    "key_aligned": "",  # binding.memo_key's, for aligned pointers (_key_source, from binding.PLAIN_KEY)
    "key_unaligned": "",  # and for the others
    "lse_template": "template",  # forward_*: the lse an allocation copies, on the host; None for output_*
    "device": "device_of(di)",  # the tensors' device: where a forward's lse and its stocks are allocated
    "cpp_record": "None",  # the C++ tail's record (``cpp_record``); None: not made yet, False: not used here
}
# describe's names of binding.PLAIN_KEY's fields (aligned is a constant of each key).
_KEY_NAMES = {"device_index": "di", "dtype": "dtype", "head_dim": "d", "causal": "is_causal", "index64": "index64",
              "bucket_q": "bucket_q", "bucket_k": "bucket_k"}


def _key_source(aligned: bool) -> str:
    """The expression in describe of ``binding.memo_key``'s key for a plain call with ``aligned`` pointers."""
    fields = (str(aligned) if name == "aligned" else _KEY_NAMES[name] for name in binding.PLAIN_KEY)
    return f"({', '.join(fields)}) + tail"


ENTRY.update(key_aligned=_key_source(True), key_unaligned=_key_source(False))
FIELD = {name: index for index, name in enumerate(ENTRY)}
_KEY_AFTER_LAUNCH = FIELD["key_aligned"] - FIELD["launch_aligned"]  # each launch's memo key, as far on
assert _KEY_AFTER_LAUNCH == FIELD["key_unaligned"] - FIELD["launch_unaligned"]
# The regular expressions here are compiled on first use (``re``'s own cache): generating a warm path needs them,
# importing this module does not.
_FIELD_NAME = r"known\[([a-z_]+)\]|plan_of\(known, ([a-z_]+)\)"


def indexed(text: str) -> str:
    """``text`` with each entry field it names (``known[floats]``, ``plan_of(known, launch_aligned)``) as its index."""
    def index(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return match.group(0).replace(name, str(FIELD[name]))

    return re.sub(_FIELD_NAME, index, text)


_DESCRIBE = """
def describe(qshape, kshape, vshape, qs, ks, vs, dtype, di, causal, scale, gqa, os, plans):
    if dtype not in DTYPES or len(qshape) != 4 or len(kshape) != 4 or vshape != kshape:
        return None
    {unpack}
    if (bk != b or dk != d or not 1 < d <= MAX_HEAD_DIM or not 0 < hk <= hq or hq % hk or not 0 < sq <= INT32_MAX
            or not 0 < sk <= INT32_MAX or not 0 < b <= MAX_GRID_YZ or hq > MAX_GRID_YZ):
        return None
    if qs[3] != 1 or ks[3] != 1 or vs[3] != 1 or not (gqa or hk == hq or hk == 1):
        return None
    {permute_in}
    {permute_out}
    dim_v = d  # vshape == kshape: v's head dim is q's
    if causal is False:
        is_causal = False
        offset = 0
    elif causal is True:
        is_causal = True
        offset = 0
    elif causal == "top_left" or causal == "bottom_right":
        is_causal = True
        offset = sk - sq if causal == "bottom_right" else 0
    else:
        return None
    if scale is None:
        scale = INV_SQRT[d]
    elif not -INF < scale < INF:
        return None
    {zero_pointers}
    index64 = {index64}
    # binding.memo_key's key; (n - 1).bit_length() is tuning.bucket_index(n) for n >= 1 (tests/test_hot.py).
    bucket_q = (sq - 1).bit_length()
    bucket_k = (sk - 1).bit_length()
    # binding.memo_key's gluon_tail: this shape fits dispatch's flash_fwd_gluon row (its tiles divide it).
    tail = gluon_tail(gluon_q_tiles(DTYPES[dtype], d, is_causal, offset, scale, sq, sk))
    strides_aligned = {aligned}
    template = lse_template(b, hq, sq)
    entry = [{entry}]
    if len(SHAPES) >= MAX_SHAPES:
        SHAPES.clear()
    SHAPES[(qshape, kshape, vshape, qs_in, ks_in, vs_in, dtype, di, causal_in, scale_in, gqa)] = entry
    return entry
"""

# The entry lookup of the Python tail (its out gives describe out's strides) and of the C++ one (``run_cpp``: it
# allocates out and lse itself; None when its plan is not memoised yet: the Python tail goes on).
_LOOKUP = """out = empty_like(q)
    if known is None or known[plans] is not plans:
        known = describe(*call, out.stride(), plans)
        if known is None:
            return None"""
_LOOKUP_CPP = """if known is None or known[plans] is not plans:
        known = describe(*call, empty_like(q).stride(), plans)
        if known is None:
            return None
    record = known[cpp_record]
    if record is None:
        record = cpp_record(known)
    if record:
        {remember}{lse}
        done = run_cpp(q, k, v, stream, lse_ptr, record)
        if done is not None:
            return done
        known[cpp_record] = None  # a plan not memoised yet: the record is made again once it is
    out = empty_like(q)"""
# The entry lookup in C++ (``serve``, with a module that reads the stream itself and allocates a forward's lse):
# the keys of ``describe``'s entries read from the TensorImpls, the record found in TABLE (``remember`` files it on
# the Python path, each time that path reaches the C++ tail) and run_cpp's tail; None: the Python path below.
_FRONT = """done = serve(q, k, v, causal, scale, gqa, TABLE, get_runtime().plans, SPARE, CUDA)
    if done is not None:
        return done
    """
_REMEMBER = "remember(q, k, v, causal, scale, gqa, TABLE, plans, record, known[lse_numel], MAX_SHAPES)\n        "
# The forward's lse for run_cpp: its stocks (run_cpp pops one, see lse_stocks), or None: run_cpp allocates it (a
# large lse; a capture's comes from the graph's pool). CPP_LSE_STOCKS False: run_cpp always allocates (at::empty).
# Measured (H200 host, bench_host, 12-01): attn_fwd's cost over flash_attn_func's in the same group 1.71 µs with
# stocks, 1.24 with at::empty; on CPU (profile_hot --cpu-fake) 6.53 against 6.17 µs. A stock's views cost about
# what at::empty costs in C++ (in Python, an allocation costs more than a view: the Python tail keeps its stocks).
# bench_host times both in one group ("hot.forward_bhsd, lse stocked" / "lse allocated").
CPP_LSE_STOCKS = False
_LSE_CPP = {"forward": "stream = raw_stream(di)\n    lse_ptr = None if stream and (current_device() != di or "
                       "is_capturing()) else known[lse_stocks]",
            "forward_allocated": "stream = raw_stream(di)\n    lse_ptr = None  # run_cpp allocates lse",
            "output": None}
# With a module that reads the current stream itself (STREAM_INSIDE): no raw_stream call before run_cpp. The Python
# tail, when run_cpp declines, reads it again (its own _LSE text).
_LSE_CPP_INSIDE = {
    "forward_allocated": "stream = None  # run_cpp reads the current stream\n    lse_ptr = None  # and allocates lse",
    "output": ("stream = None  # run_cpp reads the current stream\n"
               "    spare = SPARE.get(di)\n"
               "    if spare is None or spare[0] < known[lse_numel]:\n"
               "        lse = spare_lse(di, known[lse_numel])  # alive in this frame until after the launch\n"
               "        lse_ptr = lse.data_ptr()\n"
               "    else:\n"
               "        lse_ptr = spare[1]")}

_LAYOUTS = {
    "bhsd": ("b, hq, sq, d = qshape\n    bk, hk, sk, dk = kshape", "", ""),
    "bshd": ("b, sq, hq, d = qshape\n    bk, sk, hk, dk = kshape",
             "qs = (qs[0], qs[2], qs[1])\n    ks = (ks[0], ks[2], ks[1])\n    vs = (vs[0], vs[2], vs[1])",
             "os = (os[0], os[2], os[1])"),
}
_LSE = {
    "forward": ("stream = raw_stream(di)\n"
                "    stocks = known[lse_stocks]  # see lse_stocks\n"
                "    if stocks is None or (stream and (current_device() != di or is_capturing())):  # see lse_stocks\n"
                "        lse = empty_like(known[lse_template], device=known[device])  # see lse_template\n"
                "    else:\n"
                "        try:\n"
                "            lse = stocks[stream].pop()\n"
                "        except (KeyError, IndexError):\n"
                "            lse = restock(stocks, known[lse_template], known[device], stream)\n"
                "    lse_ptr = lse.data_ptr()",
                "out, lse"),
    "output": ("stream = raw_stream(di)\n"
               "    spare = SPARE.get(di)\n"
               "    if spare is None or spare[0] < known[lse_numel]:\n"
               "        lse = spare_lse(di, known[lse_numel])  # alive in this frame until after the launch\n"
               "        lse_ptr = lse.data_ptr()\n"
               "    else:\n"
               "        lse_ptr = spare[1]",
               "out"),
}
MAX_SHAPES = 4096  # distinct (sizes, strides, ...) remembered; past it the table starts again
# The floats of a plain call (no softcap), in FLASH_FWD.params order: written in as constants like the ints'.
PLAIN_FLOATS = {"sm_scale": "scale", "softcap": "0.0", "dropout_p": "0.0"}
_POINTER = r"\b(\w+)\.data_ptr\(\)"  # a pointer parameter's source


def _split(source: str) -> list[str]:
    """The items of a generated ", "-joined expression list (commas inside brackets stay)."""
    items, depth, current = [], 0, ""
    for char in source:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    return [item for item in [*items, current.strip()] if item]


def _int_groups() -> list[tuple[bool, list[str]]]:
    """The binding's plain ints as (is pointer, items) runs: pointer names, or constant expressions."""
    groups: list[tuple[bool, list[str]]] = []  # consecutive items of one kind
    for item in _split(binding.PLAIN_INTS_SOURCE):
        found = re.fullmatch(_POINTER, item)
        value = found.group(1) if found is not None else item
        if groups and groups[-1][0] == (found is not None):
            groups[-1][1].append(value)
        else:
            groups.append((found is not None, [value]))
    return groups


def _int_runs() -> tuple[list[str], str, str]:
    """(pointer names, the per-call ints expression, describe's constant runs) from the binding's plain ints.

    Pointers (``t.data_ptr()``) are read per call; every other parameter is a
    constant of the entry, kept in runs so the per-call tuple is a few concatenations.
    """
    groups = _int_groups()
    names = [name for is_pointer, items in groups if is_pointer for name in items]
    parts: list[str] = []
    runs: list[str] = []
    for is_pointer, items in groups:
        if is_pointer:
            parts.append("(" + ", ".join(f"{name}_ptr" for name in items) + ",)")
        else:
            parts.append(f"tails[{len(runs)}]")
            runs.append("(" + ", ".join(items) + ",)")
    pointers_in_aligned = set(re.findall(_POINTER, binding.ALIGNED_SOURCE))
    if not pointers_in_aligned <= set(names):
        raise RuntimeError(f"hot.py: aligned reads pointers {sorted(pointers_in_aligned)} that are not parameters")
    return names, " + ".join(parts) if parts else "()", ", ".join(runs)


def _floats_source() -> str:
    missing = [name for name in binding.FLOAT_PARAMS if name not in PLAIN_FLOATS]
    if missing:
        raise RuntimeError(f"hot.py: no plain-call value for float parameter(s) {missing}; add them to PLAIN_FLOATS")
    return ", ".join(PLAIN_FLOATS[name] for name in binding.FLOAT_PARAMS)


# The C++ tail's record of an entry (kernels/flash_fwd/_hotpath.cpp reads it): its Template struct, then the
# constant ints (0 where a pointer goes) and the floats; the pointers in its order (enum Pointer).
CPP_TEMPLATE = struct.Struct("<3q6I4i6h4x")  # lse shape, 2 grids, strides aligned, forward, counts, 5 slots, mask
CPP_INTERFACE = 4  # run(), serve() and remember()'s calling convention: _hotpath.cpp's LT_INTERFACE
CPP_POINTERS = ("q", "k", "v", "out", "lse")


def cpp_record(entry: list[Any], forward: bool) -> tuple[Any, ...] | bool | None:
    """The entry's record for ``run_cpp``: (template, plan aligned, plan not, fail aligned, fail not, restock).

    Written once per entry (and again when a plan is memoised later) from
    describe's constant int runs, in ``binding.PLAIN_INTS_SOURCE`` order with
    each pointer's slot, so the packing stays generated from the binding.
    None while no plan is memoised; False (kept in the entry) when the C++
    tail cannot launch it: a kernel without the compiled helper's plan (no
    helper, scratch memory), or values a C int64/float/uint32 cannot hold.
    """
    aligned, unaligned = FIELD["launch_aligned"], FIELD["launch_unaligned"]
    launches = [entry[aligned] or plan_of(entry, aligned), entry[unaligned] or plan_of(entry, unaligned)]
    if launches == [None, None]:
        return None
    ints: list[int] = []
    slots = [-1] * len(CPP_POINTERS)
    runs = iter(entry[FIELD["tails"]])
    for is_pointer, items in _int_groups():
        for name in items if is_pointer else ():
            slots[CPP_POINTERS.index(name)] = len(ints)
            ints.append(0)
        ints.extend(() if is_pointer else next(runs))
    mask = sum(1 << CPP_POINTERS.index(name) for name in re.findall(_POINTER, binding.ALIGNED_SOURCE))
    kernels = [launch[0] if launch is not None else None for launch in launches]
    plans = [fastlaunch.plan_bytes(kernel.fast) if kernel is not None else None for kernel in kernels]
    grids = [n for launch in launches for n in (launch[1] if launch is not None else (0, 0, 0))]
    sq, hq, b = entry[FIELD["dims"]]
    floats = entry[FIELD["floats"]]
    try:
        if any(kernel is not None and plan is None for kernel, plan in zip(kernels, plans, strict=True)):
            raise ValueError("a kernel without the compiled helper's plan")
        template = (CPP_TEMPLATE.pack(b, hq, sq, *grids, entry[FIELD["strides_aligned"]], forward, len(ints),
                                      len(floats), *slots, mask)
                    + struct.pack(f"<{len(ints)}q{len(floats)}f", *ints, *floats))
    except (ValueError, OverflowError, struct.error):  # a scale past float32's range, say
        entry[FIELD["cpp_record"]] = False
        return False
    fails = [getattr(kernel, "fail", None) for kernel in kernels]
    stocks = entry[FIELD["lse_stocks"]]
    refill = (functools.partial(restock, stocks, entry[FIELD["lse_template"]], entry[FIELD["device"]])
              if forward and stocks is not None else None)
    fields = {"template": template, "plan_aligned": plans[0], "plan_unaligned": plans[1], "fail_aligned": fails[0],
              "fail_unaligned": fails[1], "restock": refill}
    record = tuple(fields[name] for name in hotpath_record.RECORD)
    entry[FIELD["cpp_record"]] = record
    return record


_spare_lock = threading.Lock()
SPARE: dict[int, tuple[int, int]] = {}  # device index -> (numel, address) of a float32 buffer for lse nobody reads
_SPARE_KEPT: list[torch.Tensor] = []  # every spare buffer ever made: a captured graph may still write to one


def spare_lse(device_index: int, numel: int) -> torch.Tensor:
    """A float32 buffer of at least ``numel`` elements on the device for an lse nobody reads.

    Outside a CUDA graph capture, the device's spare buffer grows (doubling)
    and its address replaces the old one in ``SPARE``; old buffers are kept,
    never freed, since a captured graph holds their address (in all at most
    twice the largest). During a capture it returns a temporary tensor
    instead, as the general path allocates one: a buffer kept past the call
    must not come from the graph's private pool (cudagraph trees refuse a
    pool block no output holds), and the capture's pool orders the
    temporary's reuse. Kernels on several streams may write the same spare
    buffer at once: nobody reads it, and it is never freed. ``device_index``
    -1 (the CPU runs of the generated text) is never captured.
    """
    device = device_of(device_index)
    if device_index >= 0 and launch.capturing(device_index):
        return torch.empty(numel, dtype=torch.float32, device=device)
    with _spare_lock:
        found = SPARE.get(device_index)
        size = max(numel, 2 * found[0] if found is not None else 0)
        buffer = torch.empty(size, dtype=torch.float32, device=device)
        _SPARE_KEPT.append(buffer)
        SPARE[device_index] = (size, buffer.data_ptr())
        return buffer


@functools.cache
def device_of(device_index: int) -> torch.device:
    """The device of tensors whose ``get_device()`` is ``device_index``: a GPU, or the CPU for -1 (the tests' runs)."""
    return torch.device("cuda", device_index) if device_index >= 0 else torch.device("cpu")


_HOST_ONE = torch.empty(1, dtype=torch.float32)


def lse_template(batch: int, heads: int, seqlen: int) -> torch.Tensor:
    """A (batch, heads, seqlen) float32 tensor of one host element, expanded: ``empty_like(it, device=)`` is an lse.

    ``empty_like`` of a tensor that is not dense gives contiguous strides, as
    lse needs. The template is on the host so that an entry keeps no device
    memory: an entry described during a CUDA graph capture would otherwise
    keep a block of the graph's private pool alive (cudagraph trees refuse
    one no output holds: "tensor(s) in the cudagraph pool not tracked as
    outputs"). ``empty_like(template, device=)`` with the entry's cached
    device object is the cheapest form measured (CPU: 0.79 µs, 0.15 over
    ``empty_like`` of a template on the device, against 1.2 for
    ``torch.empty(shape, dtype=, device=)``; on the H200 host ``empty_like``
    costs 1.6 µs and ``new_empty(shape, dtype=)`` 3.0; benchmarks/NOTES.md,
    12-06). The C++ tail allocates lse itself (``at::empty``).
    """
    return _HOST_ONE.expand(batch, heads, seqlen)


# lse stocks: a forward_* call must return a new lse, and its allocation was 1.8 of attn_fwd's 11.2 µs on the
# H200 host (experiments/probe_host_parts.py). For a small lse, one allocation of STOCK_BYTES is cut into up to
# MAX_STOCK lse tensors at once (``unbind``: views of one block), handed out one per call. Measured on the
# H200: attn_fwd 1.79-1.89x torch.add's host time before, 1.65x after (a view costs nearly an allocation's time;
# what is saved is the allocator's own work). An lse handed out shares its storage with its stock-mates.
STOCK_BYTES = 64 << 10
MAX_STOCK = 64
MIN_STOCK = 4  # fewer lse per block than this: a plain allocation (the lse is big, the call is not host-bound)
MAX_STREAMS = 8  # streams with a stock in one entry; past it the entry's stocks start again


def lse_stocks(template: torch.Tensor | None) -> dict[int, list[torch.Tensor]] | None:
    """An entry's lse stocks (stream -> lse tensors not yet handed out), or None when its lse is not small.

    The tensors of a stock are views of one block, allocated on the stream
    they are handed out on (the dict's key), so the caching allocator's
    rule is a plain tensor's: the block is reused after its last view dies,
    ordered on that stream. A block stays alive while any of its lse does,
    so a block is at most STOCK_BYTES. Never used during a CUDA graph
    capture: a captured call's lse must come from the graph's own pool. The
    capture check (a driver query, 0.36 µs on the H200) is skipped on the legacy default
    stream (raw handle 0), which CUDA never captures. It asks the current
    device's stream, so a call on another device than the current one (whose
    own stream may be in a capture) takes no stock either.
    """
    if template is None or STOCK_BYTES // (4 * template.numel() + 12) < MIN_STOCK:
        return None
    return {}


def restock(stocks: dict[int, list[torch.Tensor]], template: torch.Tensor, device: torch.device,
            stream: int) -> torch.Tensor:
    """A new lse for ``stream`` on ``device`` (the entry's), refilling its stock with the next ones from one allocation.

    Its callers never call it during a CUDA graph capture (see ``lse_stocks``): the stock outlives the call.
    """
    numel = template.numel()
    step = -(-numel // 4) * 4  # each lse starts 16-byte aligned: its pointer is part of the aligned plan's rule
    count = min(MAX_STOCK, STOCK_BYTES // (4 * step))
    block = torch.empty(count * step, dtype=torch.float32, device=device)
    b, h, s = template.shape
    fresh = list(block.as_strided((count, b, h, s), (step, h * s, s, 1)).unbind(0))
    lse = fresh.pop()
    if len(stocks) >= MAX_STREAMS and stream not in stocks:
        stocks.clear()
    stocks[stream] = fresh
    return lse


def plan_of(entry: list[Any], index: int) -> tuple[Any, tuple[int, int, int]] | None:
    """An entry's (kernel, grid) for its memo key, once memoised, kept at ``index`` in the entry.

    ``index`` is ``FIELD["launch_aligned"]`` (aligned pointers) or
    ``FIELD["launch_unaligned"]``. The general path memoises the plan
    (``binding.plan``) on a first call; until then this is None and the call
    takes the general path.
    """
    plan = entry[FIELD["plans"]].get(entry[index + _KEY_AFTER_LAUNCH])
    if plan is None:
        return None
    kernel, block_m = plan
    sq, hq, b = entry[FIELD["dims"]]
    launch = (kernel, ((sq + block_m - 1) // block_m, hq, b))
    entry[index] = launch
    return launch




def _never_capturing() -> bool:
    return False


# The C function itself (~0.1 µs) where torch is built with CUDA/ROCm; a CPU build has a placeholder class
# there (and torch 2.13's is_current_stream_capturing calls it): nothing is ever captured on one.
is_capturing = torch._C._cuda_isCurrentStreamCapturing if torch.backends.cuda.is_built() else _never_capturing
_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # an int, ~0.3 µs; launch.raw_stream's


def source(layout: str, result: str, cuda: bool = True, cpp: bool = False, stream_inside: bool = False,
           with_front: bool = True) -> str:
    """The text of the warm path for a layout ("bhsd", "bshd") and result ("forward", "output"), and its describe.

    ``cpp``: with the C++ tail (``run_cpp``, ``cpp_record``) in front of the Python one; ``stream_inside``: it
    reads the current stream itself (its STREAM_INSIDE), so none is read before it (but with lse stocks), and
    the entry lookup is in C++ too (``serve``; ``with_front=False`` leaves it out: bench_host times both).
    """
    unpack, permute_in, permute_out = _LAYOUTS[layout]
    lse, returned = _LSE[result]
    names, ints, tails = _int_runs()
    if "lse" not in names:
        raise RuntimeError("hot.py: the binding's parameters no longer read lse.data_ptr()")
    lookup, front = _LOOKUP, ""
    if cpp and set(names) <= set(CPP_POINTERS):  # else a pointer the C++ tail does not know: Python alone
        kind = "forward_allocated" if result == "forward" and not CPP_LSE_STOCKS else result
        inside = stream_inside and kind in _LSE_CPP_INSIDE
        cpp_lse = _LSE_CPP_INSIDE[kind] if inside else _LSE_CPP[kind]
        front = _FRONT if inside and with_front else ""
        lookup = _LOOKUP_CPP.format(remember=_REMEMBER if front else "",
                                    lse=(cpp_lse or lse).replace("\n    ", "\n        "))
    pointers = "\n    ".join(f"{name}_ptr = {name}.data_ptr()" for name in names if name != "lse")
    aligned_pointers = sorted(set(re.findall(_POINTER, binding.ALIGNED_SOURCE)))
    call = _TEMPLATE.format(
        name=f"{result}_{layout}", front=front,
        device_check="q.is_cuda and k.is_cuda and v.is_cuda" if cuda else "True", lookup=lookup, lse=lse,
        pointers=pointers,
        pointer_or=" | ".join(f"{name}_ptr" for name in aligned_pointers) or "0",
        ints=ints, result=returned)
    entry = ", ".join(ENTRY.values()).format(floats=_floats_source(), tails=tails)
    describe = _DESCRIBE.format(
        entry=entry, unpack=unpack,
        permute_in="qs_in, ks_in, vs_in, causal_in, scale_in = qs, ks, vs, causal, scale\n    " + permute_in,
        permute_out=permute_out,
        zero_pointers=" = ".join(f"{name}_ptr" for name in names) + " = 0  # describe's alignment: strides alone",
        index64=binding.INDEX64_SOURCE, aligned=re.sub(_POINTER, r"\1_ptr", binding.ALIGNED_SOURCE))
    return indexed(call + describe)


def _no_template(batch: int, heads: int, seqlen: int) -> None:
    return None


def _cpu_device() -> int:
    """The current device where the warm path runs on CPU tensors (``cuda=False``): theirs, -1."""
    return -1


@functools.cache
def warn_stale_once() -> None:
    logging.getLogger("lazytriton.driver").warning(
        "the C++ warm path was built from another _hotpath.cpp (its records or calling convention differ): the "
        "Python warm path until it is rebuilt (python -m lazytriton.kernels.flash_fwd.hotpath_build)")


def usable(cpp: Any) -> bool:
    """Whether a loaded C++ tail reads this file's records: the same template format and calling convention."""
    return getattr(cpp, "TEMPLATE", None) == CPP_TEMPLATE.format and getattr(cpp, "INTERFACE", None) == CPP_INTERFACE


def generate(layout: str, result: str, cuda: bool = True, cpp: Any = None, stream_inside: bool | None = None,
             with_front: bool = True, **namespace: Any) -> Any:
    """The warm-path function for a layout ("bhsd", "bshd") and result ("forward": (out, lse); "output": out).

    ``cuda=False`` and ``namespace`` overrides serve the CPU tests and
    benchmarks/profile_hot.py, which run this same text on CPU tensors with a
    fake driver (there is no other use for them). The C++ tail is in the text when its module is built for this
    torch and enabled (hotpath.py) and the launch helper is there; ``cpp``: False, or the module to use.
    ``stream_inside`` (None: the module's STREAM_INSIDE, on CUDA only): the C++ tail reads the current stream, and
    then (unless ``with_front`` is False) the entry lookup is in C++ too.
    """
    name = f"{result}_{layout}"
    if cpp is None:  # a module built from another _hotpath.cpp reads another template: not used until rebuilt
        cpp = hotpath.module() if fastlaunch.available() else None
        if cpp is not None and not usable(cpp):
            warn_stale_once()
            cpp = None
    shapes: dict[tuple[Any, ...], list[Any]] = {}  # this function's entries (``describe``)
    scope: dict[str, Any] = {
        "SHAPES": shapes, "MAX_SHAPES": MAX_SHAPES, "plan_of": plan_of, "DTYPES": binding.DTYPES,
        "MAX_HEAD_DIM": geometry.MAX_HEAD_DIM, "gluon_tail": binding.gluon_tail,
        "gluon_q_tiles": fwd_dispatch.flash_fwd_gluon_q_tiles, "INT32_MAX": binding.INT32_MAX,
        "MAX_GRID_YZ": binding.MAX_GRID_YZ, "INV_SQRT": [0.0] + [1.0 / math.sqrt(d) for d in range(1, 257)],
        "INF": math.inf, "F32": torch.float32, "empty_like": torch.empty_like,
        "get_runtime": runtime.get, "raw_stream": _GET_RAW_STREAM or launch.raw_stream,
        "scratch_alloc": launch.scratch_alloc, "SPARE": SPARE, "spare_lse": spare_lse,
        "lse_template": lse_template if result == "forward" else _no_template, "lse_stocks": lse_stocks,
        "restock": restock, "device_of": device_of, "is_capturing": is_capturing,
        "run_cpp": getattr(cpp, "run", None) if cpp else None,
        "current_device": launch.current_device if cuda and launch.current_device else _cpu_device,
        "serve": getattr(cpp, "serve", None) if cpp else None,
        "remember": getattr(cpp, "remember", None) if cpp else None, "TABLE": {}, "CUDA": cuda,
        "cpp_record": functools.partial(cpp_record, forward=result == "forward"),
    }
    scope.update(namespace)
    if stream_inside is None:
        stream_inside = cuda and bool(getattr(cpp, "STREAM_INSIDE", 0))
    text = source(layout, result, cuda, cpp=bool(cpp), stream_inside=bool(cpp) and stream_inside,
                  with_front=with_front)
    exec(compile(text, f"<{FLASH_FWD.name} warm path: {name}>", "exec"), scope)  # noqa: S102 (our own text)
    return scope[name]


# forward_bhsd, forward_bshd, output_bhsd, output_bshd: made when first used with a plan memoised (compiling
# one costs 1.5-2 ms, a third of a cache-served first call, and a process uses one or two of them), then
# plain module attributes. Until then a stand-in declines every call: with no plan in the runtime's memo
# the warm path serves none, and the general path that takes the first call memoises one.
_FUNCTIONS = {f"{result}_{layout}": (layout, result) for result in ("forward", "output") for layout in ("bhsd", "bshd")}
_generate_lock = threading.Lock()


def _made(name: str) -> Any:
    """The warm-path function ``name``, generated now if it is not yet."""
    with _generate_lock:
        made = globals().get(name)
        if made is None or getattr(made, "stand_in", False):
            made = globals()[name] = generate(*_FUNCTIONS[name])
    return made


def _stand_in(name: str) -> Any:
    def warm(q: Any, k: Any, v: Any, causal: Any, scale: Any, gqa: bool = True) -> Any:
        rt = runtime.current()
        if rt is None or not rt.plans or q.requires_grad or k.requires_grad or v.requires_grad:
            return None  # nothing memoised yet, or a call the warm path declines (gradients): not made for it
        return _made(name)(q, k, v, causal, scale, gqa)

    warm.stand_in = True  # type: ignore[attr-defined]
    return warm


def __getattr__(name: str) -> Any:
    if name not in _FUNCTIONS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _generate_lock:
        made = globals().get(name)
        if made is None:
            made = globals()[name] = _stand_in(name)
    return made


def regenerate() -> None:
    """Make the warm paths again on their next use: after ``hotpath.enable`` or a build (benchmarks, tests)."""
    with _generate_lock:
        for name in _FUNCTIONS:
            globals().pop(name, None)
