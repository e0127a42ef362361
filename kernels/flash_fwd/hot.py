"""flash_fwd's warm path: one generated function per layout, from the binding's description.

A warm eager call (GPU tensors, a shape bucket whose plan is memoised, the
common arguments) is served here in one Python frame: the checks that matter
for that case, the two output allocations, the parameters written out from
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
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lazytriton import dispatch, runtime, tuning
from lazytriton.kernels.flash_fwd import FLASH_FWD, binding

_TEMPLATE = """
def forward_{layout}(q, k, v, causal, scale):
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or q.requires_grad or k.requires_grad or v.requires_grad:
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
    lse = q.new_empty((b, hq, sq), dtype=F32)  # 3.2 µs on the H200 host; torch.empty(device=q.device) 6.7
    os = out.stride()
    {permute_out}
    ints = ({ints},)
    aligned = {aligned}
    index64 = {index64}
    plan = get_runtime().plans.get((di, dtype, d, is_causal, aligned, index64, bucket_index(sq), bucket_index(sk)))
    if plan is None:
        return None
    kernel, block_m = plan
    kernel.launch(((sq + block_m - 1) // block_m, hq, b), raw_stream(di), ints, (scale, 0.0, 0.0), scratch_alloc)
    return out, lse
"""

_LAYOUTS = {
    "bhsd": ("b, hq, sq, d = qshape\n    bk, hk, sk, dk = kshape", "", ""),
    "bshd": ("b, sq, hq, d = qshape\n    bk, sk, hk, dk = kshape",
             "qs = (qs[0], qs[2], qs[1])\n    ks = (ks[0], ks[2], ks[1])\n    vs = (vs[0], vs[2], vs[1])",
             "os = (os[0], os[2], os[1])"),
}


def _generate(layout: str) -> Any:
    unpack, permute_in, permute_out = _LAYOUTS[layout]
    source = _TEMPLATE.format(layout=layout, unpack=unpack, permute_in=permute_in, permute_out=permute_out,
                              ints=binding.PLAIN_INTS_SOURCE, aligned=binding.ALIGNED_SOURCE,
                              index64=binding.INDEX64_SOURCE)
    namespace: dict[str, Any] = {
        "DTYPES": binding.DTYPES, "MAX_HEAD_DIM": dispatch.MAX_HEAD_DIM, "INT32_MAX": binding.INT32_MAX,
        "MAX_GRID_YZ": binding.MAX_GRID_YZ, "INV_SQRT": [0.0] + [1.0 / math.sqrt(d) for d in range(1, 257)],
        "INF": math.inf, "F32": torch.float32, "empty_like": torch.empty_like,
        "get_runtime": runtime.get, "bucket_index": tuning.bucket_index, "raw_stream": binding.raw_stream,
        "scratch_alloc": binding.scratch_alloc,
    }
    exec(compile(source, f"<{FLASH_FWD.name} warm path: {layout}>", "exec"), namespace)  # noqa: S102 (our text)
    return namespace[f"forward_{layout}"]


forward_bhsd = _generate("bhsd")
forward_bshd = _generate("bshd")
