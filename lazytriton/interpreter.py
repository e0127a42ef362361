"""CPU tensors through Triton's interpreter, without patching the Triton that compiles.

Triton's interpreter works by patching ``triton.language`` (its builtins, the
methods of ``tl.tensor`` and ``tl.dtype``, ``tl.range``...) for as long as a
kernel runs, and calls between ``@jit`` functions leave those patches in place.
In a process that also compiles, another thread's compile would then see them
(19 of 20 compiles failed with ``'block_argument' object has no attribute
'dtype'`` while ``attn_fwd`` ran on CPU tensors in another thread).

So the interpreter gets a Triton language of its own: ``triton.language`` and
``triton.runtime.interpreter`` are imported a second time, as private module
objects, and the kernel module is loaded against them. Every patch the
interpreter makes lands on these private modules, which nothing else uses; the
``triton.language`` that compiles is never touched. Its standard library
(``tl.max``, ``tl.zeros``...) is made of interpreted functions, as in a
process started with ``TRITON_INTERPRET=1``.

The copy is built once per process (0.24 s on a 2-core machine, Triton 3.9),
and that is the one moment the process sees it: ``sys.modules`` holds the
private modules instead of the real ones, and ``TRITON_INTERPRET`` reads 0,
while they are imported. It happens under ``triton_lock.TRITON_LOCK``, so no
compile of lazytriton's runs meanwhile; a thread that imports a
``triton.language`` module for the first time in that instant could get the
private one.

Four fixes of Triton's interpreter are installed on the private copy, for good:

- ``tl.dot`` on bf16: the interpreter keeps bf16 as uint16 and would multiply
  the bit patterns as integers; bf16 operands are widened to float32 first.
- float32 to bf16 (``x.to(tl.bfloat16)``): the interpreter keeps the top 16
  bits (rounding toward zero, a bias of half a unit on every value rounded);
  it rounds to nearest, ties to even, as a GPU's conversion does.
- Loop bounds such as ``tl.minimum(a, b)`` are one-element arrays under Triton
  3.6, and ``int()`` of those fails in ``range()``; ``__index__`` squeezes them
  (3.9 does so itself).
- float8 conversions (``float8e4nv``, ``float8e5``: float8_e4m3fn and
  float8_e5m2): the interpreter rounds half away from zero into float8 (a
  carry out of the mantissa lands in the exponent bits by OR, not by sum), and
  reads float8_e5m2's subnormals into float16 as 0 and both formats' NaN (and
  e5m2's inf) as finite numbers; both ways go through ``fp8_encode`` and
  ``fp8_decode``: exact, rounding to nearest, ties to even, values past the
  format's range (inf too) saturated to its largest, NaN kept: what sm_90's
  ``cvt.rn.satfinite`` does (the kernels saturate before they convert anyway).

One interpretation runs at a time: the interpreter's builder holds the current
program id for the whole process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from lazytriton.kernels import KernelSpec, get
from lazytriton.triton_lock import TRITON_LOCK

# One interpretation at a time (the interpreter's grid position is process-wide).
_run_lock = threading.Lock()
_load_lock = threading.Lock()
_PRIVATE_PREFIXES = ("triton.language", "triton.runtime.interpreter")


class _Private:
    """The interpreter's own ``triton.language``, its interpreter module, and the kernel modules loaded on them."""

    def __init__(self, modules: dict[str, ModuleType]) -> None:
        self.modules = modules
        self.kernels: dict[str, ModuleType] = {}

    @property
    def interpreter(self) -> Any:
        return self.modules["triton.runtime.interpreter"]


_private: _Private | None = None


def _is_private_name(name: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in _PRIVATE_PREFIXES)


def _import_real_triton() -> None:
    """Import triton, its language and gluon (which the interpreter imports lazily) as the compiler uses them."""
    import triton
    import triton.language  # noqa: F401

    with contextlib.suppress(ImportError):
        import triton.experimental.gluon  # noqa: F401


@contextlib.contextmanager
def _private_sys_modules(private: dict[str, ModuleType]) -> Iterator[None]:
    """Let imports inside the block see ``private`` (and load new private modules) instead of the real ones.

    On exit ``private`` holds every private module loaded, and ``sys.modules``
    and the parent packages' attributes are the real ones again. ``@jit``
    decorates for compiling meanwhile, even under ``TRITON_INTERPRET=1``
    (whose interpreted functions would bind to the real language); the
    caller makes them interpreted afterwards.
    """
    import triton
    import triton.runtime

    old_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"

    real = {name: module for name, module in sys.modules.items() if _is_private_name(name)}
    real_language = triton.language
    real_interpreter = getattr(triton.runtime, "interpreter", None)
    for name in real:
        del sys.modules[name]
    sys.modules.update(private)
    # ``import triton.language as tl`` reads the attribute of the (real) triton package.
    if "triton.language" in private:
        triton.language = private["triton.language"]  # type: ignore[attr-defined]
        triton.runtime.interpreter = private["triton.runtime.interpreter"]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for name in [name for name in sys.modules if _is_private_name(name)]:
            private[name] = sys.modules.pop(name)
        sys.modules.update(real)
        if old_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old_env
        triton.language = real_language  # type: ignore[attr-defined]
        if real_interpreter is None:
            with contextlib.suppress(AttributeError):
                del triton.runtime.interpreter  # type: ignore[attr-defined]
        else:
            triton.runtime.interpreter = real_interpreter  # type: ignore[attr-defined]


def _load_private() -> _Private:
    """Import the interpreter's own copy of ``triton.language`` and make its ``@jit`` functions interpreted."""
    _import_real_triton()
    modules: dict[str, ModuleType] = {}
    with _private_sys_modules(modules):
        importlib.import_module("triton.language")
        importlib.import_module("triton.runtime.interpreter")
    private = _Private(modules)
    for name, module in modules.items():
        if name.startswith("triton.language"):
            _interpret_jit_functions(private, module)
    _install_fixes(private.interpreter)
    return private


def _interpret_jit_functions(private: _Private, module: ModuleType) -> None:
    """Swap the module's ``@jit`` functions for interpreted twins (what ``TRITON_INTERPRET=1`` would have made)."""
    from triton.runtime.jit import JITFunction

    twins: dict[int, Any] = {}
    for name, value in list(vars(module).items()):
        if isinstance(value, JITFunction):
            twin = twins.setdefault(id(value), private.interpreter.InterpretedFunction(value.fn))
            setattr(module, name, twin)


def _install_fixes(interpreter: Any) -> None:
    """Fix bf16 ``tl.dot``, float32 to bf16 rounding and Triton 3.6's one-element loop bounds (the private copy)."""
    import numpy as np

    tl = interpreter.tl
    builder = interpreter.interpreter_builder
    create_dot = builder.create_dot

    def create_dot_bf16(a: Any, b: Any, d: Any, *args: Any) -> Any:
        def widen(x: Any) -> Any:
            if x.dtype.scalar == tl.bfloat16:
                data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            return x

        return create_dot(widen(a), widen(b), d, *args)

    builder.create_dot = create_dot_bf16
    create_fp_trunc = builder.create_fp_trunc

    def create_fp_trunc_bf16(src: Any, dst_type: Any) -> Any:
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return create_fp_trunc(src, dst_type)
        values = np.asarray(src.data, dtype=np.float32)
        bits = values.view(np.uint32)
        nearest = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        quiet = ((bits >> 16) | 0x40).astype(np.uint16)  # a NaN stays a NaN
        return interpreter.TensorHandle(np.where(np.isnan(values), quiet, nearest), tl.bfloat16)

    builder.create_fp_trunc = create_fp_trunc_bf16
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_index(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_tensor_index
    _install_fp8_fix(interpreter)


# float8 formats as the interpreter names them: (Triton's dtype name, exponent bias, mantissa bits, has inf).
_FP8 = {"fp8e4nv": (7, 3, False), "fp8e5": (15, 2, True)}


def fp8_decode(bits: Any, fmt: str) -> Any:
    """float8 bit patterns (uint8 array) of ``fmt`` (``fp8e4nv``, ``fp8e5``) as exact float32 values."""
    import numpy as np

    bias, mant, has_inf = _FP8[fmt]
    bits = np.asarray(bits, dtype=np.uint8).astype(np.int32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp, frac = (bits >> mant) & ((1 << (7 - mant)) - 1), bits & ((1 << mant) - 1)
    value = np.where(exp == 0, np.ldexp(frac.astype(np.float64), 1 - bias - mant),
                     np.ldexp((frac + (1 << mant)).astype(np.float64), exp - bias - mant))
    top = (1 << (7 - mant)) - 1
    if has_inf:
        value = np.where(exp == top, np.where(frac == 0, np.inf, np.nan), value)
    else:
        value = np.where((exp == top) & (frac == (1 << mant) - 1), np.nan, value)
    return (sign * value).astype(np.float32)


def fp8_encode(values: Any, fmt: str) -> Any:
    """Float values as ``fmt``'s bit patterns (uint8): nearest, ties to even, saturated (``satfinite``), NaN kept."""
    import numpy as np

    bias, mant, has_inf = _FP8[fmt]
    x = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(x)
    mag = np.where(finite, np.abs(x), 0.0)
    exp = np.maximum(np.frexp(mag)[1] - 1, 1 - bias)  # floor(log2); subnormals share the smallest normal's step
    # Whole steps of 2**(exp - mant): rint rounds ties to even, and a carry into the next binade is a sum
    # of the exponent's and the mantissa's bits (so 2**mant steps at exp read as exponent + 1).
    steps = np.rint(np.ldexp(mag, mant - exp)).astype(np.int64)
    bits = np.where(steps >= (1 << mant), ((exp + bias).astype(np.int64) << mant) + steps - (1 << mant), steps)
    largest = (((1 << (7 - mant)) - 1 - int(has_inf)) << mant) | ((1 << mant) - 1 - int(not has_inf))
    bits = np.where((bits > largest) | np.isinf(x), largest, bits)  # satfinite: past the range, the largest
    bits = np.where(np.isnan(x), 0x7F, bits) | np.where(np.signbit(x), 0x80, 0)
    return bits.astype(np.uint8)


def _install_fp8_fix(interpreter: Any) -> None:
    """Exact float8 conversions in the private interpreter (``fp8_encode``/``fp8_decode``, RTNE)."""
    import numpy as np

    tl = interpreter.tl
    builder = interpreter.interpreter_builder
    create_fp_to_fp = builder.create_fp_to_fp
    wide = {tl.float32: np.float32, tl.float16: np.float16}

    def widened(handle: Any) -> Any:
        """A float32/float16/bfloat16 handle's values as float32."""
        if handle.dtype.scalar == tl.bfloat16:
            return (np.asarray(handle.data).astype(np.uint32) << 16).view(np.float32)
        return np.asarray(handle.data).astype(np.float32)

    def create_fp_to_fp_fp8(src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        src_name, dst_name = src.dtype.scalar.name, dst_type.scalar.name
        if dst_name in _FP8 and src_name not in _FP8:
            return interpreter.TensorHandle(fp8_encode(widened(src), dst_name), dst_type.scalar)
        if src_name in _FP8 and dst_name not in _FP8:
            values = fp8_decode(src.data, src_name)
            if dst_type.scalar == tl.bfloat16:  # exact: every float8 value has a bfloat16 twin
                data = (values.view(np.uint32) >> 16).astype(np.uint16)
            else:
                data = values.astype(wide[dst_type.scalar])
            return interpreter.TensorHandle(data, dst_type.scalar)
        return create_fp_to_fp(src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp_fp8


def _private_copy() -> _Private:
    global _private
    if _private is None:
        with _load_lock, TRITON_LOCK:
            if _private is None:
                _private = _load_private()
    return _private


def _load_file(private: _Private, name: str, path: Any, twins: dict[int, Any] | None = None) -> ModuleType:
    """A source file loaded as a new module against the private ``triton.language``, its ``@jit`` interpreted.

    ``twins``: interpreted functions to bind instead of the real ``@jit`` functions it imported (by their id).
    """
    with TRITON_LOCK, _private_sys_modules(private.modules):
        file_spec = importlib.util.spec_from_file_location(f"_lazytriton_interpreted_{name}", path)
        module = importlib.util.module_from_spec(file_spec)  # type: ignore[arg-type]
        file_spec.loader.exec_module(module)  # type: ignore[union-attr]
    for attr, value in list(vars(module).items()):
        if twins and id(value) in twins:
            setattr(module, attr, twins[id(value)])
    _interpret_jit_functions(private, module)
    return module


def _helper_twins(private: _Private, helpers: Sequence[str]) -> dict[int, Any]:
    """The interpreted twins of the helpers' plain Triton ``@jit`` functions, by the id of the real one.

    A kernel file imports its helpers' functions from the real modules (bound
    to the real ``triton.language``, which the interpreter must not patch);
    each helper with plain ``@jit`` functions is loaded once more against the
    private copy, and the kernel's names for them are pointed at its twins.
    Gluon functions (``gluon.jit``: a JITFunction subclass) are left alone:
    the interpreter never runs the Gluon kernels.
    """
    from triton.runtime.jit import JITFunction

    twins: dict[int, Any] = {}
    for helper in helpers:
        real = importlib.import_module(helper)
        plain = {name: value for name, value in vars(real).items() if type(value) is JITFunction}
        if not plain:
            continue
        module = private.kernels.get(helper)
        if module is None:
            module = private.kernels[helper] = _load_file(private, helper, real.__file__)
        twins.update((id(value), getattr(module, name)) for name, value in plain.items())
    return twins


def _kernel_module(private: _Private, spec: KernelSpec) -> ModuleType:
    """The kernel's module, loaded once more against the private ``triton.language``, its ``@jit`` interpreted."""
    module = private.kernels.get(spec.module)
    if module is None:
        # The helper modules the file imports from (KernelSpec.helpers), imported for real first: one first
        # imported inside the block, and importing triton.language, would stay in sys.modules bound to the
        # private copy, for every later compile. Their plain @jit functions get interpreted twins of their own
        # (_helper_twins); the fused backward's helpers are Gluon functions of a kernel the interpreter never
        # runs (its file's plain kernel, flash_bwd_prep, calls none).
        module = _load_file(private, spec.name, spec.source_path, _helper_twins(private, spec.helpers))
        private.kernels[spec.module] = module
    return module


def interpret(kernel: str, grid: Sequence[int], args: Sequence[Any], constexprs: dict[str, Any]) -> None:
    """Run a kernel on CPU tensors through Triton's interpreter (its private copy; see the module doc)."""
    spec = get(kernel)
    private = _private_copy()
    with _run_lock:
        fn = getattr(_kernel_module(private, spec), spec.function)
        fn[tuple(grid)](*args, **constexprs)
