"""Which of a peer's test cases lazytriton's API can express: rules over each collected case's parameters.

A peer's test file is collected (``pytest --collect-only`` with ``peer_plugin``'s ``--peer-collect``: node id,
test function, parameters), and each case is classified by ``RULES`` without running anything:

- ``skip``: the peer's own test skips the case (its ``pytest.skip`` conditions, read from its source): not run,
  so not counted against lazytriton;
- ``gap``: the case calls for something lazytriton's API cannot express; the rule says what;
- ``feature``: the case uses something the API (or the shim's mapping of the peer's arguments) expresses; the rule
  names it. A case is expressible when it is run and no gap rule matches it.

Each rule is one feature of one suite, for the test functions it lists, and reads only the case's parameters, so a
rule holds for the values a test body derives from them (its inner loops over head_dim_v, attention_chunk,
num_splits, ...): those are described in the rule's text. Recorded against Dao-AILab/flash-attention at
0251105a2fb19d2957484b7f023cd8c115286ced (``hopper/test_flash_attn.py``, ``tests/test_flash_attn.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

KINDS = ("skip", "gap", "feature")
FP8 = "float8_e4m3fn"

Params = Mapping[str, Any]


class Rule(NamedTuple):
    suite: str
    functions: tuple[str, ...]
    kind: str
    name: str
    says: str
    when: Callable[[Params], bool]


def _mla(p: Params) -> bool:
    """FA3's dense and varlen output tests at d <= 64 (16-bit) run v of 256 and 512 columns, and qv: the MLA forward."""
    return p["d"] <= 64 and p["dtype"] != FP8


def _qv(p: Params) -> bool:
    """The MLA forward's qv calls (v of 256 and 512): flash_fwd_mla alone serves them (no pieces with qv)."""
    return _mla(p) and bool(p["has_qv"])


def _wide_v(p: Params) -> bool:
    """v of 512 columns without qv (the dv loop at d <= 64), its q, k, v requiring grad: flash_fwd over v's pieces."""
    return _mla(p) and not p["has_qv"]


def _qv_skip(p: Params) -> bool:
    return bool(p["has_qv"]) and (p["d"] != 64 or p["dtype"] == FP8)


FA3_OUT = ("test_flash_attn_output", "test_flash_attn_varlen_output")
FA3_KV = ("test_flash_attn_kvcache",)
FA2_PROBS = ("test_flash_attn_qkvpacked", "test_flash_attn_varlen_qkvpacked", "test_flash_attn_output",
             "test_flash_attn_varlen_output")
FA2_LOCAL = (*FA2_PROBS, "test_flash_attn_causal", "test_flash_attn_varlen_causal", "test_flash_attn_splitkv",
             "test_flash_attn_kvcache", "test_flash_attn_deterministic", "test_flash_attn_varlen_deterministic")

RULES: tuple[Rule, ...] = (
    # FlashAttention-3: hopper/test_flash_attn.py
    Rule("fa3", FA3_OUT, "skip", "qv-needs-hdim64", "the peer skips qv but at d 64 in 16 bits", _qv_skip),
    Rule("fa3", FA3_OUT, "feature", "v-pieces",
         "v of 512 columns without qv, with q, k, v requiring grad, attention_chunk or seqused: flash_fwd over v's "
         "first 256 columns and the rest (lazytriton.value_split)", _wide_v),
    Rule("fa3", ("test_flash_attn_output",), "feature", "window-list",
         "window_size as a list: lazytriton.window_pair", lambda p: bool(p["local"])),
    Rule("fa3", ("test_flash_attn_varlen_output", *FA3_KV), "feature", "window-tensor",
         "window_size as an int tensor of 2: lazytriton.window_pair", lambda p: bool(p["local"])),
    Rule("fa3", FA3_OUT, "feature", "fp8-forward",
         "float8_e4m3fn q, k, v with (batch, heads_k) descales: the FP8 forward (flash_fwd_fp8)",
         lambda p: p["dtype"] == FP8),
    Rule("fa3", FA3_OUT, "feature", "qv", "qv (DeepSeek's MLA): flash_fwd_mla", lambda p: bool(p["has_qv"])),
    Rule("fa3", ("test_flash_attn_output",), "feature", "qv-chunk",
         "attention_chunk with qv (the test's chunk loop at d 64, v of 256 and 512): flash_fwd_mla's CHUNK", _qv),
    Rule("fa3", ("test_flash_attn_varlen_output",), "feature", "qv-chunk",
         "attention_chunk with qv (the chunk loop runs where seqlen_q <= seqlen_k): flash_fwd_mla's CHUNK",
         lambda p: _qv(p) and p["seqlen_q"] <= p["seqlen_k"]),
    Rule("fa3", ("test_flash_attn_varlen_output",), "feature", "qv-seqused",
         "seqused_q/seqused_k (add_unused_qkv) with qv: flash_fwd_mla's SEQUSED_Q/SEQUSED_K",
         lambda p: _qv(p) and bool(p["add_unused_qkv"])),
    Rule("fa3", FA3_OUT, "feature", "head-dim-v",
         "v's head dim unlike q's (d 64: 256; d 160-192: 128), with the backward at <= 256",
         lambda p: p["dtype"] != FP8 and (p["d"] <= 64 or 128 < p["d"] <= 192)),
    Rule("fa3", (*FA3_OUT, *FA3_KV), "feature", "attention-chunk", "attention_chunk (the test draws one): CHUNK",
         lambda p: True),
    Rule("fa3", FA3_OUT, "feature", "softcap", "softcap: SOFTCAP", lambda p: p["softcap"] > 0),
    Rule("fa3", ("test_flash_attn_varlen_output",), "feature", "seqused", "seqused_q/seqused_k (add_unused_qkv)",
         lambda p: bool(p["add_unused_qkv"])),
    Rule("fa3", FA3_KV, "skip", "kvcache-peer-skips",
         "the peer skips: a page size not dividing seqlen_k, seqlen_q > seqlen_k with new keys, rotary without new "
         "keys", lambda p: (p["page_size"] is not None and p["seqlen_k"] % p["page_size"] != 0)
         or (p["seqlen_q"] > p["seqlen_k"] and p["new_kv"]) or (not p["new_kv"] and p["rotary_fraction"] > 0)),
    Rule("fa3", FA3_KV, "feature", "fp8-q-kvcache",
         "float8 q (and new keys, rotary tables) over a float8 cache: widened to bfloat16, out bfloat16 "
         "(lazytriton.kvcache_fp8)", lambda p: p["dtype"] == FP8),
    Rule("fa3", FA3_KV, "feature", "rotary-seqlens-unused",
         "rotary_seqlens without rotary tables: ignored, as FlashAttention-3 does (the shim drops it)",
         lambda p: p["rotary_fraction"] == 0),
    Rule("fa3", FA3_KV, "feature", "paged", "page_table: block_table", lambda p: p["page_size"] is not None),
    Rule("fa3", FA3_KV, "feature", "kvcache-index", "cache_leftpad / cache_batch_idx",
         lambda p: bool(p["has_leftpad"] or p["has_batch_idx"])),
    Rule("fa3", FA3_KV, "feature", "varlen-q", "cu_seqlens_q and cu_seqlens_k_new (varlen_q)",
         lambda p: bool(p["varlen_q"])),
    Rule("fa3", FA3_KV, "feature", "rotary", "rotary_cos/rotary_sin: ROTARY", lambda p: p["rotary_fraction"] > 0),
    Rule("fa3", ("test_flash3_bw_compatibility",), "gap", "op-schemas",
         "reads torch.ops.flash_attn_3's fwd, bwd, fwd_combine and get_scheduler_metadata schemas: no op of that "
         "library is registered", lambda p: True),
    Rule("fa3", ("test_flash_attn_combine", "test_flash_attn_varlen_combine_linearize"), "feature", "combine",
         "flash_attn_combine / a varlen call's num_splits hint", lambda p: True),
    # FlashAttention-2: tests/test_flash_attn.py
    Rule("fa2", ("test_flash_attn_output", "test_flash_attn_varlen_output"), "skip", "softcap-dropout",
         "the peer skips softcap with dropout", lambda p: p["softcap"] > 0 and p["dropout_p"] > 0),
    Rule("fa2", ("test_flash_attn_kvcache",), "skip", "kvcache-peer-skips",
         "the peer skips: seqlen_q > seqlen_k with new keys, rotary without new keys, batch_idx or leftpad with "
         "pages", lambda p: (p["seqlen_q"] > p["seqlen_k"] and p["new_kv"])
         or (not p["new_kv"] and p["rotary_fraction"] > 0)
         or ((p["has_batch_idx"] or p["has_leftpad"]) and p["paged_kv_block_size"] is not None)),
    Rule("fa2", FA2_PROBS, "feature", "dropout-s-dmask",
         "dropout_p > 0 with return_attn_probs' S_dmask read: lazytriton's dropout, its keep mask replayed from "
         "the call's Philox pair by the shim (probabilities recomputed in float32)", lambda p: p["dropout_p"] > 0),
    Rule("fa2", ("test_flash_attn_race_condition",), "feature", "dropout", "dropout_p > 0 (S_dmask not read)",
         lambda p: p["dropout_p"] > 0),
    Rule("fa2", FA2_LOCAL, "feature", "window-tensor", "window_size as an int tensor of 2: lazytriton.window_pair",
         lambda p: bool(p["local"])),
    Rule("fa2", FA2_LOCAL, "feature", "alibi", "alibi_slopes (batch, heads)", lambda p: bool(p.get("alibi"))),
    Rule("fa2", ("test_flash_attn_varlen_causal",), "feature", "paged-varlen",
         "block_table with cu_seqlens_k: the shim passes seqused_k = diff(cu_seqlens_k), forward only",
         lambda p: p["paged_kv_block_size"] is not None),
    Rule("fa2", ("test_flash_attn_varlen_paged_kv_num_splits",), "gap", "fa2-private-forward",
         "calls FlashAttention-2's private _flash_attn_varlen_forward", lambda p: True),
    Rule("fa2", ("test_flash_attn_generator_arg_must_be_none",), "gap", "fa2-private-ops",
         "calls FlashAttention-2's C++ entry points (flash_attn_gpu.fwd, ...)", lambda p: True),
    Rule("fa2", ("test_flash_attn_kvcache_paged_block_table_bounds",), "gap", "runtime-error",
         "expects RuntimeError for lengths past the block table: lazytriton raises ValueError naming the argument",
         lambda p: True),
)


class Verdict(NamedTuple):
    status: str  # "skipped" (by the peer), "expressible" or "gap"
    gaps: tuple[str, ...]
    features: tuple[str, ...]


def classify(suite: str, function: str, params: Params, rules: Iterable[Rule] = RULES) -> Verdict:
    """The verdict of one case: the peer skips it, or the gaps and the features of the rules that match it."""
    matched = [r for r in rules if r.suite == suite and function in r.functions and r.when(params)]
    if any(r.kind == "skip" for r in matched):
        return Verdict("skipped", (), ())
    gaps = tuple(r.name for r in matched if r.kind == "gap")
    features = tuple(r.name for r in matched if r.kind == "feature")
    return Verdict("gap" if gaps else "expressible", gaps, features)


def census(suite: str, cases: Iterable[Mapping[str, Any]], rules: Iterable[Rule] = RULES) -> dict[str, Any]:
    """Counts per test function (collected, skipped by the peer, run, expressible) and per gap and feature rule."""
    rules = tuple(rules)
    functions: dict[str, dict[str, int]] = {}
    gaps: dict[str, int] = {}
    features: dict[str, int] = {}
    for case in cases:
        verdict = classify(suite, case["function"], case["params"], rules)
        counts = functions.setdefault(case["function"], dict.fromkeys(("collected", "skipped", "run",
                                                                       "expressible"), 0))
        counts["collected"] += 1
        counts["skipped" if verdict.status == "skipped" else "run"] += 1
        counts["expressible"] += verdict.status == "expressible"
        for name in verdict.gaps:
            gaps[name] = gaps.get(name, 0) + 1
        for name in verdict.features:
            features[name] = features.get(name, 0) + 1
    totals = {key: sum(c[key] for c in functions.values()) for key in ("collected", "skipped", "run", "expressible")}
    says = {r.name: r.says for r in rules if r.suite == suite}
    return {"suite": suite, "totals": totals, "functions": functions,
            "gaps": {name: {"count": n, "says": says[name]} for name, n in sorted(gaps.items(), key=lambda x: -x[1])},
            "features": {name: {"count": n, "says": says[name]} for name, n in sorted(features.items(),
                                                                                       key=lambda x: -x[1])}}


def fraction(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "-"


def markdown(result: dict[str, Any]) -> str:
    """The census as text: per function, then the gaps and features with their instance counts."""
    lines = [f"# census: {result['suite']}", "", "| function | collected | skipped by the peer | run | expressible "
             "| of run |", "|---|---|---|---|---|---|"]
    for function, c in [*result["functions"].items(), ("**total**", result["totals"])]:
        lines.append(f"| {function} | {c['collected']} | {c['skipped']} | {c['run']} | {c['expressible']} | "
                     f"{fraction(c['expressible'], c['run'])} |")
    run = result["totals"]["run"]
    for kind in ("gaps", "features"):
        lines += ["", f"## {kind} (cases of the run)", ""]
        lines += [f"- {name}: {g['count']} ({fraction(g['count'], run)}): {g['says']}"
                  for name, g in result[kind].items()] or ["(none)"]
    return "\n".join(lines) + "\n"


def plain(params: Mapping[str, Any]) -> dict[str, Any]:
    """A case's parameters as JSON values: None, bools, ints, floats and strings as they are, a torch dtype as its
    name (``torch.bfloat16`` -> ``"bfloat16"``), a tuple or list as a list, anything else as its ``repr``."""
    return {name: _plain(value) for name, value in params.items()}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    text = str(value)
    return text.removeprefix("torch.") if type(value).__module__ == "torch" and text.startswith("torch.") else repr(
        value)
