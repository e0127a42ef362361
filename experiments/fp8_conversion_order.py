"""Whether the installed Triton compiles a float8 variant the same after a float8 variant of another target.

Each case (``KERNEL:TARGET:FORMAT``: ``kv_append``, ``kv_slots``, ``flash_decode_split`` with a float8 cache
of FORMAT, or ``flash_fwd`` with FORMAT as the dtype; FORMAT ``none`` for a bf16 cache) is compiled alone in a
fresh interpreter, which gives its reference binary; then, for each case A, one fresh interpreter compiles A and
after it every other case B, and each B's binary is compared with its reference: ``same``, ``differs`` (a
valid binary, but not the one a fresh process compiles) or ``fails`` (the compile raised: ptxas refusing an
sm_89 instruction in sm_80 PTX). A row whose A neither fixes nor feels the state (a HIP target, a bf16 cache)
shows what its first CUDA float8 column fixed. No GPU needed. Each child compiles through
``lazytriton.compiler.compile_in_process``, below the guard that moves such compiles into a fresh process, so
what it shows is Triton's own behaviour.

    python3 experiments/fp8_conversion_order.py [--cases CASE ...]
    PYTHONPATH=/path/to/triton-3.6/site-packages python3 experiments/fp8_conversion_order.py

Triton 3.6 (2026-12-06, this machine, the default cases): a first float8 case for sm_89, sm_90 or sm_100 makes
every later sm_80/sm_86 float8 case fail; a first one for sm_80 or sm_86 makes sm_90's e5m2 split kernel differ
(its e4m3 cases and kv_append's stay the same); HIP cases and bf16 caches neither fix nor feel it. Triton 3.9:
every case the same as alone, in every row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# This checkout first on sys.path, and no editable install's finder (it would map lazytriton.kernels and the other
# folders to the installed checkout whatever lazytriton's own path).
ONLY = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.path.insert(0, sys.argv[1])
import lazytriton, lazytriton.kernels, lazytriton.compiler
for module in (lazytriton, lazytriton.kernels, lazytriton.compiler):
    assert module.__file__.startswith(sys.argv[1]), module.__file__
"""

CHILD = ONLY + """
import hashlib, json
from lazytriton.compiler import compile_in_process
from lazytriton.kernels import dispatch
from lazytriton.target import Target


def variant(case):
    kernel, target, fmt = case.split(":")
    if kernel == "flash_fwd":  # the FP8 forward: the format is the dtype
        return dispatch.kernel_variant(kernel, Target.parse(target), fmt, 128, True, True, 4096, 4096)
    return dispatch.kernel_variant(kernel, Target.parse(target), "bf16", 128, False, True, 4, 4096, paged=True,
                                   kv_fp8=fmt)


for case in sys.argv[2:]:
    try:
        binary = compile_in_process(variant(case)).binary
        print(json.dumps([case, hashlib.sha256(binary).hexdigest()[:16]]), flush=True)
    except Exception as exc:
        print(json.dumps([case, "fails: " + str(exc).splitlines()[0][:120]]), flush=True)
"""

DEFAULT_CASES = ("kv_append:sm_80:e5m2", "kv_append:sm_90:e5m2", "flash_decode_split:sm_80:e5m2",
                 "flash_decode_split:sm_90:e5m2", "flash_decode_split:sm_89:e4m3", "flash_decode_split:sm_90:e4m3",
                 "flash_decode_split:sm_100:e4m3", "kv_slots:sm_86:e5m2", "flash_fwd:sm_90:e4m3",
                 "flash_decode_split:gfx942:e4m3", "flash_decode_split:gfx90a:e5m2", "kv_append:sm_80:none")


def compiled(cases: list[str]) -> dict[str, str]:
    """Each case's digest (or ``fails: ...``), compiled in this order in one fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(REPO), *cases], capture_output=True, text=True,
                          check=False)
    found = dict(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    if len(found) != len(cases):
        raise SystemExit(f"a child ended early ({done.returncode}): {done.stderr[-2000:]}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES))
    args = parser.parse_args()
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    alone = {case: compiled([case])[case] for case in args.cases}
    print(f"Triton {version}; a row: the case compiled first, then each column's case in the same process")
    width = max(map(len, args.cases))
    for first in args.cases:
        later = [case for case in args.cases if case != first]
        after = compiled([first, *later])
        cells = []
        for case in later:
            got = after[case]
            state = "fails" if got.startswith("fails") else ("same" if got == alone[case] else "differs")
            if state != "same":
                cells.append(f"{case} {state}")
        print(f"{first:<{width}}  {'; '.join(cells) or 'every later case the same as alone'}", flush=True)
    bad_alone = [case for case, got in alone.items() if got.startswith("fails")]
    if bad_alone:
        print("failed even alone:", ", ".join(bad_alone))
    return 0


if __name__ == "__main__":
    sys.exit(main())
