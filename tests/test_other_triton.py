"""Every kernel family compiles under the other Triton too (3.6 on the GPU host beside CI's 3.9).

An entry compiled by one version must launch where the other is installed,
and each kernel must compile under both: CI (``.ci/run``) makes a Python with
the other version (a virtual environment over this one, only triton
replaced) and names it in ``$LAZYTRITON_TEST_OTHER_TRITON_PYTHON``; this file
compiles one variant of each kernel there, for sm_90, with the features that
change the kernels most (split head dims, window, softcap, ALiBi, dropout,
packed sequences, a paged cache, head_dim_v, the FP8 forward's e4m3 dots, its Gluon kernel, the decoding
split kernel with its combine fused), and checks what the entries say against the same variants compiled here.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import REPO

from lazytriton.compiler import compile_variant, triton_version

OTHER_TRITON = "LAZYTRITON_TEST_OTHER_TRITON_PYTHON"

# Variant strings are what a miss log or an image holds: built here, compiled there.
VARIANTS = """

from lazytriton.kernels import dispatch, kv_append, kv_slots
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd import fp8_gluon
from lazytriton.target import Target

sm90 = Target.parse("sm_90")
VARIANTS = [
    dispatch.kernel_variant("flash_fwd", sm90, "bf16", 64, True, True, 4096, 4096),
    dispatch.kernel_variant("flash_fwd", sm90, "fp16", 96, False, True, 4096, 4096, window=True, softcap=True),
    dispatch.kernel_variant("flash_fwd", sm90, "bf16", 128, False, True, 1024, 1024, varlen=True, alibi=True,
                            dropout=True),
    dispatch.kernel_variant("flash_fwd", sm90, "bf16", 192, True, True, 4096, 4096, head_dim_v=128),
    dispatch.kernel_variant("flash_fwd", sm90, "e4m3", 128, True, True, 4096, 4096, varlen=True, window=True),  # FP8
    dispatch.kernel_variant("flash_fwd", sm90, "e5m2", 64, False, True, 4096, 4096),  # FP8 e5m2: e4m3 x e5m2 p @ v
    dispatch.kernel_variant("flash_bwd_dq", sm90, "bf16", 96, True, True, 4096, 4096, window=True),
    dispatch.kernel_variant("flash_bwd_dkdv", sm90, "bf16", 96, True, True, 4096, 4096, softcap=True),
    dispatch.kernel_variant("flash_bwd_dkdv", sm90, "bf16", 128, False, True, 4096, 4096, alibi=True, dropout=True,
                            varlen=True),
    dispatch.kernel_variant("flash_fwd_mla", sm90, "bf16", 64, True, True, 4096, 4096, head_dim_v=512, qv=True,
                            varlen=True, window=True, softcap=True),  # qv, v of 512
    decode_dispatch.decode_variant("flash_decode_split", sm90, "bf16", 128, True, True, 4, 4096, page_size=16,
                                   paged=True, window=True, softcap=True),
    decode_dispatch.decode_variant("flash_decode_split", sm90, "bf16", 128, False, True, 4, 4096,
                                   fused_combine=True),  # the combine fused: atomics, a barrier, .cg loads
    decode_dispatch.decode_variant("flash_decode_combine", sm90, "bf16", 128, True, True, 4, 4096),
    kv_append.variant(sm90, "bf16", 192, 128, True, True, False),
    kv_slots.variant(sm90, "bf16", 192, 128, True, True, False),  # int32 slots, 64-bit offsets, two chunks
    kv_slots.variant(sm90, "fp16", 128, 0, True, False, True, "e4m3"),  # a float8 cache: quantised on the way in
    fwd_dispatch.flash_fwd_gluon_default_variant(sm90, "bf16", 128, True, True, False, 4096, 4096),
    fp8_gluon.variant("sm_90", "e4m3", 256, "top_left", True, False, 4096, 4096,  # the Gluon FP8 forward (its
                      tiles=fp8_gluon.CONFIGS[256][0]),  # table's tiles, whether or not dispatch serves it yet)
    fwd_dispatch.flash_fwd_gluon_default_variant(sm90, "bf16", 128, True, True, False, 1024, 1024),  # 8 query tiles
    fwd_dispatch.flash_fwd_gluon_default_variant(sm90, "bf16", 192, True, True, False, 1024, 1024),  # split, 2 tiles
    fwd_dispatch.flash_fwd_gluon_default_variant(sm90, "fp16", 224, False, True, False, 4096, 4096),  # padded
    bwd_dispatch.flash_bwd_dkdv_gluon_default_variant(sm90, "bf16", 128, False, True, False, 4096, 4096),
    *bwd_dispatch.flash_bwd_fused_default_variants(sm90, "bf16", 128, True, True, False, 4096, 4096),
    bwd_dispatch.flash_bwd_fused_default_variants(sm90, "fp16", 192, False, True, False, 4096, 4096)[1],  # split, wide
    bwd_dispatch.flash_bwd_fused_default_variants(sm90, "bf16", 80, True, True, False, 4096, 4096)[1],  # split, narrow
]
"""

COMPILE = VARIANTS + """
import json
from lazytriton.compiler import compile_variant, triton_version
for v in VARIANTS:
    e = compile_variant(v)
    print("ENTRY " + json.dumps([str(v), triton_version(), list(e.arg_types), e.num_warps, len(e.binary) > 0]))
"""


def test_every_kernel_family_compiles_under_the_other_triton() -> None:
    python = os.environ.get(OTHER_TRITON)
    if not python:
        pytest.skip(f"set {OTHER_TRITON} to a Python with the other Triton version (3.6 beside 3.9): .ci/run does")
    done = subprocess.run([python, "-c", COMPILE], capture_output=True, text=True, timeout=1200, cwd=REPO,
                          check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    there = [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("ENTRY ")]
    scope: dict[str, object] = {}
    exec(VARIANTS, scope)  # noqa: S102 (this file's own text)
    here = scope["VARIANTS"]
    assert isinstance(here, list) and len(there) == len(here) and None not in here
    kernels = {str(v).split(":")[0] for v in here}
    assert kernels == {"flash_fwd", "flash_fwd_fp8", "flash_bwd_dq", "flash_bwd_dkdv", "flash_decode_split",
                       "flash_decode_combine", "kv_append", "kv_slots", "flash_fwd_gluon", "flash_bwd_dkdv_gluon",
                       "flash_bwd_prep", "flash_bwd_fused_gluon", "flash_fwd_mla",
                       "flash_fwd_fp8_gluon"}, "one of each family's kernels"
    for variant, (name, version, arg_types, num_warps, has_binary) in zip(here, there, strict=True):
        assert name == str(variant) and version != triton_version() and has_binary, name
        if variant is here[0]:  # compiled here too: the same launch ABI under both versions
            entry = compile_variant(variant)
            assert list(entry.arg_types) == arg_types and entry.num_warps == num_warps, name
