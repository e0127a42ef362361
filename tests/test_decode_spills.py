"""The decoding split kernel's register cap where dispatch applies it: a few bytes of stack, never hundreds.

``dispatch.capped_registers`` caps a feature's split variant at 128 registers a thread (the plain tile's
occupancy) only where that costs a few bytes of spills: 16-byte aligned tensors, pages not gathered. These
compile the served variants (this machine's Triton, sm_90; ``experiments/decode_spills.py`` reads them with
Triton's bundled cuobjdump) and hold what the cap's comment says, so that a kernel change that grows the
features' register count shows here rather than as spills on a GPU.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
from conftest import REPO

from lazytriton import compiler
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.target import Target

SM90 = Target.parse("sm_90")


@pytest.fixture(scope="module")
def spills() -> Iterator[ModuleType]:
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        yield importlib.import_module("decode_spills")
    finally:
        sys.path.remove(str(REPO / "experiments"))
        sys.modules.pop("decode_spills", None)


def _usage(spills: ModuleType, head_dim: int, aligned: bool, **flags: object) -> tuple[bool, int, int]:
    """(capped, registers, stack bytes) of the split variant dispatch serves for a windowed fp16 call."""
    variant = decode_dispatch.decode_variant("flash_decode_split", SM90, "fp16", head_dim, False, aligned, 4, 4096,
                                             window=True, **flags)  # type: ignore[arg-type]
    registers, stack = spills.usage(compiler.compile_in_process(variant).binary, spills.cuobjdump())
    return "maxnreg" in dict(variant.options), registers, stack


def test_an_aligned_feature_variant_is_capped_at_a_few_bytes_of_stack(spills: ModuleType) -> None:
    capped, registers, stack = _usage(spills, 128, True)
    assert capped and registers <= decode_dispatch.FEATURE_MAX_REGISTERS
    assert stack <= 64, f"the capped variant spills {stack} bytes a thread"


def test_unaligned_and_gathered_variants_keep_the_compilers_count(spills: ModuleType) -> None:
    capped, registers, _ = _usage(spills, 64, False)
    assert not capped and registers > decode_dispatch.FEATURE_MAX_REGISTERS, registers  # the cap would spill there
    assert not _usage(spills, 64, True, paged=True, page_size=16)[0]  # a pointer a key (106-255 registers by tile)
