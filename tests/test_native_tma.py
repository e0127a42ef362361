"""The native launcher's host tensor descriptors and scratch memory, held to the Python launcher's bytes.

Two sm_90 entries from an image ``lazytriton prewarm --from-misses`` builds: flash_fwd's ``TMA=true``
variant (device-side descriptors in Triton's global scratch: 512 bytes a program, aligned to 128) and
``flash_fwd_host_tma`` (K and V through host descriptors). ``tests/capi/native_params.c`` loads each from the
image with liblazytriton_native.so and launches it against the fake libcuda (tests/fake_libcuda.py); the
Python launcher (``lazytriton.driver.gpu``, its cffi path and its compiled helper) launches the same entry
with the same arguments on another copy of the fake. The bytes behind every kernel parameter must be equal:
the scratch pointers, the encoded maps (the fake's map serialises cuTensorMapEncodeTiled's arguments), the
descriptors' sizes and strides. tests/test_host_tma.py holds the Python launcher to Triton's own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import gpu as needs_gpu
from fake_libcuda import SCRATCH_BASE, Fake
from nativelib import STREAM, LauncherProgram, build_program, param_sizes, prewarmed_image, recorded_launch
from test_fastlaunch import helper  # noqa: F401  (a module fixture: the built launch helper)

from lazytriton.cache_format import Entry
from lazytriton.cache_format.image import Image
from lazytriton.driver import fastlaunch, gpu

LT_OK, LT_ERROR_INVALID_ARGUMENT, LT_ERROR_NULL_POINTER, LT_ERROR_CUDA = 0, 1, 2, 13
SCRATCH_VARIANT = ("flash_fwd:sm_90:fp16:ALIGN16=true,BLOCK_D=64,CAUSAL=false,EVEN_D=true,INDEX64=false,TMA=true:"
                   "BLOCK_M=64,BLOCK_N=32:num_stages=2,num_warps=4")
TMA_VARIANT = ("flash_fwd_host_tma:sm_90:bf16:ALIGN16=true,BLOCK_D=64,CAUSAL=false,EVEN_D=true:BLOCK_M=64,"
               "BLOCK_N=32:num_stages=2,num_warps=4")
# The host-descriptor call of tests/test_host_tma.py: K a (B, S, H, D) tensor seen as (B, H, S, D), V contiguous.
Q, K, V, OUT, LSE = 0x7F0000001000, 0x7F0000100000, 0x7F0000200000, 0x7F0000300000, 0x7F0000400000
SHAPE = (2, 3, 100, 64)
K_STRIDES = (100 * 3 * 64, 64, 3 * 64, 1)
V_STRIDES = (3 * 100 * 64, 100 * 64, 64, 1)
SCALARS = (6400, 64, 64 * 64, 6400, 64, 64 * 64, 300, 100, 1, 100, 100, 64, -5)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image prewarm builds from a miss log of the two variants (once a session, shared by xdist workers)."""
    return prewarmed_image(tmp_path_factory, "native-tma", variants=(SCRATCH_VARIANT, TMA_VARIANT))


def entry_of(image: Path, name: str) -> Entry:
    reader = Image(image)
    try:
        found = [reader.read(key) for key in reader.keys()]
    finally:
        reader.close()
    (entry,) = [e for e in found if e is not None and e.name == name]
    return entry


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_program(tmp_path_factory.mktemp("native-params"), "native_params")


@pytest.fixture
def native(built: dict[str, Path], image: Path) -> Any:
    """One native_params process serving from ``image``, against its fake libcuda."""
    served = LauncherProgram(built, image)
    yield served
    served.close()


def scratch_call(entry: Entry) -> tuple[tuple[int, ...], tuple[float, ...], list[str]]:
    """Distinct integers and floats for every parameter of the scratch entry, and native_params' tokens of them."""
    ints = tuple(0x10000 * (i + 1) + i for i, kind in enumerate(entry.arg_types) if kind != "fp32")
    floats = tuple(0.5 + i for i, kind in enumerate(entry.arg_types) if kind == "fp32")
    it, ft = iter(ints), iter(floats)
    tokens = [f"f:{next(ft)!r}" if kind == "fp32" else f"i:{next(it)}" for kind in entry.arg_types]
    return ints, floats, tokens


def tma_call(k_base: int = K) -> tuple[tuple[int, ...], tuple[float, ...], list[str]]:
    ints = (Q, k_base, *SHAPE, *K_STRIDES, V, *SHAPE, *V_STRIDES, OUT, LSE, *SCALARS)

    def desc(base: int, strides: tuple[int, ...]) -> str:
        return "d:4:" + ":".join(str(x) for x in (base, *SHAPE, *strides))

    tokens = [f"i:{Q}", desc(k_base, K_STRIDES), desc(V, V_STRIDES), f"i:{OUT}", f"i:{LSE}",
              *(f"i:{s}" for s in SCALARS), "f:0.125"]
    return ints, (0.125,), tokens


def python_launch(fake_library: Path, module: Any, monkeypatch: pytest.MonkeyPatch, entry: Entry,
                  grid: tuple[int, int, int], ints: tuple[int, ...], floats: tuple[float, ...],
                  scratch_at: int) -> tuple[list[Any], list[int], list[tuple[int, int]]]:
    """The Python launcher's launch on the fake: each parameter's bytes (hex, None for NULL), the addresses
    modulo 64, and its scratch_alloc calls."""
    monkeypatch.setattr(fastlaunch, "_module", lambda: module)
    kernel = gpu.CudaApi(str(fake_library)).load(entry, 0)
    fake = Fake(fake_library)
    fake.configure(param_sizes(entry))
    params, _, aligns, allocs = recorded_launch(kernel, fake, grid, ints, floats, (scratch_at,))
    return params, aligns, allocs


def test_the_image_holds_a_scratch_entry_and_a_descriptor_entry(image: Path, native: LauncherProgram) -> None:
    scratch, tma = entry_of(image, "flash_fwd_kernel"), entry_of(image, "flash_fwd_host_tma_kernel")
    assert scratch.global_scratch_size > 0 and scratch.hidden_args[0] == "global_scratch"
    assert len(tma.tensordesc_meta) == 2
    for entry, descriptors in ((scratch, 0), (tma, 2)):
        info = native.load(entry)
        assert info["load"] == LT_OK, info["error"]
        assert (info["name"], info["kind"], info["n_args"]) == (entry.name, "cubin", len(entry.arg_types))
        assert info["arg_types"] == list(entry.arg_types) and info["n_descriptors"] == descriptors
        assert info["scratch"] == [entry.global_scratch_size, entry.global_scratch_align or 1,
                                   entry.profile_scratch_size, entry.profile_scratch_align or 1]
        assert (info["info_v1"], info["info_v1_n_args"], info["info_v1_untouched"]) == (0, info["n_args"], 1)


@pytest.mark.parametrize("use_helper", [False, True], ids=["abi", "helper"])
def test_a_scratch_entry_gets_the_python_launchers_bytes(image: Path, native: LauncherProgram, fake_library: Path,
                                                         helper: Any, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                         use_helper: bool) -> None:
    entry = entry_of(image, "flash_fwd_kernel")
    grid = (3, 5, 2)
    ints, floats, tokens = scratch_call(entry)
    given = 0x7E0000000000
    want, _, allocs = python_launch(fake_library, helper if use_helper else None, monkeypatch, entry, grid, ints,
                                    floats, given)
    programs = grid[0] * grid[1] * grid[2] * entry.num_ctas
    assert allocs == [(programs * entry.global_scratch_size, 0)]
    assert native.load(entry)["load"] == LT_OK
    got = native.launch(grid, f"given:{given}:0", param_sizes(entry), tokens)
    assert got["launch"] == LT_OK, got["error"]
    assert got["params"] == want
    assert got["allocations"] == []  # the caller's memory: nothing allocated

    own = native.launch(grid, "own", param_sizes(entry), tokens)
    assert own["launch"] == LT_OK, own["error"]
    (alloc, free) = own["allocations"]
    # call, bytes, address, stream, the context current, launches before it
    assert alloc == [1, programs * entry.global_scratch_size, SCRATCH_BASE, STREAM, 0xC000, 0]
    assert free == [2, 0, SCRATCH_BASE, STREAM, 0xC000, 1]  # on the stream, after the launch
    hidden = len(entry.arg_types)
    assert own["params"][hidden] == SCRATCH_BASE.to_bytes(8, "little").hex()
    assert own["params"][:hidden] == want[:hidden] and own["params"][hidden + 1:] == want[hidden + 1:]
    assert want[hidden + 1] is None or want[hidden + 1] == bytes(8).hex()  # profile scratch: NULL


@pytest.mark.parametrize("use_helper", [False, True], ids=["abi", "helper"])
def test_a_descriptor_entry_gets_the_python_launchers_bytes(image: Path, native: LauncherProgram, fake_library: Path,
                                                            helper: Any, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                            use_helper: bool) -> None:
    entry = entry_of(image, "flash_fwd_host_tma_kernel")
    grid = (2, 3, 2)
    ints, floats, tokens = tma_call()
    want, want_aligns, allocs = python_launch(fake_library, helper if use_helper else None, monkeypatch, entry,
                                              grid, ints, floats, 0)
    assert allocs == []
    assert native.load(entry)["load"] == LT_OK
    got = native.launch(grid, "own", param_sizes(entry), tokens)
    assert got["launch"] == LT_OK, got["error"]
    assert got["params"] == want
    maps = [i for i, size in enumerate(param_sizes(entry)) if size == fastlaunch.MAP_BYTES]
    assert maps == [1, 10] and all(got["aligns"][i] == 0 == want_aligns[i] for i in maps)
    assert got["params"][1].endswith(b"FAKE".hex()) and got["allocations"] == []
    assert len(got["encodes"]) == 2 and all(call[7] == 0 for call in got["encodes"])  # maps 64-byte aligned
    moved = native.launch(grid, "own", param_sizes(entry), tma_call(K + 4096)[2])  # encoded on every launch
    assert moved["params"][1] != got["params"][1] and moved["params"][10] == got["params"][10]
    assert moved["encodes"][0][2] == K + 4096


def test_bad_arguments_are_refused_before_a_launch(image: Path, native: LauncherProgram) -> None:
    tma, scratch = entry_of(image, "flash_fwd_host_tma_kernel"), entry_of(image, "flash_fwd_kernel")
    assert native.load(tma)["load"] == LT_OK
    sizes = param_sizes(tma)
    _, _, tokens = tma_call()
    bad_stride = [*tokens[:1], tokens[1].rsplit(":", 1)[0] + ":2", *tokens[2:]]
    unaligned = [*tokens[:1], tokens[1].replace(f":{K}:", f":{K + 8}:"), *tokens[2:]]
    odd_outer = [*tokens[:2], tokens[2].replace(":6400:64:1", ":6400:3:1"), *tokens[3:]]
    for args, match in ((bad_stride, "innermost stride must be 1"), (unaligned, "16-byte aligned"),
                        (odd_outer, "multiples of 16 bytes")):
        got = native.launch((1, 1, 1), "own", sizes, args)
        assert got["launch"] == LT_ERROR_INVALID_ARGUMENT and match in got["error"], got["error"]
        assert got["launches"] == 0
    assert native.ask("fail_encode 7") == {}
    got = native.launch((1, 1, 1), "own", sizes, tokens)
    assert got["launch"] == LT_ERROR_CUDA and "cuTensorMapEncodeTiled" in got["error"] and got["launches"] == 0
    assert native.ask("fail_encode 0") == {}

    assert native.load(scratch)["load"] == LT_OK
    sizes = param_sizes(scratch)
    tokens = scratch_call(scratch)[2]
    for mode, status, match in (("given:0:0", LT_ERROR_NULL_POINTER, "scratch[0] is NULL"),
                                ("given:4160:0", LT_ERROR_INVALID_ARGUMENT, "not 128-byte aligned")):
        got = native.launch((2, 2, 2), mode, sizes, tokens)
        assert got["launch"] == status and match in got["error"] and got["launches"] == 0, got
    got = native.launch((1 << 31, 1 << 31, 1 << 31), "own", sizes, tokens)
    assert got["launch"] == LT_ERROR_INVALID_ARGUMENT and "overflows" in got["error"] and got["launches"] == 0
    assert native.ask("fail_alloc 2") == {}
    got = native.launch((2, 2, 2), "own", sizes, tokens)
    assert got["launch"] == LT_ERROR_CUDA and "cuMemAllocAsync" in got["error"] and got["launches"] == 0
    assert native.ask("fail_alloc 0") == {}
    got = native.launch((2, 2, 2), "own", sizes, tokens[:-1])
    assert got["launch"] == LT_ERROR_INVALID_ARGUMENT and "parameters, got" in got["error"]


# -- on a GPU: the same two entries, compiled by the installed Triton, on the real libcuda --------------------------

def needs_sm90() -> None:
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA entries are compiled for sm_90; this GPU is another")


@needs_gpu
@pytest.mark.gpu
def test_on_a_gpu_a_scratch_entry_launched_natively_matches_python(tmp_path: Path) -> None:
    """flash_fwd TMA=true: the native launch (its scratch from cuMemAllocAsync) writes Python's bits."""
    from nativelib import native_forward_matches_python

    needs_sm90()
    entry = native_forward_matches_python(tmp_path, SCRATCH_VARIANT, 300)
    assert entry.global_scratch_size > 0


@needs_gpu
@pytest.mark.gpu
def test_on_a_gpu_a_descriptor_entry_launched_natively_matches_python(tmp_path: Path) -> None:
    """flash_fwd_host_tma: the native encode of K's and V's maps reads what Python's does; out and lse bit-equal."""
    import torch
    from nativelib import attention_error, native_launcher

    from lazytriton import runtime
    from lazytriton.variant import Variant

    needs_sm90()
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 300, 64
    q, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # strided K
    kernel = runtime.get().kernel(Variant.parse(TMA_VARIANT), q.device.index)
    scale, grid = 1.0 / d**0.5, ((s + 63) // 64, h, b)

    def call(out: Any, lse: Any) -> tuple[list[Any], list[int]]:
        tail = [out.data_ptr(), lse.data_ptr(), *q.stride()[:3], *out.stride()[:3], *lse.stride()[:2], 1, s, s, d, 0]
        native = [q.data_ptr(), (k.data_ptr(), k.shape, k.stride()), (v.data_ptr(), v.shape, v.stride()), *tail,
                  scale]
        python = [q.data_ptr(), k.data_ptr(), *k.shape, *k.stride(), v.data_ptr(), *v.shape, *v.stride(), *tail]
        return native, python

    out, lse = torch.empty_like(q), torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    kernel.launch(grid, torch.cuda.current_stream().cuda_stream, call(out, lse)[1], (scale,))
    out2, lse2 = torch.full_like(out, float("nan")), torch.full_like(lse, float("nan"))
    native_launcher(tmp_path, kernel.entry)(grid, call(out2, lse2)[0])
    torch.cuda.synchronize()
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    err, same = attention_error(out, q, k, v, scale)
    assert err <= 2 * same + 1e-5, (err, same)
