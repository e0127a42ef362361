"""The description of ``kv_append_lengths`` (``lengths_kernel.py``): the post-append lengths of packed new keys.

The split kernel reads each sequence's key count once new keys packed by cu_seqlens_k_new are in the cache:
cache_seqlens[b] (or the constant ``seqlen_const`` without ``use_seqlens``) plus the sequence's new count.
The C API launches it on the GPU after ``kv_append`` (VARLEN) into its workspace; Python's
``kv_append.lengths.lengths`` launches the same kernel. Data only: importing it never imports triton.
"""

from __future__ import annotations

from lazytriton.kernels import KernelSpec

KERNEL = "kv_append_lengths"
MODULE = "lazytriton.kernels.kv_append.lengths_kernel"

KV_APPEND_LENGTHS = KernelSpec(
    name=KERNEL,
    module=MODULE,
    function="kv_append_lengths_kernel",
    params=(
        ("Seqlens", "*i32"),
        ("CuSeqlensKNew", "*i32"),
        ("Lens", "*i32"),
        ("batch", "i32"),
        ("seqlen_const", "i32"),
        ("use_seqlens", "i32"),
    ),
    constexprs=("BLOCK",),
    aligned_params=(),
)

INT_PARAMS = tuple(name for name, _ in KV_APPEND_LENGTHS.params)  # every parameter is a pointer or an integer
