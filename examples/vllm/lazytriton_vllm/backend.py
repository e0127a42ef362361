"""A vLLM v1 attention backend on lazytriton's public functions.

``LazyTritonAttentionBackend`` has the interface of vLLM's FlashAttention
backend (``vllm/v1/attention/backends/flash_attn.py``) and the same KV cache
layout, (2, num_blocks, block_size, num_kv_heads, head_size), so a model runs
on it unchanged. Each step, each layer:

1. writes the step's new keys and values into the paged cache at
   ``slot_mapping`` (vLLM's ``reshape_and_cache_flash``): lazytriton's
   ``reshape_and_cache_flash`` (``write_new_keys``: one kernel, no host
   sync); a batch of decodes only (one query a request) instead goes through
   ``flash_attn_with_kvcache(..., k=, v=)``, whose ``kv_append`` kernel
   writes the key at the request's position before the attention reads it.
   An FP8 KV cache (``kv_cache_dtype`` ``"fp8"``, ``"fp8_e4m3"``,
   ``"fp8_e5m2"``) holds key / k_scale and value / v_scale (the layer's
   ``_k_scale``/``_v_scale``, per tensor), quantised by either write;
2. runs the whole batch, prefills and decodes mixed, as one
   ``lazytriton.flash_attn_varlen_func(..., cu_seqlens_q=, seqused_k=,
   block_table=)`` call, as vLLM v1 does with FlashAttention-3, with the
   layer's sliding window, softcap, ALiBi slopes and sinks (gpt-oss's
   ``s_aux``); over an FP8 cache, with the layer's scales as
   ``k_descale``/``v_descale`` (as vLLM calls FlashAttention-3).

What vLLM's backend has and this one has not (cascade attention, decode
context parallelism, encoder attention, full CUDA graphs) is refused or left
to vLLM's other paths; examples/vllm/README.md lists it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import lazytriton
from lazytriton_vllm.bases import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

# The KV cache dtypes served: the model's own (vLLM's "auto") or its name, and vLLM's FP8 caches' names (the
# float8 format each holds; vLLM may allocate them as uint8 bytes, viewed as the format here).
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", *FP8_KV_CACHE_DTYPES)
# Head sizes vLLM may ask for that lazytriton's decoding kernels take (they take 1 to 256).
HEAD_SIZES = list(range(8, 257, 8))


class LazyTritonAttentionBackend(AttentionBackend):
    """vLLM's attention backend interface, served by lazytriton's kernel cache."""

    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(KV_CACHE_DTYPES)
    forward_includes_kv_cache_update: bool = True  # forward writes the new keys, then attends

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the registry's slot for an out-of-tree backend (README: registering it)

    @staticmethod
    def get_impl_cls() -> type[LazyTritonAttentionImpl]:
        return LazyTritonAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[LazyTritonMetadata]:
        return LazyTritonMetadata

    @staticmethod
    def get_builder_cls() -> type[LazyTritonMetadataBuilder]:
        return LazyTritonMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # pages of any size: 16 and its multiples read a key tile a page, others a key

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_SIZES)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size in HEAD_SIZES

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        for name, n in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_size", head_size)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        if cache_dtype_str not in KV_CACHE_DTYPES:
            raise ValueError(f"cache_dtype_str must be one of {KV_CACHE_DTYPES}, "
                             f"got {cache_dtype_str!r}")
        return (2, num_blocks, block_size, num_kv_heads, head_size)


@dataclass
class LazyTritonMetadata:
    """One step's batch, as the attention call reads it (vLLM's FlashAttentionMetadata's fields it uses).

    A request r's queries are rows query_start_loc[r] .. query_start_loc[r + 1] - 1 of the step's query; it
    sees the first seq_lens[r] keys of its pages (block_table[r]), those of this step included, its queries
    aligned bottom-right (the last query sees every key). slot_mapping[i] is the cache slot of new token i:
    page slot // block_size, row slot % block_size; a negative slot is not written (vLLM's padding).
    """

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True


class LazyTritonMetadataBuilder(AttentionMetadataBuilder[LazyTritonMetadata]):
    """Builds ``LazyTritonMetadata`` from vLLM's common metadata (views, no copies, no host sync)."""

    # Attention runs outside vLLM's piecewise CUDA graphs: the call's grid follows max_query_len and the split
    # heuristic max_seq_len, host ints that change from step to step, so a full graph is not claimed.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER  # the attribute's earlier name

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        return cls._cudagraph_support

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LazyTritonMetadata:
        """The step's metadata; a common prefix (cascade attention) is read as part of each request's pages."""
        m = common_attn_metadata
        if not isinstance(m.causal, bool):
            raise ValueError("common_attn_metadata.causal must be a bool: lazytriton takes one causal flag a call, "
                             "not one a request")
        return LazyTritonMetadata(num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                                  query_start_loc=m.query_start_loc, max_seq_len=m.max_seq_len, seq_lens=m.seq_lens,
                                  block_table=m.block_table_tensor, slot_mapping=m.slot_mapping, causal=m.causal)


def write_new_keys(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto", k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Write new token i's key and value into slot slot_mapping[i]: vLLM's ``reshape_and_cache_flash``, one kernel.

    lazytriton's slot write (``kv_slots``): the slot's page is slot // block_size, its row slot % block_size; the
    first len(slot_mapping) rows of key and value are the new tokens (the rest is vLLM's padding, not read). The
    slots are read by the kernel only (no host sync, no torch indexing): a negative slot (padding) and a slot
    past the cache are skipped, so no value of slot_mapping writes outside the cache. An FP8 cache
    (``kv_cache_dtype``) gets key / k_scale and value / v_scale, saturated, rounded to nearest even.
    """
    lazytriton.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                                       v_scale)


class LazyTritonAttentionImpl(AttentionImpl):
    """A layer's attention; built once a layer with vLLM's FlashAttentionImpl's arguments."""

    # False: every call's index tensors (block table, lengths, cu_seqlens) are checked against the cache (one host
    # sync a call); True runs under lazytriton.trusted_indices(), for indices right by construction. The slots are
    # never read on the host: the write's kernel skips any outside the cache.
    trust_indices: ClassVar[bool] = False
    # True: a step of decodes only appends through flash_attn_with_kvcache's kv_append kernel (README).
    fused_decode_append: ClassVar[bool] = True

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if not LazyTritonAttentionBackend.supports_head_size(head_size):
            raise ValueError(f"head_size must be a multiple of 8 from 8 to 256, got {head_size!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {kv_cache_dtype!r}")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"attn_type must be {AttentionType.DECODER.value!r} (this backend serves decoder "
                             f"attention over the paged cache), got {attn_type!r}")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        if logits_soft_cap is not None and not float(logits_soft_cap) >= 0.0:
            raise ValueError(f"logits_soft_cap must be None or >= 0, got {logits_soft_cap!r}")
        if alibi_slopes is not None and len(alibi_slopes) != num_heads:
            raise ValueError(f"alibi_slopes must hold num_heads = {num_heads} slopes, got {len(alibi_slopes)}")
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,)):
            raise ValueError(f"sinks must be a tensor of shape ({num_heads},) (one logit a query head), got "
                             f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
        if getattr(self, "dcp_world_size", 1) > 1:
            raise ValueError("decode context parallelism (dcp_world_size > 1) is not served by this backend")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.alibi_slopes = None if alibi_slopes is None else torch.tensor(alibi_slopes, dtype=torch.float32)
        # vLLM's window of w tokens: a query sees itself and the w - 1 keys before it (FlashAttention's (w - 1, 0)).
        self.sliding_window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        self.logits_soft_cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                kv_cache: torch.Tensor, attn_metadata: LazyTritonMetadata | None, output: torch.Tensor | None = None,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Write the step's new keys into the cache, then attend: output[:num_actual_tokens] is written.

        query: (num_tokens, num_heads, head_size); key, value: (num_tokens, num_kv_heads, head_size), None for a
        layer that shares an earlier layer's cache; kv_cache: (2, num_blocks, block_size, num_kv_heads,
        head_size); output: (num_tokens, num_heads, head_size) or (num_tokens, num_heads * head_size). Rows past
        num_actual_tokens (vLLM's padding) are neither read nor written. An FP8 cache (float8 or uint8 bytes) is
        read and written with the layer's ``_k_scale``/``_v_scale`` (float32, one value each; no layer: 1.0).
        """
        if output is None:
            raise ValueError("output must be given: this backend writes into vLLM's buffer (accept_output_buffer)")
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("output_scale and output_block_scale must be None: no fused output quantization")
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        m = attn_metadata
        n = m.num_actual_tokens
        out = output.view(output.shape[0], self.num_heads, self.head_size)[:n]
        key_cache, value_cache = kv_cache.unbind(0)
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        fp8 = FP8_KV_CACHE_DTYPES.get(self.kv_cache_dtype)
        if fp8 is not None:
            key_cache, value_cache = key_cache.view(fp8), value_cache.view(fp8)
            scales = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
        write = self.kv_sharing_target_layer_name is None and key is not None and value is not None
        with lazytriton.trusted_indices() if self.trust_indices else nullcontext():
            if write and self.fused_decode_append and m.max_query_len == 1 and m.query_start_loc.shape[0] == n + 1:
                self._decode_appending(query[:n], key[:n], value[:n], key_cache, value_cache, m, out, scales)
                return output
            if write:
                write_new_keys(key, value, key_cache, value_cache, m.slot_mapping,
                               "auto" if fp8 is None else self.kv_cache_dtype, *scales)
            lazytriton.flash_attn_varlen_func(
                query[:n], key_cache, value_cache, cu_seqlens_q=m.query_start_loc, cu_seqlens_k=None,
                max_seqlen_q=m.max_query_len, max_seqlen_k=m.max_seq_len, softmax_scale=self.scale, causal=m.causal,
                window_size=self.sliding_window, softcap=self.logits_soft_cap, alibi_slopes=self._alibi(query),
                seqused_k=m.seq_lens, block_table=m.block_table, s_aux=self._sinks(query), out=out,
                k_descale=scales[0], v_descale=scales[1])
        return output

    def _decode_appending(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, m: LazyTritonMetadata, out: torch.Tensor,
                          scales: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        """One query a request: kv_append writes request r's key at position seq_lens[r] - 1, then the attention.

        That position's slot, through the block table, is the one vLLM's slot_mapping names for the token.
        """
        n = query.shape[0]
        lazytriton.flash_attn_with_kvcache(
            query.unsqueeze(1), key_cache, value_cache, k=key.unsqueeze(1), v=value.unsqueeze(1),
            cache_seqlens=m.seq_lens[:n] - 1, block_table=m.block_table[:n], softmax_scale=self.scale,
            causal=m.causal, window_size=self.sliding_window, softcap=self.logits_soft_cap,
            alibi_slopes=self._alibi(query), s_aux=self._sinks(query), out=out.unsqueeze(1), k_descale=scales[0],
            v_descale=scales[1])

    def _alibi(self, query: torch.Tensor) -> torch.Tensor | None:
        """The slopes on the query's device (moved once)."""
        if self.alibi_slopes is not None and self.alibi_slopes.device != query.device:
            self.alibi_slopes = self.alibi_slopes.to(query.device)
        return self.alibi_slopes

    def _sinks(self, query: torch.Tensor) -> torch.Tensor | None:
        """The sinks as lazytriton reads them: float32 on the query's device (gpt-oss keeps them in bf16)."""
        if self.sinks is None:
            return None
        return self.sinks.to(device=query.device, dtype=torch.float32)
