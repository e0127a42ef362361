"""Shared fixtures: every test gets its own cache dir and fresh settings."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
# The checkout's top-level folders kernels/, prewarm/, capi/ and cache_format/ are lazytriton's subpackages (pyproject's
# package-dir), never top-level modules. `python3 -m pytest` (and each xdist worker) puts the working directory on
# sys.path, where kernels/ would shadow Hugging Face's `kernels` package, which transformers imports since 5.25:
# the checkout's root leaves the path before anything is imported from it (lazytriton itself comes from the install).
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO]

from lazytriton import compiler, config, runtime  # noqa: E402 (after the path is cleaned)


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


GPU_REASON = "needs a CUDA GPU; run on the GPU host (see README, 'GPU tests')"
gpu = pytest.mark.skipif(not has_cuda(), reason=GPU_REASON)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test skipped by ``gpu`` carries the ``gpu`` mark too, so ``-m gpu`` selects it (before -m deselects)."""
    for item in items:
        if any(mark.kwargs.get("reason") == GPU_REASON for mark in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A built and installed C API (through `lazytriton capi build`), once a module; skipped without gcc."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (apt-get install gcc)")
    where = tmp_path_factory.mktemp("capi") / "prefix"
    built = subprocess.run([sys.executable, "-m", "lazytriton.cli", "capi", "build", "--prefix", str(where)],
                           capture_output=True, text=True, timeout=600, check=False)
    assert built.returncode == 0 and "built" in built.stdout, (
        f"exit {built.returncode}\nstdout:\n{built.stdout}\nstderr:\n{built.stderr}")
    return where


@pytest.fixture(scope="module")
def fake_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake libcuda (tests/fake_libcuda.py) compiled once a module; skipped without a C compiler."""
    from fake_libcuda import build

    library = build(tmp_path_factory.mktemp("fakecuda"))
    if library is None:
        pytest.skip("no C compiler for the fake libcuda")
    return library


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything would run a kernel (interpreter or GPU runtime)."""

    def launched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a kernel was launched for bad input")

    monkeypatch.setattr(compiler, "interpret", launched)
    monkeypatch.setattr(runtime.Runtime, "kernel", launched)


@pytest.fixture
def resolved(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every variant the runtime resolves (loads or compiles) during the test, in order."""
    seen: list[Any] = []
    resolve = runtime.Runtime.resolve

    def spy(self: runtime.Runtime, variant: Any) -> object:
        seen.append(variant)
        return resolve(self, variant)

    monkeypatch.setattr(runtime.Runtime, "resolve", spy)
    return seen


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache dir for this test, through LAZYTRITON_CACHE_DIR."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("LAZYTRITON_CACHE_DIR", str(directory))
    monkeypatch.delenv("LAZYTRITON_JIT", raising=False)
    monkeypatch.setenv("LAZYTRITON_HELPERS", "0")  # no background helper builds into each test's cache dir
    monkeypatch.setenv("LAZYTRITON_CODEPACK", "0")  # nor code packs into a test's regular install (test_codepack's own)
    for name in ("LAZYTRITON_SHARED", "LAZYTRITON_SIGNING_KEY", "LAZYTRITON_SHARED_TIMEOUT_MS",
                 "LAZYTRITON_CACHE_MAX_BYTES"):
        monkeypatch.delenv(name, raising=False)  # a developer's shared tier or bound never leaks into a test
    config.reset()
    yield directory
    config.reset()


def load_experiment(name: str) -> ModuleType:
    """``experiments/<name>.py`` as a module of that name (the probes are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 300,
               safe_path: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with this test's environment (plus ``env``).

    ``safe_path``: the working directory stays off ``sys.path`` (``python -P``), so the checkout's top-level
    folders (``kernels/``) cannot shadow an installed package of the same name (Hugging Face's ``kernels``,
    which transformers imports).
    """
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, *(["-P"] if safe_path else []), "-c", code], env=full_env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def recording_backend(graphs: list[str]) -> Any:
    """A torch.compile backend that appends each graph AOTAutograd compiles (forward, then backward) to ``graphs``."""

    def backend(gm: Any, example_inputs: list[Any]) -> Any:
        from torch._dynamo.backends.common import aot_autograd

        def keep(g: Any, _: Any) -> Any:
            graphs.append(str(g.graph))
            return g

        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)

    return backend


@contextlib.contextmanager
def syncs_raise() -> Iterator[None]:
    """Inside: any host synchronisation of the current CUDA device raises (torch's sync debug mode "error").

    The device is synchronised first, so that only what runs inside counts.
    """
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def assert_compiled_grads_equal(fn: Any, inputs: Any, grad_out: Any) -> None:
    """``fn``'s gradients at ``inputs`` under ``torch.compile(fullgraph=True)`` equal the eager ones, bit for bit."""
    import torch

    leaves = [t.clone().requires_grad_() for t in inputs]
    got = torch.autograd.grad(torch.compile(fn, fullgraph=True, backend="eager")(*leaves), leaves, grad_out)
    eager = [t.clone().requires_grad_() for t in inputs]
    want = torch.autograd.grad(fn(*eager), eager, grad_out)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def sass_of(cubin: bytes, tmp_path: Path) -> str:
    """The SASS of a cubin, by the cuobjdump that Triton ships."""
    import triton.backends.nvidia as nvidia

    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    return subprocess.run([str(tool), "-sass", str(path)], check=True, capture_output=True, text=True).stdout


def loop_opcodes(sass: str, holds: str) -> list[str]:
    """The opcodes of the first loop in ``sass`` (cuobjdump's text) whose body holds an opcode starting ``holds``.

    A loop is the body of a backward branch (``BRA`` to a lower address); an opcode keeps its modifiers
    (``SHFL.IDX``), not its predicate. Empty where no such loop is found.
    """
    code = [(int(m[1], 16), m[2], m[3]) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)([^;]*);", sass)]
    index = {address: i for i, (address, _, _) in enumerate(code)}
    for i, (address, opcode, operands) in enumerate(code):
        target = re.search(r"0x[0-9a-f]+", operands) if opcode == "BRA" else None
        start = index.get(int(target[0], 16)) if target else None
        if start is not None and code[start][0] < address:
            body = [op for _, op, _ in code[start:i + 1]]
            if any(op.startswith(holds) for op in body):
                return body
    return []


def opcode_counts(opcodes: list[str]) -> Counter[str]:
    """Opcodes by count without their modifiers, but a shuffle's kind (``SHFL.IDX``, ``SHFL.BFLY``)."""
    return Counter(".".join(op.split(".")[:2]) if op.startswith("SHFL") else op.split(".")[0] for op in opcodes)


def ptxas_report(ptx: str, tmp_path: Path) -> tuple[int, int, int]:
    """(registers, spill stores, spill loads) of the PTX for sm_90a, from the installed Triton's own ptxas -v."""
    from triton.backends.nvidia.compiler import get_ptxas

    source = tmp_path / "kernel.ptx"
    source.write_text(ptx)
    done = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(source), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, timeout=600, check=True)
    log = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert regs and spills, log
    return int(regs[1]), int(spills[1]), int(spills[2])


@pytest.fixture(scope="session")
def launch_helper(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The compiled launch helper: the installed one, or one built for this run (skip when it cannot be built)."""
    import importlib

    from lazytriton.driver import fastlaunch, fastlaunch_build, trusted

    if fastlaunch.available():
        return importlib.import_module(fastlaunch.MODULE)
    try:
        path = fastlaunch_build.build(tmp_path_factory.mktemp("fastlaunch"))
    except Exception as exc:  # no compiler, no Python headers
        pytest.skip(f"the launch helper cannot be built here: {exc}")
    return trusted.load_extension(fastlaunch.MODULE, str(path), path)
