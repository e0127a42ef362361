"""Regenerate the pre-parsed cffi modules: ``python -m lazytriton.driver.ffi_build``.

Run it after changing a declaration in ``cdefs.py``; a test fails until then.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from cffi import FFI

from lazytriton.driver.cdefs import CUDA_CDEF, HIP_CDEF, cdef_hash


def generate(name: str, cdef: str, directory: Path) -> Path:
    """Write ``_{name}_ffi.py`` (cffi out-of-line ABI mode) into ``directory``."""
    module = f"_{name}_ffi"
    builder = FFI()
    builder.set_source(f"lazytriton.driver.{module}", None)
    builder.cdef(cdef)
    with tempfile.TemporaryDirectory() as tmp:
        produced = Path(builder.compile(tmpdir=tmp))
        text = produced.read_text()
    target = directory / f"{module}.py"
    target.write_text(text.rstrip("\n") + f"\n\nCDEF_HASH = {cdef_hash(cdef)!r}\n")
    return target


def main() -> int:
    here = Path(__file__).resolve().parent
    for name, cdef in (("cuda", CUDA_CDEF), ("hip", HIP_CDEF)):
        print(generate(name, cdef, here))
    return 0


if __name__ == "__main__":
    sys.exit(main())
