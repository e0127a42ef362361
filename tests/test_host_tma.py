"""Host tensor descriptors end to end on CPU: compile, Entry, cache round trip, and the launch on a fake driver.

The reference for every launched byte is Triton's own launcher: its
``make_tensordesc_arg`` (run here with a stub in place of its compiled
``fill_tma_descriptor_tiled``, whose arguments are recorded) and, for the
encode itself, the argument order of its ``fillTMADescriptorTiled`` in
driver.c (dims and box innermost first, rank - 1 strides in bytes, element
strides 1, no interleave, L2 promotion 128B, fill 0 for zero padding). The fake
cuTensorMapEncodeTiled writes a map that serialises its arguments, so equal
maps mean equal encode arguments. Both Triton versions' compiles of the test
kernel are recorded in tests/data (``host_tma_fixture.py``); each is
launched, whichever Triton is installed.
"""

from __future__ import annotations

import inspect
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import xxhash
from fake_libcuda import Fake, fake_map
from host_tma_fixture import VARIANT, compile_now, recorded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_driver import _FakeApi
from test_fastlaunch import helper  # noqa: F401  (a module fixture: the built launch helper)

from lazytriton.cache_format import Entry, EntryError, Provenance, tensordesc
from lazytriton.cache_format import entry as entry_format
from lazytriton.cache_format.envelope import seal, unseal
from lazytriton.cache_format.image import Image, write_image
from lazytriton.cache_format.tensordesc import TensorDescMeta
from lazytriton.driver import DriverError, fastlaunch, gpu
from lazytriton.record import replace

RECORDS = recorded()
Q, K, V, OUT, LSE = 0x7F0000001000, 0x7F0000100000, 0x7F0000200000, 0x7F0000300000, 0x7F0000400000
# K as a (B, S, H, D) tensor seen as (B, H, S, D): any 16-byte-multiple strides work. V contiguous.
SHAPE = (2, 3, 100, 64)
K_STRIDES = (100 * 3 * 64, 64, 3 * 64, 1)
V_STRIDES = (3 * 100 * 64, 100 * 64, 64, 1)
SCALARS = (6400, 64, 64 * 64, 6400, 64, 64 * 64, 300, 100, 1, 100, 100, 64, -5)  # strides, sizes, causal_offset


def _entry(record: dict[str, Any]) -> Entry:
    return Entry(
        key="0" * 32, variant=record["variant"], target="sm_90", kind="cubin", binary=b"\x7fELF", name=record["name"],
        num_warps=4, num_ctas=1, warp_size=32, shared=0, global_scratch_size=record["global_scratch_size"],
        global_scratch_align=1, profile_scratch_size=record["profile_scratch_size"], profile_scratch_align=1,
        arg_types=tuple(record["arg_types"]), hidden_args=tuple(record["hidden_args"]),
        provenance=Provenance("triton", record["triton"], "f" * 16, 0.0, 1),
        tensordesc_meta=tuple(TensorDescMeta(m["swizzle"], m["elem_size"], m["elem_type"], tuple(m["block_size"]))
                              for m in record["tensordesc_meta"]),
    )


def _param_sizes(record: dict[str, Any]) -> list[int]:
    """Bytes of each compiled parameter, from the kernel's own PTX declarations."""
    return [128 if "[128]" in p else 4 if p.startswith((".u32", ".f32", ".b32")) else 8
            for p in record["ptx_params"]]


def _ints(k_base: int = K) -> tuple[int, ...]:
    return (Q, k_base, *SHAPE, *K_STRIDES, V, *SHAPE, *V_STRIDES, OUT, LSE, *SCALARS)


class FakeTensor:
    """What Triton's TensorDescriptor reads of a tensor (named so that it skips the alignment assert)."""

    def __init__(self, address: int) -> None:
        import torch

        self.address, self.dtype = address, torch.bfloat16

    def data_ptr(self) -> int:
        return self.address


def _triton_descriptor_params(monkeypatch: pytest.MonkeyPatch, meta: dict[str, Any], base: int,
                              strides: tuple[int, ...]) -> list[bytes]:
    """The bytes Triton's launcher passes for one host descriptor: map, sizes (i32), strides (i64)."""
    triton = pytest.importorskip("triton")
    from triton.backends.nvidia import driver as nvidia
    from triton.tools.tensor_descriptor import TensorDescriptor

    calls: list[tuple[Any, ...]] = []

    def fill(*args: Any) -> str:
        calls.append(args)
        return "map"

    utils = SimpleNamespace(fill_tma_descriptor_tiled=fill, fill_tma_descriptor=fill)
    monkeypatch.setattr(triton.runtime, "driver", SimpleNamespace(active=SimpleNamespace(utils=utils)))
    desc = TensorDescriptor(FakeTensor(base), list(SHAPE), list(strides), list(meta["block_size"]))
    full_meta = {**meta, "fp4_padded": False, "is_im2col": False}
    extra = (None,) if len(inspect.signature(nvidia.make_tensordesc_arg).parameters) == 3 else ()
    out = nvidia.make_tensordesc_arg(desc, full_meta, *extra)
    monkeypatch.undo()
    (address, swizzle, elem_size, dtype, block, shape, elem_strides, padding), = calls
    rank = len(block)
    encoded = fake_map(dtype, rank, address, list(reversed(shape)),
                       [elem_size * elem_strides[i] for i in reversed(range(rank - 1))], list(reversed(block)),
                       [1] * rank, 0, swizzle, 2, 1 if padding == 1 else 0)
    assert out[0] == "map" and len(out) == 1 + 2 * rank
    return [encoded, *(struct.pack("<i", s) for s in out[1:1 + rank]),
            *(struct.pack("<q", s) for s in out[1 + rank:])]


def _expected(monkeypatch: pytest.MonkeyPatch, record: dict[str, Any], k_base: int = K) -> list[bytes]:
    metas = record["tensordesc_meta"]
    return [struct.pack("<q", Q), *_triton_descriptor_params(monkeypatch, metas[0], k_base, K_STRIDES),
            *_triton_descriptor_params(monkeypatch, metas[1], V, V_STRIDES), struct.pack("<q", OUT),
            struct.pack("<q", LSE), *(struct.pack("<i", s) for s in SCALARS), struct.pack("<f", 0.125),
            bytes(8), bytes(8)]



def _load(fake_library: Path, module: Any, monkeypatch: pytest.MonkeyPatch, entry: Entry) -> gpu.LoadedKernel:
    monkeypatch.setattr(fastlaunch, "_module", lambda: module)
    kernel = gpu.CudaApi(str(fake_library)).load(entry, 0)
    assert (kernel.fast is not None) == (module is not None)
    return kernel


def test_both_triton_versions_compile_the_same_launch_metadata() -> None:
    versions = {record["triton"][:3] for record in RECORDS}
    assert {"3.6", "3.9"} <= versions, "run tests/host_tma_fixture.py --write under both Triton versions"
    first = {k: v for k, v in RECORDS[0].items() if k != "triton"}
    for record in RECORDS[1:]:
        assert {k: v for k, v in record.items() if k != "triton"} == first, record["triton"]
    sizes = _param_sizes(RECORDS[0])
    # Q, then each descriptor: the 128-byte map (aligned to 64), 4 sizes (u32), 4 strides (u64)
    assert RECORDS[0]["ptx_params"][1] == ".align 64 .b8[128]"
    assert sizes[1:10] == [128, 4, 4, 4, 4, 8, 8, 8, 8] == sizes[10:19]


@pytest.fixture(scope="module")
def compiled() -> tuple[Entry, dict[str, Any]]:
    pytest.importorskip("triton")
    return compile_now()


def test_a_fresh_compile_matches_its_versions_record(compiled: tuple[Entry, dict[str, Any]]) -> None:
    entry, record = compiled
    mine = [r for r in RECORDS if r["triton"] == record["triton"]]
    if not mine:
        pytest.skip(f"no record for Triton {record['triton']}")
    assert record == mine[0]
    assert entry.variant == VARIANT and len(entry.tensordesc_meta) == 2


def test_entry_with_descriptors_round_trips_through_every_cache_format(compiled: tuple[Entry, dict[str, Any]],
                                                                     tmp_path: Path) -> None:
    entry = compiled[0]
    data = entry.encode()
    assert struct.unpack_from("<I", data, 8)[0] == entry_format.FORMAT_VERSION_DESCRIPTORS
    assert Entry.decode(data, expected_key=entry.key) == entry
    assert unseal(seal(data, b"s" * 32), entry.key, b"s" * 32) == entry
    plain = replace(_entry(RECORDS[0]), key="1" * 32, arg_types=("*fp16",), tensordesc_meta=())
    assert struct.unpack_from("<I", plain.encode(), 8)[0] == entry_format.FORMAT_VERSION  # others stay version 1
    write_image(tmp_path / "a.ltimg", [entry, plain])
    image = Image(tmp_path / "a.ltimg")
    assert image.read(entry.key) == entry and image.read(plain.key) == plain


@pytest.mark.parametrize("use_helper", [False, True], ids=["abi", "helper"])
@pytest.mark.parametrize("record", RECORDS, ids=[r["triton"] for r in RECORDS])
def test_launch_passes_what_tritons_launcher_would(fake_library: Path, helper: Any,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch, record: dict[str, Any],
                                                   use_helper: bool) -> None:
    expected = _expected(monkeypatch, record)
    kernel = _load(fake_library, helper if use_helper else None, monkeypatch, _entry(record))
    fake = Fake(fake_library)
    fake.configure(_param_sizes(record))
    assert [len(e) for e in expected] == fake.sizes
    kernel.launch((2, 3, 2), 0x5EED, _ints(), (0.125,))
    aligns: list[int] = []
    params, state = fake.last_launch(aligns)
    assert state["launches"] == 1 and (state["grid_x"], state["grid_z"]) == (2, 2)
    for i, (got, want) in enumerate(zip(params, expected, strict=True)):
        assert got == want, f"parameter {i} differs"
    assert aligns[1] == aligns[10] == 0  # the maps are 64-byte aligned
    count, calls = fake.encodes()
    assert count == 2 and all(call["map_align"] == 0 for call in calls)


@pytest.mark.parametrize("use_helper", [False, True], ids=["abi", "helper"])
def test_a_map_is_encoded_again_only_when_its_tensor_changes(fake_library: Path, helper: Any,  # noqa: F811
                                                             monkeypatch: pytest.MonkeyPatch, use_helper: bool) -> None:
    record = RECORDS[0]
    kernel = _load(fake_library, helper if use_helper else None, monkeypatch, _entry(record))
    fake = Fake(fake_library)
    fake.configure(_param_sizes(record))
    for _ in range(3):
        kernel.launch((1, 1, 1), 0, _ints(), (0.125,))
    assert fake.encodes()[0] == 2
    moved = K + 4096
    kernel.launch((1, 1, 1), 0, _ints(moved), (0.125,))
    count, calls = fake.encodes()
    assert count == 3 and calls[-1]["address"] == moved
    assert fake.last_launch()[0][1] == _expected(monkeypatch, record, moved)[1]
    assert fake.last_launch()[0][10] == _expected(monkeypatch, record)[10]  # V's map: from the cache


@pytest.mark.parametrize("use_helper", [False, True], ids=["abi", "helper"])
def test_encode_errors_and_bad_strides_are_refused_before_a_launch(fake_library: Path, helper: Any,  # noqa: F811
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   use_helper: bool) -> None:
    kernel = _load(fake_library, helper if use_helper else None, monkeypatch, _entry(RECORDS[0]))
    fake = Fake(fake_library)
    fake.configure(_param_sizes(RECORDS[0]))
    fake.set_encode_status(1)
    with pytest.raises(DriverError, match=r"cuTensorMapEncodeTiled.*CUDA error 1 \(fake error\)"):
        kernel.launch((1, 1, 1), 0, _ints(), (0.125,))
    fake.set_encode_status(0)
    bad = list(_ints())
    bad[1 + 4 + 4] = 2  # K's innermost stride
    with pytest.raises(ValueError, match="innermost"):
        kernel.launch((1, 1, 1), 0, tuple(bad), (0.125,))
    assert fake.last_launch()[1]["launches"] == 0
    kernel.launch((1, 1, 1), 0, _ints(), (0.125,))  # a failed encode is not cached
    assert fake.last_launch()[1]["launches"] == 1


def test_layout_expands_a_descriptor_into_its_map_sizes_and_strides() -> None:
    meta = TensorDescMeta(3, 2, 10, (1, 64))
    slots = fastlaunch.layout(("*bf16", "tensordesc<bf16[1, 64]>", "fp32", "i32"), (0,), (meta,))
    assert slots == (0, fastlaunch.DESC_SLOT, 2, 3, 4, 5, -1, 6, fastlaunch.NULL_SLOT)
    assert fastlaunch.descriptor_bases(slots) == (1,)
    assert fastlaunch.encode_args(meta, (4096, 7, 64, 64, 1)) == (9, 2, 4096, [64, 7], [128], [64, 1])
    with pytest.raises(fastlaunch.LayoutError, match="no tensordesc_meta"):
        fastlaunch.layout(("tensordesc<bf16[1, 64]>",), ())
    with pytest.raises(fastlaunch.LayoutError, match="descriptor parameters"):
        fastlaunch.layout(("*bf16",), (), (meta,))


def test_a_driver_without_descriptors_and_the_c_api_refuse_descriptor_entries() -> None:
    with pytest.raises(DriverError, match="only the CUDA driver"):
        gpu.LoadedKernel(_FakeApi(), _entry(RECORDS[0]), 0, None)
    from lazytriton.capi.embedded import CapiError, check_launch_layout

    with pytest.raises(CapiError, match="host tensor descriptors"):
        check_launch_layout(_entry(RECORDS[0]))


def test_triton_metadata_lazytriton_cannot_launch_alike_is_refused() -> None:
    good = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [64, 64], "fp4_padded": False}
    assert tensordesc.from_triton(good) == TensorDescMeta(3, 2, 10, (64, 64))
    for bad, match in (({**good, "fp4_padded": True}, "fp4"), ({**good, "is_im2col": True}, "im2col"),
                       ({**good, "swizzle": 9}, "swizzle"), ({"swizzle": 3}, "lacks"),
                       ({**good, "block_size": [64, 128]}, "swizzle span"), (None, "dict")):
        with pytest.raises(ValueError, match=match):
            tensordesc.from_triton(bad)


def _payload(**changes: Any) -> bytes:
    record = msgpack.unpackb(_entry(RECORDS[0]).encode()[entry_format.HEADER_SIZE:], raw=False)
    record.update(changes)
    return msgpack.packb(record, use_bin_type=True)


def _framed(payload: bytes, version: int = entry_format.FORMAT_VERSION_DESCRIPTORS) -> bytes:
    return struct.pack("<8sIIQ", entry_format.MAGIC, version, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


META = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, 32, 64]}
BAD = {
    "swizzle out of range": dict(tensordesc_meta=[{**META, "swizzle": 4}, META]),
    "one meta for two descriptors": dict(tensordesc_meta=[META]),
    "rank differs from the type": dict(tensordesc_meta=[{**META, "block_size": [32, 64]}, META]),
    "elem size differs from the dtype": dict(tensordesc_meta=[{**META, "elem_size": 4, "swizzle": 0}, META]),
    "box over 256": dict(tensordesc_meta=[{**META, "block_size": [1, 1, 512, 64]}, META]),
    "extra key": dict(tensordesc_meta=[{**META, "fp4_padded": True}, META]),
    "bool in block_size": dict(tensordesc_meta=[{**META, "block_size": [True, 1, 32, 64]}, META]),
    "an im2col type": dict(arg_types=["*bf16", "tensordesc_im2col<bf16[1, 1, 32, 64]>"] + RECORDS[0]["arg_types"][2:]),
    "empty": dict(tensordesc_meta=[]),
}


@pytest.mark.parametrize("changes", BAD.values(), ids=BAD.keys())
def test_bad_descriptor_metadata_in_an_entry_is_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(EntryError):
        Entry.decode(_framed(_payload(**changes)))


def test_descriptors_need_format_version_2_and_version_2_needs_descriptors() -> None:
    with pytest.raises(EntryError, match="fields"):
        Entry.decode(_framed(_payload(), version=entry_format.FORMAT_VERSION))  # an extra key for version 1
    record = msgpack.unpackb(_payload(), raw=False)
    del record["tensordesc_meta"]
    with pytest.raises(EntryError, match="descriptor"):  # descriptor types, no metadata
        Entry.decode(_framed(msgpack.packb(record, use_bin_type=True), version=entry_format.FORMAT_VERSION))


PROPERTY = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
ints = st.one_of(st.integers(-3, 300), st.integers(-(2**63), 2**64 - 1))
anything = st.one_of(st.none(), st.booleans(), ints, st.text(max_size=8), st.binary(max_size=8))
metas = st.fixed_dictionaries({"swizzle": ints, "elem_size": ints, "elem_type": ints,
                               "block_size": st.lists(st.one_of(ints, anything), max_size=7)})
meta_lists = st.lists(st.one_of(metas, anything, st.dictionaries(st.text(max_size=12), anything, max_size=5)),
                      max_size=4)


@PROPERTY
@given(meta_lists, st.sampled_from([entry_format.FORMAT_VERSION, entry_format.FORMAT_VERSION_DESCRIPTORS]))
def test_any_descriptor_metadata_decodes_to_an_entry_or_entry_error(items: list[Any], version: int) -> None:
    try:
        entry = Entry.decode(_framed(_payload(tensordesc_meta=items), version))
    except EntryError:
        return
    tensordesc.check(entry.arg_types, entry.tensordesc_meta)  # what decoded is what the launcher can take
    assert Entry.decode(entry.encode()) == entry


def test_a_target_without_tma_is_refused_at_compile_time() -> None:
    pytest.importorskip("triton")
    from lazytriton.compiler import CompileError, compile_variant
    from lazytriton.variant import Variant

    # Without TMA Triton passes a descriptor as pointer, sizes, strides and flags, laid out differently by 3.6
    # and 3.9: refused, never stored.
    with pytest.raises(CompileError, match="need a target with TMA"):
        compile_variant(Variant.parse(VARIANT.replace(":sm_90:", ":sm_80:")))


def test_a_kernel_of_floats_and_null_scratch_only_takes_no_integers(fake_library: Path) -> None:
    entry = replace(_entry(RECORDS[0]), arg_types=("fp32",), tensordesc_meta=())
    kernel = gpu.CudaApi(str(fake_library)).load(entry, 0)
    fake = Fake(fake_library)
    fake.configure([4, 8, 8])
    kernel.launch((1, 1, 1), 0, (), (2.0,))
    assert fake.last_launch()[0] == [struct.pack("<f", 2.0), bytes(8), bytes(8)]
