"""torch's ``CausalBias`` masks (``causal_upper_left``, ``causal_lower_right``) through lazytriton's SDPA drop-in.

torch serves such a mask as the causal mask it names, not as a tensor of values; the drop-in runs it as a causal
call of that alignment (top-left or bottom-right), forward and backward, and refuses what torch refuses. On CPU
through Triton's interpreter, against torch's own function in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import lazytriton
from lazytriton.sdpa import SDPAError

MAKERS = {"upper_left": causal_upper_left, "lower_right": causal_lower_right}


def _inputs(sq: int, sk: int, seed: int, grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, n, 16, generator=g).requires_grad_(grad) for n in (sq, sk, sk))


@pytest.mark.filterwarnings("ignore:Lower right causal bias")
@pytest.mark.parametrize("variant", sorted(MAKERS))
@pytest.mark.parametrize("sq,sk", [(4, 7), (6, 6), (7, 3)])
def test_a_causal_bias_is_the_causal_mask_it_names(variant: str, sq: int, sk: int) -> None:
    q, k, v = _inputs(sq, sk, seed=sq * 10 + sk)
    out = lazytriton.scaled_dot_product_attention(q, k, v, attn_mask=MAKERS[variant](sq, sk))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=MAKERS[variant](sq, sk))
    seen = ~ref.isnan()  # torch's lower-right rows without keys are NaN; lazytriton's are 0
    assert seen.any()
    assert float((out.double() - ref)[seen].abs().max()) < 1e-5
    if variant == "upper_left":  # the same as is_causal=True, bit for bit
        assert torch.equal(out, lazytriton.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("variant", sorted(MAKERS))
def test_a_causal_bias_has_the_causal_gradients(variant: str) -> None:
    q, k, v = _inputs(5, 8, seed=3, grad=True)
    dout = torch.randn(2, 2, 5, 16, generator=torch.Generator().manual_seed(4))
    lazytriton.scaled_dot_product_attention(q, k, v, attn_mask=MAKERS[variant](5, 8)).backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q64, k64, v64, attn_mask=MAKERS[variant](5, 8)).backward(dout.double())
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got is not None and want is not None
        assert float((got.double() - want).abs().max()) < 1e-4


def test_what_torch_refuses_with_a_causal_bias_is_refused() -> None:
    q, k, v = _inputs(4, 6, seed=1)
    with pytest.raises(SDPAError, match="CausalBias should not be used with causal=True") as raised:
        lazytriton.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(4, 6), is_causal=True)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, RuntimeError)
    with pytest.raises(SDPAError, match=r"CausalBias of \(4, 5\) query and key positions, but query and key have "
                                        r"4 and 6"):
        lazytriton.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(4, 5))
