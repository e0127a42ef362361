"""The peers' public signatures the shims copy, recorded from their interface files, and the reader of those files.

Each function is its parameters in order, each with the source text of its default (None where it has none), as
``ast.unparse`` writes it. Recorded from Dao-AILab/flash-attention at commit
0251105a2fb19d2957484b7f023cd8c115286ced: ``FA3`` from ``hopper/flash_attn_interface.py``, ``FA2`` from
``flash_attn/flash_attn_interface.py``. ``tests/test_peer_shim.py`` compares the shims with these, and these with
a peer checkout's files where one is present (``read``, which parses the file and runs nothing from it).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Iterable
from pathlib import Path

Parameters = tuple[tuple[str, "str | None"], ...]

FA3_FILE = "hopper/flash_attn_interface.py"
FA2_FILE = "flash_attn/flash_attn_interface.py"

FA3: dict[str, Parameters] = {
    "flash_attn_func": (
        ("q", None), ("k", None), ("v", None), ("softmax_scale", "None"), ("causal", "False"), ("qv", "None"),
        ("q_descale", "None"), ("k_descale", "None"), ("v_descale", "None"), ("window_size", "(-1, -1)"),
        ("attention_chunk", "0"), ("softcap", "0.0"), ("num_splits", "1"), ("pack_gqa", "None"),
        ("deterministic", "False"), ("sm_margin", "0"), ("return_attn_probs", "False"),
    ),
    "flash_attn_qkvpacked_func": (
        ("qkv", None), ("softmax_scale", "None"), ("causal", "False"), ("q_descale", "None"),
        ("k_descale", "None"), ("v_descale", "None"), ("window_size", "(-1, -1)"), ("attention_chunk", "0"),
        ("softcap", "0.0"), ("deterministic", "False"), ("num_heads_q", "None"), ("sm_margin", "0"),
        ("return_attn_probs", "False"),
    ),
    "flash_attn_varlen_func": (
        ("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
        ("max_seqlen_q", None), ("max_seqlen_k", None), ("seqused_q", "None"), ("seqused_k", "None"),
        ("softmax_scale", "None"), ("causal", "False"), ("qv", "None"), ("q_descale", "None"),
        ("k_descale", "None"), ("v_descale", "None"), ("window_size", "(-1, -1)"), ("attention_chunk", "0"),
        ("softcap", "0.0"), ("num_splits", "1"), ("pack_gqa", "None"), ("deterministic", "False"),
        ("sm_margin", "0"), ("return_attn_probs", "False"),
    ),
    "flash_attn_combine": (
        ("out_partial", None), ("lse_partial", None), ("out", "None"), ("out_dtype", "None"),
    ),
    "flash_attn_with_kvcache": (
        ("q", None), ("k_cache", None), ("v_cache", None), ("k", "None"), ("v", "None"), ("qv", "None"),
        ("rotary_cos", "None"), ("rotary_sin", "None"), ("cache_seqlens", "None"), ("cache_batch_idx", "None"),
        ("cache_leftpad", "None"), ("page_table", "None"), ("cu_seqlens_q", "None"), ("cu_seqlens_k_new", "None"),
        ("max_seqlen_q", "None"), ("rotary_seqlens", "None"), ("q_descale", "None"), ("k_descale", "None"),
        ("v_descale", "None"), ("softmax_scale", "None"), ("causal", "False"), ("window_size", "(-1, -1)"),
        ("attention_chunk", "0"), ("softcap", "0.0"), ("rotary_interleaved", "True"),
        ("scheduler_metadata", "None"), ("num_splits", "0"), ("pack_gqa", "None"), ("sm_margin", "0"),
        ("return_softmax_lse", "False"),
    ),
    "get_scheduler_metadata": (
        ("batch_size", None), ("max_seqlen_q", None), ("max_seqlen_k", None), ("num_heads_q", None),
        ("num_heads_kv", None), ("headdim", None), ("cache_seqlens", None), ("qkv_dtype", "torch.bfloat16"),
        ("headdim_v", "None"), ("cu_seqlens_q", "None"), ("cu_seqlens_k_new", "None"), ("cache_leftpad", "None"),
        ("page_size", "None"), ("max_seqlen_k_new", "0"), ("causal", "False"), ("window_size", "(-1, -1)"),
        ("attention_chunk", "0"), ("has_softcap", "False"), ("num_splits", "0"), ("pack_gqa", "None"),
        ("sm_margin", "0"),
    ),
}
FA2: dict[str, Parameters] = {
    "flash_attn_func": (
        ("q", None), ("k", None), ("v", None), ("dropout_p", "0.0"), ("softmax_scale", "None"),
        ("causal", "False"), ("window_size", "(-1, -1)"), ("softcap", "0.0"), ("alibi_slopes", "None"),
        ("deterministic", "False"), ("return_attn_probs", "False"),
    ),
    "flash_attn_qkvpacked_func": (
        ("qkv", None), ("dropout_p", "0.0"), ("softmax_scale", "None"), ("causal", "False"),
        ("window_size", "(-1, -1)"), ("softcap", "0.0"), ("alibi_slopes", "None"), ("deterministic", "False"),
        ("return_attn_probs", "False"),
    ),
    "flash_attn_kvpacked_func": (
        ("q", None), ("kv", None), ("dropout_p", "0.0"), ("softmax_scale", "None"), ("causal", "False"),
        ("window_size", "(-1, -1)"), ("softcap", "0.0"), ("alibi_slopes", "None"), ("deterministic", "False"),
        ("return_attn_probs", "False"),
    ),
    "flash_attn_varlen_func": (
        ("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
        ("max_seqlen_q", None), ("max_seqlen_k", None), ("dropout_p", "0.0"), ("softmax_scale", "None"),
        ("causal", "False"), ("window_size", "(-1, -1)"), ("softcap", "0.0"), ("alibi_slopes", "None"),
        ("deterministic", "False"), ("return_attn_probs", "False"), ("block_table", "None"),
    ),
    "flash_attn_varlen_qkvpacked_func": (
        ("qkv", None), ("cu_seqlens", None), ("max_seqlen", None), ("dropout_p", "0.0"), ("softmax_scale", "None"),
        ("causal", "False"), ("window_size", "(-1, -1)"), ("softcap", "0.0"), ("alibi_slopes", "None"),
        ("deterministic", "False"), ("return_attn_probs", "False"),
    ),
    "flash_attn_varlen_kvpacked_func": (
        ("q", None), ("kv", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None), ("max_seqlen_q", None),
        ("max_seqlen_k", None), ("dropout_p", "0.0"), ("softmax_scale", "None"), ("causal", "False"),
        ("window_size", "(-1, -1)"), ("softcap", "0.0"), ("alibi_slopes", "None"), ("deterministic", "False"),
        ("return_attn_probs", "False"),
    ),
    "flash_attn_with_kvcache": (
        ("q", None), ("k_cache", None), ("v_cache", None), ("k", "None"), ("v", "None"), ("rotary_cos", "None"),
        ("rotary_sin", "None"), ("cache_seqlens", "None"), ("cache_batch_idx", "None"), ("cache_leftpad", "None"),
        ("block_table", "None"), ("softmax_scale", "None"), ("causal", "False"), ("window_size", "(-1, -1)"),
        ("softcap", "0.0"), ("rotary_interleaved", "True"), ("alibi_slopes", "None"), ("num_splits", "0"),
        ("return_softmax_lse", "False"),
    ),
}


def read(path: Path, names: Iterable[str]) -> dict[str, Parameters]:
    """The signatures of the top-level functions ``names`` in the Python file at ``path`` (parsed, never run)."""
    wanted = set(names)
    found: dict[str, Parameters] = {}
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            args = node.args.args
            defaults: list[str | None] = [None] * (len(args) - len(node.args.defaults))
            defaults += [ast.unparse(d) for d in node.args.defaults]
            found[node.name] = tuple((a.arg, d) for a, d in zip(args, defaults, strict=True))
    return found


def of(function: Callable[..., object]) -> Parameters:
    """A shim function's signature in the same form (defaults as their source text: repr, or a dtype's name)."""
    params = []
    for p in inspect.signature(function).parameters.values():
        params.append((p.name, None if p.default is inspect.Parameter.empty else _text(p.default)))
    return tuple(params)


def _text(value: object) -> str:
    return repr(value) if isinstance(value, (type(None), bool, int, float, tuple)) else str(value)
