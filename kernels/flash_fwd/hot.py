"""flash_fwd's warm path: one generated function per layout and result, from the binding's description.

A warm eager call (GPU tensors, a shape bucket whose plan is memoised, the
common arguments) is served here in one Python frame: the checks that matter
for that case, the output allocations, the parameters written out from
``binding.PARAM_SOURCES`` in ``FLASH_FWD.params`` order, the memo key
(dispatch's buckets, as ``binding.memo_key``) and the launch. Anything else
(a first call, CPU or meta tensors, an unusual argument, bad input, inputs that
require grad) returns None, and the caller takes the general path
(``binding.check`` then ``binding.forward``), which raises the errors and
fills the memo. tests/test_hot.py checks both paths agree on every field.

Its callers send only calls without a sliding window or softcap here: the
window parameters are written in as constants (-1, -1; softcap 0.0) and the
memo key is the plain call's (``binding.memo_key`` lengthens it for the
others), so a windowed or capped plan is never served from here.

``bshd`` takes FlashAttention's (batch, seqlen, heads, head_dim) tensors and
reads their strides in the kernel's order, so no transposed view is made.

``forward_*`` return ``(out, lse)``; ``output_*`` return ``out`` alone, for
callers that drop lse (the SDPA drop-in, ``flash_attn_func`` without
``return_attn_probs``). Those skip lse's allocation (3.0 µs of a 19.7 µs
call on the H200 host): the kernel writes lse into a per-device spare buffer
that nobody reads (``spare_lse``), which only grows and is never freed, so a
CUDA graph that captured its address stays valid.

The launch goes through the compiled helper (``LoadedKernel.fast``,
lazytriton/driver/fastlaunch.py) when it is built, else ``LoadedKernel.launch``.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

import torch

from lazytriton import dispatch, runtime
from lazytriton.kernels.flash_fwd import FLASH_FWD, binding

_TEMPLATE = """
def {name}(q, k, v, causal, scale):
    if not ({device_check}) or q.requires_grad or k.requires_grad or v.requires_grad:
        return None
    dtype = q.dtype
    if dtype not in DTYPES or k.dtype is not dtype or v.dtype is not dtype:
        return None
    di = q.get_device()
    if k.get_device() != di or v.get_device() != di:
        return None
    qshape = q.shape
    kshape = k.shape
    if len(qshape) != 4 or len(kshape) != 4 or v.shape != kshape:
        return None
    {unpack}
    if (bk != b or dk != d or not 1 < d <= MAX_HEAD_DIM or not 0 < hk <= hq or hq % hk or not 0 < sq <= INT32_MAX
            or not 0 < sk <= INT32_MAX or not 0 < b <= MAX_GRID_YZ or hq > MAX_GRID_YZ):
        return None
    qs = q.stride()
    ks = k.stride()
    vs = v.stride()
    if qs[3] != 1 or ks[3] != 1 or vs[3] != 1:
        return None
    {permute_in}
    if causal is False:
        is_causal = False
        offset = 0
    elif causal is True:
        is_causal = True
        offset = 0
    elif type(causal) is str and (causal == "top_left" or causal == "bottom_right"):
        is_causal = True
        offset = sk - sq if causal == "bottom_right" else 0
    else:
        return None
    if scale is None:
        scale = INV_SQRT[d]
    elif type(scale) is not float or not -INF < scale < INF:
        return None
    out = empty_like(q)
    {lse}
    os = out.stride()
    {permute_out}
    {pointers}
    ints = ({ints},)
    aligned = {aligned}
    index64 = {index64}
    # The memo key is binding.memo_key's; (n - 1).bit_length() is tuning.bucket_index for n >= 1 (tested).
    plan = get_runtime().plans.get((di, dtype, d, is_causal, aligned, index64, (sq - 1).bit_length(),
                                    (sk - 1).bit_length()))
    if plan is None:
        return None
    kernel, block_m = plan
    fast = kernel.fast
    if fast is None:
        kernel.launch(((sq + block_m - 1) // block_m, hq, b), raw_stream(di), ints, ({floats},), scratch_alloc)
    else:
        status = fast((sq + block_m - 1) // block_m, hq, b, raw_stream(di), ints, N_INTS, ({floats},), N_FLOATS)
        if status:
            kernel.fail(status, ((sq + block_m - 1) // block_m, hq, b))
    return {result}
"""

_LAYOUTS = {
    "bhsd": ("b, hq, sq, d = qshape\n    bk, hk, sk, dk = kshape", "", ""),
    "bshd": ("b, sq, hq, d = qshape\n    bk, sk, hk, dk = kshape",
             "qs = (qs[0], qs[2], qs[1])\n    ks = (ks[0], ks[2], ks[1])\n    vs = (vs[0], vs[2], vs[1])",
             "os = (os[0], os[2], os[1])"),
}
_LSE = {
    "forward": ("lse = q.new_empty((b, hq, sq), dtype=F32)  # 3.0 µs on the H200 host; torch.empty(device=) 6.7",
                "out, lse"),
    "output": ("lse_numel = b * hq * sq\n"
               "    spare = SPARE.get(di)\n"
               "    if spare is None or spare[0] < lse_numel:\n"
               "        lse = spare_lse(di, lse_numel)  # alive in this frame until after the launch\n"
               "        lse_ptr = lse.data_ptr()\n"
               "    else:\n"
               "        lse_ptr = spare[1]",
               "out"),
}
# The floats of a plain call (no softcap), in FLASH_FWD.params order: written in as constants like the ints'.
PLAIN_FLOATS = {"sm_scale": "scale", "softcap": "0.0"}
_POINTER = re.compile(r"\b(\w+)\.data_ptr\(\)")


def _hoist_pointers(sources: tuple[str, ...], skip: tuple[str, ...] = ()) -> tuple[str, list[str]]:
    """Each ``t.data_ptr()`` the sources read, read once into ``t_ptr`` (ints and ``aligned`` share them).

    Names in ``skip`` are left to the template (the output-only path sets ``lse_ptr`` itself).
    """
    names = list(dict.fromkeys(m.group(1) for source in sources for m in _POINTER.finditer(source)))
    missing = [name for name in skip if name not in names]
    if missing:
        raise RuntimeError(f"hot.py: the binding's parameters no longer read {missing}.data_ptr()")
    assignments = "\n    ".join(f"{name}_ptr = {name}.data_ptr()" for name in names if name not in skip)
    return assignments, [_POINTER.sub(r"\1_ptr", source) for source in sources]


def _floats_source() -> str:
    missing = [name for name in binding.FLOAT_PARAMS if name not in PLAIN_FLOATS]
    if missing:
        raise RuntimeError(f"hot.py: no plain-call value for float parameter(s) {missing}; add them to PLAIN_FLOATS")
    return ", ".join(PLAIN_FLOATS[name] for name in binding.FLOAT_PARAMS)


_spare_lock = threading.Lock()
SPARE: dict[int, tuple[int, int]] = {}  # device index -> (numel, address) of a float32 buffer for lse nobody reads
_SPARE_KEPT: list[torch.Tensor] = []  # every spare buffer ever made: a captured graph may still write to one


def spare_lse(device_index: int, numel: int) -> torch.Tensor:
    """A float32 buffer of at least ``numel`` elements on the device for an lse nobody reads.

    Outside a CUDA graph capture, the device's spare buffer grows (doubling)
    and its address replaces the old one in ``SPARE``; old buffers are kept,
    never freed, since a captured graph holds their address (in all at most
    twice the largest). During a capture it returns a temporary tensor
    instead, as the general path allocates one: the capture's pool orders its
    reuse. Kernels on several streams may write the same spare buffer at
    once: nobody reads it, and it is never freed.
    """
    if is_capturing():
        return torch.empty(numel, dtype=torch.float32, device=torch.device("cuda", device_index))
    with _spare_lock:
        found = SPARE.get(device_index)
        size = max(numel, 2 * found[0] if found is not None else 0)
        buffer = torch.empty(size, dtype=torch.float32, device=torch.device("cuda", device_index))
        _SPARE_KEPT.append(buffer)
        SPARE[device_index] = (size, buffer.data_ptr())
        return buffer


is_capturing = torch.cuda.is_current_stream_capturing
_GET_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # an int, ~0.3 µs; binding.raw_stream's


def source(layout: str, result: str, cuda: bool = True) -> str:
    """The text of the warm-path function for a layout ("bhsd", "bshd") and result ("forward", "output")."""
    unpack, permute_in, permute_out = _LAYOUTS[layout]
    lse, returned = _LSE[result]
    pointers, (ints, aligned) = _hoist_pointers((binding.PLAIN_INTS_SOURCE, binding.ALIGNED_SOURCE),
                                                skip=("lse",) if result == "output" else ())
    return _TEMPLATE.format(
        name=f"{result}_{layout}", device_check="q.is_cuda and k.is_cuda and v.is_cuda" if cuda else "True",
        unpack=unpack, permute_in=permute_in, permute_out=permute_out, lse=lse, pointers=pointers, ints=ints,
        aligned=aligned, index64=binding.INDEX64_SOURCE, floats=_floats_source(), result=returned)


def generate(layout: str, result: str, cuda: bool = True, **namespace: Any) -> Any:
    """The warm-path function for a layout ("bhsd", "bshd") and result ("forward": (out, lse); "output": out).

    ``cuda=False`` and ``namespace`` overrides serve the CPU tests and
    benchmarks/profile_hot.py, which run this same text on CPU tensors with a
    fake driver (there is no other use for them).
    """
    name = f"{result}_{layout}"
    scope: dict[str, Any] = {
        "DTYPES": binding.DTYPES, "MAX_HEAD_DIM": dispatch.MAX_HEAD_DIM, "INT32_MAX": binding.INT32_MAX,
        "MAX_GRID_YZ": binding.MAX_GRID_YZ, "INV_SQRT": [0.0] + [1.0 / math.sqrt(d) for d in range(1, 257)],
        "INF": math.inf, "F32": torch.float32, "empty_like": torch.empty_like,
        "get_runtime": runtime.get, "raw_stream": _GET_RAW_STREAM or binding.raw_stream,
        "scratch_alloc": binding.scratch_alloc, "N_INTS": len(binding.INT_PARAMS),
        "N_FLOATS": len(binding.FLOAT_PARAMS), "SPARE": SPARE, "spare_lse": spare_lse,
    }
    scope.update(namespace)
    exec(compile(source(layout, result, cuda), f"<{FLASH_FWD.name} warm path: {name}>", "exec"), scope)  # noqa: S102 (our text)
    return scope[name]


forward_bhsd = generate("bhsd", "forward")
forward_bshd = generate("bshd", "forward")
output_bhsd = generate("bhsd", "output")
output_bshd = generate("bshd", "output")
