"""The compiled helpers built in the background on first GPU use, then loaded from the cache dir (helpers.py).

On CPU, through the fake libcuda (tests/fake_libcuda.py): the first use of
the CUDA driver starts exactly one build per missing helper (the spawn is
injected and counted, never timed); a process that finds the helper in the
cache dir loads it and launches through it; a failed build is recorded and
not retried; a helper that is not the user's own, is writable by others or
is reached through a link is refused; ``lazytriton info`` says each state.
One test builds ``_fastlaunch`` for real, in a detached process started by
one fresh interpreter, and loads it in another.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, run_python
from conftest import gpu as on_gpu
from fake_libcuda import Fake
from test_driver import _entry

from lazytriton import cli, config
from lazytriton.driver import fastlaunch, fastlaunch_build, gpu, helpers, helpers_build, torch_build
from lazytriton.kernels import COMPILED_EXTENSIONS, COMPILED_HELPERS
from lazytriton.kernels.flash_decode import hotpath as decode_hotpath
from lazytriton.kernels.flash_fwd import hotpath

FAST = helpers.FASTLAUNCH


class Spawns:
    """An injected spawn: records each builder it is asked to start and holds its lock, as a running builder does."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.fds: list[int] = []

    def __call__(self, argv: Any, cwd: str, log_fd: int, lock_fd: int) -> None:
        self.calls.append(list(argv))
        self.fds += [log_fd, lock_fd]

    def finish(self) -> None:
        """The builders exit: their locks are free."""
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


@pytest.fixture
def spawns(monkeypatch: pytest.MonkeyPatch) -> Any:
    made = Spawns()
    monkeypatch.setattr(helpers, "_spawn", made)
    yield made
    made.finish()


@pytest.fixture(autouse=True)
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh process's state: no package-folder helpers, nothing loaded or started, the setting unset.

    And no torch imported, as far as the helpers can tell: only the launch helper is wanted (the C++ tail's own
    cache-dir test is in test_hotpath_cpp.py), unless a test says otherwise.
    """
    monkeypatch.delenv(helpers.VARIABLE, raising=False)
    monkeypatch.setattr(helpers, "running_torch", lambda: None)
    monkeypatch.setattr(helpers, "PACKAGE_DIR", tmp_path / "package")
    monkeypatch.setattr(fastlaunch, "_import_package", lambda: None)
    monkeypatch.delitem(sys.modules, fastlaunch.MODULE, raising=False)
    helpers.reset()
    fastlaunch.refresh()
    gpu.cuda.cache_clear()
    yield
    gpu.cuda.cache_clear()
    helpers.reset()
    monkeypatch.undo()
    fastlaunch.refresh()


@pytest.fixture(scope="module")
def built_helper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``_fastlaunch`` built once for the module with the real compiler (skip without one)."""
    try:
        return fastlaunch_build.build(tmp_path_factory.mktemp("built"), mode=0o755)
    except fastlaunch_build.BuildError as exc:
        pytest.skip(f"the launch helper cannot be built here: {exc}")


def place(cache_dir: Path, built: Path) -> Path:
    """Put a built ``_fastlaunch`` where the cache dir's lookup finds it, as the builder leaves it; its path."""
    assert helpers.make_folder(cache_dir, FAST, None) is None
    target = helpers.folder(cache_dir, FAST) / helpers.module_file(FAST)
    shutil.copyfile(built, target)
    target.chmod(0o755)
    return target


def settings_changed() -> None:
    config.reset()  # a new generation: the setting is read again, as in a fresh process


def test_first_gpu_use_starts_one_background_build_per_missing_helper(fake_library: Path, cache_dir: Path,
                                                                     spawns: Spawns,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "CudaApi", functools.partial(gpu.CudaApi, str(fake_library)))
    monkeypatch.setattr(helpers, "running_torch", lambda: "2.11.0+cu130")  # a process that imported torch
    assert gpu.cuda() is gpu.cuda()
    keys = [helpers.key(FAST), helpers.key(hotpath.NAME, "2.11.0+cu130"),
            helpers.key(decode_hotpath.NAME, "2.11.0+cu130")]
    assert [call[4] for call in spawns.calls] == [FAST, hotpath.NAME, decode_hotpath.NAME]
    assert [call[call.index("--key") + 1] for call in spawns.calls] == keys
    assert spawns.calls[0][:4] == [sys.executable, "-m", helpers.BUILDER, "child"]
    assert helpers.on_first_use() == []  # the same process never starts a key twice
    helpers.reset()  # another process while the builds run: it finds their locks taken
    assert helpers.on_first_use() == [] and len(spawns.calls) == 3
    assert helpers.status(FAST, cache_dir).state == helpers.BUILDING
    spawns.finish()  # the builders died without a result (killed): the next process tries again
    helpers.reset()
    assert helpers.on_first_use() == keys and len(spawns.calls) == 6


def test_the_next_process_loads_the_helper_from_the_cache_dir_and_launches_through_it(
        fake_library: Path, cache_dir: Path, built_helper: Path, spawns: Spawns) -> None:
    assert not fastlaunch.available()
    path = place(cache_dir, built_helper)
    assert fastlaunch.refresh() and fastlaunch.origin() == str(path)
    assert helpers.on_first_use(spawns)[:1] != [helpers.key(FAST)]  # present: not built again
    assert all(call[4] != FAST for call in spawns.calls)
    kernel = gpu.CudaApi(str(fake_library)).load(_entry(("*fp16", "i32", "fp32")), 0)
    assert kernel.fast is not None
    fake = Fake(fake_library)
    fake.configure([8, 4, 4, 8, 8])
    kernel.launch((1, 1, 1), 0, (16, 3), (1.5,))
    assert fake.last_launch()[1]["launches"] == 1


def test_a_real_background_build_serves_the_next_process(cache_dir: Path) -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    if (Path(fastlaunch_build.__file__).parent / helpers.module_file(FAST)).is_file():
        pytest.skip("the launch helper is built into the package folder here, which takes precedence")
    env = {"LAZYTRITON_CACHE_DIR": str(cache_dir), helpers.VARIABLE: "1"}
    first = run_python("from lazytriton.driver import helpers\nprint(helpers.on_first_use())", env=env)
    assert first.returncode == 0 and helpers.key(FAST) in first.stdout, first.stderr
    where = helpers.folder(cache_dir, FAST)
    held = helpers.take_lock(where, blocking=True)  # returns when the detached builder has exited
    assert held is not None
    os.close(held)
    assert (where / helpers.module_file(FAST)).is_file(), (where / helpers.LOG).read_text()
    second = run_python(
        "import sys\nfrom lazytriton.driver import fastlaunch, helpers\n"
        "helpers._spawn = lambda *args: sys.exit('a build was started')\n"
        "print(fastlaunch.available(), fastlaunch.origin(), helpers.on_first_use())\n"
        "print('torch.utils.cpp_extension' in sys.modules, 'torch' in sys.modules)", env=env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split("\n")[:2] == [f"True {where / helpers.module_file(FAST)} []", "False False"]


def test_a_failed_build_is_recorded_logged_once_and_not_retried(cache_dir: Path, spawns: Spawns,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    def no_compiler(*args: Any, **kwargs: Any) -> Path:
        raise fastlaunch_build.BuildError("cc failed (exit 1):\n" + "x" * (64 << 10) + "\nfastlaunch.c:1: error: END")

    monkeypatch.setattr(fastlaunch_build, "build", no_compiler)
    assert helpers.make_folder(cache_dir, FAST, None) is None
    lock = helpers.take_lock(helpers.folder(cache_dir, FAST), blocking=False)
    assert lock is not None
    assert helpers_build.child(FAST, cache_dir, helpers.key(FAST), lock) == 1
    os.close(lock)
    marker = helpers.folder(cache_dir, FAST) / helpers.FAILED
    text = marker.read_bytes()
    assert len(text) <= helpers.MAX_FAILURE_BYTES and text.endswith(b"fastlaunch.c:1: error: END")
    state = helpers.status(FAST, cache_dir)
    assert state.state == helpers.FAILED_STATE and state.path == str(marker) and len(state.detail) <= 203
    for _ in range(2):  # two processes in a row
        helpers.reset()
        with caplog.at_level(logging.DEBUG, logger="lazytriton.driver"):
            assert helpers.on_first_use() == [] and spawns.calls == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and str(marker) in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    monkeypatch.setattr(helpers, "source_hash", lambda helper: "0123456789abcdef")  # a new source: a new key
    helpers.reset()
    assert helpers.on_first_use() == [helpers.key(FAST)]


def test_a_foreground_build_retries_a_failed_key(cache_dir: Path, built_helper: Path) -> None:
    assert helpers.make_folder(cache_dir, FAST, None) is None
    marker = helpers.folder(cache_dir, FAST) / helpers.FAILED
    marker.write_text("BuildError: an older failure\n")
    [result] = helpers_build.build(cache_dir, None)
    assert result.ok and result.path == str(helpers.folder(cache_dir, FAST) / helpers.module_file(FAST))
    assert not marker.exists() and helpers.status(FAST, cache_dir).state == helpers.CACHE
    [again] = helpers_build.build(cache_dir, None)
    assert again.ok and again.message.startswith("already built")


def _group_writable_file(target: Path, cache_dir: Path) -> str:
    target.chmod(0o775)
    return "writable by group"


def _others_writable_cache_dir(target: Path, cache_dir: Path) -> str:
    cache_dir.chmod(0o757)
    return "writable by others"


def _group_writable_key_folder(target: Path, cache_dir: Path) -> str:
    target.parent.chmod(0o775)
    return "writable by group"


def _symlinked_file(target: Path, cache_dir: Path) -> str:
    real = cache_dir / "elsewhere.so"
    target.rename(real)
    target.symlink_to(real)
    return "symbolic link"


def _symlinked_key_folder(target: Path, cache_dir: Path) -> str:
    real = target.parent.with_name("elsewhere")
    target.parent.rename(real)
    target.parent.symlink_to(real)
    return "symbolic link"


def _fifo(target: Path, cache_dir: Path) -> str:
    target.unlink()
    os.mkfifo(target, 0o644)
    return "not a regular file"


def _another_owner(target: Path, cache_dir: Path) -> str:
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    os.chown(target, 4242, 4242)
    return "owned by uid 4242"


@pytest.mark.parametrize("spoil", [_group_writable_file, _others_writable_cache_dir, _group_writable_key_folder,
                                   _symlinked_file, _symlinked_key_folder, _fifo, _another_owner],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_helper_that_is_not_the_users_own_is_refused(spoil: Any, cache_dir: Path, built_helper: Path,
                                                       spawns: Spawns, caplog: pytest.LogCaptureFixture) -> None:
    target = place(cache_dir, built_helper)
    reason = spoil(target, cache_dir)
    with caplog.at_level(logging.WARNING, logger="lazytriton.driver"):
        assert not fastlaunch.refresh()
        assert not fastlaunch.refresh()
    refusals = [r.getMessage() for r in caplog.records if "not loading the compiled helper" in r.getMessage()]
    assert len(refusals) == 1 and reason in refusals[0], caplog.text
    state = helpers.status(FAST, cache_dir)
    assert state.state == helpers.REFUSED and reason in state.detail
    assert all(call[4] != FAST for call in spawns.calls)  # building again would not make it trusted
    if spoil is _others_writable_cache_dir:
        cache_dir.chmod(0o755)


def test_the_setting_turns_the_cache_dir_helpers_off(cache_dir: Path, built_helper: Path, spawns: Spawns,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    place(cache_dir, built_helper)
    monkeypatch.setenv(helpers.VARIABLE, "off")
    settings_changed()
    assert not fastlaunch.refresh()
    assert helpers.on_first_use() == [] and spawns.calls == []
    assert helpers.status(FAST, cache_dir).state == helpers.DISABLED
    fields = cli.launch_fields(cache_dir)
    assert fields["launch_path"] == "cffi ABI mode" and "LAZYTRITON_HELPERS=0" in fields["launch_why"]
    monkeypatch.setenv(helpers.VARIABLE, "maybe")
    settings_changed()
    with pytest.raises(config.SettingsError, match="LAZYTRITON_HELPERS.*'maybe'"):
        helpers.on_first_use()
    monkeypatch.setenv(helpers.VARIABLE, "1")
    settings_changed()
    assert fastlaunch.refresh()


def test_the_key_follows_python_torch_and_source() -> None:
    fast, hot = helpers.key(FAST), helpers.key(hotpath.NAME, "2.11.0+cu130")
    assert fast.startswith(f"fastlaunch-{helpers.abi_tag()}-") and helpers.abi_tag() in hot
    assert "-torch2.11.0+cu130-" in hot and helpers.key(hotpath.NAME, "2.12.0") != hot
    assert helpers.key(FAST) == fast and "/" not in fast + hot
    assert helpers.module_file(hotpath.NAME, "2.11.0+cu130").startswith("_hotpath.torch-2.11.0+cu130.")
    with pytest.raises(ValueError, match="helper must be one of"):
        helpers.module_file("other")


def test_a_deployments_builds_in_the_package_are_found_without_importing_any_familys_description(
        tmp_path: Path, spawns: Spawns, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernels.COMPILED_EXTENSIONS`` names what each family's ``hotpath`` describes, so first use finds a
    deployment's builds (every helper in the package) by stat calls alone: no family's module, no build."""
    version = "2.11.0+cu130"
    package, kernels = tmp_path / "driver", tmp_path / "kernels"
    expected = [package / helpers.module_file(FAST)]
    for describer, extension in zip(COMPILED_HELPERS, COMPILED_EXTENSIONS, strict=True):
        module = importlib.import_module(describer)
        assert module.MODULE == extension, describer
        family = extension.split(".")[2]
        assert module.EXTENSION.folder == Path(importlib.import_module(f"lazytriton.kernels.{family}").__file__).parent
        expected.append(kernels / family / helpers.module_file(module.NAME, version))
    for path in expected:
        assert not helpers.all_in_package(version, package, kernels)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    assert helpers.all_in_package(version, package, kernels) and helpers.all_in_package(None, package, kernels)
    expected[0].unlink()
    assert not helpers.all_in_package(None, package, kernels)
    # First use in such a deployment: the registry (which imports each family's description) is never consulted.
    monkeypatch.setattr(helpers, "all_in_package", lambda torch_version: True)
    monkeypatch.setattr(helpers, "registry", lambda: pytest.fail("the registry was consulted"))
    assert helpers.on_first_use() == [] and spawns.calls == []


def test_every_compiled_helpers_source_ships_in_the_package() -> None:
    """A regular install (a wheel, ``pip install --target``) carries each C++ tail's source: the background build
    reads it from the installed package."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for name in COMPILED_HELPERS:
        module = importlib.import_module(name)
        package = name.rpartition(".")[0]
        assert module.SOURCE.name in package_data.get(package, []), f"{package}'s package-data lacks its source"
    assert torch_build.TAIL_HEADER.name in package_data["lazytriton.driver"], "the header every C++ tail includes"


def test_each_cpp_tails_key_hashes_every_file_it_compiles() -> None:
    """A C++ tail's source hash reads its source, its record's header and the shared ``lt_tail.h``: a change to any
    is a new key, so the cache dir's build is made again."""
    shared = torch_build.TAIL_HEADER.read_bytes()
    for name in COMPILED_HELPERS:
        module = importlib.import_module(name)
        hashed = module.source()
        assert module.SOURCE.read_bytes() in hashed and shared in hashed, name
        assert module.EXTENSION.record_header().encode() in hashed, name


def test_info_says_which_launch_path_and_why(cache_dir: Path, built_helper: Path, spawns: Spawns,
                                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    def info() -> dict[str, Any]:
        assert cli.main(["info", "--json"]) == 0
        return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]

    fields = info()
    assert fields["launch_path"] == "cffi ABI mode" and "not built yet" in fields["launch_why"]
    assert fields["helpers"][FAST]["state"] == helpers.NOT_BUILT
    assert helpers.on_first_use() != []  # a build in the background (its lock held by the injected spawn)
    fields = info()
    assert fields["helpers"][FAST]["state"] == helpers.BUILDING and "building" in fields["launch_why"]
    spawns.finish()
    (helpers.folder(cache_dir, FAST) / helpers.FAILED).write_text("BuildError: no C compiler\n")
    fields = info()
    assert fields["helpers"][FAST]["state"] == helpers.FAILED_STATE
    assert "failed: BuildError: no C compiler" in fields["launch_why"]
    (helpers.folder(cache_dir, FAST) / helpers.FAILED).unlink()
    target = place(cache_dir, built_helper)
    fastlaunch.refresh()
    fields = info()
    assert fields["launch_path"] == "compiled helper" and str(target) in fields["launch_why"]
    assert fields["helpers"][FAST] == {"state": helpers.CACHE, "path": str(target), "loads": True,
                                       "detail": "built for this Python and torch"}
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"launch      compiled helper: the launch helper from the cache dir ({target})" in text
    assert "helpers     launch helper: cache dir" in text and "C++ warm path: " in text
    target.chmod(0o777)
    fastlaunch.refresh()
    fields = info()
    assert fields["helpers"][FAST]["state"] == helpers.REFUSED and "refused" in fields["launch_why"]
    import torch

    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert "HIP" in info()["launch_why"]


def test_prewarm_helpers_builds_into_a_named_cache_dir_and_says_what_failed(
        tmp_path: Path, built_helper: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    from lazytriton.kernels.flash_decode import hotpath_build as decode_hotpath_build
    from lazytriton.kernels.flash_fwd import hotpath_build

    def no_headers(*args: Any, **kwargs: Any) -> Path:
        raise hotpath_build.BuildError("cannot build the C++ warm path; missing:\n  torch's C++ headers")

    monkeypatch.setattr(hotpath_build, "build", no_headers)  # the real one takes a minute; its own tests build it
    monkeypatch.setattr(decode_hotpath_build, "build", no_headers)
    deployed = tmp_path / "deployed-cache"
    assert cli.main(["prewarm", "--helpers", str(deployed)]) == 1
    out, err = capsys.readouterr()
    fast = helpers.folder(deployed, FAST) / helpers.module_file(FAST)
    assert f"helper fastlaunch: built: {fast}" in out and "helper hotpath: BuildError: cannot build" in out
    assert "2 helpers not built (hotpath, decode_hotpath)" in err
    assert helpers.status(FAST, deployed).state == helpers.CACHE
    assert cli.main(["prewarm", "--helpers", str(deployed)]) == 1  # the failed one is tried again, the other kept
    out, _ = capsys.readouterr()
    assert f"helper fastlaunch: already built (cache dir): {fast}" in out and "helper hotpath: BuildError" in out


def test_a_bad_setting_stops_info_with_the_variables_name(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(helpers.VARIABLE, "sometimes")
    settings_changed()
    assert cli.main(["info"]) == 2
    assert "LAZYTRITON_HELPERS must be one of" in capsys.readouterr().err


def test_the_build_says_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(fastlaunch_build.BuildError, match=r"a C compiler: none of \$CC"):
        fastlaunch_build.build(tmp_path)


_GPU_CALL = """
import torch, lazytriton
from lazytriton import runtime
from lazytriton.driver import fastlaunch
q = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
lazytriton.attn_fwd(q, q, q)
torch.cuda.synchronize()
print(fastlaunch.available(), fastlaunch.origin(), [k.fast is not None for k in runtime.get().loaded_kernels()])
"""


@on_gpu
def test_gpu_a_first_call_builds_the_launch_helper_for_the_next_process(cache_dir: Path) -> None:
    if (Path(fastlaunch_build.__file__).parent / helpers.module_file(FAST)).is_file():
        pytest.skip("the launch helper is built into the package folder here, which takes precedence")
    env = {"LAZYTRITON_CACHE_DIR": str(cache_dir), helpers.VARIABLE: "1"}
    first = run_python(_GPU_CALL, env=env)
    assert first.returncode == 0 and first.stdout.startswith("False None [False"), first.stdout + first.stderr
    where = helpers.folder(cache_dir, FAST)
    held = helpers.take_lock(where, blocking=True)  # the background build has finished
    assert held is not None
    os.close(held)
    second = run_python(_GPU_CALL, env=env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith(f"True {where / helpers.module_file(FAST)} [True"), second.stdout
