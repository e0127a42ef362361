"""Check that a refactor changed no binary: compile fixed variant strings in two checkouts and compare.

Each checkout compiles every variant (a fresh Triton cache) in a child process with that checkout first on
``sys.path``; a line per variant gives its key, the xxh3 of its binary (cubin or HSACO),
its warps, shared memory and argument types. Identical output: the same keys (existing images still hit)
and byte-identical binaries. The binaries hold no debug sections (``compiler.PTXAS_OPTIONS``,
``HIP_LINE_INFO``), so neither checkout's file paths enter them. The default variants are
tests/test_other_triton.py's (every family, the Gluon kernels, split and padded head dims, sm_90) and three of
sm_80's and gfx942's, built by the newer checkout.

    python3 experiments/same_binaries.py OLD_CHECKOUT [NEW_CHECKOUT (default: this one)] [--variants FILE]

Make OLD_CHECKOUT with ``git worktree add /tmp/old <commit>``. Exit status 0 when identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The checkout first on sys.path, and no editable install's finder (it would map lazytriton.kernels and the other
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
import xxhash
from lazytriton.compiler import compile_variant
from lazytriton.variant import Variant
for line in open(sys.argv[2]):
    variant = Variant.parse(line.strip())
    entry = compile_variant(variant)
    print(variant.key(), xxhash.xxh3_64_hexdigest(entry.binary), entry.num_warps, entry.shared,
          list(entry.arg_types), variant, flush=True)
"""

DEFAULTS = ONLY + """
src = open(sys.argv[1] + "/tests/test_other_triton.py").read()
start = src.index('VARIANTS = \"\"\"') + len('VARIANTS = \"\"\"')
namespace = {}
exec(src[start:src.index('\"\"\"', start)], namespace)
from lazytriton.kernels import dispatch
from lazytriton.target import Target
variants = [str(v) for v in namespace["VARIANTS"]]
for name in ("sm_80", "gfx942"):
    target = Target.parse(name)
    variants += [str(dispatch.kernel_variant("flash_fwd", target, "fp16", 64, True, True, 4096, 4096)),
                 str(dispatch.kernel_variant("flash_bwd_dkdv", target, "bf16", 128, False, True, 4096, 4096)),
                 str(dispatch.kernel_variant("flash_decode_split", target, "bf16", 128, False, True, 4, 4096,
                                             paged=True))]
print("\\n".join(variants))
"""


def variants_file(given: Path | None, folder: str, python: str, checkout: Path) -> Path:
    """``given``, or a file in ``folder`` of the default variants as ``python`` builds them from ``checkout``."""
    if given is not None:
        return given
    made = subprocess.run([python, "-c", DEFAULTS, str(checkout)], capture_output=True, text=True,
                          cwd=tempfile.gettempdir(), check=True)
    path = Path(folder) / "variants.txt"
    path.write_text(made.stdout)
    return path


def compiled(checkout: Path, variants: Path) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="same-binaries-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        result = subprocess.run([sys.executable, "-c", CHILD, str(checkout), str(variants)], capture_output=True,
                                text=True, env=env, cwd=tempfile.gettempdir(), check=False)
    if result.returncode:
        raise SystemExit(f"{checkout}: compiling failed:\n{result.stderr[-2000:]}")
    return result.stdout.splitlines()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path, nargs="?", default=REPO)
    parser.add_argument("--variants", type=Path, help="variant strings, one a line (default: see above)")
    args = parser.parse_args()
    old, new = args.old.resolve(), args.new.resolve()
    with tempfile.TemporaryDirectory(prefix="same-binaries-") as tmp:
        variants = variants_file(args.variants, tmp, sys.executable, new)
        before, after = compiled(old, variants), compiled(new, variants)
    if before == after:
        print(f"identical: {len(after)} variants, the same keys and binaries in {old} and {new}")
        return 0
    sys.stdout.writelines(difflib.unified_diff([line + "\n" for line in before], [line + "\n" for line in after],
                                               str(old), str(new)))
    return 1


if __name__ == "__main__":
    sys.exit(main())
