"""Does leaving a binary's debug sections out change its code? Compile fixed variants both ways, compare.

Triton compiles with line info by default: on CUDA ptxas gets ``-lineinfo`` and the cubin then carries the PTX it
was built from (``.nv_debug_ptx_txt``) and two line tables; on ROCm the code object carries DWARF line tables.
lazytriton's compiler passes ptxas ``-suppress-debug-info`` (``compiler.PTXAS_OPTIONS``) and on ROCm sets
Triton's ``TRITON_DISABLE_LINE_INFO`` (``compiler.HIP_LINE_INFO`` off). This compiles each variant twice in child
processes (fresh Triton caches): with ``PTXAS_OPTIONS`` emptied and ``HIP_LINE_INFO`` on (the binary as Triton
makes it), then as served. (Triton's own switch, ``TRITON_DISABLE_LINE_INFO=1``, is not the served one on CUDA:
it also drops the PTX's line directives, and ptxas then makes other code for some kernels; benchmarks/NOTES.md,
12-07 (46th).) For each pair it compares the ELF's code sections (``.text*``) byte for byte and the entry's
launch metadata (warps, shared memory, arguments), and prints both binaries' sizes and the sections only the first
has. The default variants are ``same_binaries.py``'s (every family on sm_90, three of sm_80's and gfx942's).
``--python`` names another interpreter (another Triton: CI's 3.6 venv) to compile in. ``--images DIR`` also
writes each side's entries as ``DIR/kept.ltimg`` and ``DIR/served.ltimg`` (``probe_module_load.py`` times the
driver's load of both; step ``debugsections``).

    python3 experiments/line_info_code.py [--python PY] [--variants FILE] [--images DIR]

Exit status 0 when every variant's code and metadata are the same both ways, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from same_binaries import REPO, variants_file  # noqa: E402

from lazytriton.cache_format.elf import section_contents  # noqa: E402

CHILD = """
import json, sys
from lazytriton import compiler
from lazytriton.compiler import compile_in_process
if sys.argv[2] == "kept":
    compiler.PTXAS_OPTIONS, compiler.HIP_LINE_INFO = "", True
from lazytriton.cache_format import image
from lazytriton.variant import Variant
entries = []
for line in open(sys.argv[1]):
    entries.append(compile_in_process(Variant.parse(line.strip())))
    entry = entries[-1]
    print(json.dumps([line.strip(), entry.binary.hex(), entry.num_warps, entry.shared, list(entry.arg_types)]))
if sys.argv[3]:
    image.write_image(sys.argv[3], entries)
"""


def bytes_differing(a: bytes, b: bytes) -> int:
    """Positions where two byte strings differ, the longer one's tail counted."""
    return sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))


def compiled(python: str, variants: Path, mode: str, images: Path | None) -> list[list]:
    """Each variant's [variant, binary hex, warps, shared, arg types]; mode kept or served."""
    image = str(images / f"{mode}.ltimg") if images else ""
    with tempfile.TemporaryDirectory(prefix="line-info-") as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache,
               "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
        result = subprocess.run([python, "-c", CHILD, str(variants), mode, image], capture_output=True, text=True,
                                env=env, cwd=tempfile.gettempdir(), check=False)
    if result.returncode:
        raise SystemExit(f"compiling failed:\n{result.stderr[-2000:]}")
    return [json.loads(line) for line in result.stdout.splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="the interpreter to compile in")
    parser.add_argument("--variants", type=Path, help="variant strings, one a line (default: see above)")
    parser.add_argument("--images", type=Path, help="write kept.ltimg and served.ltimg into this folder")
    args = parser.parse_args()
    if args.images:
        args.images.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="line-info-") as tmp:
        variants = variants_file(args.variants, tmp, args.python, REPO)
        with_info, without = (compiled(args.python, variants, mode, args.images) for mode in ("kept", "served"))
    version = subprocess.run([args.python, "-c", "import triton; print(triton.__version__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    print(f"Triton {version}: {len(with_info)} variants, the debug sections kept -> served")
    same_everywhere, total_on, total_off = True, 0, 0
    for (variant, on_hex, *on_meta), (_, off_hex, *off_meta) in zip(with_info, without, strict=True):
        on, off = section_contents(bytes.fromhex(on_hex)), section_contents(bytes.fromhex(off_hex))
        code = sorted(name for name in on if name.startswith(".text"))
        differing = sum(bytes_differing(on[name], off.get(name, b"")) for name in code)
        same = bool(code) and not differing and on_meta == off_meta
        same_everywhere &= same
        on_size, off_size = len(on_hex) // 2, len(off_hex) // 2
        total_on, total_off = total_on + on_size, total_off + off_size
        dropped = sorted(set(on) - set(off), key=lambda name: -len(on[name]))
        print(f"{'same' if same else 'DIFFERENT'} code ({sum(len(on[n]) for n in code)} B, {differing} differ) "
              f"and metadata{'' if on_meta == off_meta else f' {on_meta} / {off_meta}'}; "
              f"{on_size} -> {off_size} B ({off_size / on_size:.2f}); only in the first: "
              + ", ".join(f"{name} {len(on[name])}" for name in dropped[:4]) + f"  {variant[:90]}")
    print(f"all: {total_on} -> {total_off} B ({total_off / total_on:.2f}); code and metadata "
          f"{'the same in every variant' if same_everywhere else 'DIFFER'}")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
