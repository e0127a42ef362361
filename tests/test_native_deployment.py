"""The C example in both modes and the no-Python container's recipe, checked on this machine.

``lazytriton capi build`` installs both libraries; examples/c builds ``attention-native`` against
``lazytriton-native.pc`` (as examples/deployment/Dockerfile.native does), which links no libpython: without
the JIT fallback its host-memory call is refused naming how to allow it, with ``LAZYTRITON_JIT=1`` the
fallback (liblazytriton.so, opened then) runs it and the result matches the example's reference loop. Every
file the Dockerfile's final stage copies is one those build commands produce.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import gpu

from lazytriton.capi import build

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "examples" / "deployment" / "Dockerfile.native"
PREFIX_IN_IMAGE = "/opt/lazytriton"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None or shutil.which("make") is None or shutil.which("pkg-config") is None:
        pytest.skip("needs gcc, make and pkg-config")
    prefix = tmp_path_factory.mktemp("prefix")
    build.build(prefix)
    return prefix


@pytest.fixture(scope="module")
def example(installed: Path) -> Path:
    out = installed / "bin"
    env = {**os.environ, "PKG_CONFIG_PATH": str(installed / "lib" / "pkgconfig")}
    done = subprocess.run(["make", "-C", str(REPO / "examples" / "c"), f"OUT={out}", f"{out}/attention-native",
                           "CFLAGS=-O2 -Wall -Wextra -Werror -std=c99"], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return out / "attention-native"


def run(example: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LAZYTRITON_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run([str(example), "--seqlen-q", "16", "--seqlen-k", "24"], env={**base, **env},
                          capture_output=True, text=True, timeout=600, check=False)


def test_both_libraries_are_installed_and_the_native_one_links_no_python(installed: Path, example: Path) -> None:
    assert all(path.is_file() for path in build.installed_files(installed))
    if shutil.which("ldd") is not None:
        linked = subprocess.run(["ldd", str(example)], capture_output=True, text=True, check=True).stdout
        assert "liblazytriton_native.so" in linked and "python" not in linked.lower(), linked


def test_the_example_without_and_with_the_jit_fallback(example: Path, tmp_path: Path) -> None:
    native_only = run(example, tmp_path)
    assert native_only.returncode == 2, native_only.stdout + native_only.stderr
    assert "LAZYTRITON_JIT=1" in native_only.stdout + native_only.stderr
    fallback = run(example, tmp_path, LAZYTRITON_JIT="1")
    assert fallback.returncode == 0, fallback.stdout + fallback.stderr


def test_the_dockerfile_copies_only_what_its_build_commands_make(installed: Path, example: Path) -> None:
    text = DOCKERFILE.read_text()
    assert "lazytriton capi build --prefix /opt/lazytriton" in text
    assert "OUT=/opt/lazytriton/bin" in text and "attention-native" in text
    assert "--out /opt/lazytriton/images/attention.ltimg" in text
    final = text[text.rindex("\nFROM "):]
    assert "python" not in final.split("\n", 2)[1].lower(), "the final stage's base image has no Python"
    sources = [src for line in re.findall(r"^COPY --from=build (.+)$", final, re.M) for src in line.split()[:-1]]
    assert sources, final
    made = {PREFIX_IN_IMAGE + "/images/attention.ltimg"}  # the prewarm command's --out, checked above
    for source in sources:
        assert source.startswith(PREFIX_IN_IMAGE + "/"), source
        local = installed / source.removeprefix(PREFIX_IN_IMAGE + "/")
        assert source in made or local.is_file(), f"{source}: not made by the build stage's commands"


@gpu
@pytest.mark.gpu
def test_on_a_gpu_the_misses_prewarmed_are_then_served_natively(example: Path, tmp_path: Path) -> None:
    """Native only, the example's GPU calls miss and are logged; prewarmed from that log, they are served and match."""
    args = ["--gpu", "--dtype", "bf16", "--backward"]
    base = {**os.environ, "LAZYTRITON_CACHE_DIR": str(tmp_path / "cache")}
    base.pop("LAZYTRITON_JIT", None)
    missed = subprocess.run([str(example), *args], env=base, capture_output=True, text=True, timeout=600, check=False)
    assert missed.returncode == 2 and "no image holds" in missed.stdout + missed.stderr
    log, image = tmp_path / "cache" / "misses.jsonl", tmp_path / "served.ltimg"
    for _ in range(2):  # the forward's miss, then the backward's two kernels
        prewarm = subprocess.run(["lazytriton", "prewarm", "--from-misses", str(log), "--out", str(image)],
                                 capture_output=True, text=True, timeout=1200, check=False)
        assert prewarm.returncode == 0, prewarm.stderr
        served = subprocess.run([str(example), *args], env={**base, "LAZYTRITON_IMAGES": str(image)},
                                capture_output=True, text=True, timeout=600, check=False)
        if served.returncode == 0:
            break
    assert served.returncode == 0, served.stdout + served.stderr
