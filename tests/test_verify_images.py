"""``cache verify`` passes the images ``prewarm`` builds: every kernel, every target prewarm knows, both Tritons.

One image a Triton version, built as a deployment builds it (``lazytriton
prewarm`` in a subprocess) on small axes (bf16, head dim 64, seqlens 4096,
non-causal, a contiguous cache, dense and packed sequences) for every target
of ``prewarm.limits.KNOWN_TARGETS``, merged with the sm_90 variants no such
plan holds (from a miss log): each partition layout of the warp-specialised
Gluon kernels (no producer, the producer warp, ping-pong, several query tiles,
the wide tiles; the fused backward's narrow and wide programs), the Gluon
dK/dV kernel and the host-descriptor forward. ``cache verify`` must check
every entry and fail none: a warp-specialised entry launches more warps than
its variant's num_warps, and an image that prewarm reported whole must not
fail verification for it.

The second image is built by the other Triton (3.6, the GPU host's, beside
CI's 3.9: ``$LAZYTRITON_TEST_OTHER_TRITON_PYTHON``, as in
``test_other_triton.py``) and verified here, as an image built on one machine
is checked on another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO
from host_tma_fixture import VARIANT as HOST_TMA_VARIANT

from lazytriton.cache_format import Entry
from lazytriton.cache_format.image import Image
from lazytriton.cli import main
from lazytriton.kernels import FAMILIES, launched_warps
from lazytriton.kernels.flash_bwd import fused
from lazytriton.kernels.flash_bwd import gluon as bwd_gluon
from lazytriton.kernels.flash_fwd import gluon as fwd_gluon
from lazytriton.prewarm.limits import KNOWN_TARGETS
from lazytriton.variant import Variant

# Two builds of 209 entries (199 planned, 12 from the miss log, 2 in both): 5-6 minutes each on 2 shared cores.
pytestmark = pytest.mark.slow

OTHER_TRITON = "LAZYTRITON_TEST_OTHER_TRITON_PYTHON"  # as test_other_triton.py reads it
TARGETS = tuple(KNOWN_TARGETS)
AXES = ("--dtype", "bf16", "--head-dim", "64", "--causal", "none", "--seqlen-q", "4096", "--seqlen-k", "4096",
        "--paged", "contiguous", "--varlen")
# The MLA forward's family is planned only when asked for (a v of over 256 columns, or qv): its own plan.
MLA_AXES = ("--kernel", "flash_fwd_mla", "--dtype", "bf16", "--head-dim", "64", "--head-dim-v", "512", "--causal",
            "none", "--seqlen-q", "4096", "--seqlen-k", "4096")
PLAIN_KERNELS = {kernel for kernels in FAMILIES.values() for kernel in kernels}


def _gluon_fwd(tiles: tuple[int, int, int], producer: bool = False, pingpong: bool = False,
               q_tiles: int = 1) -> Variant:
    variant = fwd_gluon.variant("sm_90", "bf16", 64, "none", True, False, 4096, 4096, tiles=tiles, producer=producer,
                                pingpong=pingpong, q_tiles=q_tiles)
    assert variant is not None
    return variant


def _fused(head_dim: int) -> tuple[Variant, Variant]:
    variants = fused.variants("sm_90", "bf16", head_dim, "none", True, False, 4096, 4096)
    assert variants is not None
    return variants


def extra_variants() -> list[Variant]:
    """The sm_90 variants of every partition layout and of the kernels the plan on ``AXES`` does not hold."""
    dkdv = bwd_gluon.variant("sm_90", "bf16", 64, "none", True, False, 4096, 4096)
    assert dkdv is not None
    return [_gluon_fwd((128, 128, 8)), _gluon_fwd((128, 128, 8), producer=True), _gluon_fwd((64, 64, 4), producer=True),
            _gluon_fwd((128, 64, 4), producer=True, pingpong=True),
            _gluon_fwd((128, 128, 4), producer=True, pingpong=True, q_tiles=8),
            _gluon_fwd((192, 128, 4), producer=True), *_fused(64), *_fused(256), dkdv, Variant.parse(HOST_TMA_VARIANT)]


SM90_KERNELS = PLAIN_KERNELS | {v.kernel for v in extra_variants()}


def build(python: str, where: Path) -> Path:
    """The image ``python``'s prewarm builds of the plan on ``AXES`` and of ``extra_variants``, merged."""
    misses = where / "misses.jsonl"
    misses.write_text("".join(json.dumps({"variant": str(v)}) + "\n" for v in extra_variants()))
    image, plan, extra, mla = where / "all.ltimg", where / "plan.ltimg", where / "extra.ltimg", where / "mla.ltimg"
    output = ""
    for args in (("--target", ",".join(TARGETS), *AXES, "--out", str(plan)),
                 ("--target", ",".join(TARGETS), *MLA_AXES, "--out", str(mla)),
                 ("--from-misses", str(misses), "--out", str(extra)),
                 ("--merge", str(plan), str(mla), str(extra), "--out", str(image))):
        # Run from the temp folder: the checkout's root on sys.path would shadow other packages (conftest.py).
        done = subprocess.run([python, "-m", "lazytriton.cli", "prewarm", *args], capture_output=True, text=True,
                              timeout=3600, cwd=where, check=False)
        output += done.stdout + done.stderr
        assert done.returncode == 0, output[-6000:]
        assert ", 0 failed" in done.stdout or "--merge" in args, done.stdout[-3000:]
    return image


def entries(image: Path) -> list[Entry]:
    with Image(image) as opened:
        read = [opened.read(key) for key in opened.keys()]
    assert None not in read
    return [entry for entry in read if entry is not None]


def verified(image: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    """``lazytriton cache verify IMAGE --json``'s report, its exit status checked against its ``ok``."""
    status = main(["cache", "verify", str(image), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert status == (0 if report["ok"] else 1)
    return report


def check_image(image: Path, capsys: pytest.CaptureFixture[str], triton: str) -> Counter[str]:
    """Every target holds every kernel it runs, every entry is verified, none fails; entries per target."""
    held = entries(image)
    assert {e.provenance.compiler_version for e in held} == {triton}
    by_target: dict[str, set[str]] = {}
    for entry in held:
        by_target.setdefault(entry.target, set()).add(Variant.parse(entry.variant).kernel)
    assert set(by_target) == set(TARGETS)
    for target, kernels in by_target.items():
        assert kernels == (SM90_KERNELS if target == "sm_90" else PLAIN_KERNELS), target
    specialised = sorted(e.num_warps for e in held if launched_warps(Variant.parse(e.variant))
                         != Variant.parse(e.variant).get("num_warps"))
    assert set(specialised) == {8, 12, 16}, "every partition layout: the image tests what it should"
    report = verified(image, capsys)
    assert report["failures"] == [] and report["ok"] is True, report["failures"]
    assert report["checked"] == len(held)
    return Counter(entry.target for entry in held)


def test_verify_passes_an_image_of_every_kernel_and_target(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.compiler import triton_version

    version = triton_version()
    assert version is not None, "Triton is installed (the test environment's)"
    check_image(build(sys.executable, tmp_path), capsys, version)


def test_verify_passes_the_image_the_other_triton_builds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    python = os.environ.get(OTHER_TRITON)
    if not python:
        pytest.skip(f"set {OTHER_TRITON} to a Python with the other Triton version (3.6 beside 3.9): .ci/run does")
    version = subprocess.run([python, "-c", "import triton; print(triton.__version__)"], capture_output=True,
                             text=True, timeout=300, cwd=REPO, check=True).stdout.strip()
    check_image(build(python, tmp_path), capsys, version)
