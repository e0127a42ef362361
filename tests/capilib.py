"""Helpers for the C API's tests: programs that call liblazytriton in process, and what they report.

A test writes a Python program that loads the built library with ctypes before torch imports
(``IN_PROCESS_PRELUDE``; ``KVCACHE_PRELUDE`` adds lt_attn_kvcache's params, a refused call's record and an
absent tensor), runs it in a fresh interpreter
against the installed prefix (``report_of``) and reads the JSON line it prints last. ``assert_statuses`` holds
the calls a program expects refused to their statuses and messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The start of a program that calls the C API in process through ctypes, as a host program would (GIL released):
# lt_init before torch is imported; cffi lays the structs out from the header (sys.argv[2]); call() passes cffi
# pointers; describe() fills an lt_tensor for a CPU tensor.
IN_PROCESS_PRELUDE = r"""
import ctypes, json, math, sys
dll = ctypes.CDLL(sys.argv[1])
dll.lt_last_error.restype = ctypes.c_char_p
assert dll.lt_init(None) == 0, dll.lt_last_error()
import torch
from cffi import FFI
from lazytriton.capi import build
import lazytriton

ffi = FFI()
ffi.cdef(build.header_cdef(open(sys.argv[2]).read()))

def call(name, *args):
    fn = getattr(dll, name)
    return fn(*(ctypes.c_void_p(int(ffi.cast("uintptr_t", a))) if isinstance(a, ffi.CData) else a for a in args))

CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.int32: 4, torch.int64: 5}

def describe(view, t):
    view.data = ffi.cast("void *", t.data_ptr())
    view.dtype, view.ndim, view.device_type, view.device_index = CODES[t.dtype], t.dim(), 1, 0
    for i in range(t.dim()):
        view.sizes[i], view.strides[i] = t.shape[i], t.stride(i)
"""

# describe() for device memory (CUDA device 0), after a prelude that defines ffi and torch.
CUDA_DESCRIBE = r"""
def describe(view, t):
    view.data = ffi.cast("void *", t.data_ptr())
    view.dtype = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.int32: 4}[t.dtype]
    view.ndim, view.device_type, view.device_index = t.dim(), 2, 0
    for i in range(t.dim()):
        view.sizes[i], view.strides[i] = t.shape[i], t.stride(i)
"""


# After test_capi.VARLEN_IN_PROCESS's start (lib, ffi, describe on CPU tensors): attn_params("fwd" or "bwd",
# tensors, struct=None, **fields), an lt_attn_fwd_params or lt_attn_bwd_params of the tensors (None: left out)
# with the fields set (struct: its struct_size and version); bwd_tensors(q, k, v, out, lse, do), the backward's
# tensors ({name: tensor}) and its dq, dk and dv (filled with 7.0).
ATTN_PARAMS = r"""
def attn_params(kind, tensors, struct=None, **fields):
    p = ffi.new(f"lt_attn_{kind}_params *")
    getattr(lib, f"lt_attn_{kind}_params_init")(p)
    for name, t in tensors.items():
        if t is not None:
            describe(getattr(p, name), t)
    for name, value in fields.items():
        setattr(p, name, value)
    if struct is not None:
        p.struct_size, p.version = struct
    return p

def bwd_tensors(q, k, v, out, lse, do):
    grads = [torch.full_like(t, 7.0) for t in (q, k, v)]
    return {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": do, "dq": grads[0], "dk": grads[1],
            "dv": grads[2], "delta": torch.empty(lse.shape)}, grads
"""


# The start of a program calling lt_attn_kvcache in process: error() and params(tensors, **options).
KVCACHE_PRELUDE = IN_PROCESS_PRELUDE + r"""
def error():
    return dll.lt_last_error().decode()

def params(tensors, **options):
    p = ffi.new("lt_attn_kvcache_params *")
    assert call("lt_attn_kvcache_params_init", p) == 0
    for name, t in tensors.items():
        describe(getattr(p, name), t)
    for name, value in options.items():
        setattr(p, name, value)
    return p

def refused(tensors, change, **options):
    # lt_attn_kvcache of params(tensors, **options) after change(p): [status, message, caches untouched]
    p = params(tensors, **options)
    keep = {n: tensors[n].clone() for n in ("k_cache", "v_cache")}
    change(p)
    status = call("lt_attn_kvcache", p, ffi.NULL)
    return [status, error(), all(torch.equal(tensors[n], keep[n]) for n in keep)]

def absent(t):
    t.data, t.ndim = ffi.NULL, 0
"""

# A decoding call through the C API beside flash_attn_with_kvcache on clones (needs KVCACHE_PRELUDE and a report
# dict): case(name, tensors, python_kwargs, before_call, **params) records whether out, lse and the caches match.
KVCACHE_CASE = r"""
PY_NAMES = ("k", "v", "cache_seqlens", "block_table", "sinks", "cu_seqlens_q")

def case(name, tensors, py, before_call=None, **options):
    # C on the tensors, Python on clones: the same out, lse and caches afterwards, bit for bit.
    clones = {n: t.clone() for n, t in tensors.items()}
    q, dv = tensors["q"], tensors["v_cache"].shape[-1]
    if q.dim() == 3:
        out, lse = torch.full((*q.shape[:2], dv), 7.0), torch.full((q.shape[1], q.shape[0]), 7.0)
    else:
        out, lse = torch.full((*q.shape[:3], dv), 7.0), torch.full((q.shape[0], q.shape[2], q.shape[1]), 7.0)
    p = params({**tensors, "out": out, "lse": lse}, **options)
    if before_call is not None:
        before_call(p)
    status = call("lt_attn_kvcache", p, ffi.NULL)
    want, want_lse = lazytriton.flash_attn_with_kvcache(clones["q"], clones["k_cache"], clones["v_cache"],
                                                        return_softmax_lse=True,
                                                        **{n: clones[n] for n in PY_NAMES if n in clones}, **py)
    report[name] = {"status": status, "error": error() if status else "",
                    "out": torch.equal(out, want), "lse": torch.equal(lse, want_lse),
                    "caches": all(torch.equal(tensors[n], clones[n]) for n in ("k_cache", "v_cache"))}
    return lse
"""


def run_program(args: list[str | Path], env: dict[str, str] | None = None, timeout: float = 240,
                cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``args`` run with this test's environment plus ``env``, its output captured; a hang past ``timeout`` fails."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([str(a) for a in args], env=full_env, capture_output=True, text=True, timeout=timeout,
                          check=False, cwd=cwd)


def exit_ok(result: subprocess.CompletedProcess[str]) -> str:
    """The stdout of a program that exited 0 (otherwise the test fails with its exit status and output)."""
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def report_of(program: str, prefix: Path, env: dict[str, str] | None = None, timeout: float = 600) -> Any:
    """The JSON line ``program`` prints last, run in a fresh interpreter with the prefix's library and header.

    The program finds the library in sys.argv[1] and the header in sys.argv[2]. ``timeout``: a program runs
    its kernels through Triton's interpreter, which takes minutes on a loaded machine; only a hang reaches it.
    """
    out = exit_ok(run_program([sys.executable, "-c", program, prefix / "lib/liblazytriton.so",
                               prefix / "include/lazytriton.h"], env=env, timeout=timeout))
    return json.loads(out.splitlines()[-1])


def assert_statuses(rows: Sequence[Sequence[Any]], expected: Sequence[tuple[int, str]]) -> None:
    """Each refused call's row against its (status, needle): the status, the needle in its message.

    A row is [status, message] or [status, message, untouched], where untouched says the call wrote none of
    its outputs; there are as many rows as expected ones.
    """
    for (status, message, *untouched), (want, needle) in zip(rows, expected, strict=True):
        assert status == want and needle in message, (status, message, needle)
        assert all(untouched), f"the refused call wrote its outputs: {message}"


def flag(variant: Any, name: str) -> bool:
    """A variant's flag (variants write only the flags that are set)."""
    return dict(variant.functional).get(name, False) is True
