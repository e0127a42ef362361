"""vLLM's base classes when vLLM is installed, ``standin``'s otherwise.

``VLLM_FOUND`` says which. Two vLLM layouts are known: the one read for this
example (``vllm/v1/attention/backend.py``: backends, impls, builders and the
common metadata in one module) and the earlier v1 one (the abstract classes in
``vllm/attention/backends/abstract.py``, the builder and the common metadata
in ``vllm/v1/attention/backends/utils.py``).
"""

from __future__ import annotations

try:
    from vllm.v1.attention.backend import (
        AttentionBackend,
        AttentionCGSupport,
        AttentionImpl,
        AttentionMetadataBuilder,
        AttentionType,
        CommonAttentionMetadata,
        MultipleOf,
    )

    VLLM_FOUND = True
except ImportError:
    try:
        from vllm.attention.backends.abstract import AttentionBackend, AttentionImpl, AttentionType
        from vllm.v1.attention.backends.utils import (
            AttentionCGSupport,
            AttentionMetadataBuilder,
            CommonAttentionMetadata,
        )

        from lazytriton_vllm.standin import MultipleOf

        VLLM_FOUND = True
    except ImportError:
        from lazytriton_vllm.standin import (
            AttentionBackend,
            AttentionCGSupport,
            AttentionImpl,
            AttentionMetadataBuilder,
            AttentionType,
            CommonAttentionMetadata,
            MultipleOf,
        )

        VLLM_FOUND = False

__all__ = ["VLLM_FOUND", "AttentionBackend", "AttentionCGSupport", "AttentionImpl", "AttentionMetadataBuilder",
           "AttentionType", "CommonAttentionMetadata", "MultipleOf"]
