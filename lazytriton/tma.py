"""Where TMA (tensor memory accelerator) descriptors can work at all: the hardware's part of every TMA rule.

A kernel family's dispatch adds its policy on top (when it reads through descriptors by default); a variant
string that says ``TMA=true`` is checked against this part (``variant.check_fields``).
"""

from __future__ import annotations

from lazytriton.target import Target


def tma_possible(target: Target, aligned: bool, even_d: bool = True) -> bool:
    """Whether descriptors can work: a CUDA target with TMA (sm_90+), an aligned call, a head dim filling its tile."""
    return target.backend == "cuda" and target.capability >= 90 and aligned and even_d


def require_tma(target: Target, aligned: bool, even_d: bool = True) -> None:
    """Refuse (ValueError) TMA where descriptors cannot work: the kernel would fault or write where it must not.

    The head dim's part was measured on the H200 (Triton 3.6): with head dim
    59 in a 64-wide tile, the descriptor store wrote into the columns past
    head dim (tests/test_flash_fwd.py::test_tma_and_pointer_variants_on_gpu),
    though both versions' interpreters clip them.
    """
    if not tma_possible(target, aligned, even_d):
        raise ValueError(f"tma=True needs a CUDA target with TMA (sm_90+), an aligned call (16-byte base and "
                         f"strides) and a power-of-two head dim of at least 16, got target {target}, "
                         f"aligned={aligned}, even head dim={even_d}")
