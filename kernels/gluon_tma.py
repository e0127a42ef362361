"""TMA descriptors and copies shared by the Gluon kernels: ``flash_fwd_gluon`` and ``flash_bwd_fused_gluon``.

A helper module of both kernels (their ``KernelSpec.helpers``: its text is
in both source fingerprints). It imports triton: only
``lazytriton.compiler`` (through the kernels' files) may import it. It
compiles with Triton 3.6.0 (the GPU host) and 3.9.0 (CI) from one source.

A head dim held in two chunks (``BLOCK_D`` + ``BLOCK_D2``: Gluon's shapes
are powers of two) has each chunk in buffers of its own. ``descriptors``
gives the chunks' TMA descriptors over the whole row, the second chunk read
at column BLOCK_D. Where the second chunk's row is one span of its swizzle
(192 = 128 + 64 in 16 bits and 32 float32 columns: 128 bytes; the forward's
96 = 64 + 32 and 160 = 128 + 32, whose first chunk takes the second's
64-byte swizzle) and the first chunk's buffer has the same swizzle, its
boxes tile the first chunk's buffer as well, so one descriptor serves both: ``copy_in`` and
``copy_out`` move a buffer wider than the descriptor's box as boxes of its
sub-slices (Triton splits a wide box the same way, at the same offsets). A
descriptor made on the device is written to global scratch and fenced, ~0.7
µs of its partition's time on the H200 before the first load it serves
(``benchmarks/probe_fused_steps.py --trace``, 17th session: the backward's
K and V in at 4.6-5.1 µs at 192 against 3.2-3.6 at 256, with twice the
descriptors).
"""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """Triton 3.9's ``tma.async_atomic_add`` for 3.6, whose Gluon lacks the wrapper but not the op it builds."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


# TMA copies: Triton 3.9's names, else 3.6's (the bulk reduction shared -> global, cp.reduce.async.bulk.tensor.add:
# 3.9's name, else the shim; benchmarks/gluon_bwd_probe_kernel.py uses it too, through fused_kernel)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36


@gluon.jit
def descriptors(base, rows, cols, stride, smem, smem2, SPLIT: gl.constexpr):
    """(desc, desc2): TMA descriptors of the (rows, cols) matrix at ``base``, boxes as ``smem``'s and ``smem2``'s.

    ``stride`` is the row stride; the extent is ``cols``, so TMA zero-fills
    loads past it and stores stop at it. SPLIT: ``desc2`` reads the second
    chunk (``smem2``, at column ``smem``'s width) and covers the whole row;
    where that chunk's row is one span of its swizzle and the first chunk's
    buffer has the same swizzle, ``desc`` is the same descriptor (the first
    chunk then moves in its boxes). Without SPLIT the first stands in for the
    second (never used).
    """
    BLOCK_ROWS: gl.constexpr = smem.type.shape[-2]
    if SPLIT:
        desc2 = tma.make_tensor_descriptor(base, [rows, cols], [stride, 1], [BLOCK_ROWS, smem2.type.shape[-1]],
                                           smem2.type.layout)
        SWIZZLE: gl.constexpr = smem2.type.layout.swizzle_byte_width
        if (smem2.type.shape[-1] * smem2.dtype.primitive_bitwidth == 8 * SWIZZLE
                and smem.type.layout.swizzle_byte_width == SWIZZLE):
            desc = desc2
        else:
            desc = tma.make_tensor_descriptor(base, [rows, cols], [stride, 1], [BLOCK_ROWS, smem.type.shape[-1]],
                                              smem.type.layout)
    else:
        desc = tma.make_tensor_descriptor(base, [rows, cols], [stride, 1], [BLOCK_ROWS, smem.type.shape[-1]],
                                          smem.type.layout)
        desc2 = desc
    return desc, desc2


@gluon.jit
def copy_in(desc, row, col, bar, buf, pred=True):
    """TMA-load ``buf`` from (``row``, ``col``) on ``bar``: one copy, or boxes of a narrower descriptor's width."""
    W: gl.constexpr = desc.block_type.shape[1]
    C: gl.constexpr = buf.type.shape[1]
    if W == C:
        tma_load(desc, [row, col], bar, buf, pred=pred)
    else:
        for c in gl.static_range(C // W):
            tma_load(desc, [row, col + c * W], bar, buf.slice(c * W, W, dim=1), pred=pred)


@gluon.jit
def copy_out(desc, row, col, buf, ADD: gl.constexpr = False):
    """TMA-store ``buf`` at (``row``, ``col``), or with ADD reduce (add) it there.

    One copy, or boxes of a narrower descriptor's width.
    """
    W: gl.constexpr = desc.block_type.shape[1]
    C: gl.constexpr = buf.type.shape[1]
    for c in gl.static_range(C // W):
        box = buf if W == C else buf.slice(c * W, W, dim=1)
        if ADD:
            tma_reduce_add(desc, [row, col + c * W], box)
        else:
            tma_store(desc, [row, col + c * W], box)
