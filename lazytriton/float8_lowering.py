"""Triton 3.6 fixes a process's float8 conversions at the first one it lowers: the rule, and the fresh process.

Triton 3.6's NVIDIA backend chooses how it lowers a float8 conversion
(``tt.fp_to_fp``: sm_89's ``cvt`` instructions or the bit-level sequence older
GPUs run) once per process, from the target of the first such conversion it
lowers: the choice is C++ state, which nothing from Python resets. After a
float8 compile for sm_90 (or sm_89, sm_100), a float8 compile for sm_80 or
sm_86 emits ``cvt.rn.f16x2.e5m2x2``, which ptxas refuses ("requires .target
sm_89 or higher"); after one for sm_80, sm_90's e5m2 decoding kernel compiles
to another binary than a fresh process gives (valid, but not reproducible).
HIP targets and compiles without a float8 conversion neither fix nor feel it;
Triton 3.9 compiles each variant as a fresh process does, in any order
(``experiments/fp8_conversion_order.py``; 3.7 and 3.8, not measured, are
taken as 3.6: the cost is a process, never a binary).

So, where the installed Triton is affected, a process is bound to the first
target it compiled a float8 conversion for: ``lazytriton.compiler`` compiles
a float8 variant of any other target in a fresh interpreter
(``compile_fresh``, running ``lazytriton.compile_child``), and prewarm's pool
hands each worker float8 variants of one target (``prewarm.pool``). The rule
is pure (``needs_fresh_process``, ``fixed_after``); the process's state lives
in the compiler.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from lazytriton.cache_format import Entry
from lazytriton.variant import Variant

# The first Triton whose float8 lowering follows each compile's own target (3.9: measured; 3.6: not).
FOLLOWS_EACH_TARGET_FROM = (3, 9)
FLOAT8_DTYPES = ("e4m3", "e5m2")
# What a float8 conversion is in Triton's IR (TTIR and TTGIR, Triton's kernels and Gluon's).
CONVERSION_OP = "tt.fp_to_fp"
CHILD_MODULE = "lazytriton.compile_child"
_TAIL_CHARS = 4000


def fixed_per_process(version: str | None) -> bool:
    """Whether Triton ``version`` keeps the first float8 lowering's target for the rest of a process (pure)."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return match is not None and (int(match.group(1)), int(match.group(2))) < FOLLOWS_EACH_TARGET_FROM


def converts_float8(variant: Variant) -> bool:
    """Whether ``variant``'s kernel converts float8 values: a float8 dtype or a float8 cache (``KV_FP8``)."""
    return variant.dtype in FLOAT8_DTYPES or variant.constexprs.get("KV_FP8", "none") in FLOAT8_DTYPES


def bound_elsewhere(variant: Variant, fixed_for: str | None, version: str | None) -> bool:
    """Whether this process's float8 lowering is fixed for another target than ``variant``'s CUDA one (pure).

    ``fixed_for``: the target of the first float8 conversion this process
    lowered, or None (none yet); ``version``: the installed Triton's.
    """
    return (fixed_per_process(version) and fixed_for is not None and variant.target.startswith("sm_")
            and variant.target != fixed_for)


def needs_fresh_process(variant: Variant, fixed_for: str | None, version: str | None) -> bool:
    """Whether ``variant`` must compile in a fresh process, this one's float8 lowering fixed for ``fixed_for``."""
    return bound_elsewhere(variant, fixed_for, version) and converts_float8(variant)


def fixed_after(fixed_for: str | None, variant: Variant, ir: str | None) -> str | None:
    """The target this process's float8 lowering is fixed for once it compiled ``variant`` (pure).

    ``ir``: the compile's TTGIR (None: the compile failed, or no IR came
    back): a float8 conversion in it binds the process even where the
    variant's fields did not say so; a failed compile of a float8 variant is
    taken to have bound it (its lowering may have run before the failure).
    """
    if fixed_for is not None or not variant.target.startswith("sm_"):
        return fixed_for
    bound = converts_float8(variant) or (ir is not None and CONVERSION_OP in ir)
    return variant.target if bound else None


def child_env() -> dict[str, str]:
    """The environment of a child interpreter: this one, with this process's import path (as prewarm's workers')."""
    path = [p for p in sys.path if p]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


class FreshCompileError(RuntimeError):
    """The fresh interpreter could not compile the variant; the message holds what it printed."""


def compile_fresh(variant: Variant, key: str) -> Entry:
    """Compile ``variant`` in a fresh interpreter (``lazytriton.compile_child``) and return its checked Entry.

    The child writes the entry's bytes (``Entry.encode``) on its stdout; they
    are decoded here like any entry read from disk (checksum, key). Its
    failure raises FreshCompileError with the child's last output.
    """
    done = subprocess.run([sys.executable, "-m", CHILD_MODULE, str(variant), key], capture_output=True,
                          env=child_env(), check=False)
    if done.returncode != 0:
        said = (done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}")[-_TAIL_CHARS:]
        raise FreshCompileError(said)
    try:
        return Entry.decode(done.stdout, expected_key=key)
    except ValueError as exc:
        raise FreshCompileError(f"its entry did not decode: {exc}") from None
