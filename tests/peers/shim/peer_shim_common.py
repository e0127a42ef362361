"""What the peer shims share: the error for a feature lazytriton lacks, and the checks of scheduling hints.

The shims (``flash_attn_interface`` for FlashAttention-3, the ``flash_attn`` package for FlashAttention-2) forward
each call to lazytriton's public functions. A peer argument lazytriton has no equivalent for raises
``MissingFeature`` when its value would change the result, so the peer's test fails with a message that names the
gap; a scheduling hint that only chooses how the peer's kernels split the work (``pack_gqa``, ``sm_margin``, a
dense call's ``num_splits``, ``scheduler_metadata``) is checked and not used: lazytriton makes its own choice and
the result is the same attention.
"""

from __future__ import annotations

from typing import Any


class MissingFeature(NotImplementedError):
    """A peer's argument that lazytriton's API cannot express (the message names the function and argument)."""


def refuse(function: str, **given: Any) -> None:
    """Raise ``MissingFeature`` for the first of ``given`` that is set (not None), naming it."""
    for name, value in given.items():
        if value is not None:
            raise MissingFeature(f"lazytriton.{function} has no {name}= (the peer passed one)")


def check_hints(num_splits: Any = 0, pack_gqa: Any = None, sm_margin: Any = 0) -> None:
    """Check FlashAttention-3's scheduling hints as it types them; lazytriton chooses its own schedule."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int, got {type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0, got {num_splits}")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa must be None or a bool, got {type(pack_gqa).__name__}")
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int):
        raise TypeError(f"sm_margin must be an int, got {type(sm_margin).__name__}")
    if sm_margin < 0:
        raise ValueError(f"sm_margin must be >= 0, got {sm_margin}")
