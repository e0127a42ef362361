"""The native launcher's AMD path: an hsaco entry loaded and launched through the HIP runtime (capi/native/lt_hip.c).

A gfx942 image ``lazytriton prewarm --target gfx942`` builds (flash_fwd, fp16, head dim 64: one variant) is
served by liblazytriton_native.so to ``tests/capi/native_hip.c`` against the fake libamdhip64
(tests/fake_libhip.py, on LD_LIBRARY_PATH). The bytes behind every parameter hipModuleLaunchKernel reads must
equal what the Python HIP launcher (``lazytriton.driver.gpu.HipApi`` on another copy of the fake) passes for the
same call, and the layout the entry's arg_types give (the kernel's parameters, then Triton's global_scratch and
profile_scratch pointers). A twin of the entry with scratch sizes holds the allocation (hipMallocAsync before,
hipFreeAsync after the launch, on the stream) and the caller's scratch to the same.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import test_decoders_property as props
import xxhash
from fake_libhip import FUNCTION, HIP_ERROR_INVALID_DEVICE, SCRATCH_BASE, Fake
from fake_libhip import build as build_fake
from nativelib import STREAM, LauncherProgram, build_program, param_sizes, prewarmed_image, recorded_launch

from lazytriton import record
from lazytriton.cache_format import Entry
from lazytriton.cache_format.image import Image, write_image
from lazytriton.driver import gpu
from lazytriton.driver.cdefs import HIP_CDEF, make_ffi

LT_OK, LT_ERROR_INVALID_ARGUMENT, LT_ERROR_NULL_POINTER, LT_ERROR_NO_GPU = 0, 1, 2, 8
LT_ERROR_UNSUPPORTED, LT_ERROR_CUDA = 9, 13
AXES = ("--target", "gfx942", "--kernel", "flash_fwd", "--dtype", "fp16", "--head-dim", "64", "--causal", "none",
        "--seqlen-q", "128", "--seqlen-k", "128")
GLOBAL, GLOBAL_ALIGN, PROFILE, PROFILE_ALIGN = 384, 512, 64, 64  # the scratch twin's sizes a program


@pytest.fixture(scope="module")
def hsaco(tmp_path_factory: pytest.TempPathFactory) -> Entry:
    """The gfx942 entry of the image prewarm builds (once a session, shared by xdist workers)."""
    reader = Image(prewarmed_image(tmp_path_factory, "native-hip", AXES))
    try:
        entries = [reader.read(key) for key in reader.keys()]
    finally:
        reader.close()
    (entry,) = entries
    assert entry is not None and entry.kind == "hsaco" and entry.target == "gfx942"
    return entry


def twin(entry: Entry, name: str, **changes: Any) -> Entry:
    """The entry under another key, with changes."""
    return record.replace(entry, key=xxhash.xxh3_128_hexdigest(name.encode()), **changes)


@pytest.fixture(scope="module")
def scratch_twin(hsaco: Entry) -> Entry:
    return twin(hsaco, "hip-scratch", global_scratch_size=GLOBAL, global_scratch_align=GLOBAL_ALIGN,
                profile_scratch_size=PROFILE, profile_scratch_align=PROFILE_ALIGN)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory, hsaco: Entry, scratch_twin: Entry) -> Path:
    """The prewarm image's entry, its scratch twin and a (made-up) cubin, in one image."""
    path = tmp_path_factory.mktemp("native-hip-image") / "hip.ltimg"
    write_image(path, [hsaco, scratch_twin, props.make_entry(7)])
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The native library, the fake as libamdhip64.so (``driver``) and as .so.6 only (``driver6``), the program."""
    return build_program(tmp_path_factory.mktemp("native-hip"), "native_hip", build_fake,
                         (("driver", "libamdhip64.so"), ("driver6", "libamdhip64.so.6"), ("none", None)))


class Native(LauncherProgram):
    """One native_hip process serving from ``image``, the fake found in ``driver``: a load names the device to
    load on and the fake's current device, a launch the fake's current device."""

    LOAD_TOKENS = ("device", "current")
    LAUNCH_TOKENS = ("current",)


@pytest.fixture
def native(built: dict[str, Path], image: Path) -> Any:
    served = Native(built, image)
    yield served
    served.close()


def call_of(entry: Entry) -> tuple[tuple[int, ...], tuple[float, ...], list[str]]:
    """Distinct values for every parameter (pointers, negative i32s, fp32s), and native_hip's tokens of them."""
    ints: list[int] = []
    floats: list[float] = []
    tokens = []
    for i, kind in enumerate(entry.arg_types):
        if kind == "fp32":
            floats.append(0.5 + i)
            tokens.append(f"f:{floats[-1]!r}")
        else:
            ints.append(0x7F0000000000 + 0x1000 * i if kind.startswith("*") else -(i + 1) if kind == "i32"
                        else (1 << 40) + i)
            tokens.append(f"i:{ints[-1]}")
    return tuple(ints), tuple(floats), tokens


def expected_bytes(entry: Entry, ints: tuple[int, ...], floats: tuple[float, ...],
                   scratch: tuple[int, int] = (0, 0)) -> list[str]:
    """The parameter bytes the entry's arg_types give: each value at its size, then global and profile scratch."""
    it, ft = iter(ints), iter(floats)
    out = [struct.pack("<f", next(ft)) if kind == "fp32" else struct.pack("<i" if kind == "i32" else "<q", next(it))
           for kind in entry.arg_types]
    by_name = dict(zip(("global_scratch", "profile_scratch"), scratch, strict=True))
    out += [struct.pack("<Q", by_name[name]) for name in entry.hidden_args]
    return [b.hex() for b in out]


def python_launch(fake_library: Path, entry: Entry, device: int, grid: tuple[int, int, int], ints: tuple[int, ...],
                  floats: tuple[float, ...], scratch_at: tuple[int, int] = (0, 0)) -> tuple[list[Any], dict[str, int],
                                                                                          list[tuple[int, int]]]:
    """The Python HIP launcher's launch on the fake: each parameter's bytes (hex), the launch's state, and its
    scratch_alloc calls (given the addresses of scratch_at in order)."""
    api = gpu.HipApi.__new__(gpu.HipApi)  # HipApi opens libamdhip64.so by name: here, the fake by its path
    api.ffi = make_ffi("hip", HIP_CDEF)
    api.lib = api.ffi.dlopen(str(fake_library))
    fake = Fake(fake_library)
    fake.configure(param_sizes(entry))
    kernel = api.load(entry, device)
    params, state, _, allocs = recorded_launch(kernel, fake, grid, ints, floats, [a for a in scratch_at if a])
    return params, state, allocs


def test_the_prewarm_image_serves_its_gfx942_entry_through_hip(hsaco: Entry, native: Native) -> None:
    info = native.load(hsaco, device=1, current=0)
    assert info["load"] == LT_OK, info["error"]
    assert (info["name"], info["kind"], info["n_args"]) == (hsaco.name, "hsaco", len(hsaco.arg_types))
    assert (info["block_threads"], info["shared"]) == (hsaco.num_warps * 64, hsaco.shared)
    assert hsaco.hidden_args == ("global_scratch", "profile_scratch")  # Triton 3.6 and 3.9 append both
    (load,) = info["loads"]
    elf = int.from_bytes(b"\x7fELF", "little")
    assert load == {"device": 1, "head": elf, "module": 0xA000, "function_of": 0xA000, "name": hsaco.name}
    assert info["sets"] == [[1], [0]] and info["device"] == 0  # loaded on device 1, the caller's device restored


def test_a_launch_gets_the_python_hip_launchers_bytes(hsaco: Entry, native: Native, built: dict[str, Path]) -> None:
    grid = (3, 5, 2)
    ints, floats, tokens = call_of(hsaco)
    want, want_state, allocs = python_launch(built["fake"], hsaco, 1, grid, ints, floats)
    assert allocs == [] and want == expected_bytes(hsaco, ints, floats)
    assert native.load(hsaco, device=1)["load"] == LT_OK
    got = native.launch(grid, "own", param_sizes(hsaco), tokens, current=2)
    assert got["launch"] == LT_OK, got["error"]
    assert got["params"] == want
    launches, gx, gy, gz, block_x, block_yz, shared, stream, function, device, extra_null = got["state"]
    assert launches == 1 and (gx, gy, gz) == grid
    assert (block_x, block_yz, shared) == (hsaco.num_warps * hsaco.warp_size, 1001, hsaco.shared)
    assert (stream, function, device, extra_null) == (STREAM, FUNCTION, 1, 1)
    assert [want_state[k] for k in ("block_x", "shared", "stream", "device", "extra_null")] == \
        [block_x, shared, stream, device, extra_null]
    assert got["allocations"] == [] and got["sets"] == [[1], [2]] and got["device"] == 2
    same = native.launch(grid, "own", param_sizes(hsaco), tokens, current=1)  # already current: no hipSetDevice
    assert same["launch"] == LT_OK and same["sets"] == [] and same["params"] == want


def test_scratch_is_allocated_on_the_stream_or_taken_from_the_caller(scratch_twin: Entry, native: Native,
                                                                     built: dict[str, Path]) -> None:
    grid = (4, 3, 2)
    programs = grid[0] * grid[1] * grid[2]
    ints, floats, tokens = call_of(scratch_twin)
    given = (0x7E0000000000, 0x7E0001000000)
    want, _, allocs = python_launch(built["fake"], scratch_twin, 0, grid, ints, floats, given)
    assert allocs == [(programs * GLOBAL, 0), (programs * PROFILE, 0)]
    assert want == expected_bytes(scratch_twin, ints, floats, given)
    assert native.load(scratch_twin)["load"] == LT_OK
    got = native.launch(grid, f"given:{given[0]}:{given[1]}", param_sizes(scratch_twin), tokens)
    assert got["launch"] == LT_OK, got["error"]
    assert got["params"] == want and got["allocations"] == []

    own = native.launch(grid, "own", param_sizes(scratch_twin), tokens)
    assert own["launch"] == LT_OK, own["error"]
    # call, bytes, address, stream, the device current, launches before it
    global_alloc, profile_alloc, *frees = own["allocations"]
    pad = GLOBAL_ALIGN - 1  # past the runtime's 256-byte alignment: room to align
    assert global_alloc == [1, programs * GLOBAL + pad, SCRATCH_BASE, STREAM, 0, 0]
    profile_at = SCRATCH_BASE + (programs * GLOBAL + pad + 4095) // 4096 * 4096 + 4096
    assert profile_alloc == [1, programs * PROFILE, profile_at, STREAM, 0, 0]
    assert frees == [[2, 0, SCRATCH_BASE, STREAM, 0, 1], [2, 0, profile_at, STREAM, 0, 1]]  # after the launch
    assert own["params"] == expected_bytes(scratch_twin, ints, floats, (SCRATCH_BASE, profile_at))

    misaligned = native.launch(grid, f"given:{given[0] + 256}:{given[1]}", param_sizes(scratch_twin), tokens)
    assert misaligned["launch"] == LT_ERROR_INVALID_ARGUMENT and "512-byte aligned" in misaligned["error"]
    missing = native.launch(grid, f"given:0:{given[1]}", param_sizes(scratch_twin), tokens)
    assert missing["launch"] == LT_ERROR_NULL_POINTER and "scratch[0] is NULL" in missing["error"]
    assert misaligned["state"][0] == missing["state"][0] == 0  # nothing launched


def test_failures_name_the_hip_call_and_restore_the_device(hsaco: Entry, scratch_twin: Entry,
                                                           native: Native) -> None:
    _, _, tokens = call_of(hsaco)
    sizes = param_sizes(hsaco)
    no_device = native.load(hsaco, device=9)
    assert no_device["load"] == LT_ERROR_NO_GPU and "no HIP device 9" in no_device["error"]
    assert f"HIP error {HIP_ERROR_INVALID_DEVICE}" in no_device["error"]
    native.ask("fail 0 300")  # hipModuleLoadData
    bad_module = native.load(hsaco, device=1)
    assert bad_module["load"] == LT_ERROR_CUDA and "hipModuleLoadData failed: HIP error 300" in bad_module["error"]
    assert bad_module["device"] == 0
    native.ask("fail 1 500")  # hipModuleGetFunction
    no_function = native.load(hsaco)
    assert no_function["load"] == LT_ERROR_CUDA and "hipModuleGetFunction failed" in no_function["error"]

    assert native.load(hsaco, device=1)["load"] == LT_OK
    native.ask("fail 2 719")  # hipModuleLaunchKernel
    failed = native.launch((1, 1, 1), "own", sizes, tokens)
    assert failed["launch"] == LT_ERROR_CUDA and "hipModuleLaunchKernel failed: HIP error 719" in failed["error"]
    assert failed["device"] == 0 and failed["sets"] == [[1], [0]]
    wrong = native.launch((1, 1, 1), "own", sizes, tokens[:-1])
    assert wrong["launch"] == LT_ERROR_INVALID_ARGUMENT and f"takes {len(tokens)} parameters" in wrong["error"]
    empty = native.launch((1, 0, 1), "own", sizes, tokens)
    assert empty["launch"] == LT_ERROR_INVALID_ARGUMENT and "empty dimension" in empty["error"]
    assert wrong["state"][0] == empty["state"][0] == 0 and wrong["sets"] == empty["sets"] == []

    assert native.load(scratch_twin)["load"] == LT_OK
    native.ask("fail 3 2")  # hipMallocAsync
    no_memory = native.launch((1, 1, 1), "own", param_sizes(scratch_twin), call_of(scratch_twin)[2])
    assert no_memory["launch"] == LT_ERROR_CUDA and "hipMallocAsync failed: HIP error 2" in no_memory["error"]
    assert no_memory["state"][0] == 0 and [a[0] for a in no_memory["allocations"]] == [1]


def test_the_entry_kind_picks_the_driver(hsaco: Entry, built: dict[str, Path], image: Path) -> None:
    """A cubin goes to libcuda (absent here), an hsaco to the HIP runtime: found as .so.6, or named when absent."""
    cubin = props.make_entry(7)
    served = Native(built, image, "driver6")
    try:
        assert served.load(hsaco)["load"] == LT_OK  # libamdhip64.so.6 when there is no libamdhip64.so
        no_cuda = served.load(cubin)
        assert no_cuda["load"] == LT_ERROR_NO_GPU and "libcuda.so.1" in no_cuda["error"]
    finally:
        served.close()
    served = Native(built, image, "none")
    try:
        no_hip = served.load(hsaco)
        assert no_hip["load"] == LT_ERROR_NO_GPU and "cannot load the HIP runtime" in no_hip["error"]
    finally:
        served.close()


def test_an_hsaco_with_host_descriptors_or_clusters_is_refused(hsaco: Entry, built: dict[str, Path],
                                                                tmp_path: Path) -> None:
    from lazytriton.cache_format.tensordesc import TensorDescMeta

    kind = "tensordesc<fp16[64, 64]>"
    meta = TensorDescMeta(swizzle=0, elem_size=2, elem_type=6, block_size=(64, 64))
    described = twin(hsaco, "hip-descriptors", arg_types=(hsaco.arg_types[0], kind, *hsaco.arg_types[2:]),
                     tensordesc_meta=(meta,))
    clustered = twin(hsaco, "hip-clusters", num_ctas=2)
    image = tmp_path / "refused.ltimg"
    write_image(image, [described, clustered])
    served = Native(built, image)
    try:
        for entry, why in ((described, "only the CUDA driver"), (clustered, "num_ctas=2")):
            refused = served.load(entry)
            assert refused["load"] == LT_ERROR_UNSUPPORTED and why in refused["error"], refused
            assert refused["loads"] == []  # refused before the runtime is asked
    finally:
        served.close()


def needs_amd_gpu() -> None:
    try:
        import torch
    except ImportError:
        pytest.skip("needs torch with ROCm and an AMD GPU (gfx942)")
    if getattr(torch.version, "hip", None) is None or not torch.cuda.is_available():
        pytest.skip("needs an AMD GPU (ROCm torch, gfx942); the native HIP path runs on the fake runtime elsewhere")
    if "gfx942" not in torch.cuda.get_device_properties(0).gcnArchName:
        pytest.skip("the image's entry is compiled for gfx942; this AMD GPU is another")


@pytest.mark.gpu
def test_on_an_amd_gpu_the_native_launch_writes_pythons_bits(tmp_path: Path, hsaco: Entry) -> None:
    """flash_fwd gfx942 launched natively (liblazytriton_native.so, hipModuleLaunchKernel) and by Python: bit-equal."""
    needs_amd_gpu()
    from nativelib import native_forward_matches_python

    native_forward_matches_python(tmp_path, hsaco.variant, 128)

