"""The description of the KV-cache append kernel (``kv_append``, ``triton_kernel.py``); the package says what it does.

The kernel registry (``lazytriton.kernels.get``) reads it from here; the package builds its variant.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec

FAMILY = "kv_append"
MODULE = "lazytriton.kernels.kv_append.triton_kernel"
# PDL's least CUDA capability (90: Hopper's griddepcontrol), None: off. The kernel then releases its programmatic
# dependent, the call's split kernel (flash_decode's PDL: a rotary call's, or every call's with DEPENDENT_SPLIT), as
# it starts.
PDL_FROM: int | None = 90


def _strides(*tensors: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"stride_{t}{d}", "{index}") for t in tensors for d in ("b", "s", "h"))


_STRIDES = _strides("k", "v", "kc", "vc")

KV_APPEND = KernelSpec(
    name="kv_append",
    module=MODULE,
    function="kv_append_kernel",
    params=(
        ("K", "*{dtype}"),
        ("V", "*{dtype}"),
        ("KCache", "*{dtype}"),
        ("VCache", "*{dtype}"),
        ("Seqlens", "*i32"),
        ("BatchIdx", "*i32"),
        ("BlockTable", "*i32"),
        ("RotaryCos", "*{dtype}"),
        ("RotarySin", "*{dtype}"),
        ("RotarySeqlens", "*i32"),
        ("KDescale", "*fp32"),
        ("VDescale", "*fp32"),
        ("CuSeqlensKNew", "*i32"),
        *_STRIDES,
        ("stride_tb", "{index}"),
        ("stride_kdb", "i32"),
        ("stride_kdh", "i32"),
        ("stride_vdb", "i32"),
        ("stride_vdh", "i32"),
        ("heads_k", "i32"),
        ("seqlen_new", "i32"),
        ("head_dim", "i32"),
        ("head_dim_v", "i32"),
        ("seqlen_const", "i32"),
        ("use_seqlens", "i32"),
        ("use_batch_idx", "i32"),
        ("page_size", "i32"),
        ("capacity", "i32"),
        ("cache_rows", "i32"),
        ("rotary_dim", "i32"),
        ("seqlen_ro", "i32"),
        ("use_rotary_seqlens", "i32"),
        ("use_k_descale", "i32"),
        ("use_v_descale", "i32"),
        ("num_seqs", "i32"),
    ),
    constexprs=("BLOCK_M", "BLOCK_D", "EVEN_D", "BLOCK_DV", "EVEN_DV", "PAGED", "ROTARY", "ROTARY_INTERLEAVED",
                "KV_FP8", "VARLEN"),
    aligned_params=("K", "V", "KCache", "VCache") + tuple(name for name, _ in _STRIDES),
    helpers=("lazytriton.kernels.rotary",),
    capability_flags=(("PDL", PDL_FROM),),
)

KERNELS = (KV_APPEND,)
INT_PARAMS = tuple(name for name, _ in KV_APPEND.params)  # every parameter is a pointer or an integer
