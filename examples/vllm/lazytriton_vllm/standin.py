"""The few vLLM base classes the backend subclasses, for a machine without vLLM.

vLLM is a large CUDA install; the backend, its tests and a reader of this
example do not need it. With vLLM installed, ``lazytriton_vllm.bases`` takes
vLLM's own classes and this module is not imported. The names and signatures
follow vLLM's ``vllm/v1/attention/backend.py``; only what the backend and its
tests use is here: no selection logic, no registry.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch


class AttentionType(str, enum.Enum):
    """Which attention a layer computes (vLLM's names and values)."""

    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_ONLY = "encoder_only"
    ENCODER_DECODER = "encoder_decoder"


class AttentionCGSupport(enum.Enum):
    """How far a builder's metadata may be replayed in a full CUDA graph (vLLM's levels)."""

    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0


class MultipleOf:
    """A kernel block size: any multiple of ``base``."""

    def __init__(self, base: int) -> None:
        self.base = base


class AttentionBackend(ABC):
    """A backend: names its impl and builder classes and lays out the KV cache."""

    accept_output_buffer: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[Any]: ...

    @staticmethod
    @abstractmethod
    def get_builder_cls() -> type[Any]: ...

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]: ...

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        sizes = cls.get_supported_head_sizes()
        return not sizes or head_size in sizes

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes


M = TypeVar("M")


@dataclass
class CommonAttentionMetadata:
    """The batch as vLLM's model runner describes it to every backend's builder (the fields read here)."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor = True


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Builds a backend's metadata from the common metadata, once a step for every layer of a KV cache group."""

    reorder_batch_threshold: int | None = None

    @abstractmethod
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device

    @abstractmethod
    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> M: ...


class AttentionImpl(ABC):
    """A layer's attention: built once a layer, then ``forward`` once a step."""

    dcp_world_size: int = 1
    can_return_lse_for_decode: bool = False

    @abstractmethod
    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor | None = None, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor: ...
