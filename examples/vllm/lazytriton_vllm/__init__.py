"""lazytriton as a vLLM v1 attention backend (examples/vllm/README.md says how to use it).

``register()`` is the vLLM plugin (the ``vllm.general_plugins`` entry point in
examples/vllm/pyproject.toml): vLLM calls it in every process it starts, and
it puts ``LazyTritonAttentionBackend`` in vLLM's registry under ``CUSTOM``,
which ``--attention-backend CUSTOM`` then selects.
"""

from __future__ import annotations

BACKEND = "lazytriton_vllm.backend.LazyTritonAttentionBackend"


def register() -> None:
    """Register the backend as vLLM's CUSTOM attention backend (vLLM must be installed)."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError:  # the registry's earlier home
        from vllm.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
