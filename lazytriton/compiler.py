"""The compiler: Variant -> Entry through Triton, and the CPU interpreter.

This is the only module that imports triton, and it does so inside its
functions: importing it costs nothing. Entries it makes carry every piece of
launch metadata, so that they launch later without Triton (and with another
Triton version installed).

Supported: Triton 3.6 (the GPU host) to 3.9 (CI). Both append two hidden
pointer parameters (global and profile scratch) after the kernel's own.
Triton 3.6 fixes a process's float8 lowering for the first target it lowers
one for: ``compile_variant`` then compiles another target's float8 variants
in a fresh interpreter (``lazytriton.float8_lowering``).
CPU tensors go through Triton's interpreter, in ``lazytriton.interpreter``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from lazytriton import float8_lowering
from lazytriton.cache_format import Entry, Provenance, tensordesc
from lazytriton.cache_format.tensordesc import TensorDescMeta
from lazytriton.kernels import KernelSpec, get, source_fingerprint
from lazytriton.target import Target
from lazytriton.triton_lock import TRITON_LOCK
from lazytriton.variant import LAUNCH_ABI, Variant, kernel_constexprs


class CompileError(RuntimeError):
    """Triton could not compile a variant; the message names it."""


# Binaries are built without their debug sections, which no launch reads. CUDA: ptxas's options for every compile
# (Triton's ``ptx_options``, which the PTXAS_OPTIONS environment variable would otherwise set). Triton compiles
# with line info, and ptxas then puts the whole PTX (``.nv_debug_ptx_txt``) and two line tables in the cubin: 70%
# of its bytes, read, decompressed and handed to the driver at every load. ``-suppress-debug-info`` leaves them
# out and nothing else: the PTX is the same, and so is the code ptxas makes of it, byte for byte
# (experiments/line_info_code.py), while Triton's own switch (TRITON_DISABLE_LINE_INFO) drops the PTX's line
# directives too, and ptxas then allocates some kernels' registers otherwise. A key names one code whatever the
# user's PTXAS_OPTIONS or TRITON_DISABLE_LINE_INFO.
PTXAS_OPTIONS = "-suppress-debug-info"
# ROCm: whether the code object keeps its DWARF line tables (a quarter of its bytes). Off: Triton's own switch
# (TRITON_DISABLE_LINE_INFO) is set for each compile; LLVM's AMDGPU code does not depend on them (the same code
# and metadata with and without, every family on gfx942 and gfx950: experiments/line_info_code.py).
HIP_LINE_INFO = False


# The target this process's Triton fixed its float8 lowering for (``float8_lowering.fixed_after``), under
# TRITON_LOCK; it stays None where the installed Triton lowers each compile for its own target.
_float8_fixed_for: str | None = None


def float8_fixed_for() -> str | None:
    """The target this process's float8 lowering is fixed for (Triton 3.6, once it lowered one), or None."""
    return _float8_fixed_for


def triton_version() -> str | None:
    """The installed Triton's version, or None (read without importing it)."""
    try:
        from importlib.metadata import version

        return version("triton")
    except Exception:
        return None


def _version_tuple(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def hidden_args_for(version: str) -> tuple[str, ...]:
    """The pointers Triton appends to a kernel's parameters, by Triton version."""
    v = _version_tuple(version)
    if v >= (3, 5):
        return ("global_scratch", "profile_scratch")
    if v >= (3, 2):
        return ("global_scratch",)
    return ()


def _ptx_param_count(ptx: str, name: str) -> int:
    match = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if match is None:
        raise CompileError(f"kernel {name} not found in PTX")
    return match.group(1).count(".param")


def _check_signature(spec: KernelSpec, fn: Any) -> None:
    expected = [name for name, _ in spec.params] + list(spec.constexprs) + [name for name, _ in spec.capability_flags]
    if list(fn.arg_names) != expected:
        raise CompileError(f"kernel {spec.name}: source parameters {fn.arg_names} differ from its description "
                           f"{expected}")


def divisibility_hints(spec: KernelSpec, variant: Variant) -> dict[tuple[int, ...], list[list[Any]]]:
    """Triton's ``attrs`` for ``variant``: the divisibility its parameters may be assumed to have.

    ``tt.divisibility`` 16 on ``aligned_params`` under ALIGN16 and on
    ``seq_aligned_params`` under SEQ16; 8 on ``eight_params`` always (unless
    marked 16).
    """
    constexprs = variant.constexprs
    marked: set[str] = set()
    if constexprs.get("ALIGN16", False):
        marked.update(spec.aligned_params)
    if constexprs.get("SEQ16", False):
        marked.update(spec.seq_aligned_params)
    return {(i,): [["tt.divisibility", 16 if name in marked else 8]] for i, (name, _) in enumerate(spec.params)
            if name in marked or name in spec.eight_params}


def _expanded_count(arg_types: Sequence[str]) -> int:
    """Parameters the compiled kernel takes for ``arg_types``: a host descriptor is a map, its shape and strides."""
    return sum(1 + 2 * tensordesc.parse_type(kind)[1] if tensordesc.is_descriptor(kind) else 1 for kind in arg_types)


def _descriptor_meta(variant: Variant, arg_types: tuple[str, ...], meta: Any) -> tuple[TensorDescMeta, ...]:
    """The Entry's ``tensordesc_meta`` from Triton's: how the launcher encodes each host descriptor.

    Without Triton's metadata (a target with no TMA) Triton passes a descriptor
    as a pointer, shapes, strides and flags, in a layout that differs between
    3.6 and 3.9: such kernels are refused rather than launched wrongly.
    """
    if not any(tensordesc.is_descriptor(kind) for kind in arg_types):
        return ()
    if not meta:
        raise CompileError(f"{variant}: host tensor descriptors need a target with TMA (sm_90+); "
                           "Triton gave no tensordesc_meta")
    try:
        metas = tuple(tensordesc.from_triton(item) for item in meta)
        tensordesc.check(arg_types, metas)
    except ValueError as exc:
        raise CompileError(f"{variant}: {exc}") from None
    return metas


@contextlib.contextmanager
def _compile_environment(backend: str) -> Iterator[None]:
    """Triton's environment for one compile, restored after it.

    Its own cache in a throwaway dir (every compile is real, nothing leaks
    into ~/.triton), and its line info switch ours, not the user's: off on
    ROCm unless ``HIP_LINE_INFO``, on for CUDA (where ptxas is told to leave
    the debug sections out: with the switch off ptxas would make other code).
    """
    with tempfile.TemporaryDirectory(prefix="lazytriton-triton-") as tmp:
        values = {"TRITON_CACHE_DIR": tmp,
                  "TRITON_DISABLE_LINE_INFO": "1" if backend == "hip" and not HIP_LINE_INFO else "0"}
        old = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in old.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def compile_variant(variant: Variant, key: str | None = None) -> Entry:
    """Compile ``variant`` for its target with Triton and return the Entry.

    In this process, unless the installed Triton fixed this process's float8
    lowering for another target and ``variant`` converts float8: then in a
    fresh interpreter, which compiles it as any fresh process would
    (``lazytriton.float8_lowering``). So, after such a fix, is another CUDA
    target's variant whose compile here failed or showed a float8 conversion
    its fields did not foretell.
    """
    with TRITON_LOCK:
        fixed, version = _float8_fixed_for, triton_version()
        elsewhere = float8_lowering.bound_elsewhere(variant, fixed, version)
        if not float8_lowering.needs_fresh_process(variant, fixed, version):
            try:
                entry, ir = _compile(variant, key)
            except CompileError:
                if not elsewhere:
                    raise
            else:
                if not (elsewhere and float8_lowering.CONVERSION_OP in ir):
                    return entry
    try:
        return float8_lowering.compile_fresh(variant, key or variant.key())
    except float8_lowering.FreshCompileError as exc:
        raise CompileError(f"compiling {variant} in a fresh process (this one's Triton {version} lowers float8 "
                           f"for {fixed} only) failed: {exc}") from None


def compile_in_process(variant: Variant, key: str | None = None) -> Entry:
    """Compile ``variant`` in this process whatever its float8 lowering is fixed for (``compile_variant``'s part).

    Triton is an optional extra (a deployment served from images needs none):
    without it, a miss ends here with an ImportError that says how to get it.
    """
    return _compile(variant, key)[0]


def _compile(variant: Variant, key: str | None) -> tuple[Entry, str]:
    """``compile_in_process``, and the TTGIR it compiled through (float8 conversions show there)."""
    global _float8_fixed_for
    try:
        import triton
    except ModuleNotFoundError as exc:
        if exc.name != "triton":  # installed but broken: its own error says more
            raise
        raise ImportError(f"compiling {variant} needs triton, which is not installed: pip install 'lazytriton[jit]' "
                          "(or serve it from an image built by lazytriton prewarm)", name="triton") from exc
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = get(variant.kernel)
    target = Target.parse(variant.target)
    fn = getattr(importlib.import_module(spec.module), spec.function)
    _check_signature(spec, fn)
    constexprs = {**kernel_constexprs(variant, spec.constexprs),
                  **spec.target_constexprs(target.backend, target.capability)}
    options: dict[str, Any] = dict(variant.options)
    options.setdefault("enable_fp_fusion", True)
    if target.backend == "cuda":
        options["ptx_options"] = PTXAS_OPTIONS
    arch: int | str = int(target.arch) if target.backend == "cuda" else target.arch
    signature = spec.signature(variant.dtype, bool(variant.constexprs.get("INDEX64", False)), constexprs)
    source_type: Any = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # a Gluon kernel (flash_fwd_gluon) has its own source type
        try:
            from triton.experimental.gluon import GluonASTSource
        except ImportError:  # Triton 3.6 has it only in its private module
            from triton.experimental.gluon._runtime import GluonASTSource

        source_type = GluonASTSource
    source = source_type(fn, signature, constexprs=constexprs, attrs=divisibility_hints(spec, variant))
    with TRITON_LOCK, _compile_environment(target.backend):
        fixes = float8_lowering.fixed_per_process(triton.__version__)
        try:
            kernel = triton.compile(source, target=GPUTarget(target.backend, arch, target.warp_size), options=options)
        except Exception as exc:
            if fixes:
                _float8_fixed_for = float8_lowering.fixed_after(_float8_fixed_for, variant, None)
            raise CompileError(f"compiling {variant} failed: {type(exc).__name__}: {exc}") from exc
        ir = str(kernel.asm.get("ttgir", ""))
        if fixes:
            _float8_fixed_for = float8_lowering.fixed_after(_float8_fixed_for, variant, ir)
    md = kernel.metadata
    version = str(getattr(md, "triton_version", None) or triton.__version__)
    hidden = hidden_args_for(version)
    arg_types = tuple(kind for kind in signature.values() if kind != "constexpr")
    descriptors = _descriptor_meta(variant, arg_types, getattr(md, "tensordesc_meta", None))
    if target.backend == "cuda":
        found = _ptx_param_count(kernel.asm["ptx"], md.name) - _expanded_count(arg_types)
        if found != len(hidden):
            raise CompileError(f"{variant}: PTX has {found} hidden parameters, "
                               f"Triton {version} should add {len(hidden)}")
    entry = Entry(
        key=key or variant.key(),
        variant=str(variant),
        target=str(target),
        kind=target.binary_kind,
        binary=bytes(kernel.asm[target.binary_kind]),
        name=md.name,
        num_warps=md.num_warps,
        num_ctas=getattr(md, "num_ctas", 1),
        warp_size=target.warp_size,
        shared=md.shared,
        global_scratch_size=getattr(md, "global_scratch_size", 0),
        global_scratch_align=getattr(md, "global_scratch_align", 1),
        profile_scratch_size=getattr(md, "profile_scratch_size", 0),
        profile_scratch_align=getattr(md, "profile_scratch_align", 1),
        arg_types=arg_types,
        hidden_args=hidden,
        tensordesc_meta=descriptors,
        provenance=Provenance(
            compiler="triton", compiler_version=version, source_fingerprint=source_fingerprint(variant.kernel),
            created=time.time(), launch_abi=LAUNCH_ABI,
        ),
    )
    return entry, ir


def interpret(kernel: str, grid: Sequence[int], args: Sequence[Any], constexprs: dict[str, Any]) -> None:
    """Run a kernel on CPU tensors through Triton's interpreter (``lazytriton.interpreter``)."""
    from lazytriton import interpreter

    interpreter.interpret(kernel, grid, args, constexprs)
