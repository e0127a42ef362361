"""What a cold process's first call does without: checked on what runs and what is read, never on time.

- ``helpers.on_first_use`` neither reads nor hashes the source of a helper
  the package holds (one ``stat`` each); a helper it does not hold still
  gets its key (its source hashed) and its background build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lazytriton.driver import helpers

TORCH = "2.11.0+cu130"  # a process that imported torch: both helpers wanted


class Recorder:
    """Stands in for ``helpers.source_hash`` (reads and hashes a helper's source): the helpers it was asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, helper: str) -> str:
        self.asked.append(helper)
        return "0" * 16


@pytest.fixture
def first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh process's helper state, a torch version, a counted spawn and a counted source hash."""
    monkeypatch.delenv(helpers.VARIABLE, raising=False)
    monkeypatch.setenv("LAZYTRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(helpers, "running_torch", lambda: TORCH)
    spawned: list[list[str]] = []
    monkeypatch.setattr(helpers, "_spawn", lambda argv, cwd, log_fd, lock_fd: spawned.append(list(argv)))
    hashed = Recorder()
    monkeypatch.setattr(helpers, "source_hash", hashed)
    from lazytriton import config

    config.reset()
    helpers.reset()
    yield spawned, hashed
    helpers.reset()
    monkeypatch.undo()
    config.reset()


def test_first_use_reads_no_source_of_a_helper_the_package_holds(first_use: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    spawned, hashed = first_use
    monkeypatch.setattr(helpers, "in_package", lambda helper, torch_version=None: tmp_path / helper)
    assert helpers.wanted(TORCH) == tuple(helpers.registry())  # both helpers looked at
    assert helpers.on_first_use() == [] and spawned == [] and hashed.asked == []


def test_first_use_still_keys_and_builds_a_helper_the_package_lacks(first_use: Any, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spawned, hashed = first_use
    packaged = helpers.FASTLAUNCH
    monkeypatch.setattr(helpers, "in_package",
                        lambda helper, torch_version=None: tmp_path / helper if helper == packaged else None)
    lacking = [name for name in helpers.registry() if name != packaged]
    started = helpers.on_first_use()
    assert started == [helpers.key(name, TORCH) for name in lacking]
    assert [argv[4] for argv in spawned] == lacking
    assert packaged not in hashed.asked and set(lacking) <= set(hashed.asked)
