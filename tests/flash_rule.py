"""FlashAttention's numerics rule, as the tests apply it: a result against a float64 reference and a same-dtype one.

``references`` runs a reference twice (on float64 copies of the inputs and on the inputs as they are) and takes
the gradients of both; ``check_rule`` holds a result to at most ``factor`` times the same-dtype reference's error
against the float64 one (2 for out and lse, FlashAttention-3 allows 3 for the gradients), plus a floor scaled by
the float64 values' size.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch


def seed_of(*params: object) -> int:
    """A stable seed from a case's parameters (not hash(), which is salted per process)."""
    return zlib.crc32(repr(params).encode())


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref.detach().double()).abs().max()) if a.numel() else 0.0


def check_rule(name: str, got: torch.Tensor, exact: torch.Tensor, same: torch.Tensor, floor: float,
               factor: float = 2) -> None:
    """``got`` finite and within ``factor`` x the same-dtype reference's error of the float64 one, plus ``floor``."""
    assert torch.isfinite(got).all(), f"{name} has NaN/inf"
    err, same_err = max_err(got, exact), max_err(same, exact)
    bound = factor * same_err + floor * max(1.0, float(exact.detach().abs().max()) if exact.numel() else 0.0)
    assert err <= bound, f"{name}: max error {err:.3g} > {factor} x same-dtype's {same_err:.3g} + floor ({bound:.3g})"


class Reference(NamedTuple):
    """A reference's out and lse (detached) and the gradients of its inputs for the given dout."""

    out: torch.Tensor
    lse: torch.Tensor
    grads: tuple[torch.Tensor, ...]


def references(reference: Callable[..., tuple[torch.Tensor, torch.Tensor]], inputs: Sequence[torch.Tensor],
               do: torch.Tensor) -> tuple[Reference, Reference]:
    """``reference(*inputs)`` in float64 and in the inputs' own dtype, each with its gradients for ``do``."""
    results = []
    for exact in (True, False):
        leaves = [t.double().requires_grad_() if exact else t.clone().requires_grad_() for t in inputs]
        out, lse = reference(*leaves)
        grads = torch.autograd.grad(out, leaves, do.double() if exact else do)
        results.append(Reference(out.detach(), lse.detach(), grads))
    return results[0], results[1]
