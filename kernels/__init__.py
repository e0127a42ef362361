"""Kernel descriptions: what each Triton kernel takes and how it is launched.

A description names the source file of the ``@triton.jit`` function, its
parameters in order (with their Triton types), which of them are constexprs
and which may be assumed 16-divisible (under which flag). It is data (and,
for a warp-specialised kernel, the function that counts the warps it
launches): importing this package never imports triton. The sources
themselves (``*/triton_kernel.py``) are read only by ``lazytriton.compiler``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from lazytriton.record import record
from lazytriton.target import Target

if TYPE_CHECKING:  # lazytriton.variant imports this package: import it where it is used
    from lazytriton.variant import Variant


# Triton's name of a variant dtype where the two differ (the others, fp16, bf16 and fp32, are Triton's own):
# e4m3 is torch.float8_e4m3fn, OCP's FP8 with 4 exponent bits and no infinity; e5m2 is torch.float8_e5m2.
TRITON_DTYPES = {"e4m3": "fp8e4nv", "e5m2": "fp8e5"}


@record
class KernelSpec:
    """A Triton kernel as the compiler and the launcher see it.

    ``params`` lists every runtime parameter in order as ``(name, type)``;
    ``{dtype}`` in a type stands for the variant's dtype (``*{dtype}`` is a
    pointer to it) and ``{index}`` for the index type, ``i32`` unless the
    variant has ``INDEX64=true``. A host tensor descriptor parameter is typed
    ``tensordesc<{dtype}[1, 1, {BLOCK_N}, {BLOCK_D}]>``: names in braces other
    than ``dtype`` and ``index`` are the variant's constexprs (its block shape).
    ``aligned_params`` (pointers and the tensors' strides) may be marked
    16-divisible when the variant has ``ALIGN16=true``; ``seq_aligned_params``
    (sizes such as the seqlens, and strides derived from them) when it has
    ``SEQ16=true``. Two flags, because a packed (varlen) or odd-length call has
    aligned tensors but not aligned seqlens, and should keep the first hints.
    ``eight_params`` (the head dim where the kernel's rule takes multiples of
    8 only: TMA's 16-byte rows) are marked 8-divisible in every variant, so
    that a mask on them stays whole over 8 columns and 16-byte accesses stay
    16-byte accesses.
    ``wide_blocks`` are the BLOCK_ constexprs that may also be three times
    a power of two (a program of three power-of-two parts: flash_fwd_gluon's
    BLOCK_M of three consumer warpgroups); every other BLOCK_ field is a
    power of two.
    ``constexprs`` are the constexpr parameters, filled from the variant's
    functional and tuned fields. ``helpers`` names the other modules whose
    ``@jit`` functions the kernel calls (``from ... import``): their sources
    enter its fingerprint, and the interpreter imports them before loading
    the kernel's file.
    ``capability_flags`` are the kernel's last constexpr parameters, after
    ``constexprs``, which the compile target sets and no variant names:
    ``(name, capability)`` is true on a CUDA target of at least that
    capability (sm_89 is 89) and false everywhere else (the parameter's
    default, which Triton's interpreter takes); a capability of None: false
    everywhere (a flag a family keeps off until it is measured). They guard inline PTX a
    kernel takes where Triton's own lowering is slower; the variant's target
    already tells the binaries apart.
    ``flags`` are the kernel's own flags: boolean constexprs a variant writes
    only when true (absent: false, so the strings and keys of variants without
    them hold), beside the flags every attention kernel shares
    (``lazytriton.variant``'s); a family declares them here, in its folder.
    ``dependent`` names the capability flag under which the kernel is its
    stream predecessor's programmatic dependent (Hopper's programmatic
    dependent launch): where the flag is true for the target, the driver
    launches it with programmatic stream serialization, so its launch
    overlaps the kernel before it, and the kernel waits for that kernel's
    memory (``gdc_wait``) before it reads what it wrote (the kernel before
    it lets it start with ``gdc_launch_dependents``). "": launched plainly.
    ``dependent_flag``, where given, is a variant flag the variant must also
    carry to launch as a dependent (a kernel whose launches follow a given
    kernel only in some calls: those calls' variants carry the flag).
    A launcher without the attribute (``lt_kernel_launch``'s, a driver
    before CUDA 12.3) is still right: the wait then returns at once, the
    stream having ordered the two.
    ``warps`` gives the warps an entry of a variant launches a block with,
    for a warp-specialised kernel (Gluon's ``gl.warp_specialize``), whose
    partitions together run more warps than the variant's ``num_warps`` (the
    default partition's); None for every other kernel, which launches its
    ``num_warps``. ``launched_warps`` answers for any variant.
    """

    name: str
    module: str
    function: str
    params: tuple[tuple[str, str], ...]
    constexprs: tuple[str, ...]
    aligned_params: tuple[str, ...]
    seq_aligned_params: tuple[str, ...] = ()
    helpers: tuple[str, ...] = ()
    eight_params: tuple[str, ...] = ()
    wide_blocks: tuple[str, ...] = ()
    warps: Callable[[Variant], int] | None = None
    capability_flags: tuple[tuple[str, int | None], ...] = ()
    flags: tuple[str, ...] = ()
    dependent: str = ""
    dependent_flag: str = ""

    @property
    def source_path(self) -> Path:
        """The kernel's source file, found without importing it."""
        return _module_path(self.module)

    @property
    def source_paths(self) -> tuple[Path, ...]:
        """The files of what the kernel computes: its own, then its ``helpers``'."""
        return (self.source_path, *(_module_path(name) for name in self.helpers))

    def target_constexprs(self, backend: str, capability: int | None) -> dict[str, bool]:
        """The ``capability_flags``' values for a compile target (``capability`` None: not CUDA)."""
        have = capability if backend == "cuda" and capability is not None else -1
        return {name: least is not None and have >= least for name, least in self.capability_flags}

    def dependent_launch(self, backend: str, capability: int | None) -> bool:
        """Whether the kernel's binary for a compile target is launched as a programmatic dependent."""
        return bool(self.dependent) and self.target_constexprs(backend, capability)[self.dependent]

    def signature(self, dtype: str, index64: bool = False, constexprs: Mapping[str, object] | None = None
                  ) -> dict[str, str]:
        """Triton's signature dict for this kernel at ``dtype``, constexprs included.

        ``constexprs`` fill the block shapes of descriptor parameter types (KeyError without them).
        """
        index = "i64" if index64 else "i32"
        values = {**(constexprs or {}), "dtype": TRITON_DTYPES.get(dtype, dtype), "index": index}
        sig = {name: kind.format(**values) for name, kind in self.params}
        sig.update({name: "constexpr" for name in self.constexprs})
        sig.update({name: "constexpr" for name, _ in self.capability_flags})
        return sig


@functools.cache
def _module_path(module: str) -> Path:
    """A module's source file, found without importing it (once per process: the kernels share files)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"kernel source module {module} not found")
    return Path(spec.origin)


@functools.cache
def source_bytes(path: Path) -> bytes:
    """A source file's bytes, line endings normalised, read once per process.

    flash_bwd's two kernels share one file, and the attention kernels ``chunk.py``.
    """
    data = path.read_bytes()
    return data.replace(b"\r\n", b"\n") if b"\r" in data else data  # one memchr: most files hold no \r


@functools.cache
def source_fingerprint(kernel: str) -> str:
    """xxh3-64 of the kernel's source files (line endings normalised) and of its description's typing and hints.

    The files (``KernelSpec.source_paths``: its own, then its helpers') hold
    the kernel and every ``@triton.jit`` function it calls, so any change to
    what it computes changes the fingerprint, and with it every key of that
    kernel. The description decides the binary too (parameter
    types, which parameters are marked 16-divisible under ALIGN16 and SEQ16,
    which 8-divisible always)
    without touching the source: when ALIGN16 stopped covering flash_bwd's
    seqlens, its ALIGN16 variants kept their strings, and entries compiled
    with the old hints must miss, not serve an odd-length call. Computed once
    per process.
    """
    spec = get(kernel)
    texts = [source_bytes(path) for path in spec.source_paths]
    hints: tuple[object, ...] = (spec.aligned_params, spec.seq_aligned_params)
    hints += (spec.eight_params,) if spec.eight_params else ()
    hints += (spec.capability_flags,) if spec.capability_flags else ()
    described = repr((spec.params, spec.constexprs, *hints)).encode()
    return xxhash.xxh3_64_hexdigest(b"\0".join((*texts, described)))


# Kernel families (one folder each under kernels/) and the kernels of each, in launch order.
FAMILIES: dict[str, tuple[str, ...]] = {
    "flash_fwd": ("flash_fwd",),
    "flash_bwd": ("flash_bwd_dq", "flash_bwd_dkdv"),
    "flash_decode": ("flash_decode_split", "flash_decode_combine"),
    "kv_append": ("kv_append", "kv_append_lengths"),  # flash_attn_with_kvcache's new keys, then (packed new
    # keys) each sequence's length after the append, before flash_decode runs
    "flash_combine": ("flash_combine",),  # flash_attn_combine: partial results over key chunks merged
    "kv_slots": ("kv_slots",),  # write_kvcache_slots: keys and values written at cache slots (vLLM's slot_mapping)
    "flash_bwd_dsinks": ("flash_bwd_dsinks",),  # the attention sinks' gradient, after flash_bwd (C API, GPU)
    "flash_fwd_mla": ("flash_fwd_mla",),  # FlashAttention-3's forward with qv, or v's head dim up to 512 (MLA)
}


# Compiled helpers a family brings (``lazytriton.driver.helpers`` builds and loads them as it does its own launch
# helper): the modules whose ``HELPER`` describes each. flash_fwd's and flash_decode's C++ warm-path tails (each
# family's hot.py runs its own).
COMPILED_HELPERS: tuple[str, ...] = ("lazytriton.kernels.flash_fwd.hotpath", "lazytriton.kernels.flash_decode.hotpath")
# Their extensions' import names, in the same order (each module's ``MODULE``; the files: ``helpers.extension_file``):
# ``helpers.all_in_package`` looks for the package's builds by these names, without importing the modules above.
COMPILED_EXTENSIONS: tuple[str, ...] = ("lazytriton.kernels.flash_fwd._hotpath",
                                        "lazytriton.kernels.flash_decode._hotpath")


def family_of(kernel: str) -> str:
    """The family a kernel belongs to (its folder under kernels/)."""
    for family, kernels in FAMILIES.items():
        if kernel in kernels:
            return family
    raise ValueError(f"unknown kernel {kernel!r}; known: {sorted(k for ks in FAMILIES.values() for k in ks)}")


# Where each kernel's description lives (module, name): ``get`` imports it on the kernel's first lookup, so a
# process imports the descriptions of the kernels it looks up, not every family's. Each family's kernels (FAMILIES),
# then the alternatives that sit in a family's folder but are in no family (flash_fwd_gluon, flash_fwd_fp8,
# flash_fwd_fp8_gluon, flash_fwd_host_tma, flash_bwd_dkdv_gluon and the fused backward's two kernels, flash_bwd_prep and
# flash_bwd_fused_gluon): not kernels a call launches in order (prewarm enumerates families; dispatch picks them by
# rule). ``tests/test_lazy_imports.py`` holds every row to the description it names.
SPEC_HOMES: dict[str, tuple[str, str]] = {
    "flash_fwd": ("lazytriton.kernels.flash_fwd", "FLASH_FWD"),
    "flash_bwd_dq": ("lazytriton.kernels.flash_bwd", "FLASH_BWD_DQ"),
    "flash_bwd_dkdv": ("lazytriton.kernels.flash_bwd", "FLASH_BWD_DKDV"),
    "flash_decode_split": ("lazytriton.kernels.flash_decode", "FLASH_DECODE_SPLIT"),
    "flash_decode_combine": ("lazytriton.kernels.flash_decode", "FLASH_DECODE_COMBINE"),
    "kv_append": ("lazytriton.kernels.kv_append.spec", "KV_APPEND"),
    "kv_append_lengths": ("lazytriton.kernels.kv_append.lengths_spec", "KV_APPEND_LENGTHS"),
    "flash_combine": ("lazytriton.kernels.flash_combine.spec", "FLASH_COMBINE"),
    "kv_slots": ("lazytriton.kernels.kv_slots.spec", "KV_SLOTS"),
    "flash_bwd_dsinks": ("lazytriton.kernels.flash_bwd_dsinks.spec", "FLASH_BWD_DSINKS"),
    "flash_fwd_mla": ("lazytriton.kernels.flash_fwd_mla", "FLASH_FWD_MLA"),
    "flash_fwd_gluon": ("lazytriton.kernels.flash_fwd.gluon_spec", "FLASH_FWD_GLUON"),
    "flash_fwd_fp8": ("lazytriton.kernels.flash_fwd.fp8_spec", "FLASH_FWD_FP8"),
    "flash_fwd_fp8_gluon": ("lazytriton.kernels.flash_fwd.fp8_gluon_spec", "FLASH_FWD_FP8_GLUON"),
    "flash_fwd_host_tma": ("lazytriton.kernels.flash_fwd", "FLASH_FWD_HOST_TMA"),
    "flash_bwd_dkdv_gluon": ("lazytriton.kernels.flash_bwd.gluon_spec", "FLASH_BWD_DKDV_GLUON"),
    "flash_bwd_prep": ("lazytriton.kernels.flash_bwd.fused_spec", "FLASH_BWD_PREP"),
    "flash_bwd_fused_gluon": ("lazytriton.kernels.flash_bwd.fused_spec", "FLASH_BWD_FUSED_GLUON"),
}
_looked_up: dict[str, KernelSpec] = {}  # the descriptions imported so far, by kernel


def specialised_warps(default: int, workers: tuple[int, ...]) -> int:
    """The warps of a ``gl.warp_specialize`` program whose partitions set their registers (``setmaxnreg``).

    The default partition's ``default`` warps (the variant's num_warps), then
    the ``workers``' warps together, padded to whole warpgroups of 4: Triton's
    AllocateWarpGroups pass pads them so that every warp of a warpgroup is
    there to give up registers. One producer warp beside 8 default warps: 12.
    """
    return default + -(-sum(workers) // 4) * 4


def launched_warps(variant: Variant) -> int:
    """The warps an entry of ``variant`` launches a block with, its metadata num_warps (ValueError: unknown kernel).

    The variant's ``num_warps``, or what its kernel's ``KernelSpec.warps``
    counts for a warp-specialised kernel. The launch itself takes the entry's
    num_warps (``Entry.block_threads``); ``lazytriton cache verify`` and
    ``cache import`` check that it is this count.
    """
    spec = get(variant.kernel)
    return spec.warps(variant) if spec.warps is not None else int(variant.get("num_warps"))


def dependent_launch(variant: Variant) -> bool:
    """Whether ``variant``'s binary is launched as its stream predecessor's programmatic dependent."""
    spec = get(variant.kernel)
    if not spec.dependent or (spec.dependent_flag and not variant.constexprs.get(spec.dependent_flag, False)):
        return False
    target = Target.parse(variant.target)
    return spec.dependent_launch(target.backend, target.capability)


def get(kernel: str) -> KernelSpec:
    """The description of a kernel by name (ValueError: unknown kernel); its module is imported on first lookup."""
    found = _looked_up.get(kernel)
    if found is not None:
        return found
    home = SPEC_HOMES.get(kernel) if type(kernel) is str else None
    if home is None:
        raise ValueError(f"unknown kernel {kernel!r}; known: {sorted(SPEC_HOMES)}")
    found = getattr(importlib.import_module(home[0]), home[1])
    if found.name != kernel:
        raise RuntimeError(f"kernels.SPEC_HOMES: {home[0]}.{home[1]} describes {found.name!r}, not {kernel!r}")
    _looked_up[kernel] = found
    return found
