"""Programmatic dependent launch of the decoding kernels (``PDL``: ``kernels/flash_decode/__init__.py``).

On CPU: the flag is a compile-target flag of the split, combine and kv_append kernels (the variants' strings
never change); the split kernel's and kv_append's sm_90 PTX release their dependent, the combine kernel's and the
split kernel's wait for their predecessor (none of it elsewhere), the split kernel before its first load of global
memory (a rotary one before its first key's); the combine kernel and the split kernel (every one with
``DEPENDENT_SPLIT``, else a rotary one) are the ones launched as dependents (kv_append never is), whichever the
switch says; a dependent launches through ``cuLaunchKernelEx`` with
programmatic stream serialization on the fake libcuda, through the compiled helper and through cffi's ABI mode
alike (plainly where the driver has no ``cuLaunchKernelEx``: the kernel's wait makes that right too). The GPU
tests run decoding calls (rotary, plain, and plain with every split kernel a dependent; with new keys, packed new
keys and none; eager, in a CUDA graph right after a device-to-device copy and after a join of two streams) with the
flag on against the same calls with it off, bit for bit.
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
from lazytriton.kernels.flash_decode import DEPENDENT_SPLIT, PDL_FROM, binding, checks
from lazytriton.kernels.kv_append import spec as append_spec
from lazytriton.record import replace
from lazytriton.target import Target
from lazytriton.variant import kernel_constexprs

SPLIT, COMBINE, APPEND = "flash_decode_split", "flash_decode_combine", "kv_append"


def _with_pdl(monkeypatch: pytest.MonkeyPatch, least: int | None, every_split: bool = DEPENDENT_SPLIT) -> None:
    """The three kernels' PDL flag from capability ``least`` (None: off), as ``PDL_FROM`` sets it, and every split
    kernel a dependent or only a rotary one, as ``DEPENDENT_SPLIT`` sets it.

    No variant's key is computed while it is patched: the source fingerprint a key holds is computed once a
    process, and would keep the patched spec's for the tests after this one.
    """
    for name in (SPLIT, COMBINE, APPEND):
        spec = kernels.get(name)
        flags = tuple((flag, least if flag == "PDL" else at) for flag, at in spec.capability_flags)
        spec = replace(spec, capability_flags=flags)
        if name == SPLIT:
            spec = replace(spec, dependent_flag="" if every_split else "ROTARY")
        monkeypatch.setitem(kernels._looked_up, name, spec)  # noqa: SLF001


@pytest.fixture
def keys_of_patched_specs() -> Iterator[None]:
    """For a test that computes keys while ``_with_pdl`` patches the specs: the source fingerprints cached then
    (once a process) are dropped after it, so that a later test in the process (a native library built from
    ``native_tables``, a key compared with another process's) keys the real kernels."""
    kernels.source_fingerprint.cache_clear()
    yield
    kernels.source_fingerprint.cache_clear()


def _variants(target: str, rotary: bool = False) -> tuple[Any, Any, Any]:
    """(split, combine, kv_append) of a bf16 head-dim-128 call, rotary (non-interleaved) or not."""
    found = Target.parse(target)
    return (dispatch.kernel_variant(SPLIT, found, "bf16", 128, False, True, 4, 4096, rotary=rotary),
            dispatch.kernel_variant(COMBINE, found, "bf16", 128, False, True, 4, 4096),
            dispatch.kernel_variant(APPEND, found, "bf16", 128, False, True, 1, 4096, rotary=rotary))


def _dependents(target: str, rotary: bool = False) -> list[bool]:
    return [kernels.dependent_launch(v) for v in _variants(target, rotary)]


def test_pdl_is_a_target_flag_and_the_dependents_are_the_combine_and_split_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    split, combine, append = (kernels.get(name) for name in (SPLIT, COMBINE, APPEND))
    assert ("PDL", PDL_FROM) in split.capability_flags and combine.capability_flags == (("PDL", PDL_FROM),)
    assert ("PDL", append_spec.PDL_FROM) in append.capability_flags
    assert combine.dependent == "PDL" and not combine.dependent_flag
    assert (split.dependent, split.dependent_flag) == ("PDL", "" if DEPENDENT_SPLIT else "ROTARY")
    assert not append.dependent
    plain, rotary = _variants("sm_90"), _variants("sm_90", rotary=True)
    assert all("PDL" not in str(v) for v in plain + rotary)  # a target flag: no variant string names it
    on = PDL_FROM is not None and PDL_FROM <= 90
    assert _dependents("sm_90") == [on and DEPENDENT_SPLIT, on, False] and _dependents("sm_90", True) == [on, on, False]
    _with_pdl(monkeypatch, 90)
    assert _dependents("sm_90") == [DEPENDENT_SPLIT, True, False] and _dependents("sm_90", True) == [True, True, False]
    for target in ("sm_80", "gfx942"):
        assert _dependents(target) == _dependents(target, True) == [False, False, False]
    assert _variants("sm_90") == plain and _variants("sm_90", True) == rotary
    _with_pdl(monkeypatch, None)
    assert _dependents("sm_90") == _dependents("sm_90", True) == [False, False, False]


def test_the_sm90_binaries_release_and_wait_and_no_other_target_does() -> None:
    """PTX of both kernels for sm_90 with the flag as a target sets it (compiled here, no GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lazytriton.compiler import divisibility_hints

    release, wait = "griddepcontrol.launch_dependents", "griddepcontrol.wait"
    counts, first = {}, {}
    plain, rotary = _variants("sm_90"), _variants("sm_90", rotary=True)
    for name, variant in (("split", plain[0]), ("rotary split", rotary[0]), ("combine", plain[1]),
                          ("kv_append", plain[2])):
        spec = kernels.get(variant.kernel)
        fn = getattr(importlib.import_module(spec.module), spec.function)
        for flag in (True, False):
            constexprs = {**kernel_constexprs(variant, spec.constexprs),
                          **{flag_name: False for flag_name, _ in spec.capability_flags}, "PDL": flag}
            source = ASTSource(fn, spec.signature("bf16", False, constexprs), constexprs=constexprs,
                               attrs=divisibility_hints(spec, variant))
            ptx = str(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(variant.options))
                      .asm["ptx"])
            counts[name, flag] = (ptx.count(release), ptx.count(wait), ptx.count("griddepcontrol"))
            if flag:
                first[name] = (ptx.find(wait), ptx.find("ld.global"), ptx.find("cp.async"))
    assert counts["split", True][0] >= 1 and counts["split", True][1] == 1
    waits, load, copy = first["split"]  # any predecessor's dependent: nothing read before its memory is there
    assert 0 <= waits < min(at for at in (load, copy) if at >= 0)
    assert counts["rotary split", True][0] >= 1 and counts["rotary split", True][1] == 1
    waits, load, copy = first["rotary split"]  # kv_append's: q, the length, the tables read first; keys after
    assert 0 <= load < waits < copy
    assert counts["combine", True][0] == 0 and counts["combine", True][1] >= 1
    assert counts["kv_append", True][0] >= 1 and counts["kv_append", True][1] == 0
    assert all(counts[name, False] == (0, 0, 0) for name in ("split", "rotary split", "combine", "kv_append"))


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

    variants = (*_variants("sm_90"), *_variants("sm_90", rotary=True), *_variants("sm_80", rotary=True))
    _with_pdl(monkeypatch, 90)  # after the variants: a key would cache the patched spec's source fingerprint
    monkeypatch.setattr(driver, "load", load)
    rt = runtime.get()
    monkeypatch.setattr(rt, "resolve", Resolved)
    for i, variant in enumerate(variants):
        rt._load(variant, f"key {i}", 7)  # noqa: SLF001
    assert loads == [(SPLIT, DEPENDENT_SPLIT), (COMBINE, True), (APPEND, False), (SPLIT, True), (COMBINE, True),
                     (APPEND, False), (SPLIT, False), (COMBINE, False), (APPEND, False)]


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


def _appending_calls(gen: torch.Generator, rotary: bool) -> dict[str, dict[str, Any]]:
    """A decoding call's arguments (rotary or not) with one new key a sequence, with packed new keys, and with
    none."""
    b, hq, hk, d, capacity, ro = 3, 32, 8, 128, 3000, 3100
    base = {"q": torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen),
            "k_cache": torch.randn(b, capacity, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen),
            "v_cache": torch.randn(b, capacity, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen),
            "cache_seqlens": torch.tensor([2990, 17, 2049], dtype=torch.int32, device="cuda"),
            "causal": True, "return_softmax_lse": True}
    if rotary:
        angles = torch.rand(ro, d // 4, device="cuda", generator=gen) * 6.3
        base.update(rotary_cos=angles.cos().to(torch.bfloat16), rotary_sin=angles.sin().to(torch.bfloat16))
    new = {name: torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for name in "kv"}
    packed = {name: torch.randn(7, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for name in "kv"}
    none = {name: torch.randn(b, 0, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for name in "kv"}
    cu = torch.tensor([0, 4, 4, 7], dtype=torch.int32, device="cuda")
    return {"new": {**base, **new}, "packed": {**base, **packed, "cu_seqlens_k_new": cu}, "none": {**base, **none}}


def _fresh(call: dict[str, Any]) -> dict[str, Any]:
    """The call with caches of its own (the append writes them)."""
    return {**call, "k_cache": call["k_cache"].clone(), "v_cache": call["v_cache"].clone()}


@on_gpu
@pytest.mark.parametrize("rotary, every_split", [(True, False), (False, False), (False, True)],
                         ids=["rotary", "plain", "every-split"])
def test_gpu_appending_decoding_as_a_dependent_gives_the_plain_launches_bits(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, keys_of_patched_specs: None, rotary: bool,
        every_split: bool) -> None:
    """The split kernel waits for kv_append (a rotary one before its first key, a plain one before it reads
    anything): the same bits as launched plainly, eager and replayed from a CUDA graph, with new keys, packed ones
    and none (kv_append then writes nothing, or for a plain call is not launched). In the graph a device-to-device
    copy (a memcpy node, not a kernel) comes right before each call, and a second graph joins a side stream's
    kernel into the call's stream right before it (two predecessors)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    calls = _appending_calls(torch.Generator(device="cuda").manual_seed(12), rotary)
    source = torch.randn(1 << 20, device="cuda")
    results: dict[Any, Any] = {}
    for least in (None, 90):
        _with_pdl(monkeypatch, least, every_split)
        kernels.source_fingerprint.cache_clear()  # each flag's own keys
        config.configure(cache_dir=tmp_path / f"cache-{least}")  # and binaries, a fresh runtime
        for name, call in calls.items():
            args = _fresh(call)
            out, lse = lazytriton.flash_attn_with_kvcache(**args)
            graphed = _fresh(call)  # the eager call made its plans: none is made during the capture
            copied = torch.empty_like(source)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                copied.copy_(source)
                captured, _ = lazytriton.flash_attn_with_kvcache(**graphed)
            graph.replay()
            joined_args, side, doubled = _fresh(call), torch.cuda.Stream(), torch.empty_like(source)
            joined_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(joined_graph):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.mul(source, 2, out=doubled)
                torch.cuda.current_stream().wait_stream(side)
                joined, _ = lazytriton.flash_attn_with_kvcache(**joined_args)
            joined_graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(copied, source) and torch.equal(doubled, source * 2)
            assert torch.equal(joined, captured) and torch.equal(joined_args["k_cache"], graphed["k_cache"])
            results[least, name] = (out, lse, args["k_cache"], args["v_cache"], captured, graphed["k_cache"])
        new = calls["new"]
        inputs = checks.Inputs(new["q"], new["k_cache"], new["v_cache"], new["k"], new["v"], new["cache_seqlens"],
                               rotary_cos=new.get("rotary_cos"), rotary_sin=new.get("rotary_sin"))
        call = checks.check(inputs, causal=True)
        split = binding.plan(new["q"].device, new["q"].dtype, call, *binding.layout_flags(inputs, results[least,
                                                                                                        "new"][0]))[0]
        assert split.dependent is (least == 90 and (rotary or every_split))
    for name in calls:
        plain, dependent = results[None, name], results[90, name]
        assert all(torch.equal(a, b) for a, b in zip(plain, dependent, strict=True)), name
        assert torch.equal(dependent[0], dependent[4]) and torch.equal(dependent[2], dependent[5]), name
