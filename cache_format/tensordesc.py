"""Host tensor descriptors in an Entry: how the launcher must encode each one (a CUtensorMap).

A kernel parameter typed ``tensordesc<bf16[1, 1, 64, 128]>`` (Triton's type
string for a host-side ``TensorDescriptor``; Gluon adds a layout after the
block shape) reaches the compiled kernel as 1 + 2 x rank parameters: a
128-byte CUtensorMap passed by value (64-byte aligned), then the shape as
rank i32, then the strides as rank i64. The map is built on the host with
``cuTensorMapEncodeTiled`` from the tensor's base, shape and strides and the
compiler's ``tensordesc_meta`` for that parameter: swizzle mode, element size,
element type (the device's enum, as Triton records it) and the box
(``block_size``, which may be narrower than the type's block: a 128-wide bf16
block with 128-byte swizzle is loaded as two 64-wide boxes). Triton 3.6 and
3.9 expand and encode the same way for everything an Entry may hold here;
they differ for fp4-padded maps (3.6 also passes the doubled shape) and 3.9
adds im2col maps: the compiler refuses both, so no entry carries them.

Nothing here is trusted: ``check`` is what the entry decoder runs on
metadata read from disk or a shared tier.
"""

from __future__ import annotations

import re

from lazytriton.record import record

MAX_RANK = 5  # cuTensorMapEncodeTiled: tensorRank 1..5
MAX_BOX = 256  # boxDim[i] <= 256
SWIZZLE_BYTES = {0: 0, 1: 32, 2: 64, 3: 128}  # CUtensorMapSwizzle -> span in bytes (0: none)
# Triton's device-side element type enum -> the host's CUtensorMapDataType
# (triton/backends/nvidia/driver.py, TMA_DTYPE_DEVICE_TO_HOST, identical in 3.6 and 3.9).
DEVICE_TO_HOST_DTYPE = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}
# Element sizes of the dtypes a descriptor may hold (Triton's type names).
ELEM_SIZE = {"i8": 1, "u8": 1, "fp8e4nv": 1, "fp8e5": 1, "fp8e4b15": 1, "i16": 2, "u16": 2, "fp16": 2, "bf16": 2,
             "i32": 4, "u32": 4, "fp32": 4, "i64": 8, "u64": 8, "fp64": 8}
_TYPE = r"tensordesc<([a-z0-9]+)\[([0-9, ]+)\](,[^>]*)?>"  # compiled on first use (re's cache), not at import


@record
class TensorDescMeta:
    """How to encode one host descriptor parameter: Triton's ``tensordesc_meta`` entry for it."""

    swizzle: int
    elem_size: int
    elem_type: int
    block_size: tuple[int, ...]

    @property
    def rank(self) -> int:
        """Dimensions of the tensor (and of the box)."""
        return len(self.block_size)

    @property
    def host_dtype(self) -> int:
        """The CUtensorMapDataType that cuTensorMapEncodeTiled takes."""
        return DEVICE_TO_HOST_DTYPE[self.elem_type]


def is_descriptor(kind: str) -> bool:
    """True for a host tensor descriptor parameter type."""
    return kind.startswith("tensordesc")


def parse_type(kind: str) -> tuple[str, int]:
    """(dtype, rank) of a ``tensordesc<...>`` type; ValueError for anything the launcher does not take."""
    match = re.fullmatch(_TYPE, kind)
    if match is None or "input_rank" in kind:
        raise ValueError(f"parameter type {kind!r} is not a tiled host descriptor type (tensordesc<dtype[block]>)")
    dims = match.group(2).split(",")
    if not all(d.strip().isdigit() for d in dims) or not 1 <= len(dims) <= MAX_RANK:
        raise ValueError(f"parameter type {kind!r}: block shape must be 1 to {MAX_RANK} integers")
    return match.group(1), len(dims)


def from_triton(meta: object) -> TensorDescMeta:
    """One entry of Triton's ``metadata.tensordesc_meta``; ValueError for a map lazytriton cannot encode."""
    if not isinstance(meta, dict):
        raise ValueError(f"tensordesc_meta entry must be a dict, got {meta!r}")
    if meta.get("fp4_padded") or meta.get("is_im2col"):
        raise ValueError(f"tensordesc_meta {meta}: fp4-padded and im2col descriptors are not supported "
                         "(Triton 3.6 and 3.9 launch them differently)")
    try:
        made = TensorDescMeta(int(meta["swizzle"]), int(meta["elem_size"]), int(meta["elem_type"]),
                              tuple(int(b) for b in meta["block_size"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"tensordesc_meta entry {meta} lacks or mistypes a field: {exc}") from None
    check_one(made)
    return made


def check_one(meta: TensorDescMeta) -> None:
    """Raise ValueError unless ``meta`` is something cuTensorMapEncodeTiled can be asked to encode."""
    if meta.swizzle not in SWIZZLE_BYTES:
        raise ValueError(f"descriptor swizzle={meta.swizzle}, expected one of {sorted(SWIZZLE_BYTES)}")
    if meta.elem_size not in (1, 2, 4, 8):
        raise ValueError(f"descriptor elem_size={meta.elem_size}, expected 1, 2, 4 or 8")
    if meta.elem_type not in DEVICE_TO_HOST_DTYPE:
        raise ValueError(f"descriptor elem_type={meta.elem_type}, expected 0..15")
    box = meta.block_size
    if not 1 <= len(box) <= MAX_RANK or not all(1 <= b <= MAX_BOX for b in box):
        raise ValueError(f"descriptor block_size={list(box)}: 1 to {MAX_RANK} dims, each 1..{MAX_BOX}")
    span = SWIZZLE_BYTES[meta.swizzle]
    if span and box[-1] * meta.elem_size > span:
        raise ValueError(f"descriptor block_size={list(box)}: the inner box ({box[-1] * meta.elem_size} bytes) "
                         f"exceeds the {span}-byte swizzle span")


def check(arg_types: tuple[str, ...], metas: tuple[TensorDescMeta, ...]) -> None:
    """Raise ValueError unless ``metas`` describe exactly the descriptor parameters of ``arg_types``, in order."""
    kinds = [kind for kind in arg_types if is_descriptor(kind)]
    if len(kinds) != len(metas):
        raise ValueError(f"{len(kinds)} descriptor parameters but {len(metas)} tensordesc_meta entries")
    for kind, meta in zip(kinds, metas, strict=True):
        dtype, rank = parse_type(kind)
        check_one(meta)
        if rank != meta.rank:
            raise ValueError(f"parameter {kind!r} has rank {rank}, its tensordesc_meta block_size "
                             f"{list(meta.block_size)} rank {meta.rank}")
        if ELEM_SIZE.get(dtype) != meta.elem_size:
            raise ValueError(f"parameter {kind!r}: elem_size={meta.elem_size}, expected {ELEM_SIZE.get(dtype)}")
