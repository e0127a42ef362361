"""lt_plan_launch and lt_attn_fwd read a dense call of this version's struct where the caller keeps it, and copy an
older struct (or a packed call's views) first: both ways must launch the same and refuse the same.

A C program (tests/capi/plan_paths.c) plans a bf16 forward call served from an image, then makes thousands of
calls from it by random changes, hostile ones included (dtypes, shapes, strides, outputs on inputs or on each
other, null or misaligned pointers, devices, flags, window, softcap, scale, chunk, sinks, descales, packed
sequences), and sends each as this version's struct and as the same call in a version 7 struct. The statuses,
the messages and the fake libcuda's record of each launch must agree.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from nativelib import build_program
from test_native_front import FWD_INTS, call_variant, fake_entry

from lazytriton.cache_format.image import write_image

CALLS = 4000
# What the random calls must reach for the comparison to mean something: launches, and the refusals of
# LT_ERROR_INVALID_ARGUMENT (1, aliasing among them), _DTYPE (2), _SHAPE (4), _NULL_POINTER (5), _PLAN_MISMATCH (10)
# and LT_MISS (16: lt_attn_fwd's calls of another shape class).
STATUSES = {"0", "1", "2", "4", "5", "10", "16"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The native library, the fake libcuda as libcuda.so.1, and plan_paths linked against the library."""
    return build_program(tmp_path_factory.mktemp("plan-paths"), "plan_paths")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_callers_struct_and_its_copy_launch_and_refuse_alike(built: dict[str, Path], tmp_path: Path,
                                                                 seed: int) -> None:
    image = tmp_path / "call.ltimg"
    write_image(image, [fake_entry(call_variant(False))])
    env = {"LAZYTRITON_IMAGES": str(image), "LD_LIBRARY_PATH": str(built["driver"]),
           "LAZYTRITON_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path), "PLAN_PATHS_INTS": str(FWD_INTS)}
    done = subprocess.run([str(built["program"]), str(seed), str(CALLS)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["mismatches"] == 0, report["first_mismatch"]
    assert report["calls"] == CALLS
    assert STATUSES <= set(report["statuses"]), report["statuses"]
    assert report["launches"] > CALLS // 4, report
