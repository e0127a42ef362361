"""The runtime follows the settings through a generation number; config never imports the runtime (issue 9)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_python

from lazytriton import config, runtime


def test_config_never_imports_the_runtime() -> None:
    result = run_python(
        "import sys, lazytriton.config as c\n"
        "c.settings(); c.configure(jit=False, cache_max_bytes='64M'); c.reset(); c.settings()\n"
        "assert 'lazytriton.runtime' not in sys.modules, 'config imported the runtime'\n"
        "import lazytriton.runtime as r\n"
        "assert r.get().settings.jit is True\n"
        "c.configure(jit=False)\n"
        "assert r.get().settings.jit is False\n"
        "print('ok')\n")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_configure_gives_a_new_runtime_on_next_use(tmp_path: Path) -> None:
    first = runtime.get()
    assert runtime.get() is first  # the same settings: the same runtime
    config.configure(cache_dir=tmp_path / "other")
    second = runtime.get()
    assert second is not first and second.settings.cache_dir == tmp_path / "other"
    assert second.local.directory == tmp_path / "other" / "entries"


def test_reset_of_config_rereads_the_environment(cache_dir: Path) -> None:
    config.configure(jit=False)
    assert runtime.get().settings.jit is False
    config.reset()
    assert runtime.get().settings.jit is True and runtime.get().settings.cache_dir == cache_dir


def test_runtime_reset_still_drops_the_runtime() -> None:
    first = runtime.get()
    runtime.reset()
    assert runtime.current() is None
    assert runtime.get() is not first


def test_bad_settings_leave_the_runtime_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    first = runtime.get()
    monkeypatch.setenv("LAZYTRITON_JIT", "maybe")
    config.reset()
    with pytest.raises(ValueError, match="LAZYTRITON_JIT"):
        runtime.get()
    assert runtime.current() is first
    monkeypatch.delenv("LAZYTRITON_JIT")
    assert runtime.get().settings.jit is True
