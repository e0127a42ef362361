"""The native core's choice of the decoding kernels' variants and keys against Python's, over thousands of calls.

``capi/native/lt_decode_choice.c`` (with the tables ``capi/native_tables.py`` generates) must give every call of
the C API's decoding plans the variant string and key Python gives: ``flash_decode_split`` and
``flash_decode_combine`` as ``flash_decode.binding.variants`` chooses them for the whole call (and
``embedded_kvcache.plan_variants``, the fallback's planner), ``kv_append`` as ``embedded_kvcache.append_variant``
and ``flash_combine`` as ``embedded_combine.plan_variant``. The calls draw every axis the C API's plans take:
dtypes, head dims and value head dims, GQA groups and seqlen_q (rows), contiguous and paged caches (page sizes
a key tile divides and gathered ones), capacities in and between the tuning buckets, causal, alignment, 64-bit
indexing, window, softcap, ALiBi, left pads, rotary (pairs or halves), sinks, packed queries, attention_chunk, new
keys, MLA's qv (v up to 512), and every
target the tables and defaults tell apart. cache_batch_idx, cache_seqlens and the split count are runtime
arguments: no variant reads them (the split count's inputs, min_split_keys and PROGRAMS_PER_SM, are held here too).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from nativelib import answers_of, build_driver

from lazytriton.capi import embedded_combine, embedded_kvcache
from lazytriton.kernels import dependent_launch
from lazytriton.kernels.flash_decode import DEPENDENT_SPLIT, binding, checks
from lazytriton.target import Target

CAPABILITIES = (75, 80, 86, 89, 90, 100, 120)
DTYPES = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32}
HEAD_DIMS = (8, 16, 24, 32, 40, 48, 59, 64, 72, 80, 96, 100, 112, 128, 144, 160, 192, 200, 224, 255, 256)
CAPACITIES = (1, 16, 100, 512, 1000, 1024, 1025, 4096, 5000, 16384, 32768, 40000, 1 << 20)
PAGES = (1, 2, 3, 8, 12, 16, 24, 32, 48, 64, 100, 128, 256)
SPLIT, COMBINE, APPEND, FLASH_COMBINE = 3, 4, 5, 6


def decode_calls(count: int, seed: int) -> list[dict[str, int]]:
    """``count`` decoding calls of the C API, every axis drawn, the tuned head dims and capacities often."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        d = rng.choice(HEAD_DIMS) if rng.random() < 0.7 else rng.randint(1, 256)
        dv = d if rng.random() < 0.7 else rng.choice((rng.choice(HEAD_DIMS), rng.randint(1, 256)))
        hk = rng.choice((1, 2, 8))
        page = rng.choice(PAGES) if rng.random() < 0.5 else 0
        capacity = rng.choice(CAPACITIES) if rng.random() < 0.7 else rng.randint(1, 70000)
        if page:
            capacity = -(-capacity // page) * page  # max_blocks x page_size
        rotary = rng.random() < 0.2
        capability, dtype = rng.choice(CAPABILITIES), rng.choice((1, 2, 2, 3))
        # a float8 cache (5 e4m3, 6 e5m2) is read by fp16/bf16 queries; e4m3 from sm_89 (the refusals: below)
        formats = (0, 0, 0, 6) + ((5,) if capability >= 89 else ())
        kv_fp8 = rng.choice(formats) if dtype != 3 else 0
        qv = int(kv_fp8 == 0 and rng.random() < 0.15)  # MLA's qv (no float8 cache): v up to 512, often 512
        if qv or (rng.random() < 0.05):
            dv = rng.choice((512, 512, 448, 300, rng.randint(257, 512)))
        out.append({"capability": capability, "dtype": dtype, "kv_fp8": kv_fp8, "qv": qv, "head_dim": d,
                    "head_dim_v": dv, "heads_k": hk, "batch": rng.choice((1, 2, 3, 8, 32)),
                    "heads_q": hk * rng.choice((1, 1, 2, 4, 8, 16)),
                    "seqlen_q": rng.choice((1, 1, 2, 4, 5, 16, 33)), "causal": int(rng.random() < 0.5),
                    "aligned": int(rng.random() < 0.7), "index64": int(rng.random() < 0.2), "capacity": capacity,
                    "page_size": page, "window": int(rng.random() < 0.2), "softcap": int(rng.random() < 0.2),
                    "alibi": int(rng.random() < 0.2), "leftpad": int(rng.random() < 0.2), "rotary": int(rotary),
                    "rotary_interleaved": int(rotary and rng.random() < 0.5), "sinks": int(rng.random() < 0.2),
                    "varlen_q": int(rng.random() < 0.2), "chunk": int(rng.random() < 0.2),
                    "append": int(rng.random() < 0.4),
                    "append_aligned": int(rng.random() < 0.7), "append_index64": int(rng.random() < 0.2)})
    return out


def request_line(kernel: int, c: dict[str, int]) -> tuple[int, ...]:
    """The ltn_decode_request lt_front.c builds from lt_kvcache.c's plan request of call ``c``."""
    causal = int(c["causal"] and c["seqlen_q"] > 1)  # lt_kvcache.c's (and checks.check's) rule
    rows = c["heads_q"] // c["heads_k"] * c["seqlen_q"]
    aligned, index64 = ((c["append_aligned"], c["append_index64"]) if kernel == APPEND
                        else (c["aligned"], c["index64"]))
    return (kernel, c["capability"], c["dtype"], c["head_dim"], c["head_dim_v"], causal, aligned, index64, rows,
            c["capacity"], c["page_size"], int(c["page_size"] > 0), c["window"], c["softcap"], c["alibi"],
            c["leftpad"], c["rotary"], c["rotary_interleaved"], c["sinks"], c["varlen_q"], c["chunk"], c["kv_fp8"],
            c["qv"], c["batch"] * c["heads_k"] if c["kv_fp8"] else 0)


def python_decode(c: dict[str, int]) -> tuple[str, str]:
    """(split, combine) as ``binding.variants`` chooses them for the whole call, each ``ok VARIANT KEY``."""
    causal = bool(c["causal"] and c["seqlen_q"] > 1)
    dv = 0 if c["head_dim_v"] == c["head_dim"] else c["head_dim_v"]
    call = checks.Call(c["batch"], c["heads_q"], c["heads_k"], c["seqlen_q"], c["head_dim"], 0, c["capacity"],
                       c["page_size"], 7, -1, causal, 0.1, window_left=8 if c["window"] else -1,
                       window_right=0 if c["window"] else -1,
                       softcap=5.0 if c["softcap"] else 0.0, alibi=bool(c["alibi"]), head_dim_v=dv,
                       leftpad=bool(c["leftpad"]), rotary_dim=max(c["head_dim"] // 2 * 2, 2) if c["rotary"] else 0,
                       rotary_interleaved=bool(c["rotary_interleaved"]), sinks=bool(c["sinks"]),
                       varlen_q=bool(c["varlen_q"]), total_q=c["batch"] * c["seqlen_q"] if c["varlen_q"] else 0,
                       attention_chunk=64 if c["chunk"] else 0, kv_fp8=embedded_kvcache.KV_FP8[c["kv_fp8"]],
                       qv=bool(c["qv"]))
    target = Target("cuda", str(c["capability"]), 32)
    chosen = binding.variants(target, DTYPES[c["dtype"]], call, bool(c["aligned"]), bool(c["index64"]))
    planned = embedded_kvcache.plan_variants(
        c["capability"], c["dtype"], c["head_dim"], causal, bool(c["aligned"]), bool(c["index64"]), call.rows,
        c["capacity"], c["page_size"], bool(c["window"]), bool(c["softcap"]), bool(c["alibi"]), c["head_dim_v"],
        bool(c["leftpad"]), bool(c["rotary"]), bool(c["rotary_interleaved"]), bool(c["sinks"]), bool(c["varlen_q"]),
        bool(c["chunk"]), embedded_kvcache.KV_FP8[c["kv_fp8"]], bool(c["qv"]), binding.kv_pairs(call))
    assert tuple(map(str, planned)) == tuple(map(str, chosen))  # the fallback's planner is the binding's choice
    return tuple(_answer(v) for v in chosen)  # type: ignore[return-value]


def _answer(v: object) -> str:
    """The program's line for a variant Python chose: it, its key, and whether it launches as a dependent."""
    return f"ok {v} {v.key()} {int(dependent_launch(v))}"  # type: ignore[attr-defined,arg-type]


def python_append(c: dict[str, int]) -> str:
    v = embedded_kvcache.append_variant(c["capability"], c["dtype"], c["head_dim"], c["head_dim_v"],
                                        c["page_size"] > 0, bool(c["append_aligned"]), bool(c["append_index64"]),
                                        bool(c["rotary"]), bool(c["rotary_interleaved"]),
                                        embedded_kvcache.KV_FP8[c["kv_fp8"]])
    return _answer(v)


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built, _ = build_driver(tmp_path_factory.mktemp("decode-choice"), "native_decode_choice")
    return built


def test_decoding_calls_give_python_s_variants_and_keys(program: Path) -> None:
    calls = decode_calls(3000, seed=20261212)
    lines = [request_line(kernel, c) for c in calls for kernel in (SPLIT, COMBINE, APPEND)]
    answers = answers_of(program, [" ".join(map(str, line)) for line in lines])
    for i, c in enumerate(calls):
        split, combine = python_decode(c)
        for kernel, expected, answer in zip(("split", "combine", "append"), (split, combine, python_append(c)),
                                            answers[3 * i:3 * i + 3], strict=True):
            assert answer == expected, f"{kernel} {c}:\n C      {answer}\n Python {expected}"
    seen = " ".join(answers)
    splits = [a for a in answers if a.startswith("ok flash_decode_split:")]
    assert any(a.startswith("ok flash_decode_split:sm_90") and "ROTARY=true" in a for a in splits)
    hopper_on = [a.split(":")[1].split()[0] in ("sm_90", "sm_100", "sm_120") for a in splits]  # PDL from sm_90
    dependent = [on and (DEPENDENT_SPLIT or "ROTARY=true" in a) for a, on in zip(splits, hopper_on, strict=True)]
    assert [a.endswith(" 1") for a in splits] == dependent and not all(hopper_on)
    for name in ("PAGE_GATHER=true", "ROTARY_INTERLEAVED=true", "VARLEN_Q=true", "CHUNK=true", "BLOCK_DV=",
                 "QV=true", "BLOCK_DV=512", "num_warps=8",
                 "KV_FP8=e4m3", "KV_FP8=e5m2",
                 "num_stages=5",
                 "BLOCK_N=32", "INDEX64=true", "flash_decode_split:sm_90:bf16"):
        assert name in seen, f"no call drew {name}"


def test_flash_combine_calls_give_python_s_variant_and_key(program: Path) -> None:
    rng = random.Random(20261213)
    calls = [(rng.choice(CAPABILITIES), rng.choice((1, 2, 3)),
              rng.choice((1, 8, 16, 17, 64, 96, 100, 128, 129, 256, 512, 1000, 65535 * 128)) if rng.random() < 0.6
              else rng.randint(1, 4096), int(rng.random() < 0.6), int(rng.random() < 0.3)) for _ in range(1500)]
    lines = [f"{FLASH_COMBINE} {cap} {dtype} {d} 0 0 {aligned} {wide} 0 0 0 0 0 0 0 0 0 0 0 0"
             for cap, dtype, d, aligned, wide in calls]
    for call, answer in zip(calls, answers_of(program, lines), strict=True):
        v = embedded_combine.plan_variant(*call[:3], bool(call[3]), bool(call[4]))
        assert answer == _answer(v), call


def test_the_split_count_s_inputs_are_the_binding_s(program: Path) -> None:
    rng = random.Random(11)
    cases = [(d, rng.choice((0, 0, 16384, 65536, 98304, 115712, 197632, 300000, rng.randint(1, 1 << 18))),
              rng.choice((0, 65536, 101376, 167936, 233472, rng.randint(1, 1 << 18)))) for d in range(1, 257)]
    answers = answers_of(program, [f"split {d} {shared} {capacity}" for d, shared, capacity in cases])
    assert answers == [f"{binding.min_split_keys(d)} {binding.programs_per_sm(shared, capacity)}"
                       for d, shared, capacity in cases]


def test_calls_python_refuses_are_refused(program: Path) -> None:
    bad = ["3 90 2 257 0 0 1 0 4 1024 0 0 0 0 0 0 0 0 0 0", "4 90 7 64 0 0 1 0 4 1024 0 0 0 0 0 0 0 0 0 0",
           "9 90 2 64 0 0 1 0 4 1024 0 0 0 0 0 0 0 0 0 0", "3 90 2 64 0 0 1 0 -4 1024 0 0 0 0 0 0 0 0 0 0",
           "6 90 2 0 0 0 1 0 0 0 0 0 0 0 0 0 0 0 0 0",
           "3 80 2 64 0 0 1 0 4 1024 0 0 0 0 0 0 0 0 0 0 0 5",  # an e4m3 cache below sm_89 (kv_fp8.unsupported)
           "5 86 2 64 0 0 1 0 4 1024 0 0 0 0 0 0 0 0 0 0 0 5", "3 90 2 64 0 0 1 0 4 1024 0 0 0 0 0 0 0 0 0 0 0 7"]
    assert all(answer.startswith("error ") for answer in answers_of(program, bad))
