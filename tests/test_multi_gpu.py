"""Every GPU of the host: a call on cuda:1 loads its kernel on device 1, launches on device 1's current stream, and the
runtime keeps one handle per device; CUDA graphs captured on device 1; two threads driving two devices at once.

Run on the two-GPU machine (the device tool's nvidia-h200-x2):
``python3 -m pytest tests/test_multi_gpu.py -m gpu -q``. The tests that need two
devices skip with a reason on a host with one; the rest run there on cuda:0
(a call on a non-default stream, a graph on the one device, two threads on
one device); without a GPU everything skips. tests/test_devices.py checks the
same on CPU, on a fake driver of two devices.

How "on device 1's current stream" is checked: the call runs under
``torch.cuda.stream(s)`` (s a new stream of the call's device) with another
device made current; s first sleeps on the GPU (``torch.cuda._sleep``), then
copies the real inputs into the tensors the call is given. A launch on s
reads the copied inputs; a launch on any other stream would run before the
copies land and read zeros. The result must equal, bit for bit, the same call
on cuda:0's default stream (the same kernel on the same GPU model).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_python

import lazytriton
from lazytriton import config, runtime
from lazytriton.kernels.flash_decode.reference import kvcache_reference
from lazytriton.kernels.flash_fwd.reference import attention_reference


def _device_count() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a CUDA build on a machine without a usable driver
        return 0


N_GPUS = _device_count()
one_gpu = pytest.mark.skipif(N_GPUS < 1, reason="needs a CUDA GPU; run on the GPU host (see README, 'GPU tests')")
two_gpus = pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2 CUDA devices (the device tool's nvidia-h200-x2 machine "
                                                 f"kind); this host has {N_GPUS}")
pytestmark = pytest.mark.gpu

# (the call's device, the current device while it is made)
PAIRS = [pytest.param(0, 0, marks=one_gpu, id="cuda0-current0"),
         pytest.param(1, 0, marks=two_gpus, id="cuda1-current0"),
         pytest.param(0, 1, marks=two_gpus, id="cuda0-current1")]
SLEEP_CYCLES = 200_000_000  # ~0.1 s at an H200's 1.98 GHz: a launch on another stream runs long before it ends
CALLS_PER_THREAD = 300


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("multi-gpu-cache")


@pytest.fixture(autouse=True)
def cache_dir(module_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """One cache dir for the module (each kernel compiles once), and a fresh runtime for each test (cold loads)."""
    monkeypatch.setenv("LAZYTRITON_CACHE_DIR", str(module_cache))
    monkeypatch.delenv("LAZYTRITON_JIT", raising=False)
    for name in ("LAZYTRITON_SHARED", "LAZYTRITON_SIGNING_KEY", "LAZYTRITON_SHARED_TIMEOUT_MS",
                 "LAZYTRITON_CACHE_MAX_BYTES"):
        monkeypatch.delenv(name, raising=False)
    config.reset()
    yield module_cache
    config.reset()


# ---------------------------------------------------------------------------
# The entry points, each as a case: its inputs (made on the CPU from a seed, then moved) and its call


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


class Case:
    """An entry point's call: ``inputs`` (tensors, then other arguments), ``run`` (its outputs, a tuple)."""

    name = ""
    graphs = True  # captured in a CUDA graph by test_a_cuda_graph_captured_on_a_device_replays_there

    def make(self, gen: torch.Generator) -> dict[str, Any]:
        raise NotImplementedError

    def inputs(self, device: torch.device, seed: int = 0) -> dict[str, Any]:
        made = self.make(torch.Generator().manual_seed(seed))
        return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in made.items()}

    def run(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def reference(self, a: dict[str, Any]) -> torch.Tensor | None:
        """The first output in float32 from the CPU inputs (a plain PyTorch twin), or None."""
        return None

    def __str__(self) -> str:
        return self.name


class AttnFwd(Case):
    name = "attn_fwd"

    def make(self, gen: torch.Generator) -> dict[str, Any]:
        return {"q": _randn(gen, 2, 4, 300, 64), "k": _randn(gen, 2, 2, 257, 64), "v": _randn(gen, 2, 2, 257, 64)}

    def run(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        return tuple(lazytriton.flash.attn_fwd(a["q"], a["k"], a["v"], causal="bottom_right"))

    def reference(self, a: dict[str, Any]) -> torch.Tensor | None:
        return attention_reference(a["q"].float(), a["k"].float(), a["v"].float(), causal="bottom_right")[0]


class FlashAttnFunc(Case):
    """flash_attn_func and its backward (deterministic: the gradients are bitwise reproducible)."""

    name = "flash_attn_func+backward"
    graphs = False

    def make(self, gen: torch.Generator) -> dict[str, Any]:
        return {"q": _randn(gen, 2, 300, 4, 64), "k": _randn(gen, 2, 257, 2, 64), "v": _randn(gen, 2, 257, 2, 64),
                "do": _randn(gen, 2, 300, 4, 64)}

    def run(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        leaves = [a[n].detach().requires_grad_() for n in ("q", "k", "v")]
        out = lazytriton.flash_attn_func(*leaves, causal=True, deterministic=True)
        out.backward(a["do"])
        return (out.detach(), *(t.grad for t in leaves))

    def reference(self, a: dict[str, Any]) -> torch.Tensor | None:
        q, k, v = (a[n].float().transpose(1, 2) for n in ("q", "k", "v"))
        return attention_reference(q, k, v, causal="bottom_right")[0].transpose(1, 2)


class FlashAttnFuncOut(FlashAttnFunc):
    """flash_attn_func's forward alone (the warm path that drops lse), for graphs and threads."""

    name = "flash_attn_func"
    graphs = True

    def run(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        return (lazytriton.flash_attn_func(a["q"], a["k"], a["v"], causal=True),)


class Varlen(Case):
    name = "flash_attn_varlen_func"
    LENS_Q, LENS_K = (100, 200, 1), (57, 200, 43)

    def make(self, gen: torch.Generator) -> dict[str, Any]:
        cu_q = torch.tensor([0, 100, 300, 301], dtype=torch.int32)
        cu_k = torch.tensor([0, 57, 257, 300], dtype=torch.int32)
        return {"q": _randn(gen, 301, 4, 64), "k": _randn(gen, 300, 2, 64), "v": _randn(gen, 300, 2, 64),
                "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}

    def run(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        return (lazytriton.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                                  200, 200, causal=True),)

    def reference(self, a: dict[str, Any]) -> torch.Tensor | None:
        rows = []
        cu_q, cu_k = a["cu_seqlens_q"].tolist(), a["cu_seqlens_k"].tolist()
        for i in range(len(cu_q) - 1):
            q, k, v = (a[n][lo:hi].float().transpose(0, 1)[None]
                       for n, lo, hi in (("q", cu_q[i], cu_q[i + 1]), ("k", cu_k[i], cu_k[i + 1]),
                                         ("v", cu_k[i], cu_k[i + 1])))
            rows.append(attention_reference(q, k, v, causal="bottom_right")[0][0].transpose(0, 1))
        return torch.cat(rows)


class KvCache(Case):
    """A decode step: the new keys appended in place (the caches are outputs too), then attention over the cache."""

    name = "flash_attn_with_kvcache"

    def make(self, gen: torch.Generator) -> dict[str, Any]:
        return {"q": _randn(gen, 2, 1, 8, 128), "k_cache": _randn(gen, 2, 1024, 2, 128),
                "v_cache": _randn(gen, 2, 1024, 2, 128), "k": _randn(gen, 2, 1, 2, 128), "v": _randn(gen, 2, 1, 2, 128),
                "cache_seqlens": torch.tensor([500, 1000], dtype=torch.int32)}

    def run(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        out = lazytriton.flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"],
                                                 cache_seqlens=a["cache_seqlens"], causal=True)
        return out, a["k_cache"], a["v_cache"]

    def reference(self, a: dict[str, Any]) -> torch.Tensor | None:
        return kvcache_reference(**{n: t.float() if t.is_floating_point() else t for n, t in a.items()},
                                 causal=True)[0]


class Sdpa(Case):
    name = "scaled_dot_product_attention"

    def make(self, gen: torch.Generator) -> dict[str, Any]:
        return {"q": _randn(gen, 2, 4, 300, 64), "k": _randn(gen, 2, 4, 257, 64), "v": _randn(gen, 2, 4, 257, 64)}

    def run(self, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        return (lazytriton.scaled_dot_product_attention(a["q"], a["k"], a["v"], is_causal=True),)

    def reference(self, a: dict[str, Any]) -> torch.Tensor | None:
        return attention_reference(a["q"].float(), a["k"].float(), a["v"].float(), causal="top_left")[0]


CASES = [AttnFwd(), FlashAttnFunc(), Varlen(), KvCache(), Sdpa()]
GRAPH_CASES = [AttnFwd(), FlashAttnFuncOut(), Varlen(), KvCache(), Sdpa()]


def _cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


def _on_a_busy_stream(case: Case, device: int, current: int, calls: int = 2) -> list[tuple[torch.Tensor, ...]]:
    """``calls`` results of the case on ``device``, each made with ``current`` the current device and
    ``device``'s current stream a new stream that sleeps, then receives the inputs (see the module's docstring)."""
    source = case.inputs(_cuda(device))
    results = []
    for _ in range(calls):  # the first call is cold in a fresh runtime (plan, load), the next warm
        given = {n: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t for n, t in source.items()}
        torch.cuda.synchronize(device)
        stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SLEEP_CYCLES)
            for name, t in given.items():
                if isinstance(t, torch.Tensor):
                    t.copy_(source[name])
            with torch.cuda.device(current):
                assert torch.cuda.current_device() == current
                outputs = case.run(given)
        stream.synchronize()
        results.append(tuple(t.detach().clone() for t in outputs))
    return results


def _on_the_default_stream(case: Case, device: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The case on ``device`` as a one-device program makes it: current device ``device``, its default stream."""
    a = case.inputs(_cuda(device), seed)
    with torch.cuda.device(device):
        outputs = case.run(a)
    torch.cuda.synchronize(device)
    return tuple(t.detach().clone() for t in outputs)


def _assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: output {i}"
        if not torch.equal(g.cpu(), w.cpu()):
            worst = (g.cpu().float() - w.cpu().float()).abs().max().item()
            raise AssertionError(f"{what}: output {i} differs (max |diff| {worst:.3g})")


# ---------------------------------------------------------------------------
# Each entry point on a device other than the current one, on that device's current stream


@pytest.mark.parametrize(("device", "current"), PAIRS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_entry_point_runs_on_its_devices_current_stream(case: Case, device: int, current: int) -> None:
    results = _on_a_busy_stream(case, device, current)
    want = _on_the_default_stream(case, 0)
    for i, got in enumerate(results):
        assert all(t.device == _cuda(device) for t in got)
        _assert_same(got, want, f"{case} on cuda:{device} (current cuda:{current}), call {i} (0: cold, 1: warm)")
    expected = case.reference(case.inputs(torch.device("cpu")))
    if expected is not None:
        torch.testing.assert_close(results[-1][0].cpu().float(), expected, atol=2e-2, rtol=2e-2)


@two_gpus
def test_the_runtime_keeps_one_handle_per_device() -> None:
    for device, current in ((0, 1), (1, 0)):
        for case in (AttnFwd(), FlashAttnFunc(), KvCache()):
            _on_a_busy_stream(case, device, current, calls=1)
    rt = runtime.get()
    devices_of: dict[str, list[int]] = {}
    for kernel in rt.loaded_kernels():
        devices_of.setdefault(kernel.entry.key, []).append(kernel.device_index)
    assert devices_of and all(sorted(found) == [0, 1] for found in devices_of.values()), devices_of
    handles = [int(kernel._api.ffi.cast("uintptr_t", kernel.function)) for kernel in rt.loaded_kernels()]
    assert len(set(handles)) == len(handles), "each device's load has its own function handle"
    memo_devices = {key[0] for key in rt.plans if isinstance(key, tuple) and key and type(key[0]) is int}
    assert memo_devices == {0, 1}, "the forward's memo keys name the device"


# ---------------------------------------------------------------------------
# CUDA graphs


@pytest.mark.parametrize("device", [pytest.param(0, marks=one_gpu, id="cuda0"),
                                    pytest.param(1, marks=two_gpus, id="cuda1")])
@pytest.mark.parametrize("case", GRAPH_CASES, ids=str)
def test_a_cuda_graph_captured_on_a_device_replays_there(case: Case, device: int) -> None:
    static = case.inputs(_cuda(device))
    with torch.cuda.device(device):
        case.run(static)  # loads the kernels on this device
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            case.run(static)  # warm on the capture stream
            # The capture stream named: torch's default one is made once a process, on the device current then.
            with torch.cuda.graph(graph, stream=stream):
                captured = case.run(static)
        torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        fresh = case.inputs(_cuda(device), seed)
        with torch.cuda.device(device):  # a graph replays on the current device's current stream
            for name, t in static.items():
                if isinstance(t, torch.Tensor):
                    t.copy_(fresh[name])
            graph.replay()
            torch.cuda.synchronize()
            replayed = tuple(t.clone() for t in captured)
        _assert_same(replayed, _on_the_default_stream(case, device, seed), f"{case}'s graph on cuda:{device}, "
                                                                             f"seed {seed}")


@two_gpus
def test_a_capture_on_device_1_needs_device_1s_kernels_loaded() -> None:
    q, k, v = (t.to(_cuda(1)) for t in AttnFwd().make(torch.Generator().manual_seed(5)).values())
    q0, k0, v0 = (t.to(_cuda(0)) for t in (q, k, v))
    lazytriton.flash.attn_fwd(q0, k0, v0, causal=True)  # device 0's kernel only
    with torch.cuda.device(1):
        stream = torch.cuda.Stream()  # a capture stream of cuda:1 (torch's default one may be another device's)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(lazytriton.CaptureError, match="not loaded on cuda:1"):
            with torch.cuda.graph(graph, stream=stream):
                lazytriton.flash.attn_fwd(q, k, v, causal=True)
        torch.cuda.synchronize()
        lazytriton.preload(q, k, causal=True)  # the tensors' device: cuda:1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out, _ = lazytriton.flash.attn_fwd(q, k, v, causal=True)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, lazytriton.flash.attn_fwd(q, k, v, causal=True)[0])


# A capture on cuda:1 whose call is made with cuda:0 current (a device switched inside the capture): the checks that
# depend on the capture (read index values to the host, load a kernel) must ask cuda:1. In a child process: a capture
# broken by a host read leaves the allocator's capture state behind.
SWITCHED_CAPTURE = """
import os
import sys
import torch
import lazytriton

what = os.environ["WHAT"]
gen = torch.Generator().manual_seed(0)
dev = torch.device("cuda", 1)
if what == "varlen":
    q, k, v = (torch.randn(shape, generator=gen).bfloat16().to(dev) for shape in ((301, 4, 64), (300, 2, 64),
                                                                                   (300, 2, 64)))
    cu_q = torch.tensor([0, 100, 300, 301], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 57, 257, 300], dtype=torch.int32, device=dev)
    call = lambda: lazytriton.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 200, causal=True)
    call()  # loaded on cuda:1
else:
    q, k, v = (torch.randn(1, 2, 700, 32, generator=gen).half().to(dev) for _ in range(3))
    call = lambda: lazytriton.scaled_dot_product_attention(q, k, v)
    q0, k0, v0 = (t.to("cuda:0") for t in (q, k, v))
    lazytriton.scaled_dot_product_attention(q0, k0, v0)  # loaded on cuda:0 only
with torch.cuda.device(1):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            with torch.cuda.device(0):
                out = call()
    except lazytriton.CaptureError as exc:
        print("CaptureError:", exc)
        sys.exit(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
print("replayed", "equal" if torch.equal(out, call()) else "DIFFERENT")
"""


@two_gpus
def test_a_varlen_call_captured_on_device_1_with_device_0_current_reads_no_values() -> None:
    done = run_python(SWITCHED_CAPTURE, {"WHAT": "varlen"})
    assert done.returncode == 0 and "replayed equal" in done.stdout, done.stdout + done.stderr


@two_gpus
def test_a_load_inside_device_1s_capture_with_device_0_current_is_refused() -> None:
    done = run_python(SWITCHED_CAPTURE, {"WHAT": "load"})
    assert done.returncode == 0 and "CaptureError:" in done.stdout and "not loaded on cuda:1" in done.stdout, (
        done.stdout + done.stderr)


# ---------------------------------------------------------------------------
# Two threads, each driving its own device (or, with one GPU, its own stream of the one device)


THREAD_CASES: list[Case] = [AttnFwd(), FlashAttnFuncOut(), Sdpa()]


@pytest.mark.parametrize("devices", [pytest.param((0, 0), marks=one_gpu, id="one-device-two-streams"),
                                     pytest.param((0, 1), marks=two_gpus, id="two-devices")])
def test_two_threads_drive_their_devices_at_once(devices: tuple[int, int]) -> None:
    """Each thread: the other thread's device current, its own device's stream a new one; hundreds of calls from a
    cold runtime (both threads load at once), each kept and checked against the same call made alone afterwards."""
    start = threading.Barrier(2)
    kept: dict[int, list[tuple[int, int, tuple[torch.Tensor, ...]]]] = {0: [], 1: []}
    errors: dict[int, BaseException] = {}
    inputs = {(slot, seed): [case.inputs(_cuda(devices[slot]), seed) for case in THREAD_CASES]
              for slot in (0, 1) for seed in (0, 1)}
    torch.cuda.synchronize(devices[0])
    torch.cuda.synchronize(devices[1])

    def drive(slot: int) -> None:
        device, other = devices[slot], devices[1 - slot]
        try:
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), torch.cuda.device(other):
                start.wait()
                for i in range(CALLS_PER_THREAD):
                    seed = i % 2
                    which = i % len(THREAD_CASES)
                    outputs = THREAD_CASES[which].run(inputs[(slot, seed)][which])
                    kept[slot].append((which, seed, tuple(t.detach() for t in outputs)))
            stream.synchronize()
        except BaseException as exc:  # reported by the main thread
            errors[slot] = exc
            start.abort()

    threads = [threading.Thread(target=drive, args=(slot,)) for slot in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for slot in (0, 1):
        device = devices[slot]
        want = {(which, seed): _on_the_default_stream(case, device, seed)
                for which, case in enumerate(THREAD_CASES) for seed in (0, 1)}
        assert len(kept[slot]) == CALLS_PER_THREAD
        for i, (which, seed, got) in enumerate(kept[slot]):
            _assert_same(got, want[(which, seed)], f"thread {slot} on cuda:{device}, call {i} ({THREAD_CASES[which]})")
    devices_of: dict[str, set[int]] = {}
    for kernel in runtime.get().loaded_kernels():
        devices_of.setdefault(kernel.entry.key, set()).add(kernel.device_index)
    assert devices_of and all(found == set(devices) for found in devices_of.values()), devices_of


# ---------------------------------------------------------------------------
# The C API: a tensor's device_index picks the device; the caller's stream orders the launch


CAPI_ON_A_DEVICE = """
import ctypes, json, os
dll = ctypes.CDLL(os.environ["LT_LIBRARY"])  # lt_init before the host imports torch (see tests/test_capi.py)
dll.lt_last_error.restype = ctypes.c_char_p
assert dll.lt_init(None) == 0, dll.lt_last_error()
import torch
from cffi import FFI
from lazytriton.capi import build
import lazytriton

ffi = FFI()
ffi.cdef(build.header_cdef(open(os.environ["LT_HEADER"]).read()))
device, current, sleep = (int(os.environ[name]) for name in ("LT_DEVICE", "LT_CURRENT", "LT_SLEEP"))

def c_arg(a):
    if isinstance(a, ffi.CData):
        return ctypes.c_void_p(int(ffi.cast("uintptr_t", a)))
    return a

def call(name, *args):
    return getattr(dll, name)(*(c_arg(a) for a in args))

def describe(view, t):
    view.data = ffi.cast("void *", t.data_ptr())
    view.dtype, view.ndim, view.device_type, view.device_index = {torch.bfloat16: 2, torch.float32: 3}[t.dtype], \\
        t.dim(), 2, t.get_device()
    for i in range(t.dim()):
        view.sizes[i], view.strides[i] = t.shape[i], t.stride(i)

gen = torch.Generator().manual_seed(0)
dev = torch.device("cuda", device)
source = [torch.randn(shape, generator=gen).bfloat16().to(dev) for shape in ((2, 4, 300, 64), (2, 2, 257, 64),
                                                                            (2, 2, 257, 64))]
report = {}
for way in ("lt_attn_fwd", "lt_plan_launch"):
    q, k, v = (torch.zeros_like(t) for t in source)
    out, lse = torch.full_like(q, 7.0), torch.full((2, 4, 300), 7.0, device=dev)
    p = ffi.new("lt_attn_fwd_params *")
    call("lt_attn_fwd_params_init", p)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        describe(getattr(p, name), t)
    p.causal = 2
    plan = ffi.new("lt_plan **")
    if way == "lt_plan_launch":
        report["plan"] = call("lt_attn_fwd_plan", p, plan), dll.lt_last_error().decode()
    torch.cuda.synchronize(dev)
    stream = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(sleep)
        for t, s in zip((q, k, v), source):
            t.copy_(s)
        with torch.cuda.device(current):
            handle = ctypes.c_void_p(stream.cuda_stream)
            if way == "lt_attn_fwd":
                report[way] = call("lt_attn_fwd", p, handle), dll.lt_last_error().decode()
            else:
                report[way] = call("lt_plan_launch", plan[0], p, handle), dll.lt_last_error().decode()
    stream.synchronize()
    want_out, want_lse = lazytriton.flash.attn_fwd(*source, causal="bottom_right")
    report[way + " close"] = bool(torch.allclose(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
                                  and torch.allclose(lse, want_lse, atol=1e-3, rtol=1e-3))
    report[way + " out"] = out.float().sum().item()
print(json.dumps(report))
"""


@pytest.mark.parametrize(("device", "current"), PAIRS)
def test_the_c_api_launches_on_the_tensors_device_and_the_callers_stream(prefix: Path, device: int,
                                                                         current: int) -> None:
    done = run_python(CAPI_ON_A_DEVICE, {"LT_LIBRARY": str(prefix / "lib/liblazytriton.so"),
                                         "LT_HEADER": str(prefix / "include/lazytriton.h"), "LT_DEVICE": str(device),
                                         "LT_CURRENT": str(current), "LT_SLEEP": str(SLEEP_CYCLES)})
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["lt_attn_fwd"][0] == 0 and report["plan"][0] == 0 and report["lt_plan_launch"][0] == 0, report
    assert report["lt_attn_fwd close"] and report["lt_plan_launch close"], report
    assert report["lt_attn_fwd out"] == report["lt_plan_launch out"], "one kernel, one result"
