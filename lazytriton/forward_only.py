"""Torch ops with a forward only: a backward through them raises NotImplementedError with the op's own message.

Registered as their autograd formula (``register``), so a call on inputs that require grad runs forward (the
peers' tests make FP8 and MLA inputs that require grad and never call backward) and a backward says why it
cannot be taken.
"""

from __future__ import annotations

from typing import Any


def register(message: str, *ops: Any) -> None:
    """Give each of ``ops`` (``torch.library.custom_op`` objects) an autograd formula that raises ``message``."""

    def no_backward(ctx: Any, *grads: Any) -> Any:
        raise NotImplementedError(message)

    def setup(ctx: Any, inputs: Any, output: Any) -> None:
        return None

    for op in ops:
        op.register_autograd(no_backward, setup_context=setup)
