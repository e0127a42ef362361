"""The pytest plugin that runs a peer's test file against the shims (``-p peer_plugin``).

Options (``benchmarks/peer_suites.py`` passes them):

- ``--peer-sample F`` / ``--peer-every N`` / ``--peer-seed S`` / ``--peer-min-per-function M`` /
  ``--peer-max-seqlen L`` / ``--peer-shard K/N``: which cases run (``peer_select``); the rest are deselected.
- ``--peer-deadline EPOCH``: a case whose setup starts after this time (``time.time()``) is skipped with
  ``OVER_BUDGET``, so a run given a wall-clock budget still ends with its summary (xdist workers too).
- ``--peer-timeout T``: each phase of a case (setup, call, teardown) ends with ``PeerTimeout`` after T seconds
  (SIGALRM: on the main thread of a POSIX process; a kernel already launched on a GPU runs on).
- After each case on a GPU, the memory torch's allocator caches goes back to the card (``release_cached_memory``):
  the workers of ``-n`` share it.
- ``--peer-device native``: no mapping, the tests choose their devices (PyTorch's instantiate a class for each
  device type present; a function mode would also turn off its modules' fast paths, which check for one).
- ``--peer-device cpu``: the peer's tests hard-code ``device="cuda"``; on a machine without a GPU, every
  ``device`` argument naming CUDA and every ``.cuda()``/``.to("cuda")`` gives a CPU tensor while a case runs (a
  torch function mode), and ``torch.cuda.get_device_capability``/``get_device_properties`` describe an sm_90
  (the target lazytriton's CPU path compiles for), so the module-level checks of the peers' files pass. lazytriton
  then runs the kernels through Triton's interpreter: a smoke run, at small seqlens only.
- ``--peer-collect PATH``: writes every collected case (after ``-k``/``-m``, before the sample) as JSON lines,
  ``{"nodeid", "function", "params"}``, the parameters as ``peer_census.plain`` writes them (what
  ``benchmarks/peer_suites.py census`` classifies; with ``--collect-only`` nothing runs).
- ``--peer-summary PATH``: writes the results (``peer_summary``) as JSON at PATH and as text beside it (``.md``);
  ``--peer-meta KEY=VALUE`` adds fields to it (suite, file, peer commit).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from peer_census import plain
from peer_select import Case, parse_shard, select
from peer_summary import Results, function_of, markdown
from torch.overrides import TorchFunctionMode

SM90_PROPERTIES = types.SimpleNamespace(name="CPU (Triton's interpreter, as sm_90)", major=9, minor=0,
                                        total_memory=80 * 2**30, multi_processor_count=132)


OVER_BUDGET = "not run: the run's --budget was spent"


class PeerTimeout(Exception):
    """A case's phase ran past --peer-timeout."""


def _is_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))


class CudaToCpu(TorchFunctionMode):
    """Every device argument naming CUDA names the CPU, and ``Tensor.cuda()`` returns the CPU tensor."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


# A sequence length in the name of a test torch's ``parametrize`` instantiated: ``..._seq_len_q_514_...``,
# ``..._q_seq_len_11_...``, ``..._kv_seq_len_1030_...``, ``..._seq_len_8_...``.
NAME_SEQLEN = re.compile(r"(?:^|_)((?:q_|kv_|k_)?seq_len(?:_q|_k)?)_(\d+)(?=_|$)")


def case_of(item: pytest.Item) -> Case:
    """The case of a collected item: its function and parameters.

    A pytest-parametrised test (FlashAttention's) groups by its function name, its parameters the callspec's. A
    test torch's ``parametrize``/``instantiate_device_type_tests`` made (PyTorch's suites: one unittest method a
    case, ``TestSDPACPU::test_x_seq_len_q_4_..._cpu_float16``) groups by its class and the generic method's name
    (``__wrapped__``); its parameters are the sequence lengths its name spells (``seqlen_*``: what
    ``--peer-max-seqlen`` bounds).
    """
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        return Case(item.nodeid.split("::", 1)[-1].split("[")[0], item.nodeid, callspec.params)
    wrapped = getattr(getattr(item, "obj", None), "__wrapped__", None)
    name = item.nodeid.split("::")[-1]
    if wrapped is None or not isinstance(getattr(wrapped, "__name__", None), str):
        return Case(item.nodeid.split("::", 1)[-1].split("[")[0], item.nodeid, {})
    parent = item.nodeid.split("::")[-2] if item.nodeid.count("::") >= 2 else ""
    params = {f"seqlen_{key}": int(value) for key, value in NAME_SEQLEN.findall(name[len(wrapped.__name__):])}
    return Case(f"{parent}::{wrapped.__name__}" if parent else wrapped.__name__, item.nodeid, params)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("peer", "a peer's test suite against lazytriton")
    group.addoption("--peer-sample", type=float, default=1.0, help="fraction of each test function's cases kept")
    group.addoption("--peer-every", type=int, default=0, help="keep each function's every Nth case instead")
    group.addoption("--peer-seed", type=int, default=0, help="seed of the sample")
    group.addoption("--peer-min-per-function", type=int, default=1, help="cases kept per function at least")
    group.addoption("--peer-max-seqlen", type=int, default=0, help="drop cases with a seqlen* parameter over this")
    group.addoption("--peer-shard", default="0/1", help="K/N: run shard K of N of the kept cases (N runs cover all)")
    group.addoption("--peer-timeout", type=float, default=0.0, help="seconds per phase of a case (0: none)")
    group.addoption("--peer-deadline", type=float, default=0.0,
                    help="skip the cases whose setup starts after this time.time() (0: none)")
    group.addoption("--peer-device", choices=("cuda", "cpu", "native"), default="cuda",
                    help="cpu: map device cuda to CPU; native: the tests pick their devices (PyTorch's)")
    group.addoption("--peer-collect", default=None, help="write every collected case as JSON lines here")
    group.addoption("--peer-summary", default=None, help="write the results as JSON here (and .md beside)")
    group.addoption("--peer-meta", action="append", default=[], help="KEY=VALUE added to the summary")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(PeerRun(config), "peer_run")


class PeerRun:
    """One run's selection, timeouts, device mapping and results (registered by ``pytest_configure``)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results = Results()
        self.saved: dict[str, Any] = {}
        self.cpu = config.getoption("--peer-device") == "cpu"
        self.timeout = config.getoption("--peer-timeout")
        self.deadline = config.getoption("--peer-deadline")
        self.counts = {"collected": 0, "selected": 0, "over_budget": 0}
        if self.cpu:
            self.saved = {"get_device_capability": torch.cuda.get_device_capability,
                          "get_device_properties": torch.cuda.get_device_properties}
            torch.cuda.get_device_capability = lambda device=None: (9, 0)
            torch.cuda.get_device_properties = lambda device=None: SM90_PROPERTIES

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        for name, saved in self.saved.items():
            setattr(torch.cuda, name, saved)

    @pytest.hookimpl(trylast=True)  # after -k and -m: the sample is of the cases they leave
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        cases = [case_of(item) for item in items]
        collect = config.getoption("--peer-collect")
        if collect:
            with open(collect, "w") as f:
                for case in cases:
                    f.write(json.dumps({"nodeid": case.nodeid, "function": case.function,
                                        "params": plain(case.params)}) + "\n")
        shard, shards = parse_shard(config.getoption("--peer-shard"))
        kept = set(select(cases, fraction=config.getoption("--peer-sample"), every=config.getoption("--peer-every"),
                          seed=config.getoption("--peer-seed"),
                          min_per_function=config.getoption("--peer-min-per-function"),
                          max_seqlen=config.getoption("--peer-max-seqlen"), shard=shard, shards=shards))
        for item, case in zip(items, cases, strict=True):
            if case.function != function_of(item.nodeid):
                item.user_properties.append(("peer_function", case.function))
        dropped = [item for item in items if item.nodeid not in kept]
        self.counts = {"collected": len(items), "selected": len(items) - len(dropped), "over_budget": 0}
        if dropped:
            items[:] = [item for item in items if item.nodeid in kept]
            config.hook.pytest_deselected(items=dropped)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """SIGALRM after --peer-timeout seconds, raising PeerTimeout where the phase is (main thread only)."""
        if self.timeout <= 0 or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, self.timeout)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Iterator[None]:
        if self.deadline and time.time() > self.deadline:
            pytest.skip(OVER_BUDGET)  # before the fixtures: the case costs nothing
        with self.timed():
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        with self.timed(), (CudaToCpu() if self.cpu else contextlib.nullcontext()):
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Iterator[None]:
        with self.timed():
            yield
        if not self.cpu:
            release_cached_memory()

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """xdist's controller: the collection counts from a worker (each collects and selects the same cases)."""
        counts = getattr(node, "workeroutput", {}).get("peer_counts")
        if counts:
            self.counts.update(counts)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.results.add(report)
        if report.skipped and OVER_BUDGET in str(report.longrepr):
            self.counts["over_budget"] = self.counts.get("over_budget", 0) + 1

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.results.add(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workerinput"):  # an xdist worker: the controller writes the summary
            self.config.workeroutput["peer_counts"] = {k: self.counts[k] for k in ("collected", "selected")}
            return
        path = self.config.getoption("--peer-summary")
        if path:
            summary = self.summary()
            Path(path).write_text(json.dumps(summary, indent=1) + "\n")
            Path(path).with_suffix(".md").write_text(markdown(summary))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.write_sep("=", "peer suite summary")
        terminalreporter.write(markdown(self.summary()))

    def summary(self) -> dict[str, Any]:
        config = self.config
        meta: dict[str, Any] = dict(entry.split("=", 1) for entry in config.getoption("--peer-meta") if "=" in entry)
        meta["device"] = config.getoption("--peer-device")
        meta["selection"] = {name: config.getoption(f"--peer-{name}") for name in
                             ("sample", "every", "seed", "min-per-function", "max-seqlen", "timeout")}
        meta["selection"].update(self.counts)
        meta["selection"]["deadline"] = self.deadline
        return self.results.summary(**meta)


def release_cached_memory() -> None:
    """Give the GPU memory torch's allocator caches back after a case (when CUDA is in use in this process).

    Workers of one run share a card (``-n``): memory one worker's large case left cached would otherwise be out of
    the others' reach, and their cases fail with out-of-memory errors that no lone run has.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _alarm(signum: int, frame: Any) -> None:
    raise PeerTimeout("the case ran past --peer-timeout")
