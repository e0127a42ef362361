"""A bounded mutation fuzzer over the native core's image and entry readers, under ASan and UBSan.

tests/capi/native_fuzz.c mutates a valid image (zstd with a dictionary) and a valid entry a fixed number of
times from a fixed seed and reads each result; a crash, a sanitizer report or a leak fails the run. The
mutations must reach both verdicts (some images and entries still read, most refused), so the driver cannot
pass by reading nothing.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import test_decoders_property as props
from nativelib import SANITIZER_ENV, build_driver

ITERATIONS = 1500


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    program, _ = build_driver(tmp_path_factory.mktemp("fuzz"), "native_fuzz")
    return program


@pytest.mark.parametrize("mode", ["image", "entry"])
def test_mutated_inputs_give_statuses_never_crashes(fuzzer: Path, tmp_path: Path, mode: str) -> None:
    seed_file = tmp_path / "seed"
    seed_file.write_bytes(props.IMAGES["zstd-dict"] if mode == "image" else props.ENCODED)
    done = subprocess.run([str(fuzzer), mode, str(seed_file), str(ITERATIONS), "20261205", str(tmp_path / "scratch")],
                          capture_output=True, text=True, env=SANITIZER_ENV, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    counts = json.loads(done.stdout)
    assert counts["ok"] + counts["damaged"] + counts["io"] + counts["nomem"] == ITERATIONS, counts
    assert counts["ok"] > 0 and counts["damaged"] > ITERATIONS // 2, counts
