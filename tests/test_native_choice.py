"""The native core's choice of variant and key against Python's, field by field, over thousands of calls.

``capi/native/lt_choice.c`` (with the tables ``capi/native_tables.py`` generates) must give every call of the C
API's plans (``embedded.plan_variant``: flash_fwd, flash_bwd_dq and flash_bwd_dkdv; dense and packed, each head
dim and value head dim, causal, alignment, SEQ16, 64-bit indexing, window, softcap, used lengths, sinks,
attention_chunk, seqlens in and between the tuning buckets, every target the tables and defaults tell apart) the
same variant string and the same key, and refuse the calls Python refuses. On CPU, built with ASan and UBSan where
they run.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from nativelib import answers_of, build_driver

from lazytriton import tuning
from lazytriton.capi import embedded
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_fwd import fp8_gluon
from lazytriton.target import Target

KERNELS = ("flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv")
CAPABILITIES = (75, 80, 86, 89, 90, 100, 120)
DTYPES = {1: "fp16", 2: "bf16", 3: "fp32"}
HEAD_DIMS = (8, 16, 24, 32, 40, 48, 59, 64, 72, 80, 96, 100, 112, 128, 144, 160, 192, 200, 224, 255, 256)
SEQLENS = (1, 2, 15, 16, 17, 64, 100, 128, 500, 1024, 1025, 2048, 4096, 5000, 16384, 20000, 65536, 1 << 20)


def calls(count: int, seed: int) -> list[tuple[int, ...]]:
    """``count`` calls (native_choice's fields in order), every axis drawn, the tuned head dims and seqlens often."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        head_dim = rng.choice(HEAD_DIMS) if rng.random() < 0.7 else rng.randint(1, 256)
        head_dim_v = head_dim if rng.random() < 0.6 else rng.choice((rng.choice(HEAD_DIMS), rng.randint(1, 256)))
        varlen = int(rng.random() < 0.3)
        used = (rng.random() < 0.3, rng.random() < 0.3) if varlen or rng.random() < 0.05 else (False, False)
        aligned = int(rng.random() < 0.6)
        seqlens = [rng.choice(SEQLENS) if rng.random() < 0.6 else rng.randint(1, 70000) for _ in range(2)]
        # 5, 6: e4m3, e5m2, the FP8 forward (flash_fwd_fp8)
        dtype = rng.choice((5, 6)) if rng.random() < 0.12 else rng.choice((1, 2, 3))
        call = (rng.randrange(3), rng.choice(CAPABILITIES), dtype, head_dim, head_dim_v,
                int(rng.random() < 0.5), aligned, int(rng.random() < 0.5), int(rng.random() < 0.2),
                int(rng.random() < 0.2), int(rng.random() < 0.2), varlen, int(used[0]), int(used[1]), *seqlens)
        sinks = rng.random() < (0.3 if call[0] == 0 else 0.03)  # a backward kernel with sinks: refused
        out.append((*call, int(sinks), int(rng.random() < 0.3)))
    return out


def python_choice(call: tuple[int, ...]) -> str:
    """``ok VARIANT KEY`` as the C API's Python planner chooses, or ``error`` where it refuses the call."""
    kernel, capability, dtype, head_dim, head_dim_v, causal, aligned, seq16, index64, window, softcap, varlen, \
        used_q, used_k, seqlen_q, seqlen_k, sinks, chunk = call
    try:
        variant = embedded.plan_variant(KERNELS[kernel], capability, dtype, head_dim, bool(causal), bool(aligned),
                                        bool(index64), seqlen_q, seqlen_k, bool(varlen), head_dim_v,
                                        seq16=bool(seq16), window=bool(window), softcap=bool(softcap),
                                        seqused=(bool(used_q), bool(used_k)), sinks=bool(sinks), chunk=bool(chunk))
    except ValueError:
        return "error"
    return f"ok {variant} {variant.key()}"


def native_choice(program: Path, lines: list[tuple[int, ...]]) -> list[str]:
    return answers_of(program, [" ".join(map(str, call)) for call in lines])


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built, _ = build_driver(tmp_path_factory.mktemp("choice"), "native_choice")
    return built


def test_every_axis_gives_python_s_variant_and_key(program: Path) -> None:
    lines = calls(4000, seed=20261205)
    answers = native_choice(program, lines)
    served = 0
    for call, answer in zip(lines, answers, strict=True):
        expected = python_choice(call)
        if expected == "error":
            assert answer.startswith("error "), f"{call}: Python refuses it, C answered {answer}"
        else:
            assert answer == expected, f"{call}:\n C      {answer}\n Python {expected}"
            served += 1
    assert "CHUNK=true" in " ".join(answers), "no call drew attention_chunk"
    assert "flash_fwd_fp8:sm_90:e4m3" in " ".join(answers), "no call drew the FP8 forward"
    assert "flash_fwd_fp8:sm_90:e5m2" in " ".join(answers), "no call drew the FP8 forward's e5m2"
    assert served > 2700  # the refusals (seqused without varlen, SEQ16 unaligned, e4m3 off sm_90+ or backward) are few


def fp8_gluon_calls(count: int, seed: int) -> list[tuple[int, ...]]:
    """Dense FP8 forward calls on sm_90 about the Gluon FP8 forward's table: its head dims, tile multiples or not."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        head_dim = rng.choice((64, 128, 256, 96, 192))
        seqlens = [rng.choice((128, 256, 512, 1024, 4096, 8192)) if rng.random() < 0.8 else rng.randint(1, 9000)
                   for _ in range(2)]
        window, softcap, chunk = (int(rng.random() < 0.1) for _ in range(3))
        out.append((0, rng.choice((90, 90, 90, 100)), rng.choice((5, 6)), head_dim, head_dim,
                    int(rng.random() < 0.5), int(rng.random() < 0.8), 0, int(rng.random() < 0.1), window, softcap,
                    0, 0, 0, *seqlens, 0, chunk))
    return out


def test_fp8_calls_the_gluon_kernel_serves_in_python_plan_flash_fwd_fp8_in_c_and_python(
        program: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C API keeps flash_fwd_fp8 where Python's binding runs flash_fwd_fp8_gluon: that entry takes scratch.

    (tests/test_fp8_gluon_reach.py: its TMA descriptors are made on the device, in global scratch memory, which
    the C API's plans do not pass.) C and Python agree on every such call, variant and key.
    """
    monkeypatch.setattr(fp8_gluon, "BY_DEFAULT", True)  # the Gluon kernel at every head dim of its table
    monkeypatch.setattr(fp8_gluon, "DEFAULT_HEAD_DIMS", frozenset(fp8_gluon.HEAD_DIMS))
    lines = fp8_gluon_calls(600, seed=20261205)
    answers = native_choice(program, lines)
    for call, answer in zip(lines, answers, strict=True):
        assert answer == python_choice(call), call
        assert answer.startswith("ok flash_fwd_fp8:"), f"{call}: {answer}"
    assert any(":sm_90:e4m3:" in a for a in answers) and any(":sm_90:e5m2:" in a for a in answers)
    gluon = [call for call in lines if call[1] == 90 and not any(call[9:11]) and not call[17]
             and fp8_gluon.prewarm_twin("sm_90", embedded.FP8_CODES[call[2]], call[3], bool(call[5]),
                                        bool(call[6]), bool(call[8]), call[14], call[15]) is not None]
    assert len(gluon) > 50, "too few draws that Python's binding runs on the Gluon FP8 forward"


def test_a_table_row_flows_to_c(tmp_path: Path) -> None:
    """A tuning row the generator is given is the one C serves: a new row needs no edit of the C code."""
    row = tuning.parse_row({"target": "sm_90", "kernel": "flash_fwd", "dtype": "bf16", "head_dim": "128",
                            "causal": "0", "seqlen_q": "4096", "seqlen_k": "4096", "BLOCK_M": "32", "BLOCK_N": "16",
                            "num_warps": "2", "num_stages": "5", "waves_per_eu": "0", "tflops": "1",
                            "gpu": "test", "measured": "2026-12-05"})
    table = tuning.Table([row])
    built, _ = build_driver(tmp_path, "native_choice", table)
    lines = [(0, 90, 2, 128, 128, causal, 1, 0, 0, 0, 0, 0, 0, 0, sq, sk)
             for causal in (0, 1) for sq in (100, 4096, 9000) for sk in (1, 4096, 70000)]
    for call, answer in zip(lines, native_choice(built, lines), strict=True):
        variant = dispatch.kernel_variant("flash_fwd", Target.parse("sm_90"), "bf16", 128, bool(call[5]), True,
                                          call[14], call[15], table=table)
        assert answer == f"ok {variant} {variant.key()}"
        assert ("BLOCK_M=32,BLOCK_N=16" in answer) == (not call[5])
