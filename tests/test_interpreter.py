"""The CPU interpreter runs on a private copy of triton.language: another thread's Triton work never sees its patches.

Issue 13, finding 7: while ``attn_fwd`` ran on CPU tensors in one thread, 19 of
20 Triton compiles in another thread failed ('block_argument' object has no
attribute 'dtype'), because Triton's interpreter patches ``triton.language``
for the whole process.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from compiled_once import small_variant
from conftest import run_python

from lazytriton import compiler
from lazytriton.flash import attn_fwd

DEADLINE_S = 120.0


@triton.jit
def _user_kernel(x_ptr, n, BLOCK: tl.constexpr):
    # tl.range, tl.zeros, tl.maximum and tensor operators: all of them patched while the interpreter runs.
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in tl.range(0, n, BLOCK):
        acc += tl.load(x_ptr + i + tl.arange(0, BLOCK))
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.maximum(acc, 0.0))


def _compile_user_kernel() -> None:
    """A Triton compile that does not go through lazytriton (an application's own kernel)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(_user_kernel, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 64})
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"][:4] == b"\x7fELF"


def _language_state() -> dict[tuple[str, str], Any]:
    """Every attribute of the real triton.language modules and of the classes the interpreter patches."""
    owners: list[Any] = [m for name, m in sorted(sys.modules.items())
                         if (name == "triton.language" or name.startswith("triton.language.")) and m is not None]
    owners += [tl.tensor, tl.core.dtype]
    owners += [getattr(tl.core, name, None) for name in ("condition", "tensor_descriptor_base")]  # not in every Triton
    return {(getattr(o, "__name__", repr(o)), name): value
            for o in owners if o is not None for name, value in vars(o).items()}


def _cpu_call() -> None:
    q, k, v = (torch.randn(1, 2, 20, 64) for _ in range(3))
    out, _ = attn_fwd(q, k, v, causal=True)  # causal: calls between @jit functions, which Triton never un-patches
    assert torch.isfinite(out).all()


def test_interpreting_leaves_the_real_triton_language_untouched() -> None:
    before = _language_state()
    _cpu_call()
    after = _language_state()
    # Modules the first call imports (gluon, libdevice) add names; nothing that was there may change.
    changed = sorted(k for k in before if after.get(k) is not before[k])
    added_to_classes = sorted(k for k in after.keys() - before.keys() if not k[0].startswith("triton.language"))
    assert not added_to_classes, f"interpreting added to triton.language's classes: {added_to_classes}"
    assert not changed, f"interpreting changed triton.language: {changed[:10]}"
    assert sys.modules["triton.language"] is tl and triton.language is tl


@pytest.fixture
def interpreting() -> Iterator[list[int]]:
    """A thread running attn_fwd on CPU tensors over and over; yields its count of finished calls."""
    runs = [0]
    errors: list[BaseException] = []
    stop = threading.Event()
    first = threading.Event()

    def loop() -> None:
        try:
            while not stop.is_set():
                _cpu_call()
                runs[0] += 1
                first.set()
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)
            first.set()

    thread = threading.Thread(target=loop, name="interpreting", daemon=True)
    thread.start()
    assert first.wait(DEADLINE_S), "the interpreting thread finished no call"
    yield runs
    stop.set()
    thread.join(DEADLINE_S)
    assert not errors, f"the interpreting thread failed: {errors[0]!r}"
    assert runs[0] >= 2


@pytest.mark.parametrize("compile_once", [
    pytest.param(lambda: compiler.compile_variant(small_variant("sm_90")), id="compile_variant"),
    pytest.param(_compile_user_kernel, id="application_kernel"),
])
def test_compiles_in_another_thread_succeed_while_interpreting(interpreting: list[int],
                                                                compile_once: Callable[[], Any]) -> None:
    failures = []
    for _ in range(10):
        try:
            compile_once()
        except Exception as exc:
            failures.append(repr(exc)[:200])
    assert not failures, f"{len(failures)} of 10 compiles failed beside the interpreter: {failures[:3]}"
    # The interpreter kept running beside the compiles (it is not serialised behind them, nor they behind it).
    seen = interpreting[0]
    deadline = threading.Event()
    for _ in range(int(DEADLINE_S * 10)):
        if interpreting[0] > seen:
            break
        deadline.wait(0.1)
    assert interpreting[0] > seen


def test_a_compile_while_the_interpreter_is_patched_sees_the_real_triton_language() -> None:
    """Deterministic: the interpreting thread stops right after Triton's interpreter has applied its
    patches (its ``_patch_lang`` returned) until this thread has compiled and looked at triton.language."""
    _cpu_call()  # the first call imports what it needs; now the state of the real language is settled
    before = _language_state()
    patched, checked = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "return" and code.co_name == "_patch_lang" and "interpreter" in code.co_filename \
                and not patched.is_set():
            patched.set()
            checked.wait(DEADLINE_S)

    def run() -> None:
        sys.setprofile(profile)
        try:
            _cpu_call()
        except BaseException as exc:
            errors.append(exc)
        finally:
            sys.setprofile(None)
            patched.set()

    thread = threading.Thread(target=run, name="interpreting", daemon=True)
    thread.start()
    try:
        assert patched.wait(DEADLINE_S), "the interpreter never applied its patches"
        during = _language_state()
        _compile_user_kernel()
    finally:
        checked.set()
        thread.join(DEADLINE_S)
    assert not errors, f"the interpreting thread failed: {errors[0]!r}"
    changed = sorted(k for k in before if during.get(k) is not before[k])
    assert not changed, f"triton.language as another thread saw it mid-interpretation: {changed[:10]}"


def test_cpu_calls_work_when_the_whole_process_interprets() -> None:
    """Under TRITON_INTERPRET=1 Triton's own @jit functions are interpreted ones bound to the real language;
    the private copy is still built for compiling first, then made interpreted."""
    result = run_python(
        "import torch\n"
        "from lazytriton.flash import attn_fwd\n"
        "q, k, v = (torch.randn(1, 2, 20, 64) for _ in range(3))\n"
        "out, _ = attn_fwd(q, k, v, causal=True)\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "assert (out - ref).abs().max().item() < 1e-4\n"
        "print('ok')\n", env={"TRITON_INTERPRET": "1"})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
