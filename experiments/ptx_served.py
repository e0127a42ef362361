"""Fingerprints of the PTX that flash_fwd_gluon's served variants compile to, to show a source change is a no-op.

A refactor of the kernel's source changes its fingerprint (so every cache key)
and the line numbers in its debug sections, but should leave the code of the
variants dispatch serves as it was. This compiles each of them for cuda:90 with
the installed Triton (no GPU needed), drops what only says where the source
was (debug sections, ``.loc`` lines, comments, label names), and prints a short
hash per variant; ``--save`` writes them, ``--compare`` says which differ from
a saved set. Run it on the old source, then on the new (``git stash``):

    python experiments/ptx_served.py --save /tmp/before.json
    python experiments/ptx_served.py --compare /tmp/before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

# (head dim, causal, seqlen): each a served row of a kind: programs of 4 and 8 tiles, split x2, one tile
# (split 160), the wide tiles, a split head dim in the padded tile's rows, head dim 256
SERVED = ((128, False, 1024), (128, True, 1024), (64, False, 1024), (192, False, 1024), (192, True, 1024),
          (160, True, 1024), (64, True, 4096), (96, False, 4096), (256, True, 4096))


def code_of(ptx: str) -> str:
    """The PTX without what only says where the source was: debug sections, .loc lines, comments, label names."""
    if ".section" in ptx:
        ptx = ptx[:ptx.index(".section")]
    kept = (line for line in ptx.splitlines() if not line.strip().startswith((".loc", ".file", "//")))
    return re.sub(r"\$L__\w+", "L", "\n".join(kept))


def fingerprints() -> dict[str, str]:
    """Each served variant's string and the hash of its PTX's code, compiled by the installed Triton."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_gluon_fwd import sm90_ptx  # the tests' compile of a flash_fwd_gluon variant to PTX

    from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
    from lazytriton.target import Target

    found = {}
    for head_dim, causal, seqlen in SERVED:
        variant = fwd_dispatch.flash_fwd_gluon_default_variant(Target.parse("sm_90"), "bf16", head_dim, causal, True,
                                                               False, seqlen, seqlen)
        if variant is None:
            raise SystemExit(f"no served flash_fwd_gluon variant at head dim {head_dim}, causal {causal}, {seqlen}")
        found[str(variant)] = hashlib.sha256(code_of(sm90_ptx(variant)).encode()).hexdigest()[:16]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, help="write the fingerprints here (JSON)")
    parser.add_argument("--compare", type=Path, help="compare with fingerprints saved before; exit 1 if any differ")
    args = parser.parse_args(argv)
    found = fingerprints()
    for name, digest in found.items():
        print(digest, name)
    if args.save:
        args.save.write_text(json.dumps(found, indent=1) + "\n")
    if args.compare:
        before = json.loads(args.compare.read_text())
        differ = sorted(set(before) ^ set(found) | {k for k in before.keys() & found.keys() if before[k] != found[k]})
        print("same" if not differ else "differ:\n  " + "\n  ".join(differ))
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
