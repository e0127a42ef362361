"""Compile-only checks for GPU targets this machine does not have: binaries and launch metadata.

Triton compiles for sm_90, sm_80, gfx942 and gfx950 without a GPU. Nothing here launches; the
checks are structural: an ELF of the right machine and arch, and metadata that a launcher can
trust (warps, warp size, shared memory within the target's limit, parameter layout).
"""

from __future__ import annotations

import itertools
import os
import struct
from typing import Any

import pytest

from lazytriton import compiler, geometry
from lazytriton.cache_format import Entry
from lazytriton.cache_format.elf import section_contents
from lazytriton.compiler import CompileError, compile_in_process, compile_variant, triton_version
from lazytriton.kernels import get, source_fingerprint
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import LAUNCH_ABI, Variant

# Most shared memory one program may use (bytes): cudaDevAttrMaxSharedMemoryPerBlockOptin on
# H100/H200 (227 KiB) and A100 (163 KiB); LDS per workgroup on MI300 (64 KiB) and MI355 (160 KiB).
SHARED_LIMIT = {"sm_90": 232448, "sm_80": 166912, "gfx942": 65536, "gfx950": 163840}

# ELF e_machine: EM_CUDA and EM_AMDGPU; e_flags EF_AMDGPU_MACH values of the two AMD targets.
EM_CUDA, EM_AMDGPU = 190, 224
AMDGPU_MACH = {"gfx942": 0x04C, "gfx950": 0x04F}

SMALL = Config(64, 32, 4, 2)


def small_variant(target: str, dtype: str = "fp16", causal: bool = False, index64: bool = False) -> Variant:
    return fwd_dispatch.flash_fwd_variant(Target.parse(target), dtype, 64, causal, True, 4096, config=SMALL,
                                          index64=index64)


def expected_arg_types(dtype: str, index64: bool) -> tuple[str, ...]:
    """flash_fwd's runtime parameters, written out by hand (independent of the kernel description)."""
    index = "i64" if index64 else "i32"
    mods = ("*fp32", f"*{dtype}", "*i64")  # Alibi, Bias, Philox (after the cu_seqlens pointers)
    # ... then Seqused_q, Seqused_k, Sinks, the strides, the sizes (group_size, seqlen_q, seqlen_k, head_dim,
    # head_dim_v, causal_offset, the window, attention_chunk), stride_alibi_b and the bias's four 64-bit strides,
    # then sm_scale, softcap, dropout_p
    return (f"*{dtype}",) * 4 + ("*fp32",) + ("*i32",) * 2 + mods + ("*i32",) * 2 + ("*fp32",) + (index,) * 14 + \
        ("i32",) * 10 + ("i64",) * 4 + ("fp32",) * 3


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


DEBUG_SECTIONS = {"cuda": (".nv_debug_ptx_txt", ".debug_line", ".nv_debug_line_sass"),
                  "hip": (".debug_line", ".debug_info")}


@pytest.mark.parametrize("target", ["sm_90", "sm_80", "gfx942"])
def test_a_binary_leaves_its_debug_sections_out_and_keeps_tritons_code(target: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The served binary has no PTX text or line tables, and the very code of Triton's own compile with them."""
    debug = DEBUG_SECTIONS[Target.parse(target).backend]
    variant = small_variant(target, causal=True)
    monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "1")  # a user's setting: the compile sets its own, then restores it
    served = section_contents(compile_in_process(variant).binary)
    assert os.environ["TRITON_DISABLE_LINE_INFO"] == "1"
    monkeypatch.setattr(compiler, "PTXAS_OPTIONS", "")
    monkeypatch.setattr(compiler, "HIP_LINE_INFO", True)
    kept = section_contents(compile_in_process(variant).binary)
    assert all(name in kept for name in debug), sorted(kept)  # what Triton's own compile leaves in
    assert not [name for name in debug if name in served]
    code = [name for name in kept if name.startswith(".text")]
    assert code and all(served[name] == kept[name] for name in code)
    assert sum(map(len, served.values())) < 0.8 * sum(map(len, kept.values()))


def test_compile_takes_the_key_it_is_given() -> None:
    variant = small_variant("sm_90")
    assert compile_variant(variant, "0" * 32).key == "0" * 32


def test_compile_error_names_the_variant() -> None:
    variant = fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, False, True, 4096,
                                             config=Config(64, 32, 3, 2))  # 3 warps: not a power of two
    with pytest.raises(CompileError, match="num_warps=3"):
        compile_variant(variant)


def _default_variant(target: str, dtype: str, head_dim: int, causal: bool, seqlen_q: int = 4096) -> Variant:
    return fwd_dispatch.flash_fwd_variant(Target.parse(target), dtype, head_dim, causal, True, seqlen_q)


# Every default config the dispatcher gives sm_90 for long sequences (the largest tiles).
SM90_DEFAULTS = list(itertools.product(("fp16", "bf16", "fp32"), geometry.HEAD_DIMS, (False, True)))


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

    from lazytriton import compiler
    from lazytriton.flash import attn_fwd
    from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
    from lazytriton.tiles import Config

    q, k, v = (torch.randn(1, 1, 20, 64) for _ in range(3))
    attn_fwd(q, k, v, causal=True)
    variant = fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, True, True, 64,
                                             config=Config(64, 32, 4, 2))
    assert compiler.compile_variant(variant).binary[:4] == b"\x7fELF"
    out, _ = attn_fwd(q, k, v, causal=True)
    assert torch.isfinite(out).all()


# --- TMA (device-side tensor descriptors): sm_90 only ---------------------------------------------------------

# Each program writes its four descriptors (Q, K, V, Out: 128 bytes each, 128-byte aligned) into its own slice
# of Triton's hidden global_scratch buffer, at (linear program id) x global_scratch_size, so a launch needs
# grid x num_ctas x 512 bytes there (the PTX of Triton 3.6.0 and 3.9.0 computes the offset so: measured).
TMA_SCRATCH = 4 * 128


def tma_variant(dtype: str = "bf16", head_dim: int = 64, causal: bool = False, seqlen_q: int = 4096,
                index64: bool = False, config: Config | None = SMALL) -> Variant:
    return fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), dtype, head_dim, causal, True, seqlen_q, config=config,
                                          index64=index64, tma=True)


def check_tma_entry(entry: Entry, variant: Variant) -> None:
    from lazytriton.prewarm.limits import estimate_shared, refusal

    check_entry(entry, variant)
    assert variant.get("TMA") is True and variant.get("ALIGN16") is True
    assert (entry.global_scratch_size, entry.global_scratch_align) == (TMA_SCRATCH, 128), (
        "a TMA variant keeps its descriptors in global scratch; the launcher must allocate it")
    assert entry.hidden_args == ("global_scratch", "profile_scratch")
    # prewarm must not refuse what compiles. Its estimate is a lower bound at 16-bit dtypes; an fp32 TMA
    # variant uses less (64/32/64, 2 stages: 24856 B against an estimate of 32768, Triton 3.9).
    assert refusal(variant) is None
    if variant.dtype != "fp32":
        assert estimate_shared(variant) <= entry.shared


# Dispatch's shapes of TMA variants besides the defaults: 64-bit strides, BLOCK_M 16 for short queries, fp16
# and fp32 (allowed on request, not chosen), the largest head dim. A padded head dim (EVEN_D=false) is refused:
# tests/test_dispatch.py::test_tma_needs_a_head_dim_that_fills_its_tile.
TMA_SHAPES = [
    dict(dtype="bf16", head_dim=64),
    dict(dtype="fp16", head_dim=32, causal=True),
    dict(dtype="bf16", head_dim=128, causal=True, index64=True),
    dict(dtype="fp16", head_dim=128, seqlen_q=8, config=None),
    dict(dtype="fp32", head_dim=64, causal=True),
    dict(dtype="bf16", head_dim=256, config=None),
]


@pytest.mark.parametrize("shape", TMA_SHAPES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_tma_variant_compiles_with_global_scratch(shape: dict) -> None:
    variant = tma_variant(**shape)
    check_tma_entry(compile_variant(variant), variant)


def test_pointer_variant_needs_no_global_scratch() -> None:
    variant = fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "bf16", 64, False, True, 4096, config=SMALL,
                                             tma=False)
    entry = compile_variant(variant)
    check_entry(entry, variant)
    assert entry.global_scratch_size == 0


def test_variant_without_tma_or_with_tma_false_compiles_the_pointer_kernel() -> None:
    # Variant strings written before TMA existed (miss logs, tuning scripts) still compile, to the pointer kernel.
    old = small_variant("sm_90")
    assert "TMA" not in dict(old.functional)
    explicit = Variant.parse(str(old).replace("INDEX64=false", "INDEX64=false,TMA=false"))
    assert explicit.get("TMA") is False and explicit.key() != old.key()
    for variant in (old, explicit):
        assert compile_variant(variant).global_scratch_size == 0


def test_launcher_gives_a_tma_entry_the_scratch_it_expects() -> None:
    from lazytriton.driver import gpu
    from lazytriton.kernels.flash_fwd import grid

    variant = tma_variant()
    entry = compile_variant(variant)

    class Api(gpu._GpuApi):
        def __init__(self) -> None:
            from lazytriton.driver.cdefs import CUDA_CDEF, make_ffi

            self.ffi = make_ffi("cuda", CUDA_CDEF)
            self.scratch: list[int] = []

        def launch(self, kernel: gpu.LoadedKernel, grid_: tuple[int, int, int], stream: int, buffers: Any) -> None:
            slot = len(entry.arg_types)  # the first hidden pointer: global_scratch
            self.scratch.append(int(self.ffi.cast("uint64_t *", buffers.params[slot])[0]))

    class Memory:
        def data_ptr(self) -> int:
            return 1 << 20

    api, asked = Api(), []
    kernel = gpu.LoadedKernel(api, entry, 0, None)
    launch_grid = grid(1000, 6, 2, int(variant.get("BLOCK_M")))
    ints = tuple(range(1, len(entry.arg_types) - 2))  # all but the three floats (sm_scale, softcap, dropout_p)
    kernel.launch(launch_grid, 0, ints, (0.125, 0.0, 0.0), lambda n, dev: asked.append(n) or Memory())
    assert asked == [launch_grid[0] * launch_grid[1] * launch_grid[2] * entry.num_ctas * TMA_SCRATCH]
    assert api.scratch == [1 << 20], "global_scratch must reach the kernel's first hidden parameter"


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "head_dim", "causal"),
                         list(itertools.product(("fp16", "bf16"), geometry.HEAD_DIMS, (False, True))))
def test_sm90_default_configs_compile_and_fit_with_tma(dtype: str, head_dim: int, causal: bool) -> None:
    variant = tma_variant(dtype, head_dim, causal, config=None)
    check_tma_entry(compile_variant(variant), variant)
