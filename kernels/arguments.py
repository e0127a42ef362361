"""Arguments as the kernels read them, and as error messages show them.

``index_tensor`` gives an index tensor (cache_seqlens, cache_batch_idx,
block_table, cu_seqlens, ALiBi slopes) the form the kernels assume: a plain
``torch.Tensor`` whose memory is laid out as its logical values. The kernels
read such a tensor through its pointer, as if its last stride were 1, while
the value checks read its logical values: a view such as ``x[::2]`` would have
one set of values checked and another launched, so it is copied. A subclass
(``nn.Parameter``, or any class overriding ``__torch_function__``) is viewed
as the plain tensor it holds, so that its shape, its checks and its pointer
come from the tensor itself, not from an override. A tensor whose class
overrides ``__torch_dispatch__`` (FakeTensor and the other tracing tensors)
has no memory of its own to read: it is left as given (tracing checks only
shapes, and its own dispatch runs the op on the tensors it holds). A plain
contiguous tensor, the common call, is returned as it is, after one type test
and one ``is_contiguous`` call.

``shown`` formats a value for an error message: a tensor by its shape, dtype
and device, never its values (a message must not print a user's data, nor
thousands of numbers).
"""

from __future__ import annotations

from typing import Any

import torch

_Tensor = torch.Tensor
_NO_DISPATCH = torch._C._disabled_torch_dispatch_impl  # torch.Tensor's own __torch_dispatch__: none
_MAX_SHOWN = 120  # characters of a non-tensor value's repr in a message


def index_tensor(t: Any) -> Any:
    """``t`` as the kernels read it: a plain, contiguous torch.Tensor; anything else (None, an int) as given."""
    if type(t) is _Tensor:
        return t if t.is_contiguous() else t.contiguous()
    if not isinstance(t, _Tensor) or type(t).__torch_dispatch__ is not _NO_DISPATCH:
        return t
    with torch._C.DisableTorchFunctionSubclass():  # no override sees the conversion
        plain = t.as_subclass(_Tensor)
    return plain if plain.is_contiguous() else plain.contiguous()


def shown(value: Any) -> str:
    """``value`` as an error message shows it: a tensor by its shape, dtype and device; else its repr, cut short."""
    if isinstance(value, _Tensor):
        return f"a tensor of shape {tuple(value.shape)}, dtype {value.dtype}, on {value.device}"
    if type(value) in (tuple, list) and any(isinstance(v, _Tensor) for v in value):
        inner = ", ".join(shown(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"({inner})" if type(value) is tuple else f"[{inner}]"
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "..."


# A chunk of this many keys or more (FlashAttention-3's attention_chunk) holds every key of a call whose
# positions stay below 2**29 (the windowed calls' bound) at either alignment: larger chunks are cut to it.
MAX_CHUNK = 2**30


def check_chunk(name: str, attention_chunk: Any) -> int:
    """``attention_chunk`` checked: an int >= 0 (0: off), else a TypeError/ValueError naming ``name``."""
    if type(attention_chunk) is not int:
        raise TypeError(f"{name} must be an int >= 0 (0 is off), got {shown(attention_chunk)}")
    if attention_chunk < 0:
        raise ValueError(f"{name} must be >= 0 (0 is off), got {attention_chunk}")
    return attention_chunk


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_dropout(name: str, p: Any) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    return float(p)
