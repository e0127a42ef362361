"""The pytest plugin that runs PyTorch's attention tests against lazytriton (``-p torch_route``).

PyTorch's ``test_transformers.py`` calls ``torch.nn.functional.scaled_dot_product_attention`` for both sides of a
comparison: the call under test with the fused backends enabled (``sdpa_kernel([SDPBackend.FLASH_ATTENTION])``,
efficient or cuDNN attention, or torch's default, all enabled), and its reference with the math backend alone
(``sdpa_kernel([SDPBackend.MATH])``) or through ``torch.ops.aten._scaled_dot_product_attention_math``. This plugin
replaces the function (the name in ``torch.nn.functional``, which the test file, ``nn.MultiheadAttention`` and the
Transformer layers call) before the test file is imported, with a router:

- a fused backend enabled that takes the query's dtype on its device: lazytriton's drop-in,
  ``lazytriton.scaled_dot_product_attention``, serves the call. What it refuses (float64 on CPU, nested tensors,
  ...) raises, and the case fails with that message: a gap, counted;
- the math backend alone, or a dtype no fused backend takes there (float64 on a GPU: the references some tests
  compute with every backend enabled, which torch serves by its math): torch's own function.

With ``--torch-route-to torch`` every call goes to torch's function, logged as above: the baseline run, whose
failures are the file's own against the installed torch (the file and torch need not be of one version).

Each case's calls are logged (``--torch-route-log PATH``, JSON lines: the node id, the calls lazytriton served,
those torch's math served, and the first line of each refusal), so ``benchmarks/peer_suites.py`` tells the cases
that exercise lazytriton from those that test torch alone (its module classes' fast paths, its backend choice).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import lazytriton

TORCH_SDPA = F.scaled_dot_product_attention


class Calls:
    """The current case's routed calls."""

    def __init__(self) -> None:
        self.lazytriton = 0
        self.torch = 0
        self.refused: list[str] = []


CALLS = Calls()
ROUTE_TO = ["lazytriton"]  # the run's --torch-route-to


def fused_backend_enabled() -> bool:
    """Whether the context lets SDPA take a fused backend (flash, memory-efficient or cuDNN attention)."""
    backends = torch.backends.cuda
    return bool(backends.flash_sdp_enabled() or backends.mem_efficient_sdp_enabled() or backends.cudnn_sdp_enabled())


# The dtypes torch's fused backends take, by device type (torch's sdp_utils): on CUDA, flash and cuDNN attention
# take float16 and bfloat16, memory-efficient attention float32 too; on CPU, its flash backend takes float64 as
# well. Other device types: as CUDA's flags say.
FUSED_DTYPES = {"cuda": (torch.float16, torch.bfloat16, torch.float32),
                "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def fused_dtype(device_type: str, dtype: Any) -> bool:
    """Whether some fused backend of torch takes ``dtype`` on ``device_type`` (pure)."""
    allowed = FUSED_DTYPES.get(device_type)
    return allowed is None or dtype in allowed


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Any:
    """torch's SDPA signature: lazytriton's where a fused backend may serve, torch's math where only it may."""
    if ROUTE_TO[0] == "torch" or not fused_backend_enabled() or not fused_dtype(query.device.type, query.dtype):
        CALLS.torch += 1
        bias_type = type(attn_mask)
        if bias_type.__name__ == "CausalBias" and hasattr(bias_type, "_dispatch"):
            # torch's CausalBias serves itself when the function called is F.scaled_dot_product_attention, which
            # is this one now: its own dispatch, whose inner SDPA calls come back here
            return bias_type._dispatch(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa)
    CALLS.lazytriton += 1
    try:
        return lazytriton.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                       is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    except Exception as exc:
        if "PeerTimeout" in f"{type(exc).__name__}: {exc}":  # the case's time ran out inside the call
            raise
        CALLS.refused.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:240])
        raise


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("peer")
    group.addoption("--torch-route-log", default=None, help="append each case's routed SDPA calls here (JSON lines)")
    group.addoption("--torch-route-to", choices=("lazytriton", "torch"), default="lazytriton",
                    help="torch: every call to torch's own function (the baseline run)")


def pytest_configure(config: pytest.Config) -> None:
    ROUTE_TO[0] = config.getoption("--torch-route-to")
    F.scaled_dot_product_attention = scaled_dot_product_attention
    config.pluginmanager.register(RouteLog(config.getoption("--torch-route-log")), "torch_route_log")


def pytest_unconfigure(config: pytest.Config) -> None:
    F.scaled_dot_product_attention = TORCH_SDPA


class RouteLog:
    """Writes one line a case (appended with one write: xdist's workers share the file)."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        global CALLS
        CALLS = Calls()
        try:
            yield
        finally:
            if self.path:
                line = json.dumps({"nodeid": item.nodeid, "lazytriton": CALLS.lazytriton, "torch": CALLS.torch,
                                   "refused": CALLS.refused}) + "\n"
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
