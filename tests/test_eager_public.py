"""The public functions take lazytriton.eager for differentiable eager calls (CPU, interpreter)."""

from __future__ import annotations

import subprocess
import sys


def test_a_training_step_through_the_public_functions_imports_neither_dynamo_nor_the_op() -> None:
    code = """
import sys, torch
import lazytriton
q, k, v = (torch.randn(1, 16, 2, 16, requires_grad=True) for _ in range(3))
out = lazytriton.flash_attn_func(q, k, v, causal=True)
out2, lse = lazytriton.attn_fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
(out.sum() + out2.sum()).backward()
assert q.grad is not None and k.grad is not None and v.grad is not None
loaded = [name for name in ("torch._dynamo", "lazytriton.ops") if name in sys.modules]
assert not loaded, loaded
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
