"""The Entry byte format: round trip, and every kind of bad bytes rejected with EntryError."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
import xxhash

from lazytriton.cache_format import Entry, EntryError, Provenance
from lazytriton.cache_format import entry as entry_module
from lazytriton.record import asdict, replace

KEY = "0123456789abcdef0123456789abcdef"
OTHER_KEY = "f" * 32


def make_entry(binary: bytes = b"\x7fELF" + bytes(range(256)) * 2, **changes: Any) -> Entry:
    entry = Entry(
        key=KEY,
        variant="flash_fwd:sm_90:fp16:BLOCK_D=64:BLOCK_M=64,BLOCK_N=32:num_stages=2,num_warps=4",
        target="sm_90", kind="cubin", binary=binary, name="flash_fwd_kernel",
        num_warps=4, num_ctas=1, warp_size=32, shared=24576,
        global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
        arg_types=("*fp16", "*fp16", "i64", "i32", "fp32"), hidden_args=("global_scratch", "profile_scratch"),
        provenance=Provenance(compiler="triton", compiler_version="3.9.0", source_fingerprint="0123456789abcdef",
                              created=1700000000.25, launch_abi=1),
    )
    return replace(entry, **changes)


def record_of(entry: Entry) -> dict[str, Any]:
    record = asdict(entry)
    record["arg_types"] = list(entry.arg_types)
    record["hidden_args"] = list(entry.hidden_args)
    del record["tensordesc_meta"]  # written only by format version 2 (tests/test_entry_tensordesc.py)
    return record


def frame(payload: bytes, version: int = entry_module.FORMAT_VERSION, magic: bytes = entry_module.MAGIC) -> bytes:
    """Header with a valid length and checksum around ``payload``: only the schema checks can object."""
    return struct.pack("<8sIIQ", magic, version, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload


def pack(record: Any) -> bytes:
    return frame(msgpack.packb(record, use_bin_type=True))


# --- round trip ------------------------------------------------------------------------------------------------


def test_round_trip() -> None:
    entry = make_entry()
    data = entry.encode()
    assert data[:8] == b"LTENTRY\0"
    assert len(data) == entry_module.HEADER_SIZE + struct.unpack_from("<I", data, 12)[0]
    for form in (data, bytearray(data), memoryview(data)):
        assert Entry.decode(form) == entry
    assert Entry.decode(data, expected_key=KEY) == entry
    decoded = Entry.decode(data)
    assert type(decoded.arg_types) is tuple and type(decoded.hidden_args) is tuple
    assert type(decoded.binary) is bytes and isinstance(decoded.provenance, Provenance)
    assert decoded.block_threads == 128


def test_round_trip_variations() -> None:
    for entry in (
        make_entry(kind="hsaco", target="gfx942", warp_size=64, binary=b"x"),
        make_entry(arg_types=(), hidden_args=()),
        make_entry(binary=bytes(300_000), shared=232448, num_warps=8),
        make_entry(global_scratch_size=4096, global_scratch_align=128, profile_scratch_size=2**32 - 1),
        make_entry(provenance=replace(make_entry().provenance, created=-1.5, compiler_version="")),
    ):
        assert Entry.decode(entry.encode()) == entry


def test_encoding_is_deterministic() -> None:
    assert make_entry().encode() == make_entry().encode()


# --- damaged bytes ---------------------------------------------------------------------------------------------


def test_every_truncation_is_detected() -> None:
    data = make_entry().encode()
    for length in range(len(data)):
        with pytest.raises(EntryError):
            Entry.decode(data[:length])


def test_extra_bytes_are_detected() -> None:
    data = make_entry().encode()
    for tail in (b"\0", b"x" * 100, data):
        with pytest.raises(EntryError):
            Entry.decode(data + tail)


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_flipped_byte_is_detected(mask: int) -> None:
    data = make_entry().encode()
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= mask
        with pytest.raises(EntryError):
            Entry.decode(bytes(damaged))


def test_flipped_bytes_in_a_large_entry_are_detected() -> None:
    data = make_entry(binary=bytes(range(256)) * 1024).encode()
    positions = list(range(64)) + list(range(64, len(data), 997)) + [len(data) - 1]
    for position in positions:
        damaged = bytearray(data)
        damaged[position] ^= 0x10
        with pytest.raises(EntryError):
            Entry.decode(bytes(damaged))


def test_header_fields_are_checked() -> None:
    payload = msgpack.packb(record_of(make_entry()), use_bin_type=True)
    with pytest.raises(EntryError, match="magic"):
        Entry.decode(frame(payload, magic=b"LTENTRY\1"))
    with pytest.raises(EntryError, match="version"):
        Entry.decode(frame(payload, version=3))
    with pytest.raises(EntryError, match="header says"):
        Entry.decode(frame(payload)[:-1])
    with pytest.raises(EntryError, match="checksum"):
        good = frame(payload)
        Entry.decode(good[:16] + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload) ^ 1) + good[24:])


def test_oversize_is_rejected_before_hashing() -> None:
    limit = entry_module.MAX_ENTRY_BYTES
    header = struct.pack("<8sIIQ", entry_module.MAGIC, 1, limit + 1 - entry_module.HEADER_SIZE, 0)
    with pytest.raises(EntryError, match="exceeds"):
        Entry.decode(header + bytes(limit + 1 - entry_module.HEADER_SIZE))


def test_encoded_binary_over_the_bound_does_not_decode() -> None:
    data = make_entry(binary=bytes(entry_module.MAX_ENTRY_BYTES)).encode()
    with pytest.raises(EntryError):
        Entry.decode(data)


def test_header_claiming_a_huge_payload_is_rejected() -> None:
    header = struct.pack("<8sIIQ", entry_module.MAGIC, 1, 2**32 - 1, 0)
    with pytest.raises(EntryError):
        Entry.decode(header + b"\x80")


def test_wrong_key_is_rejected() -> None:
    data = make_entry().encode()
    with pytest.raises(EntryError, match=OTHER_KEY):
        Entry.decode(data, expected_key=OTHER_KEY)


# --- schema (valid checksum, wrong content) --------------------------------------------------------------------


def test_a_valid_frame_of_the_plain_record_decodes() -> None:
    # The helpers below build payloads the way encode() does: this one must pass, so each
    # rejection below is due to the one change made.
    assert Entry.decode(pack(record_of(make_entry()))) == make_entry()


def _without(name: str) -> dict[str, Any]:
    record = record_of(make_entry())
    del record[name]
    return record


def _with(**changes: Any) -> dict[str, Any]:
    record = record_of(make_entry())
    record.update(changes)
    return record


def _with_provenance(**changes: Any) -> dict[str, Any]:
    record = record_of(make_entry())
    record["provenance"] = {**record["provenance"], **changes}
    return record


_PROVENANCE_MISSING = record_of(make_entry())
del _PROVENANCE_MISSING["provenance"]["created"]

BAD_RECORDS = {
    **{f"missing {name}": _without(name) for name in entry_module._SCHEMA},
    "extra field": _with(extra=1),
    "not a map": list(record_of(make_entry()).values()),
    "nil": None,
    "int": 7,
    "bool for int": _with(num_warps=True),
    "bool for shared": _with(shared=False),
    "float for int": _with(shared=1.0),
    "str for int": _with(num_warps="4"),
    "negative int": _with(shared=-1),
    "int too large": _with(shared=2**32),
    "int for str": _with(name=5),
    "bytes for str": _with(name=b"flash_fwd_kernel"),
    "str for bytes": _with(binary="\x7fELF"),
    "empty binary": _with(binary=b""),
    "nil binary": _with(binary=None),
    "str for list": _with(arg_types="*fp16"),
    "map for list": _with(hidden_args={}),
    "int in arg_types": _with(arg_types=["*fp16", 3]),
    "nil in hidden_args": _with(hidden_args=[None]),
    "list for provenance": _with(provenance=["triton"]),
    "bad kind": _with(kind="ptx"),
    "zero warps": _with(num_warps=0),
    "too many warps": _with(num_warps=64),
    "warp size 16": _with(warp_size=16),
    "provenance missing field": _PROVENANCE_MISSING,
    "provenance extra field": _with_provenance(host="node1"),
    "provenance int for float": _with_provenance(created=1700000000),
    "provenance str for float": _with_provenance(created="now"),
    "provenance bool for int": _with_provenance(launch_abi=True),
    "provenance int for str": _with_provenance(compiler=1),
    "string too long": _with(name="x" * (entry_module.MAX_STR + 1)),
    "array too long": _with(arg_types=["i32"] * (entry_module.MAX_ARRAY + 1)),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_schema_violations_are_rejected(case: str) -> None:
    with pytest.raises(EntryError):
        Entry.decode(pack(BAD_RECORDS[case]))


def test_bytes_map_keys_are_rejected() -> None:
    record = {name.encode(): value for name, value in record_of(make_entry()).items()}
    with pytest.raises(EntryError):
        Entry.decode(pack(record))


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"\x81", b"\xdf\xff\xff\xff\xff", b"\xc7\x01\x05x",
    msgpack.packb(record_of(make_entry()), use_bin_type=True) + b"\x00",  # trailing data
    msgpack.packb(record_of(make_entry()), use_bin_type=True)[:-1],  # valid checksum, truncated msgpack
])
def test_invalid_msgpack_with_a_valid_checksum_is_rejected(payload: bytes) -> None:
    with pytest.raises(EntryError):
        Entry.decode(frame(payload))


def test_entry_error_is_a_value_error() -> None:
    assert issubclass(EntryError, ValueError)
