"""The score modifications of the attention kernels' calls: ALiBi slopes, an additive bias, dropout.

``with_mods`` checks them and puts them into a checked call
(``binding.Call``: its ``alibi``, ``bias``, ``dropout_p`` and ``philox``
fields), naming the argument in any error, before anything runs;
``draw_philox`` draws dropout's [seed, offset] on the device; ``mod_tensors``
gives Triton's launchers (interpreter, JIT) a tensor for each of the three
pointers. The kernels' flags are ``Call.mods``; the launch parameters come
from ``binding.PARAM_SOURCES`` like every other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lazytriton.kernels.arguments import shown
from lazytriton.kernels.flash_fwd.names import NAMES, Names

if TYPE_CHECKING:
    from lazytriton.kernels.flash_fwd.binding import Call


def with_mods(call: Call, q: torch.Tensor, alibi: Any = None, bias: Any = None, dropout_p: Any = 0.0,
              philox: Any = None, names: Names | None = None) -> Call:
    """``call`` with ALiBi slopes, an additive bias and dropout checked (a TypeError/ValueError naming each).

    ``alibi``: float32 slopes of shape (heads_q,) or (batch, heads_q) on q's
    device (FlashAttention-2's). ``bias``: q's dtype, exactly (batch, heads_q,
    seqlen_q, seqlen_k) in the kernel's order, any strides (0 where it
    broadcasts: the public functions expand, never copy); one that requires
    grad gets its gradient from the backward (flash_bwd_dq's BIAS_GRAD)
    through the autograd of the callers that pass it as an input
    (``lazytriton.eager``, ``lazytriton.ops``). ``dropout_p`` in [0, 1);
    above 0 it needs ``philox``, the int64 [seed, offset] pair on q's device
    the kernels draw their mask from (``draw_philox``).
    """
    if names is None:
        names = NAMES
    b, hq, _, sq, sk, _ = call.shape
    if alibi is not None:
        if not isinstance(alibi, torch.Tensor):
            raise TypeError(f"{names.alibi} must be a torch.Tensor or None, got {type(alibi).__name__}")
        if alibi.dtype != torch.float32:
            raise TypeError(f"{names.alibi} must be float32, got {alibi.dtype}")
        if tuple(alibi.shape) not in ((hq,), (b, hq)):
            raise ValueError(f"{names.alibi} must have shape ({hq},) or ({b}, {hq}) (heads or batch x heads), got "
                             f"{tuple(alibi.shape)}")
        if alibi.device != q.device:
            raise ValueError(f"{names.alibi} is on {alibi.device} but {names.q} is on {q.device}")
        if alibi.stride(-1) != 1 and hq > 1:
            alibi = alibi.contiguous()
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{names.bias} must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.dtype != q.dtype:
            raise TypeError(f"{names.bias} must have {names.q}'s dtype {q.dtype} (or be boolean), got {bias.dtype}")
        if tuple(bias.shape) != (b, hq, sq, sk):
            raise ValueError(f"{names.bias} must have shape {(b, hq, sq, sk)} here, got {tuple(bias.shape)}")
        if bias.device != q.device:
            raise ValueError(f"{names.bias} is on {bias.device} but {names.q} is on {q.device}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{names.dropout} must be a float, got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{names.dropout} must be in [0, 1), got {dropout_p!r}")
    if p > 0.0:
        if (not isinstance(philox, torch.Tensor) or philox.dtype != torch.int64 or tuple(philox.shape) != (2,)
                or philox.device != q.device):
            raise ValueError(f"with {names.dropout} > 0, philox must be an int64 tensor [seed, offset] on "
                             f"{q.device}, got {shown(philox)}")
        philox = philox if philox.is_contiguous() else philox.contiguous()
    else:
        philox = None
    return call._replace(alibi=alibi, bias=bias, dropout_p=p, philox=philox)


def draw_philox(device: torch.device) -> torch.Tensor:
    """A fresh [seed, offset] for dropout, drawn on ``device`` from torch's generator.

    Drawn on the device, not the host: ``torch.manual_seed`` reproduces it,
    and inside a CUDA graph capture torch's own graph-safe RNG makes each
    replay draw anew. Both below 2**62, so offset + element index never wraps.
    """
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def mod_tensors(call: Call, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Alibi, Bias and Philox arguments for Triton's launchers: the call's, or empty stand-ins never read."""
    return (torch.empty(0, dtype=torch.float32, device=q.device) if call.alibi is None else call.alibi,
            torch.empty(0, dtype=q.dtype, device=q.device) if call.bias is None else call.bias,
            torch.empty(0, dtype=torch.int64, device=q.device) if call.philox is None else call.philox)
