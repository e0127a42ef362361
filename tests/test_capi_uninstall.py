"""``lazytriton capi uninstall``: removes exactly what ``capi build`` installed (``pip uninstall`` does not).

No compiler needed: the installed files are laid out by hand where
``build.installed_files`` (which ``build`` itself installs to) says.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

from lazytriton.capi import build


def _capi(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lazytriton", "capi", *args], env=dict(os.environ),
                          capture_output=True, text=True, timeout=300, check=False)


def test_uninstall_removes_exactly_the_installed_files(tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    installed = build.installed_files(prefix)
    others = [prefix / "lib" / "libother.so", prefix / "include" / "other.h", prefix / "lib" / "pkgconfig" / "x.pc",
              prefix / "lib" / "cmake" / "other" / "otherConfig.cmake", prefix / "bin" / "python"]
    leftover = prefix / "lib" / ".liblazytriton.so.k2j4x9"  # an interrupted install's temp file (_install)
    for path in (*installed, *others, leftover):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")

    dry = _capi("uninstall", "--prefix", str(prefix), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert len(lines) == len(installed) + 1 and all(line.startswith("would remove ") for line in lines), dry.stdout
    assert all(path.exists() for path in (*installed, leftover))

    result = _capi("uninstall", "--prefix", str(prefix))
    assert result.returncode == 0, result.stderr
    assert not any(path.exists() for path in (*installed, leftover))
    assert not (prefix / "lib" / "cmake" / "lazytriton").exists()
    assert all(path.is_file() for path in others), "nothing else under the prefix is touched"
    assert {line.removeprefix("removed ") for line in result.stdout.splitlines()} == {
        *map(str, installed), str(leftover), str(prefix / "lib" / "cmake" / "lazytriton")}

    again = _capi("uninstall", "--prefix", str(prefix))
    assert again.returncode == 0 and again.stdout.startswith("nothing to remove"), again.stdout


def test_the_readme_names_every_installed_file(tmp_path: Path) -> None:
    readme = (REPO / "capi" / "README.md").read_text()
    assert "lazytriton capi uninstall" in readme
    rm_line = readme[readme.index('rm -f "$P/'):]
    for path in build.installed_files(tmp_path):
        relative = path.relative_to(tmp_path.resolve()).as_posix()
        assert f'"$P/{relative}"' in rm_line, relative
