"""What the installed Triton compiles for the host-descriptor test kernel, as JSON (tests/test_host_tma.py).

``python tests/host_tma_fixture.py --write`` (under each Triton version: 3.6, the GPU host's, and 3.9, CI's)
records it in ``tests/data/host_tma_<version>.json``; the test compares a fresh compile with the file of
its own version and launches the entries of every recorded version on the fake driver.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"
VARIANT = ("flash_fwd_host_tma:sm_90:bf16:ALIGN16=true,BLOCK_D=64,CAUSAL=false,EVEN_D=true:BLOCK_M=64,BLOCK_N=32:"
           "num_stages=2,num_warps=4")


def ptx_params(ptx: str, name: str) -> list[str]:
    """The kernel's PTX parameter declarations, names stripped: ``.align 64 .b8 [128]``, ``.u32``, ..."""
    match = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    assert match is not None
    return [re.sub(r"\s+\S*_param_\d+", "", p.strip()).replace(".param ", "") for p in match.group(1).split(",")]


def describe(entry: Any, ptx: str) -> dict[str, Any]:
    """The launch metadata of a compiled entry that the launcher depends on."""
    return {"triton": entry.provenance.compiler_version, "variant": entry.variant, "name": entry.name,
            "arg_types": list(entry.arg_types), "hidden_args": list(entry.hidden_args),
            "tensordesc_meta": [{"swizzle": m.swizzle, "elem_size": m.elem_size, "elem_type": m.elem_type,
                                 "block_size": list(m.block_size)} for m in entry.tensordesc_meta],
            "global_scratch_size": entry.global_scratch_size, "profile_scratch_size": entry.profile_scratch_size,
            "ptx_params": ptx_params(ptx, entry.name)}


def compile_now() -> tuple[Any, dict[str, Any]]:
    """Compile the test variant with the installed Triton: (Entry, its description)."""
    import triton

    from lazytriton import compiler
    from lazytriton.variant import Variant

    captured: dict[str, str] = {}
    real = triton.compile

    def keep_ptx(*args: Any, **kwargs: Any) -> Any:
        kernel = real(*args, **kwargs)
        captured["ptx"] = kernel.asm["ptx"]
        return kernel

    triton.compile = keep_ptx
    try:
        entry = compiler.compile_variant(Variant.parse(VARIANT))
    finally:
        triton.compile = real
    return entry, describe(entry, captured["ptx"])


def recorded() -> list[dict[str, Any]]:
    """Every version's recorded description."""
    return [json.loads(path.read_text()) for path in sorted(DATA.glob("host_tma_*.json"))]


def main() -> int:
    entry, record = compile_now()
    text = json.dumps(record, indent=1) + "\n"
    if "--write" in sys.argv[1:]:
        path = DATA / f"host_tma_{record['triton']}.json"
        path.write_text(text)
        print(path)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
