"""lazytriton.h's API served by liblazytriton_native.so: native with an image, and through the JIT fallback.

A C program (tests/capi/native_front.c) calls lt_init and lt_attn_fwd, with no Python reachable: the native
core computes the call's variant and key (tests/test_native_choice.py holds them to Python's), loads the
entry from the image and launches it against the fake libcuda with the arguments lazytriton.c passes. A call
no image serves is LT_MISS naming the variant and how to allow the fallback; allowed, the fallback opens
liblazytriton.so (its embedded Python) only then: a host-memory call runs through it, and its output is
the PyTorch reference's.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from nativelib import build_program

from lazytriton.cache_format import Entry
from lazytriton.cache_format.entry import Provenance
from lazytriton.cache_format.image import write_image
from lazytriton.capi import build, embedded
from lazytriton.kernels import get
from lazytriton.kernels.flash_fwd import FLASH_FWD, reference

REPO = Path(__file__).resolve().parents[1]
LT_OK, LT_ERROR_UNSUPPORTED, LT_ERROR_PYTHON, LT_MISS = 0, 9, 14, 16
SQ, SK, HQ, D = 300, 500, 4, 128


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The native library, the fake libcuda as libcuda.so.1, and native_front linked against the library."""
    return build_program(tmp_path_factory.mktemp("native-front"), "native_front")


def call_variant(causal: bool) -> Any:
    """The variant the C API's Python planner gives native_front's GPU call (aligned, 32-bit indexing)."""
    return embedded.plan_variant("flash_fwd", 90, 2, D, causal, True, False, SQ, SK, head_dim_v=D)


# flash_fwd's parameters at bf16 with 32-bit indexing (its description's): FWD_INTS pointers and integers, 3 fp32
FWD_TYPES = tuple(kind for kind in FLASH_FWD.signature("bf16").values() if kind != "constexpr")
FWD_INTS = len(FWD_TYPES) - 3


def fake_entry(variant: Any) -> Entry:
    """An entry of ``variant`` (no real compile) with its kernel's parameter layout (its description's, at the
    variant's dtype and indexing): flash_fwd's here, the decoding kernels' in benchmarks/bench_capi.py."""
    spec = get(variant.kernel)
    types = tuple(kind for kind in spec.signature(variant.dtype, variant.constexprs.get("INDEX64") is True).values()
                  if kind != "constexpr")
    return Entry(key=variant.key(), variant=str(variant), target=variant.target, kind="cubin",
                 binary=b"\x7fELF" + bytes(64), name=f"{variant.kernel}_kernel",
                 num_warps=int(variant.get("num_warps")), num_ctas=1, warp_size=32, shared=49152,
                 global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
                 arg_types=types, hidden_args=("global_scratch", "profile_scratch"),
                 provenance=Provenance("triton", "3.6.0", "0123456789abcdef", 1.5e9, 1))


def front(built: dict[str, Path], tmp_path: Path, images: str, jit: int, device: str, causal: int,
          extra_env: dict[str, str] | None = None, *args: str) -> dict[str, Any]:
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    env = {"LAZYTRITON_IMAGES": images, "LD_LIBRARY_PATH": str(built["driver"]), "PATH": str(empty),
           "LAZYTRITON_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path), "NATIVE_FRONT_INTS": str(FWD_INTS),
           **(extra_env or {})}
    done = subprocess.run([str(built["program"]), str(jit), device, str(causal), *args], capture_output=True,
                          text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_a_call_is_served_from_the_image_with_no_python(built: dict[str, Path], tmp_path: Path) -> None:
    variant = call_variant(False)
    image = tmp_path / "fwd.ltimg"
    write_image(image, [fake_entry(variant)])
    report = front(built, tmp_path, str(image), 0, "cuda", 0, {"PYTHONHOME": "/nonexistent"})
    assert (report["init"], report["fwd"]) == (LT_OK, LT_OK), report
    launches, _, _, gx, gy, gz, block_x, _, shared, stream, function, context, _ = report["state"]
    block_m = int(variant.get("BLOCK_M"))
    assert launches == 1 and (gx, gy, gz) == (math.ceil(SQ / block_m), HQ, 1)
    assert (block_x, shared, stream, function, context) == (int(variant.get("num_warps")) * 32, 49152, 0x5EA,
                                                            0xF000, 0xC000)
    params = report["params"]
    assert params[:4] == [0x7F0000100000, 0x7F0000200000, 0x7F0000300000, 0x7F0000400000]
    scale = struct.unpack("<f", struct.pack("<i", params[FWD_INTS]))[0]  # then softcap, dropout_p
    assert math.isclose(scale, 1 / math.sqrt(D), rel_tol=1e-6) and params[FWD_INTS + 1:FWD_INTS + 3] == [0, 0]
    assert params[FWD_INTS + 3:FWD_INTS + 5] == [0, 0]  # the hidden scratch pointers' values: NULL
    assert (report["stats"], report["plans"], report["image_entries"]) == (LT_OK, 1, 1)


def test_a_miss_without_the_fallback_names_the_variant_and_how_to_allow_it(built: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    image = tmp_path / "fwd.ltimg"
    write_image(image, [fake_entry(call_variant(False))])
    missing = call_variant(True)
    for jit, env in ((0, {}), (2, {"LAZYTRITON_JIT": "1"})):
        report = front(built, tmp_path, str(image), jit, "cuda", 1, env)
        assert report["fwd"] == LT_MISS, report
        assert str(missing) in report["error"] and missing.key() in report["error"]
        assert "LAZYTRITON_JIT=1" in report["error"]
    assert json.loads((tmp_path / "cache" / "misses.jsonl").read_text().splitlines()[0])["key"] == missing.key()
    report = front(built, tmp_path, str(image), 0, "cpu", 0)
    assert report["fwd"] == LT_ERROR_UNSUPPORTED and "LAZYTRITON_JIT=1" in report["error"], report


def test_the_fallback_without_liblazytriton_says_what_to_build(built: dict[str, Path], tmp_path: Path) -> None:
    image = tmp_path / "fwd.ltimg"
    write_image(image, [fake_entry(call_variant(False))])
    absent = tmp_path / "nowhere" / "liblazytriton.so"
    report = front(built, tmp_path, str(image), 1, "cuda", 1, {"LAZYTRITON_CAPI_EMBEDDED": str(absent)})
    assert report["fwd"] == LT_ERROR_PYTHON and str(absent) in report["error"], report
    assert "lazytriton capi build" in report["error"]


def test_the_fallback_serves_host_memory_through_the_embedded_python(built: dict[str, Path], tmp_path: Path,
                                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    prefix = tmp_path_factory.mktemp("embedded")
    library = build.build(prefix).library
    out = tmp_path / "out.bin"
    report = front(built, tmp_path, "", 0, "cpu", 1, {"LAZYTRITON_JIT": "1", "LAZYTRITON_CAPI_EMBEDDED": str(library),
                                                      "PATH": "/usr/bin:/bin"}, str(out))
    assert (report["init"], report["fwd"]) == (LT_OK, LT_OK), report
    sq, sk, d = 24, 40, 32

    def filled(t: int, heads: int, seqlen: int) -> torch.Tensor:
        i = torch.arange(heads * seqlen * d, dtype=torch.int64)
        return (((i * (t + 3) * 7919) % 97).float() / 97.0 - 0.5).to(torch.bfloat16).view(1, heads, seqlen, d)

    q, k, v = filled(0, HQ, sq), filled(1, 2, sk), filled(2, 2, sk)
    got = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.bfloat16).view(1, HQ, sq, d)
    want, _ = reference.attention_reference(q.float(), k.float(), v.float(), causal="bottom_right")
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
