"""The cold-start benchmarks on CPU: Triton's JIT baseline built from the binding, the children's code, and
what a fresh process served from an image imports.

``bench_prewarm.py --cold-start`` needs a CUDA GPU; what it launches through
Triton's own JIT (``cold_start.triton_jit_call``) is checked here: its
argument list binds every parameter of the served kernel's JIT function (a
parameter the kernel gains and the binding does not pack fails here, not on
the GPU host), and the same call runs under Triton's interpreter and matches
SDPA.

The first result of a fresh process served from an image (the cold start's
path, on the fake libcuda: ``cold_start.route_to_fake_driver``) imports none
of ``NEVER_ON_THE_WARM_PATH``: checked on ``sys.modules``, never on time.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from conftest import REPO, run_python

from lazytriton.kernels import get
from lazytriton.target import Target

BENCHMARKS = REPO / "benchmarks"


@pytest.fixture
def cold_start(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    import importlib

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield importlib.import_module("cold_start")


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    import importlib

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield importlib.import_module("bench_prewarm")


def test_triton_jit_baseline_binds_every_parameter_of_the_served_kernel(cold_start: ModuleType) -> None:
    shape, causal = cold_start.CALL
    q, k, v = (torch.empty(shape, dtype=torch.bfloat16, device="meta") for _ in range(3))
    fn, grid, args, constexprs, options, out, lse = cold_start.triton_jit_call(q, k, v, causal, Target.parse("sm_90"))
    spec = get("flash_fwd_gluon")
    assert fn.fn.__name__ == spec.function  # what dispatch serves this call on sm_90: the baseline runs the same
    signature = inspect.signature(fn.fn)
    assert list(signature.parameters) == [name for name, _ in spec.params] + list(spec.constexprs)
    bound = signature.bind(*args, **constexprs)  # TypeError if a parameter is missing or unknown
    assert list(bound.arguments) == list(signature.parameters), "every parameter given, none left to its default"
    assert set(options) == {"num_warps", "num_stages"} and grid[1:] == (shape[1], shape[0])
    assert out.shape == shape and lse.shape == shape[:3]


SCRIPT = """
import sys, torch
sys.path.insert(0, {benchmarks!r})
import cold_start
from lazytriton.target import Target
torch.manual_seed(0)
q, k, v = (torch.randn((1, 2, 64, 64), dtype=torch.float16) for _ in range(3))
fn, grid, args, constexprs, options, out, lse = cold_start.triton_jit_call(q, k, v, True, Target.parse("sm_90"))
fn[grid](*args, **constexprs, **options)
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
err = float((out.float() - ref).abs().max())
assert type(fn).__name__ == "InterpretedFunction" and err < 1e-2, (type(fn), err)
print("ok", err)
"""


def test_triton_jit_baseline_runs_under_the_interpreter_and_matches_sdpa() -> None:
    # The bench's launch, fn[grid](*args, **constexprs, **options), in a process started with TRITON_INTERPRET=1
    # (fp16: the plain interpreter multiplies bf16 as integers); the variant dispatch picks for sm_90.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(benchmarks=str(BENCHMARKS))], env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


def test_the_working_set_step_through_torch_s_sdpa_is_the_same_step(cold_start: ModuleType) -> None:
    """The peer's step (``sdpa=True``) computes what lazytriton's does: the same gradients of q, k and v, on CPU
    with small shapes of the working set's kinds (self-attention, causal, cross-attention)."""
    def inputs() -> list[tuple[Any, ...]]:
        gen = torch.Generator().manual_seed(0)

        def randn(*shape: int, grad: bool = True) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).requires_grad_(grad)

        return [(randn(1, 2, sq, 16), randn(1, 2, sk, 16), randn(1, 2, sk, 16), causal, randn(1, 2, sq, 16, grad=False))
                for sq, sk, causal in ((24, 24, False), (16, 16, True), (16, 24, False))]

    ours, theirs = cold_start.working_set_step(inputs()), cold_start.working_set_step(inputs(), sdpa=True)
    assert len(ours) == len(theirs) == 9
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-4)


def test_every_child_is_valid_python_that_times_after_its_inputs(bench: ModuleType) -> None:
    for scenario, provider in bench.PROVIDERS:
        code = bench.child_code(scenario, provider)
        compile(code, f"<{scenario} {provider}>", "exec")
        assert code.index("inputs_ready = time.monotonic()") < code.index("json.dumps")
        assert "import lazytriton" not in code.split("inputs_ready =")[0]  # nothing of ours before the mark


def test_the_report_holds_both_scenarios_and_refuses_a_compile_from_an_image(bench: ModuleType,
                                                                            tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            capsys: pytest.CaptureFixture[str],
                                                                            ) -> None:
    calls: list[dict[str, str]] = []

    def child(code: str, env: dict[str, str]) -> tuple[float, dict[str, Any]]:
        calls.append(env)
        report: dict[str, Any] = {"ready": 10.008, "inputs": 10.0, "finite": True}
        if "from lazytriton.flash import attn_fwd" in code:
            report |= {"served": {"image": 8}, "compiles": 0, "loaded": 8,
                       "phases": {"import": 0.004, "call": 0.003, "gpu": 0.001}}
        return 0.5, report

    monkeypatch.setattr(bench, "time_child", child)
    monkeypatch.setattr(bench, "compile_bytecode", lambda: None)
    plain = tmp_path / "plain.ltimg"
    monkeypatch.setattr(bench, "plain_copy", lambda image, work: plain)
    monkeypatch.setattr("lazytriton.machine.target_of_device", lambda device: Target.parse("sm_90"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a fake GPU")
    image = tmp_path / "given.ltimg"
    image.write_bytes(b"")
    args = bench.argparse.Namespace(image=image, keep_image=None, reps=2, jit_reps=1)
    rows: list[dict[str, Any]] = []
    bench.measure_cold_start(args, tmp_path, rows)
    printed = capsys.readouterr().out
    assert "one_kernel" in printed and "working_set" in printed and printed.count("target: at most") == 4
    assert printed.count("torch's own SDPA, the same calls: 8.0 ms; lazytriton / SDPA 1.00x") == 2
    after = {(row["kernel"], row["provider"]): row["value"] for row in rows if row["metric"] == "after_torch_cuda_init"}
    assert set(after) == set(bench.PROVIDERS) and after[("working_set", "lazytriton_image")] == 8.0
    served = [env for env in calls if env.get("LAZYTRITON_IMAGES") in (str(image), str(plain))]
    assert served and all(env["LAZYTRITON_JIT"] == "0" for env in served)
    assert sum(env["LAZYTRITON_IMAGES"] == str(plain) for env in served) == 2 * 2  # reps x scenarios

    def compiled(code: str, env: dict[str, str]) -> tuple[float, dict[str, Any]]:
        seconds, report = child(code, env)
        if "served" in report:
            report["compiles"] = 1
        return seconds, report

    monkeypatch.setattr(bench, "time_child", compiled)
    with pytest.raises(SystemExit, match="not everything was served from the image"):
        bench.measure_cold_start(args, tmp_path, [])


def test_the_image_is_built_from_the_scenarios_own_misses(bench: ModuleType, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Each recording child (JIT on, an empty cache dir) leaves its miss log; prewarm --from-misses packs exactly
    # the variants logged. Here the children are stand-ins that log one small variant each.
    from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch

    logged = [fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 16, causal, True, 16)
              for causal in (False, True)]
    children: list[dict[str, str]] = []

    def child(code: str, env: dict[str, str]) -> tuple[float, dict[str, Any]]:
        assert env["LAZYTRITON_JIT"] == "1" and env["LAZYTRITON_IMAGES"] == ""
        variant = logged[len(children)]
        children.append(env)
        (Path(env["LAZYTRITON_CACHE_DIR"]) / "misses.jsonl").write_text(f'{{"variant": "{variant}"}}\n')
        return 1.0, {"compiles": 1}

    monkeypatch.setattr(bench, "time_child", child)
    image = bench.cold_start_image(tmp_path)
    from lazytriton.cache_format.image import Image

    with Image(image) as built:
        assert sorted(built.keys()) == sorted(v.key() for v in logged)
    assert len(children) == 2


# What the first result from an image never needs: the compiler and what only a miss, a build, a tool or the
# local tier's database uses. (Modules that importing torch brings, such as json or hashlib, cannot be told apart.)
NEVER_ON_THE_WARM_PATH = (
    "triton", "lazytriton.compiler", "lazytriton.interpreter", "lazytriton.triton_lock", "lazytriton.misslog",
    "diskcache", "sqlite3", "filelock", "redis", "cffi", "sysconfig", "torch._dynamo", "lazytriton.ops",
    "lazytriton.cli", "lazytriton.prewarm", "lazytriton.store.shared_dir", "lazytriton.driver.helpers_build",
)

WARM_CHILD = """
import json, sys, torch
sys.path.insert(0, {benchmarks!r})
import cold_start
torch.manual_seed(0)
backward = {backward!r}
q, k, v = (torch.randn({shape!r}, dtype=torch.float16, requires_grad=backward) for _ in range(3))
torch_modules = set(sys.modules)
from lazytriton import runtime
from lazytriton.flash import attn_fwd
cold_start.route_to_fake_driver({library!r}, {target!r}, backward=backward)
out, lse = attn_fwd(q, k, v, causal=True)
if backward:
    out.float().sum().backward()
rt = runtime.get()
print(json.dumps({{"served": dict(rt.served), "compiles": rt.compiles, "loaded": len(rt.loaded_kernels()),
                  "imported": sorted(set(sys.modules) - torch_modules)}}))
"""


def _child(library: Path, target: str, shape: tuple[int, ...], backward: bool, env: dict[str, str]) -> dict[str, Any]:
    code = WARM_CHILD.format(benchmarks=str(BENCHMARKS), library=str(library), target=target, shape=shape,
                             backward=backward)
    result = run_python(code, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return report


@pytest.mark.parametrize(("target", "shape", "backward"), [
    ("sm_90", (1, 2, 128, 64), False),  # flash_fwd_gluon (warp-specialised), as the bench's one kernel on sm_90
    ("sm_80", (1, 2, 64, 64), True),  # flash_fwd, then flash_bwd_dq and flash_bwd_dkdv: a training step's kernels
])
def test_a_call_served_from_an_image_imports_nothing_the_warm_path_does_not_need(
        fake_library: Path, tmp_path: Path, target: str, shape: tuple[int, ...], backward: bool) -> None:
    # The image holds exactly what the call loads: what a first process compiled (JIT on, its misses logged),
    # packed by prewarm --from-misses. A second, fresh process is served from it with the compiler off.
    recorded = tmp_path / "recorded"
    first = _child(fake_library, target, shape, backward, {"LAZYTRITON_CACHE_DIR": str(recorded),
                                                            "LAZYTRITON_JIT": "1", "LAZYTRITON_IMAGES": ""})
    assert first["compiles"] == first["loaded"] > 0 and "triton" in first["imported"]  # the check can see it
    image = tmp_path / "warm.ltimg"
    packed = run_python(f"from lazytriton.cli import main; main(['prewarm', '--from-misses', "
                        f"{str(recorded / 'misses.jsonl')!r}, '--out', {str(image)!r}])",
                        env={"LAZYTRITON_CACHE_DIR": str(recorded)}, timeout=600)
    assert packed.returncode == 0 and image.is_file(), packed.stdout + packed.stderr
    served = _child(fake_library, target, shape, backward, {"LAZYTRITON_CACHE_DIR": str(tmp_path / "fresh"),
                                                             "LAZYTRITON_JIT": "0", "LAZYTRITON_IMAGES": str(image)})
    assert served["served"] == {"image": first["loaded"]} and served["compiles"] == 0
    assert served["loaded"] == first["loaded"]
    imported = [name for name in NEVER_ON_THE_WARM_PATH
                if any(module == name or module.startswith(name + ".") for module in served["imported"])]
    assert imported == [], f"the warm path from an image imported {imported}"
