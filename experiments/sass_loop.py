"""The instructions of a compiled variant's hottest loop, by opcode: where a step's issue slots go.

Compiles (no GPU needed) each variant given (its string, as ``cache explain`` or a miss log prints it) with the
installed Triton, disassembles it (Triton's bundled cuobjdump) and prints, for the first loop whose body holds
``--holds`` (default ``MUFU``: the softmax's loop), its length and its opcodes by count. Run it under each Triton
the GPU hosts use (the host's is 3.6). Two variants of one kernel side by side say what a source change buys a
step before any GPU runs it.

Usage: python3 experiments/sass_loop.py VARIANT [VARIANT ...] [--holds MUFU] [--top 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--holds", default="MUFU", help="an opcode (prefix) the loop's body must hold")
    parser.add_argument("--top", type=int, default=16, help="opcodes printed a variant")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import loop_opcodes, opcode_counts, sass_of  # the tests' disassembly and loop finder

    from lazytriton.compiler import compile_variant, triton_version
    from lazytriton.variant import Variant

    print(f"Triton {triton_version()}")
    with tempfile.TemporaryDirectory() as scratch:
        for text in args.variants:
            body = loop_opcodes(sass_of(compile_variant(Variant.parse(text)).binary, Path(scratch)), args.holds)
            counts = opcode_counts(body)
            print(f"{len(body):5d} {text}")
            print("      " + "  ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
