"""The examples (examples/deployment, examples/cluster, examples/c) keep what their READMEs say.

- The plan sizes each README quotes, in a table of prewarm flags and counts,
  are what ``lazytriton prewarm FLAGS --list`` counts today.
- The cluster example removes its work dir (``$TMPDIR/lazytriton-cluster-*``)
  however it ends, unless ``--keep``.
- The deployment's wheel command gives the file the Dockerfile copies.
- No example puts the checkout's root (or any folder) on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
from conftest import REPO

from lazytriton.cli import main

EXAMPLES = REPO / "examples"
# A row of a README's plan table: | what | `--target ...` | count |
PLAN_ROW = re.compile(r"^\|[^|\n]*\|\s*`(--target [^`]+)`\s*\|\s*(\d+)\s*\|\s*$", re.MULTILINE)


def plan_rows(readme: Path) -> list[tuple[list[str], int]]:
    return [(flags.split(), int(count)) for flags, count in PLAN_ROW.findall(readme.read_text())]


def planned(flags: list[str], capsys: pytest.CaptureFixture[str]) -> int:
    """How many variants ``lazytriton prewarm FLAGS --list`` plans (its count line, on stderr)."""
    capsys.readouterr()
    assert main(["prewarm", *flags, "--list"]) == 0
    out, err = capsys.readouterr()
    count = int(err.strip().splitlines()[-1].split()[0])
    assert count == len(out.splitlines())
    return count


def load_run_cluster() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_cluster", EXAMPLES / "cluster" / "run_cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# The counts the READMEs quote


@pytest.mark.parametrize("example", ["deployment", "cluster"])
def test_the_plan_sizes_a_readme_quotes_are_prewarms(example: str, capsys: pytest.CaptureFixture[str]) -> None:
    rows = plan_rows(EXAMPLES / example / "README.md")
    assert len(rows) >= 2, "each README has a plan table: a quick try and the default"
    found = {" ".join(flags): (quoted, planned(flags, capsys)) for flags, quoted in rows}
    assert all(quoted == counted for quoted, counted in found.values()), (
        f"examples/{example}/README.md quotes other plan sizes than prewarm's (quoted, counted): {found}")


def test_the_deployment_table_names_build_image_defaults() -> None:
    script = (EXAMPLES / "deployment" / "build_image.sh").read_text()
    targets = re.search(r"TARGETS=\$\{TARGETS:-([\w,]+)\}", script)
    assert targets is not None
    flags = [" ".join(f) for f, _ in plan_rows(EXAMPLES / "deployment" / "README.md")]
    assert f"--target {targets.group(1)}" in flags, "the default row is build_image.sh's own plan"
    quick = re.search(r'PREWARM_ARGS="([^"]+)" examples/deployment/build_image.sh',
                      (EXAMPLES / "deployment" / "README.md").read_text())
    assert quick is not None and f"--target {targets.group(1)} {quick.group(1)}" in flags


def test_the_cluster_table_names_run_clusters_plans() -> None:
    run_cluster = load_run_cluster()
    flags = [" ".join(f) for f, _ in plan_rows(EXAMPLES / "cluster" / "README.md")]
    assert flags == [" ".join(run_cluster.plan_args("flash_fwd")), " ".join(run_cluster.plan_args())]
    assert "run_cluster.py --nodes 4 --kernel flash_fwd" in (EXAMPLES / "cluster" / "README.md").read_text()


# ---------------------------------------------------------------------------
# The cluster example leaves nothing behind


@pytest.fixture
def run_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> ModuleType:
    """run_cluster with its phases faked: the plan and the JIT phase write into the work dir as the real ones do."""
    module = load_run_cluster()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def plan(workdir: Path, flags: list[str]) -> Path:
        (workdir / "jit" / "node1").mkdir(parents=True)
        (workdir / "jit" / "node1" / "cache.db").write_bytes(b"\0" * 4096)
        path = workdir / "variants.txt"
        path.write_text("flash_fwd:sm_90:fp16:x\n")
        return path

    monkeypatch.setattr(module, "plan", plan)
    return module


def leftovers(tmp_path: Path) -> list[Path]:
    return sorted(tmp_path.glob("lazytriton-cluster-*"))


def test_run_cluster_removes_its_work_dir(run_cluster: ModuleType, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[Path] = []
    monkeypatch.setattr(run_cluster, "phase_jit", lambda workdir, *args: ran.append(workdir))
    assert run_cluster.main(["--redis", "redis://127.0.0.1:9/0", "--phase", "jit"]) == 0
    assert ran and ran[0].parent == tmp_path
    assert leftovers(tmp_path) == []


def test_run_cluster_removes_its_work_dir_after_a_failure(run_cluster: ModuleType, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def failed(*args: object) -> None:
        raise SystemExit("a node failed:\n...")

    monkeypatch.setattr(run_cluster, "phase_jit", failed)
    with pytest.raises(SystemExit, match="a node failed"):
        run_cluster.main(["--redis", "redis://127.0.0.1:9/0", "--phase", "jit"])
    assert leftovers(tmp_path) == []


def test_run_cluster_keep_leaves_the_work_dir_and_says_where(run_cluster: ModuleType, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(run_cluster, "phase_jit", lambda *args: None)
    assert run_cluster.main(["--redis", "redis://127.0.0.1:9/0", "--phase", "jit", "--keep"]) == 0
    kept = leftovers(tmp_path)
    assert len(kept) == 1 and (kept[0] / "jit" / "node1" / "cache.db").is_file()
    assert f"work dir kept: {kept[0]}" in capsys.readouterr().out


@pytest.mark.slow
def test_run_cluster_end_to_end_compiles_each_key_once_and_cleans_up(tmp_path: Path) -> None:
    """Two nodes and a real Redis on the smallest plan (the append kernel: two variants)."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server (apt-get install redis-server)")
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYTRITON_")}
    env["TMPDIR"] = str(tmp_path)
    result = subprocess.run([sys.executable, str(EXAMPLES / "cluster" / "run_cluster.py"), "--nodes", "2",
                             "--kernel", "kv_append"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "total compiles: 2 on 2 nodes (as expected)" in result.stdout, result.stdout
    assert "total compiles: 0 on 2 nodes (as expected)" in result.stdout, result.stdout
    assert leftovers(tmp_path) == []


# ---------------------------------------------------------------------------
# The deployment's wheel, and sys.path


@pytest.mark.slow
def test_the_wheel_command_gives_the_file_the_dockerfile_copies(tmp_path: Path) -> None:
    from importlib.metadata import version

    if int(version("setuptools").split(".")[0]) < 77:
        pytest.skip("needs setuptools>=77 (the build requirement) for --no-build-isolation")
    readme = (EXAMPLES / "deployment" / "README.md").read_text()
    command = "python3 -m pip wheel --no-deps -w dist ."
    assert command in readme
    # The README's command, offline: the build requirements come from this environment.
    source = tmp_path / "src"
    for name in ("lazytriton", "kernels", "cache_format", "prewarm", "capi"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", "dist", "."], cwd=source, capture_output=True, text=True, timeout=600,
                           check=False)
    assert built.returncode == 0, built.stderr
    wheels = [p.name for p in (source / "dist").iterdir()]
    copied = re.search(r"^COPY (dist/\S+\.whl) ", (EXAMPLES / "deployment" / "Dockerfile").read_text(), re.MULTILINE)
    assert copied is not None
    assert len(wheels) == 1 and Path(wheels[0]).match(Path(copied.group(1)).name), (wheels, copied.group(1))
    assert f"dist/{wheels[0]}" in readme, "the README names the wheel the command gives"


def test_no_example_touches_sys_path() -> None:
    """Run from a checkout, an example must not put the root on sys.path: kernels/ would shadow HF's kernels."""
    for path in EXAMPLES.rglob("*"):
        if path.suffix in (".py", ".sh") or path.name == "Dockerfile":
            text = path.read_text()
            assert "sys.path" not in text and "PYTHONPATH" not in text, path
