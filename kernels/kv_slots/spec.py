"""The description of the slot-addressed KV-cache write (``kv_slots``, ``triton_kernel.py``).

The package says what it does; the kernel registry (``lazytriton.kernels.get``) reads the description from here,
and the package builds its variant.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec

FAMILY = "kv_slots"
MODULE = "lazytriton.kernels.kv_slots.triton_kernel"

# (token, head) strides of key and value; (block, slot in the block, head) strides of the caches.
_STRIDES = (("stride_kt", "{index}"), ("stride_kh", "{index}"), ("stride_vt", "{index}"), ("stride_vh", "{index}"),
            ("stride_kcb", "{index}"), ("stride_kcs", "{index}"), ("stride_kch", "{index}"),
            ("stride_vcb", "{index}"), ("stride_vcs", "{index}"), ("stride_vch", "{index}"))

KV_SLOTS = KernelSpec(
    name="kv_slots",
    module=MODULE,
    function="kv_slots_kernel",
    params=(
        ("K", "*{dtype}"),
        ("V", "*{dtype}"),
        ("KCache", "*{dtype}"),
        ("VCache", "*{dtype}"),
        ("Slots32", "*i32"),
        ("Slots64", "*i64"),
        ("KDescale", "*fp32"),
        ("VDescale", "*fp32"),
        *_STRIDES,
        ("heads_k", "i32"),
        ("n_rows", "i32"),
        ("head_dim", "i32"),
        ("head_dim_v", "i32"),
        ("block_size", "i32"),
        ("num_slots", "{index}"),
        ("use_k_descale", "i32"),
        ("use_v_descale", "i32"),
    ),
    constexprs=("BLOCK_M", "BLOCK_D", "EVEN_D", "EVEN_DV", "SLOT64", "KV_FP8"),
    aligned_params=("K", "V", "KCache", "VCache") + tuple(name for name, _ in _STRIDES),
)

KERNELS = (KV_SLOTS,)
INT_PARAMS = tuple(name for name, _ in KV_SLOTS.params)  # every parameter is a pointer or an integer
