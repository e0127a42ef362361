"""benchmarks/profile_cold.py's ``--split --steps`` on CPU: a first call served from an image through the fake libcuda.

The GPU round's ``coldsteps`` step reads these lines on the host (where one kernel's first result goes, step by
step); this runs the same script with the fake driver, so that a renamed driver function or a moved load step
fails here, not in a GPU call.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_python

SCRIPT = REPO / "benchmarks" / "profile_cold.py"
SHAPE = "1,2,128,64"  # bf16, causal: flash_fwd_gluon on sm_90, as the bench's one kernel there
# The fake driver's route builds the driver's binding without ``helpers.on_first_use`` (which would start real
# compiles of the helpers in the background), so its ``helpers`` step is the host's alone.
STEPS = ("api", "context", "module", "kernel", "launch")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An sm_90 image of the call's forward variants, built by prewarm (the compiler runs here, not in the call)."""
    where = tmp_path_factory.mktemp("steps")
    out = where / "one.ltimg"
    built = run_python(f"from lazytriton.cli import main; main(['prewarm', '--target', 'sm_90', '--kernel', "
                       f"'flash_fwd', '--dtype', 'bf16', '--head-dim', '64', '--causal', 'top_left', '--seqlen-q', "
                       f"'128', '--out', {str(out)!r}, '-j', '1'])",
                       env={"LAZYTRITON_CACHE_DIR": str(where / "build")}, timeout=600)
    assert out.is_file(), built.stdout[-2000:] + built.stderr[-2000:]
    return out


def profile(library: Path, image: Path, cache_dir: Path, helpers: str) -> str:
    env = {"LAZYTRITON_IMAGES": str(image), "LAZYTRITON_JIT": "0", "LAZYTRITON_CACHE_DIR": str(cache_dir),
           "LAZYTRITON_HELPERS": helpers}
    full = {**os.environ, **env}
    done = subprocess.run([sys.executable, str(SCRIPT), "--fake-driver", str(library), "--shape", SHAPE,
                           "--causal", "--split", "--steps"], env=full, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("helpers", ["0", "1"])
def test_each_step_of_the_first_load_is_timed_once(fake_library: Path, image: Path, tmp_path: Path,
                                                   helpers: str) -> None:
    text = profile(fake_library, image, tmp_path / "cache", helpers)
    assert re.search(r"^driver import \d+\.\d ms \(\d+\.\d CPU\)$", text, re.M), text
    assert "served {'image': 1}; compiles 0; loaded 1" in text, text  # from the image, nothing compiled
    split = next(line for line in text.splitlines() if line.startswith("split: "))
    for label in ("forward", "plans", "reads", "loads", *STEPS):
        found = re.search(rf"(?:: |; ){label} (-?\d+\.\d) ms \((-?\d+\.\d) CPU, (\d+) calls\)", split)
        assert found is not None, f"{label} missing from {split}"
        assert int(found.group(3)) == 1, split  # the outermost call of each, once: one kernel, one load
        assert float(found.group(1)) >= 0.0, split  # a nested step's own part: never more than its whole
