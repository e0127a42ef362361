"""Programmatic dependent launch of the decoding pair (``PDL``: ``kernels/flash_decode/__init__.py``).

On CPU: the flag is a compile-target flag of both kernels (the variants' strings never change), the split
kernel's sm_90 PTX releases its dependent and the combine kernel's waits for it (none of it elsewhere), the
combine kernel is the one launched as a dependent, and a dependent launches through ``cuLaunchKernelEx`` with
programmatic stream serialization on the fake libcuda, through the compiled helper and through cffi's ABI mode
alike (plainly where the driver has no ``cuLaunchKernelEx``: the kernel's wait makes that right too). The GPU
test runs a decoding call with the flag on against the same call with it off, bit for bit.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_libcuda import Fake
from test_driver import _entry
from test_flash_fwd import on_gpu

import lazytriton
from lazytriton import config, kernels
from lazytriton.driver import fastlaunch, gpu
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_decode import PDL_FROM, binding, checks
from lazytriton.record import replace
from lazytriton.target import Target
from lazytriton.variant import kernel_constexprs

SPLIT, COMBINE = "flash_decode_split", "flash_decode_combine"


def _with_pdl(monkeypatch: pytest.MonkeyPatch, least: int | None) -> None:
    """Both kernels' PDL flag from capability ``least`` (None: off), as ``PDL_FROM`` sets it.

    No variant's key is computed while it is patched: the source fingerprint a key holds is computed once a
    process, and would keep the patched spec's for the tests after this one.
    """
    for name in (SPLIT, COMBINE):
        spec = kernels.get(name)
        flags = tuple((flag, least if flag == "PDL" else at) for flag, at in spec.capability_flags)
        monkeypatch.setitem(kernels._looked_up, name, replace(spec, capability_flags=flags))  # noqa: SLF001


@pytest.fixture
def keys_of_patched_specs() -> Iterator[None]:
    """For a test that computes keys while ``_with_pdl`` patches the specs: the source fingerprints cached then
    (once a process) are dropped after it, so that a later test in the process (a native library built from
    ``native_tables``, a key compared with another process's) keys the real kernels."""
    kernels.source_fingerprint.cache_clear()
    yield
    kernels.source_fingerprint.cache_clear()


def _variants(target: str) -> tuple[Any, Any]:
    found = Target.parse(target)
    return (dispatch.kernel_variant(SPLIT, found, "bf16", 128, False, True, 4, 4096),
            dispatch.kernel_variant(COMBINE, found, "bf16", 128, False, True, 4, 4096))


def test_pdl_is_a_target_flag_and_only_the_combine_kernel_launches_as_a_dependent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    split, combine = (kernels.get(name) for name in (SPLIT, COMBINE))
    assert ("PDL", PDL_FROM) in split.capability_flags and combine.capability_flags == (("PDL", PDL_FROM),)
    assert combine.dependent == "PDL" and not split.dependent
    plain = _variants("sm_90")
    assert all("PDL" not in str(v) for v in plain)  # a target flag: no variant string names it
    on = PDL_FROM is not None and PDL_FROM <= 90
    assert [kernels.dependent_launch(v) for v in plain] == [False, on]
    _with_pdl(monkeypatch, 90)
    assert [kernels.dependent_launch(v) for v in _variants("sm_90")] == [False, True]
    assert [kernels.dependent_launch(v) for v in _variants("sm_80")] == [False, False]
    assert [kernels.dependent_launch(v) for v in _variants("gfx942")] == [False, False]
    assert _variants("sm_90") == plain
    _with_pdl(monkeypatch, None)
    assert [kernels.dependent_launch(v) for v in _variants("sm_90")] == [False, False]


def test_the_sm90_binaries_release_and_wait_and_no_other_target_does() -> None:
    """PTX of both kernels for sm_90 with the flag as a target sets it (compiled here, no GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lazytriton.compiler import divisibility_hints

    counts = {}
    for name, instruction in ((SPLIT, "griddepcontrol.launch_dependents"), (COMBINE, "griddepcontrol.wait")):
        spec = kernels.get(name)
        variant = _variants("sm_90")[name == COMBINE]
        fn = getattr(importlib.import_module(spec.module), spec.function)
        for flag in (True, False):
            constexprs = {**kernel_constexprs(variant, spec.constexprs),
                          **{flag_name: False for flag_name, _ in spec.capability_flags}, "PDL": flag}
            source = ASTSource(fn, spec.signature("bf16", False, constexprs), constexprs=constexprs,
                               attrs=divisibility_hints(spec, variant))
            ptx = str(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(variant.options))
                      .asm["ptx"])
            counts[name, flag] = (ptx.count(instruction), ptx.count("griddepcontrol"))
    assert counts[SPLIT, True][0] >= 1 and counts[COMBINE, True][0] >= 1
    assert counts[SPLIT, False] == counts[COMBINE, False] == (0, 0)


def _launch(fake_library: Path, monkeypatch: pytest.MonkeyPatch, module: Any, dependent: bool,
            without_ex: bool = False) -> dict[str, int]:
    monkeypatch.setattr(fastlaunch, "_module", lambda: module)
    api = gpu.CudaApi(str(fake_library))
    if without_ex:  # a driver older than CUDA 11.8
        api.driver_functions = api.driver_functions[:5] + (0,)
        api._launch_ex = None  # noqa: SLF001
    entry = _entry(("*fp16", "i32", "fp32"))
    kernel = api.load(entry, 0, dependent)
    assert kernel.dependent is dependent and (kernel.fast is not None) == (module is not None)
    fake = Fake(fake_library)
    fake.configure([8, 4, 4])
    kernel.launch((3, 2, 1), 0x5EED, (0x7F0000001000, 7), (0.5,))
    params, state = fake.last_launch()
    assert params == [(0x7F0000001000).to_bytes(8, "little"), (7).to_bytes(4, "little"), bytes.fromhex("0000003f")]
    assert (state["grid_x"], state["grid_y"], state["grid_z"], state["stream"]) == (3, 2, 1, 0x5EED)
    assert state["block_x"] == entry.block_threads
    return fake.launch_log()[-1]


@pytest.mark.parametrize("path", ["helper", "abi"])
def test_a_dependent_kernel_launches_with_programmatic_stream_serialization(
        path: str, fake_library: Path, launch_helper: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    module = launch_helper if path == "helper" else None
    assert _launch(fake_library, monkeypatch, module, dependent=True)["programmatic"] == 1
    assert _launch(fake_library, monkeypatch, module, dependent=False)["programmatic"] == 0
    assert _launch(fake_library, monkeypatch, module, dependent=True, without_ex=True)["programmatic"] == 0
    Fake(fake_library).set_driver_version(12020)  # a graph captures no programmatic launch before CUDA 12.3
    try:
        assert _launch(fake_library, monkeypatch, module, dependent=True)["programmatic"] == 0
    finally:
        Fake(fake_library).set_driver_version(13000)


def test_the_runtime_loads_each_kernel_as_its_spec_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from lazytriton import driver, runtime

    loads: list[tuple[str, bool]] = []

    def load(entry: Any, device_index: int, dependent: bool = False) -> Any:
        loads.append((entry, dependent))
        return object()

    class Resolved:
        def __init__(self, variant: Any) -> None:
            self.entry = variant.kernel

    variants = (*_variants("sm_90"), *_variants("sm_80"))
    _with_pdl(monkeypatch, 90)  # after the variants: a key would cache the patched spec's source fingerprint
    monkeypatch.setattr(driver, "load", load)
    rt = runtime.get()
    monkeypatch.setattr(rt, "resolve", Resolved)
    for i, variant in enumerate(variants):
        rt._load(variant, f"key {i}", 7)  # noqa: SLF001
    assert loads == [(SPLIT, False), (COMBINE, True), (SPLIT, False), (COMBINE, False)]


@on_gpu
def test_gpu_decoding_with_pdl_gives_the_plain_pairs_bits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          keys_of_patched_specs: None) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(3, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache = (torch.randn(3, 3000, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                        for _ in range(2))
    lens = torch.tensor([3000, 17, 2049], dtype=torch.int32, device="cuda")
    results = {}
    for least in (None, 90):
        _with_pdl(monkeypatch, least)
        kernels.source_fingerprint.cache_clear()  # each flag's own keys
        config.configure(cache_dir=tmp_path / f"cache-{least}")  # and binaries, a fresh runtime
        out, lse = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, return_softmax_lse=True)
        call = checks.check(checks.Inputs(q, k_cache, v_cache, cache_seqlens=lens))
        combine = binding.plan(q.device, q.dtype, call, *binding.layout_flags(checks.Inputs(q, k_cache, v_cache),
                                                                              out))[3]
        assert combine.dependent is (least == 90)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = lazytriton.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
        graph.replay()
        torch.cuda.synchronize()
        results[least] = (out, lse, captured)
    assert all(torch.equal(a, b) for a, b in zip(results[None], results[90], strict=True))
    assert torch.equal(results[90][0], results[90][2])
