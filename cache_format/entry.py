r"""Entry: one compiled kernel and all that is needed to launch it without Triton.

Bytes on disk (see SPEC.md):

    offset  size  field
    0       8     magic  b"LTENTRY\\0"
    8       4     format version, uint32 little-endian (1, or 2 when it holds host descriptors)
    12      4     payload length, uint32 little-endian
    16      8     xxh3-64 of the payload, uint64 little-endian
    24      n     payload: a msgpack map (schema in ``_SCHEMA``)

Decoding is bounded (entry, binary and string sizes, array lengths) and
checks the checksum before msgpack ever sees the payload, then every field's
type. Anything off raises ``EntryError``; nothing partial is returned.
"""

from __future__ import annotations

import struct
from typing import Any

import xxhash

from lazytriton.cache_format import mpack, tensordesc
from lazytriton.cache_format.tensordesc import TensorDescMeta
from lazytriton.record import asdict, field, record

MAGIC = b"LTENTRY\0"
# Version 2 adds one key, ``tensordesc_meta``, to entries with host tensor descriptor parameters. Entries
# without them are still written as version 1, byte for byte as before; a reader that knows only version 1
# refuses a version 2 entry on its version field (it could not launch it).
FORMAT_VERSION = 1
FORMAT_VERSION_DESCRIPTORS = 2
FORMAT_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_DESCRIPTORS)
_HEADER = struct.Struct("<8sIIQ")
HEADER_SIZE = _HEADER.size

# Bounds on what a decoder accepts. The largest attention cubin seen is under
# 1 MiB; 64 MiB leaves room while refusing a hostile multi-GB allocation.
MAX_ENTRY_BYTES = 64 << 20
MAX_STR = 4096
MAX_ARRAY = 256


class EntryError(ValueError):
    """Bytes that are not a valid entry: truncated, corrupt or malformed."""


@record
class Provenance:
    """Where an entry came from. Informational: never part of the key."""

    compiler: str
    compiler_version: str
    source_fingerprint: str
    created: float
    launch_abi: int


@record
class Entry:
    """A compiled kernel with its launch metadata.

    ``arg_types`` are the kernel's runtime parameters in order (Triton type
    strings such as ``*bf16``, ``i64``, ``fp32``); ``hidden_args`` are the
    pointers the compiler appends after them (``global_scratch``,
    ``profile_scratch``), passed as NULL when their size is 0.
    ``tensordesc_meta`` says, for each ``tensordesc<...>`` parameter in
    order, how the launcher encodes its CUtensorMap (``tensordesc.py``).
    """

    key: str
    variant: str
    target: str
    kind: str
    binary: bytes = field(repr=False)
    name: str
    num_warps: int
    num_ctas: int
    warp_size: int
    shared: int
    global_scratch_size: int
    global_scratch_align: int
    profile_scratch_size: int
    profile_scratch_align: int
    arg_types: tuple[str, ...]
    hidden_args: tuple[str, ...]
    provenance: Provenance
    tensordesc_meta: tuple[TensorDescMeta, ...] = ()

    @property
    def block_threads(self) -> int:
        """Threads per program: warp size times warps."""
        return self.warp_size * self.num_warps

    def encode(self) -> bytes:
        """The entry as bytes: header, then the msgpack payload."""
        record = asdict(self)
        record["arg_types"] = list(self.arg_types)
        record["hidden_args"] = list(self.hidden_args)
        version = FORMAT_VERSION
        if self.tensordesc_meta:
            version = FORMAT_VERSION_DESCRIPTORS
            record["tensordesc_meta"] = [asdict(meta) | {"block_size": list(meta.block_size)}
                                         for meta in self.tensordesc_meta]
        else:
            del record["tensordesc_meta"]
        payload = mpack.packb(record)
        return _HEADER.pack(MAGIC, version, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload

    @classmethod
    def decode(cls, data: bytes | memoryview, expected_key: str | None = None) -> Entry:
        """Verify and decode bytes made by ``encode``; raise EntryError if anything is off."""
        if len(data) < HEADER_SIZE:
            raise EntryError(f"entry truncated: {len(data)} bytes, header needs {HEADER_SIZE}")
        if len(data) > MAX_ENTRY_BYTES:
            raise EntryError(f"entry of {len(data)} bytes exceeds the {MAX_ENTRY_BYTES} byte bound")
        magic, version, length, checksum = _HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            raise EntryError(f"not an entry: magic {magic!r}")
        if version not in FORMAT_VERSIONS:
            raise EntryError(f"entry format version {version} is not one of {FORMAT_VERSIONS}")
        if length != len(data) - HEADER_SIZE:
            raise EntryError(f"entry payload is {len(data) - HEADER_SIZE} bytes, header says {length}")
        payload = memoryview(data)[HEADER_SIZE:]
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            raise EntryError("entry checksum mismatch")
        try:
            record = mpack.unpackb(payload, max_bin_len=MAX_ENTRY_BYTES, max_str_len=MAX_STR,
                                   max_array_len=MAX_ARRAY, max_map_len=64)
        except ValueError as exc:
            raise EntryError(f"entry payload is not valid msgpack: {exc}") from None
        entry = _from_record(record, version)
        if expected_key is not None and entry.key != expected_key:
            raise EntryError(f"entry holds key {entry.key}, expected {expected_key}")
        return entry


_SCHEMA: dict[str, type] = {
    "key": str, "variant": str, "target": str, "kind": str, "binary": bytes, "name": str,
    "num_warps": int, "num_ctas": int, "warp_size": int, "shared": int,
    "global_scratch_size": int, "global_scratch_align": int,
    "profile_scratch_size": int, "profile_scratch_align": int,
    "arg_types": list, "hidden_args": list, "provenance": dict,
}
_SCHEMA_V2: dict[str, type] = {**_SCHEMA, "tensordesc_meta": list}
_DESCRIPTOR: dict[str, type] = {"swizzle": int, "elem_size": int, "elem_type": int, "block_size": list}
_PROVENANCE: dict[str, type] = {
    "compiler": str, "compiler_version": str, "source_fingerprint": str, "created": float, "launch_abi": int,
}


def _check_fields(record: Any, schema: dict[str, type], what: str) -> None:
    if not isinstance(record, dict) or set(record) != set(schema):
        # Keys may be bytes among str (msgpack bin keys): sort their reprs, never the keys themselves.
        got = sorted(map(repr, record)) if isinstance(record, dict) else type(record).__name__
        raise EntryError(f"{what} fields are {got}, expected {sorted(schema)}")
    for name, kind in schema.items():
        value = record[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise EntryError(f"{what} field {name} is {type(value).__name__}, expected {kind.__name__}")
        if isinstance(value, int) and not 0 <= value < 1 << 32:
            raise EntryError(f"{what} field {name}={value} is out of range")


def _descriptors(items: list[Any]) -> tuple[TensorDescMeta, ...]:
    if not items:
        raise EntryError("entry format version 2 with no tensordesc_meta (version 1 is written for those)")
    metas = []
    for item in items:
        _check_fields(item, _DESCRIPTOR, "entry tensordesc_meta")
        block = item["block_size"]
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in block):
            raise EntryError(f"entry tensordesc_meta block_size {block!r} must hold ints")
        metas.append(TensorDescMeta(item["swizzle"], item["elem_size"], item["elem_type"], tuple(block)))
    return tuple(metas)


def _from_record(record: Any, version: int = FORMAT_VERSION) -> Entry:
    _check_fields(record, _SCHEMA_V2 if version == FORMAT_VERSION_DESCRIPTORS else _SCHEMA, "entry")
    _check_fields(record["provenance"], _PROVENANCE, "entry provenance")
    metas = _descriptors(record["tensordesc_meta"]) if version == FORMAT_VERSION_DESCRIPTORS else ()
    for name in ("arg_types", "hidden_args"):
        if not all(isinstance(item, str) for item in record[name]):
            raise EntryError(f"entry field {name} must hold strings")
    if record["kind"] not in ("cubin", "hsaco"):
        raise EntryError(f"entry kind {record['kind']!r} is not cubin or hsaco")
    if not record["binary"]:
        raise EntryError("entry binary is empty")
    if not 1 <= record["num_warps"] <= 32 or record["warp_size"] not in (32, 64):
        raise EntryError(f"entry num_warps={record['num_warps']} warp_size={record['warp_size']} are not sane")
    try:
        tensordesc.check(tuple(record["arg_types"]), metas)
    except ValueError as exc:
        raise EntryError(f"entry host descriptors: {exc}") from None
    fields = dict(record)
    fields["tensordesc_meta"] = metas
    fields["arg_types"] = tuple(record["arg_types"])
    fields["hidden_args"] = tuple(record["hidden_args"])
    fields["provenance"] = Provenance(**record["provenance"])
    return Entry(**fields)
