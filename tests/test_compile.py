"""Compile-only checks for GPU targets this machine does not have: binaries and launch metadata.

Triton compiles for sm_90, sm_80, gfx942 and gfx950 without a GPU. Nothing here launches; the
checks are structural: an ELF of the right machine and arch, and metadata that a launcher can
trust (warps, warp size, shared memory within the target's limit, parameter layout).
"""

from __future__ import annotations

import itertools
import struct

import pytest

from lazytriton import dispatch
from lazytriton.cache_format import Entry
from lazytriton.compiler import CompileError, compile_variant, triton_version
from lazytriton.kernels import get, source_fingerprint
from lazytriton.target import Target
from lazytriton.variant import LAUNCH_ABI, Variant

# Most shared memory one program may use (bytes): cudaDevAttrMaxSharedMemoryPerBlockOptin on
# H100/H200 (227 KiB) and A100 (163 KiB); LDS per workgroup on MI300 (64 KiB) and MI355 (160 KiB).
SHARED_LIMIT = {"sm_90": 232448, "sm_80": 166912, "gfx942": 65536, "gfx950": 163840}

# ELF e_machine: EM_CUDA and EM_AMDGPU; e_flags EF_AMDGPU_MACH values of the two AMD targets.
EM_CUDA, EM_AMDGPU = 190, 224
AMDGPU_MACH = {"gfx942": 0x04C, "gfx950": 0x04F}

SMALL = dispatch.Config(64, 32, 4, 2)


def small_variant(target: str, dtype: str = "fp16", causal: bool = False, index64: bool = False) -> Variant:
    return dispatch.flash_fwd_variant(Target.parse(target), dtype, 64, causal, True, 4096, config=SMALL,
                                      index64=index64)


def expected_arg_types(dtype: str, index64: bool) -> tuple[str, ...]:
    """flash_fwd's runtime parameters, written out by hand (independent of the kernel description)."""
    index = "i64" if index64 else "i32"
    return (f"*{dtype}",) * 4 + ("*fp32",) + (index,) * 14 + ("i32",) * 5 + ("fp32",)


def check_elf(entry: Entry, target: Target) -> None:
    binary = entry.binary
    assert binary[:4] == b"\x7fELF", f"{entry.kind} is not an ELF: {binary[:8]!r}"
    assert binary[4] == 2 and binary[5] == 1, "expected a 64-bit little-endian ELF"
    (e_machine,) = struct.unpack_from("<H", binary, 18)
    (e_flags,) = struct.unpack_from("<I", binary, 48)
    if target.backend == "cuda":
        assert e_machine == EM_CUDA
        # The SM number sits in the low byte of e_flags (cubin ABI 7) or the next one (ABI 8, CUDA 12.8+).
        assert target.capability in (e_flags & 0xFF, (e_flags >> 8) & 0xFF), f"cubin e_flags {e_flags:#x}"
    else:
        assert e_machine == EM_AMDGPU
        if str(target) in AMDGPU_MACH:
            assert e_flags & 0xFF == AMDGPU_MACH[str(target)], f"hsaco e_flags {e_flags:#x}"


def check_entry(entry: Entry, variant: Variant) -> None:
    target = Target.parse(variant.target)
    assert entry.key == variant.key()
    assert entry.variant == str(variant)
    assert entry.target == variant.target
    assert entry.kind == target.binary_kind
    assert len(entry.binary) > 1024
    check_elf(entry, target)
    assert entry.name == get("flash_fwd").function
    assert entry.num_warps == variant.get("num_warps")
    assert entry.num_ctas == 1
    assert entry.warp_size == (32 if target.backend == "cuda" else 64)
    assert 0 < entry.shared <= SHARED_LIMIT[variant.target], (
        f"{variant} needs {entry.shared} B of shared memory; {variant.target} has {SHARED_LIMIT[variant.target]}")
    assert entry.hidden_args == ("global_scratch", "profile_scratch")
    index64 = bool(variant.get("INDEX64"))
    assert entry.arg_types == expected_arg_types(variant.dtype, index64)
    spec_types = tuple(t for t in get("flash_fwd").signature(variant.dtype, index64).values() if t != "constexpr")
    assert entry.arg_types == spec_types
    for size, align in ((entry.global_scratch_size, entry.global_scratch_align),
                        (entry.profile_scratch_size, entry.profile_scratch_align)):
        assert size >= 0 and align >= 1 and align & (align - 1) == 0
    prov = entry.provenance
    assert prov.compiler == "triton"
    assert prov.compiler_version == triton_version()
    assert prov.source_fingerprint == source_fingerprint("flash_fwd")
    assert prov.launch_abi == LAUNCH_ABI
    assert Entry.decode(entry.encode(), expected_key=entry.key) == entry


@pytest.mark.parametrize("target", ["sm_90", "sm_80", "gfx942", "gfx950"])
def test_compile_small_variant(target: str) -> None:
    variant = small_variant(target)
    check_entry(compile_variant(variant), variant)


@pytest.mark.parametrize(("dtype", "index64"), [("bf16", False), ("fp32", False), ("fp16", True)])
def test_compile_arg_types_follow_dtype_and_index(dtype: str, index64: bool) -> None:
    variant = small_variant("sm_90", dtype, causal=True, index64=index64)
    check_entry(compile_variant(variant), variant)


def test_compile_takes_the_key_it_is_given() -> None:
    variant = small_variant("sm_90")
    assert compile_variant(variant, "0" * 32).key == "0" * 32


def test_compile_error_names_the_variant() -> None:
    variant = dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, False, True, 4096,
                                         config=dispatch.Config(64, 32, 3, 2))  # 3 warps: not a power of two
    with pytest.raises(CompileError, match="num_warps=3"):
        compile_variant(variant)


def _default_variant(target: str, dtype: str, head_dim: int, causal: bool, seqlen_q: int = 4096) -> Variant:
    return dispatch.flash_fwd_variant(Target.parse(target), dtype, head_dim, causal, True, seqlen_q)


# Every default config the dispatcher gives sm_90 for long sequences (the largest tiles).
SM90_DEFAULTS = list(itertools.product(("fp16", "bf16", "fp32"), dispatch.HEAD_DIMS, (False, True)))


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "head_dim", "causal"), SM90_DEFAULTS)
def test_sm90_default_configs_compile_and_fit(dtype: str, head_dim: int, causal: bool) -> None:
    variant = _default_variant("sm_90", dtype, head_dim, causal)
    check_entry(compile_variant(variant), variant)


# The largest-tile defaults of the other targets: head dim 128 and 256, and fp32. A sweep of every
# default (4 targets x 3 dtypes x 5 head dims x causal x seqlen 16/64/1024, Triton 3.9) compiled and
# fit; the tightest were sm_90 fp16/bf16 d128 128/128/8/3 at 229376 of 232448 B and gfx942 fp32
# d256 at exactly 65536 B.
OTHER_DEFAULTS = [
    ("sm_80", "bf16", 128, False), ("sm_80", "fp16", 128, True), ("sm_80", "bf16", 256, True),
    ("sm_80", "fp32", 128, False), ("sm_80", "fp32", 256, False),
    ("gfx942", "fp16", 128, False), ("gfx942", "bf16", 256, True), ("gfx942", "fp32", 256, False),
    ("gfx950", "bf16", 128, True),
]


@pytest.mark.parametrize(("target", "dtype", "head_dim", "causal"), OTHER_DEFAULTS)
def test_other_targets_default_configs_compile_and_fit(target: str, dtype: str, head_dim: int, causal: bool) -> None:
    variant = _default_variant(target, dtype, head_dim, causal)
    check_entry(compile_variant(variant), variant)


def test_short_sequence_default_compiles() -> None:
    # seqlen_q <= 16 gives BLOCK_M 16: the smallest tile tl.dot takes.
    variant = _default_variant("sm_90", "bf16", 128, True, seqlen_q=8)
    assert variant.get("BLOCK_M") == 16
    check_entry(compile_variant(variant), variant)


def test_interpreting_then_compiling_in_one_process() -> None:
    """Triton's interpreter leaves triton.language patched after calls between @jit functions;
    lazytriton.interpreter runs it on a private copy, so a compile after a CPU call still works (and vice versa)."""
    import torch

    from lazytriton import compiler, dispatch
    from lazytriton.flash import attn_fwd

    q, k, v = (torch.randn(1, 1, 20, 64) for _ in range(3))
    attn_fwd(q, k, v, causal=True)
    variant = dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, True, True, 64,
                                         config=dispatch.Config(64, 32, 4, 2))
    assert compiler.compile_variant(variant).binary[:4] == b"\x7fELF"
    out, _ = attn_fwd(q, k, v, causal=True)
    assert torch.isfinite(out).all()
