"""A newcomer's first hour (issue 13): commands, one-line errors, logging, and installing.

Each command runs as a user runs it: ``python -m lazytriton ...`` in a fresh
process, with the test's own cache dir. An error is one line on stderr (and
maybe a hint line), never a traceback, with exit status 2 for a usage or
configuration error and 1 for a failure of the work.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO, run_python

import lazytriton
from lazytriton import config
from lazytriton.cli import describe_error, main, plural

# Settings a developer's shell may hold, which would change what these commands do.
_CLEARED = ("LAZYTRITON_LOG_LEVEL", "LAZYTRITON_DEBUG", "LAZYTRITON_JIT", "LAZYTRITON_IMAGES")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(extra or {})
    return env


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lazytriton", *args], env=_env(env), capture_output=True,
                          text=True, timeout=300, check=False)


def one_line_error(result: subprocess.CompletedProcess[str], status: int) -> str:
    """The error line of a command that failed as a user should see it; fails the test otherwise."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == status, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) in (1, 2), result.stderr
    assert len(lines) == 1 or lines[1].startswith("hint:"), result.stderr
    return lines[0]


# ---------------------------------------------------------------------------
# Commands


def test_version_and_python_m_lazytriton() -> None:
    result = cli("--version")
    assert (result.returncode, result.stdout) == (0, f"lazytriton {lazytriton.__version__}\n"), result.stderr


def test_info_json_is_one_json_object(cache_dir: Path) -> None:
    result = cli("info", "--json")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) == 1
    info = json.loads(result.stdout)
    assert info["lazytriton"] == lazytriton.__version__
    assert info["cache_dir"] == str(cache_dir)
    assert (info["entries"], info["compiles"], info["jit"], info["shared"], info["signing"]) == (0, 0, True, None,
                                                                                                 False)
    assert info["images"] == [] and info["max_bytes"] == config.DEFAULT_CACHE_MAX_BYTES


@pytest.mark.parametrize(("name", "value"), [("LAZYTRITON_LOG_LEVEL", "loud"), ("LAZYTRITON_CACHE_MAX_BYTES", "lots"),
                                             ("LAZYTRITON_JIT", "maybe"), ("LAZYTRITON_SHARED", "ftp://x")])
def test_a_bad_setting_is_one_line_and_exit_status_2(name: str, value: str) -> None:
    line = one_line_error(cli("info", env={name: value}), 2)
    assert line.startswith("lazytriton: configuration error:") and name in line and value in line, line


def test_a_usage_error_is_exit_status_2() -> None:
    result = cli("info", "--bogus")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unrecognized arguments: --bogus" in result.stderr


def test_demo_without_jit_and_nothing_cached_says_so_in_one_line() -> None:
    line = one_line_error(cli("demo", "--cpu", env={"LAZYTRITON_JIT": "0"}), 1)
    assert "LAZYTRITON_JIT=0" in line and "no cache tier holds flash_fwd:sm_90:" in line


def test_traceback_only_on_request() -> None:
    for args, env in ((("--traceback", "info"), {}), (("info",), {"LAZYTRITON_DEBUG": "1"})):
        result = cli(*args, env={"LAZYTRITON_LOG_LEVEL": "loud", **env})
        assert result.returncode == 2 and "Traceback" in result.stderr, result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith("lazytriton: configuration error:")


def test_describe_error_maps_exceptions_to_status_message_and_hint() -> None:
    from lazytriton.compiler import CompileError
    from lazytriton.runtime import KernelNotFound

    assert describe_error(config.SettingsError("LAZYTRITON_JIT must be ..."))[0] == 2
    status, message, hint = describe_error(KernelNotFound("no cache tier holds v and LAZYTRITON_JIT=0"))
    assert status == 1 and "LAZYTRITON_JIT=0" in message and hint and "LAZYTRITON_IMAGES" in hint
    status, message, hint = describe_error(ModuleNotFoundError("No module named 'triton'", name="triton"))
    assert status == 1 and hint and "pip install 'lazytriton[jit]'" in hint
    status, message, hint = describe_error(CompileError("compiling v failed:\n  line 1\n  line 2"))
    assert (status, message, hint) == (1, "lazytriton: compiling v failed: line 1 line 2", None)
    status, message, hint = describe_error(RuntimeError("x" * 5000))
    assert status == 1 and message.startswith("lazytriton: error: RuntimeError: x") and len(message) < 700
    assert describe_error(PermissionError(13, "Permission denied", "/c"))[:2] == (
        1, "lazytriton: [Errno 13] Permission denied: '/c'")


def test_a_miss_without_triton_says_how_to_install_it() -> None:
    code = ("import sys\nsys.modules['triton'] = None  # as on a deployment without the [jit] extra\n"
            "from lazytriton.cli import main\nsys.exit(main(['demo', '--cpu']))")
    result = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300,
                            check=False)
    line = one_line_error(result, 1)
    assert "needs triton" in line and "pip install 'lazytriton[jit]'" in line


def test_use_image_reports_a_missing_kernel_and_a_bad_setting_in_one_line(tmp_path: Path) -> None:
    script = REPO / "examples" / "deployment" / "use_image.py"
    (tmp_path / "images").mkdir()  # a folder with no image in it: every kernel is missing
    env = _env({"LAZYTRITON_IMAGES": str(tmp_path / "images"), "LAZYTRITON_JIT": "0"})
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert "the image lacks a kernel these calls need" in one_line_error(result, 1)
    result = subprocess.run([sys.executable, str(script)], env={**env, "LAZYTRITON_JIT": "maybe"},
                            capture_output=True, text=True, timeout=300, check=False)
    assert "LAZYTRITON_JIT" in one_line_error(result, 2)


@pytest.mark.parametrize("argv", [[], ["info"], ["demo"], ["prewarm"], ["cache"], ["cache", "ls"], ["cache", "verify"],
                                  ["cache", "explain"], ["capi"], ["capi", "build"], ["capi", "uninstall"],
                                  ["tune"]])
def test_help_shows_no_rst_markup(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--help"])
    assert stop.value.code == 0
    shown = capsys.readouterr().out
    assert "usage:" in shown and "``" not in shown, shown


def test_plural() -> None:
    assert [plural(n, "entry") for n in (0, 1, 2)] == ["0 entries", "1 entry", "2 entries"]
    assert (plural(1, "variant"), plural(3, "variant"), plural(2, "key")) == ("1 variant", "3 variants", "2 keys")


def test_prewarm_counts_one_variant_in_the_singular(capsys: pytest.CaptureFixture[str]) -> None:
    # Head dim 32: no Gluon row, so flash_fwd's one variant (at 64 the plan holds its flash_fwd_gluon twin too)
    call = ["prewarm", "--target", "sm_90", "--dtype", "bf16", "--head-dim", "32", "--causal", "top_left",
            "--seqlen-q", "128", "--seqlen-k", "128", "--list"]
    assert main([*call, "--kernel", "flash_fwd"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and err.strip() == "1 variant"
    assert main(call) == 0  # every kernel family: the count says how many of each kernel
    out, err = capsys.readouterr()
    count = len(out.splitlines())  # the decoding family adds its own (contiguous and paged split, one combine)
    assert err.strip().startswith(f"{count} variants: flash_fwd 1, flash_bwd_dq 2, flash_bwd_dkdv 2, ")  # SEQ16 or not


# ---------------------------------------------------------------------------
# Logging


def test_the_library_leaves_an_applications_logger_level_alone() -> None:
    code = ("import logging\nfrom lazytriton import config\n"
            "logging.getLogger('lazytriton').setLevel(logging.ERROR)\nconfig.settings()\n"
            "logger = logging.getLogger('lazytriton')\nprint(logging.getLevelName(logger.level), len(logger.handlers))")
    result = run_python(code, _env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ERROR", "0"]


def test_a_jit_compile_at_debug_is_logged_to_stderr_when_no_logging_is_configured() -> None:
    code = ("from lazytriton import runtime\nfrom lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch\n"
            "from lazytriton.target import Target\n"
            "variant = fwd_dispatch.flash_fwd_variant(Target.parse('sm_90'), 'fp16', 16, False, True, 16)\n"
            "print(runtime.get().resolve(variant).source)")
    result = run_python(code, _env({"LAZYTRITON_LOG_LEVEL": "debug"}))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["jit"]
    assert "lazytriton: INFO lazytriton.runtime: compiling flash_fwd:sm_90:fp16:" in result.stderr, result.stderr


def test_a_record_reaches_an_application_configured_later_once() -> None:
    code = ("import logging, sys\nfrom lazytriton import config\nconfig.settings()\n"
            "logging.basicConfig(stream=sys.stdout, format='app %(name)s %(message)s')\n"
            "logging.getLogger('lazytriton.runtime').info('hello')")
    result = run_python(code, _env({"LAZYTRITON_LOG_LEVEL": "INFO"}))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["app lazytriton.runtime hello"]
    assert "hello" not in result.stderr


def test_a_bad_log_level_names_the_variable_and_the_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAZYTRITON_LOG_LEVEL", "loud")
    config.reset()
    with pytest.raises(ValueError, match=r"LAZYTRITON_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, "
                                         r"CRITICAL .*got 'loud'"):
        config.settings()
    monkeypatch.delenv("LAZYTRITON_LOG_LEVEL")
    config.reset()
    with pytest.raises(ValueError, match="log_level must be one of"):
        config.configure(log_level="loud")
    with pytest.raises(TypeError, match="log_level must be a level name"):
        config.configure(log_level=10)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Installing and packaging


def test_record_imports_without_typing_dataclass_transform() -> None:
    """Python 3.10 has no typing.dataclass_transform; requires-python says 3.10 works."""
    code = ("import typing\ndel typing.dataclass_transform\n"
            "import lazytriton.config, lazytriton.variant, lazytriton.cache_format\n"
            "from lazytriton.record import record, replace\n"
            "@record\nclass A:\n    x: int\n    y: str = 'y'\n"
            "print(replace(A(1), y='z'))")
    result = run_python(code, _env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "A(x=1, y='z')"


def _site_paths() -> str:
    """This interpreter's package folders (torch and the other dependencies), not the checkout's own paths."""
    folders = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
               *(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))]
    return os.pathsep.join(dict.fromkeys(folders))


def _source_copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for name in ("lazytriton", "kernels", "cache_format", "prewarm", "capi"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    return src


IMPORTS = ("import lazytriton.flash, lazytriton.kernels, lazytriton.prewarm.cli, lazytriton.capi, "
           "lazytriton.cache_format\nprint(lazytriton.__file__)\nprint(lazytriton.kernels.__file__)")


def _run_isolated(cwd: Path, pythonpath: str) -> subprocess.CompletedProcess[str]:
    """``python -S``: no .pth files, so no editable install; only ``pythonpath`` (and cwd) to import from."""
    env = {**_env(), "PYTHONPATH": pythonpath}
    return subprocess.run([sys.executable, "-S", "-c", IMPORTS], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_a_source_checkout_maps_its_top_level_folders(tmp_path: Path) -> None:
    src = _source_copy(tmp_path)
    result = _run_isolated(src, _site_paths())
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(src / "lazytriton" / "__init__.py"), str(src / "kernels" / "__init__.py")]


@pytest.mark.slow
def test_a_regular_install_imports_from_the_checkout_root_and_anywhere_else(tmp_path: Path) -> None:
    """After ``pip install .`` the checkout's lazytriton/ shadows the install in its root: it must still import."""
    from importlib.metadata import version

    if int(version("setuptools").split(".")[0]) < 77:
        pytest.skip("needs setuptools>=77 (the build requirement) for --no-build-isolation")
    src, site = _source_copy(tmp_path), tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(site), str(src)], capture_output=True, text=True,
                         timeout=600, check=False)
    assert pip.returncode == 0, pip.stderr
    path = f"{site}{os.pathsep}{_site_paths()}"
    in_root = _run_isolated(src, path)
    assert in_root.returncode == 0, in_root.stderr
    assert in_root.stdout.split()[1] == str(src / "kernels" / "__init__.py")
    elsewhere = _run_isolated(tmp_path, path)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert elsewhere.stdout.split() == [str(site / "lazytriton" / "__init__.py"),
                                        str(site / "lazytriton" / "kernels" / "__init__.py")]
    assert (site / "lazytriton" / "py.typed").is_file()
    assert (site / "lazytriton-0.1.0.dist-info" / "licenses" / "LICENSE").is_file()
    metadata = (site / "lazytriton-0.1.0.dist-info" / "METADATA").read_text()
    assert "License-Expression: MIT" in metadata
    assert "Requires-Dist: triton<3.10,>=3.6; extra == \"jit\"" in metadata


def test_pyproject_triton_is_an_extra_with_bounds_and_the_license_is_spdx() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    meta = project["project"]
    assert not any(dep.startswith("triton") for dep in meta["dependencies"])
    assert meta["optional-dependencies"]["jit"] == ["triton>=3.6,<3.10"]
    assert any(dep.startswith("lazytriton[") and "jit" in dep for dep in meta["optional-dependencies"]["test"])
    assert meta["license"] == "MIT" and meta["license-files"] == ["LICENSE"]
    assert "MIT License" in (REPO / "LICENSE").read_text()
    assert "setuptools>=77" in project["build-system"]["requires"]
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["lazytriton"]
    assert (REPO / "lazytriton" / "py.typed").is_file()


# ---------------------------------------------------------------------------
# The README: what a newcomer copies from it runs, and what it quotes is true


README = REPO / "README.md"
DOCS = (README, REPO / "benchmarks" / "README.md", *sorted((REPO / "examples").glob("*/README.md")))


def _quick_start_snippet() -> str:
    """The first Python block of the README's quick start."""
    text = README.read_text()
    start = text.index("## Quick start")
    block = re.search(r"```python\n(.*?)```", text[start:text.index("\n## ", start + 1)], re.DOTALL)
    assert block is not None, "the quick start has a Python snippet"
    return block.group(1)


def test_the_readme_quick_start_snippet_runs_on_cpu(tmp_path: Path) -> None:
    snippet = _quick_start_snippet()
    assert "cuda" not in snippet and len(snippet.splitlines()) <= 10, snippet
    script = tmp_path / "first_call.py"
    script.write_text(snippet)
    # As a newcomer runs it: a script outside the checkout, CPU tensors only, an empty cache dir.
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env({"CUDA_VISIBLE_DEVICES": ""}),
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["out", "(1,", "2,", "16,", "64)", "dq", "(1,", "2,", "16,", "64)"], result.stdout


def test_the_readme_two_commands_are_the_demo_and_cis_test_command() -> None:
    text = README.read_text()
    assert 'python3 -m pip install -e ".[jit]" && lazytriton demo' in text
    ci_test = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if "-m pytest" in line]
    assert ci_test == ["python3 -m pytest -n auto"], ci_test
    assert f'python3 -m pip install -e ".[test]" && {ci_test[0]}' in text


def _subcommands(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The subcommands ``lazytriton ARGV --help`` lists (its usage line's ``{a,b,c}``)."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    listed = re.search(r"\{([\w,]+)\}", capsys.readouterr().out)
    assert listed is not None
    return listed.group(1).split(",")


def test_the_readme_names_the_commands_there_are(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(README.read_text().split())
    for name in _subcommands([], capsys):
        assert f"`{name}`" in text or f"`lazytriton {name}" in text or f"`{name} " in text, name
    cache = _subcommands(["cache"], capsys)
    assert f"`cache {'|'.join(cache)}`" in text, "the README lists every cache subcommand, in the parser's order"


def test_the_readme_performance_tables_are_plot_perfs_summary() -> None:
    text = README.read_text()
    asked = re.findall(r"`plot_perf\.py --summary --head-dims ([\d,]+)`", text)
    assert len(asked) == 2, asked
    for head_dims in asked:
        result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot_perf.py"), "--summary",
                                 "--head-dims", head_dims], capture_output=True, text=True, timeout=300, check=False)
        assert result.returncode == 0, result.stderr
        rows = [line for line in result.stdout.splitlines() if line.startswith("| forward") or
                line.startswith("| backward")]
        assert rows and all(row in text for row in rows), f"--head-dims {head_dims}: plot_perf.py gives\n" + \
            "\n".join(rows)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_the_docs_links_name_files_of_the_checkout(doc: Path) -> None:
    for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
        if "://" in target:
            continue
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(REPO) and path.exists(), f"{doc.name} links {target}"
