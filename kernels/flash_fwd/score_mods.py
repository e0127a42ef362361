"""The score modifications of the attention kernels' calls: ALiBi slopes, an additive bias, dropout.

``with_mods`` checks them and puts them into a checked call
(``binding.Call``: its ``alibi``, ``bias``, ``dropout_p`` and ``philox``
fields), naming the argument in any error, before anything runs;
``draw_philox`` draws dropout's [seed, offset] (torch's CUDA generator's, on the
device); ``mod_tensors``
gives Triton's launchers (interpreter, JIT) a tensor for each of the three
pointers. The kernels' flags are ``Call.mods``; the launch parameters come
from ``binding.PARAM_SOURCES`` like every other.
"""

from __future__ import annotations

import threading
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


_GENERATOR_LOCK = threading.Lock()


def draw_philox(device: torch.device, elements: int) -> torch.Tensor:
    """Dropout's [seed, offset] for a call whose mask has ``elements`` entries (int64, on ``device``).

    On a CUDA device, outside a graph capture and ``torch.compile``: the seed and Philox offset of torch's CUDA
    generator, which then advances by ``elements`` rounded up to 4, as PyTorch's memory-efficient backend takes
    them (``generator_pair``). The kernels' stream is that backend's, so after the same ``torch.manual_seed`` a
    call drops the elements torch's would (``_fill_mem_eff_dropout_mask_`` builds its mask). Elsewhere (the CPU,
    a capture, a compiled graph): drawn on the device by ``torch.randint``, which ``torch.manual_seed``
    reproduces and each replay of a graph draws anew; both below 2**62, so offset + index never wraps.
    """
    if device.type == "cuda" and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing():
        index = device.index if device.index is not None else torch.cuda.current_device()
        seed, offset = generator_pair(torch.cuda.default_generators[index], elements)
        pair = torch.tensor([seed, offset], dtype=torch.int64, pin_memory=True)
        return pair.to(device, non_blocking=True)  # no host synchronisation (a pageable copy would wait)
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def dense_elements(call: Call) -> int:
    """The entries of a dense call's dropout mask: batch x heads_q x seqlen_q x seqlen_k."""
    b, hq, _, sq, sk, _ = call.shape
    return b * hq * sq * sk


def packed_elements(q: Any, k: Any) -> int:
    """The entries of a packed call's mask: heads_q x total_q x total_k over (total, heads, dim) q and k.

    0 for tensors of another shape, which the call's checks then refuse.
    """
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 3 and k.dim() == 3:
        return q.shape[0] * q.shape[1] * k.shape[0]
    return 0


def generator_pair(generator: Any, elements: int) -> tuple[int, int]:
    """The (seed, offset) a Philox generator (torch's CUDA one) gives a call drawing ``elements`` numbers.

    The generator's offset moves past them, rounded up to 4 (torch's ``philox_cuda_state``); the seed comes
    back as a signed 64-bit integer, its bits unchanged.
    """
    with _GENERATOR_LOCK:
        seed, offset = generator.initial_seed(), generator.get_offset()
        generator.set_offset(offset + (elements + 3) // 4 * 4)
    return (seed - 2**64 if seed >= 2**63 else seed), offset


def mod_tensors(call: Call, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Alibi, Bias and Philox arguments for Triton's launchers: the call's, or empty stand-ins never read."""
    return (torch.empty(0, dtype=torch.float32, device=q.device) if call.alibi is None else call.alibi,
            torch.empty(0, dtype=q.dtype, device=q.device) if call.bias is None else call.bias,
            torch.empty(0, dtype=torch.int64, device=q.device) if call.philox is None else call.philox)
