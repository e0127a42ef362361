"""Decoders of untrusted bytes, driven by hypothesis: any input gives a valid value or the module's own error.

Entry.decode gives an Entry or EntryError; envelope.unseal an Entry or Rejected; an Image opens or raises
ImageError, and every read of an opened one gives an Entry, None or ImageError. Inputs: random bytes, and
mutations of valid encodings (flipped bytes, truncations), valid checksums over bad content (the checksums
recomputed after the damage) and a wrong type in every field. Anything else (TypeError, KeyError,
zstandard.ZstdError, ...) fails the test.
"""

from __future__ import annotations

import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytriton.cache_format import Entry, EntryError, Provenance
from lazytriton.cache_format import entry as entry_format
from lazytriton.cache_format.envelope import Rejected, seal, unseal
from lazytriton.cache_format.image import HEADER_SIZE, RECORD_SIZE, Image, ImageError, write_image

# ~200 examples a test keeps the file under a minute on a loaded 2-core machine.
PROPERTY = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SIGNING_KEY = b"k" * 32
HEADER = struct.Struct("<8sIIQ")
IMAGE_HEADER = struct.Struct("<8sIIII6Q3Q")
RECORD = struct.Struct("<16sQIIQ")


def make_entry(i: int = 0, size: int = 3000) -> Entry:
    key = xxhash.xxh3_128_hexdigest(f"property:{i}".encode())
    body = bytes((j * 7 + i) % 251 for j in range(size))
    return Entry(key=key, variant="flash_fwd:sm_90:fp16:::", target="sm_90", kind="cubin", binary=b"\x7fELF" + body,
                 name="flash_fwd_kernel", num_warps=4, num_ctas=1, warp_size=32, shared=1024,
                 global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
                 arg_types=("*fp16", "i32"), hidden_args=("global_scratch", "profile_scratch"),
                 provenance=Provenance("triton", "3.9.0", "0123456789abcdef", 1.5e9, 1))


ENTRY = make_entry()
ENCODED = ENTRY.encode()
RECORD_FIELDS = msgpack.unpackb(ENCODED[HEADER.size:], raw=False)

# Any msgpack value: what a hostile writer can put in any field, at any depth.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=8), st.binary(max_size=8)), inner, max_size=4)), max_leaves=12)


def with_header(payload: bytes) -> bytes:
    """An entry header with a valid checksum over ``payload``, whatever it holds."""
    return HEADER.pack(entry_format.MAGIC, entry_format.FORMAT_VERSION, len(payload),
                       xxhash.xxh3_64_intdigest(payload)) + payload


def decode_entry(data: bytes) -> Entry | None:
    try:
        return Entry.decode(data, expected_key=ENTRY.key)
    except EntryError:
        return None


def flip(data: bytes, positions: list[int], xor: int) -> bytes:
    out = bytearray(data)
    for p in positions:
        out[p % len(out)] ^= xor
    return bytes(out)


# --- entries -----------------------------------------------------------------------------------------------------


def test_a_bytes_key_among_str_keys_is_an_entry_error() -> None:
    """Issue 13, finding 3: the error path itself raised TypeError (sorted() over str and bytes keys)."""
    fields = dict(RECORD_FIELDS)
    fields[b"key"] = fields.pop("key")
    with pytest.raises(EntryError, match="fields are"):
        Entry.decode(with_header(msgpack.packb(fields, use_bin_type=True)))
    provenance = dict(RECORD_FIELDS, provenance={**RECORD_FIELDS["provenance"], b"extra": 1})
    with pytest.raises(EntryError, match="provenance fields"):
        Entry.decode(with_header(msgpack.packb(provenance, use_bin_type=True)))


@PROPERTY
@given(st.binary(max_size=400))
def test_entry_random_bytes(data: bytes) -> None:
    decode_entry(data)
    decode_entry(entry_format.MAGIC + data)


@PROPERTY
@given(st.lists(st.integers(0, len(ENCODED) - 1), min_size=1, max_size=4, unique=True), st.integers(1, 255),
       st.integers(0, len(ENCODED)))
def test_entry_flipped_and_truncated(positions: list[int], xor: int, cut: int) -> None:
    assert decode_entry(flip(ENCODED, positions, xor)) is None, "a flipped byte is caught (header or checksum)"
    assert decode_entry(ENCODED[:cut]) == (ENTRY if cut == len(ENCODED) else None)


@PROPERTY
@given(st.binary(max_size=400))
def test_entry_valid_checksum_over_random_payload(payload: bytes) -> None:
    decode_entry(with_header(payload))


@PROPERTY
@given(values)
def test_entry_valid_checksum_over_any_msgpack_value(value: Any) -> None:
    assert decode_entry(with_header(msgpack.packb(value, use_bin_type=True))) is None


def mutated_fields(name: str, value: Any, how: str) -> dict[Any, Any]:
    """The valid entry's fields with ``name`` replaced by ``value``, dropped, keyed by bytes, or ``value`` added."""
    fields = dict(RECORD_FIELDS)
    if how == "replace":
        fields[name] = value
    elif how == "drop":
        del fields[name]
    elif how == "bytes-key":
        fields[name.encode()] = fields.pop(name)
    elif how == "extra":
        fields["zz_" + name] = value
    return fields


@PROPERTY
@given(st.sampled_from(sorted(RECORD_FIELDS)), values, st.sampled_from(["replace", "drop", "bytes-key", "extra"]))
def test_entry_wrong_type_in_every_field(name: str, value: Any, how: str) -> None:
    decoded = decode_entry(with_header(msgpack.packb(mutated_fields(name, value, how), use_bin_type=True)))
    assert decoded is None or (how == "replace" and decoded.key == ENTRY.key)


@PROPERTY
@given(st.sampled_from(sorted(RECORD_FIELDS["provenance"])), values, st.booleans())
def test_entry_wrong_type_in_every_provenance_field(name: str, value: Any, bytes_key: bool) -> None:
    provenance = dict(RECORD_FIELDS["provenance"])
    if bytes_key:
        provenance[name.encode()] = provenance.pop(name)
    else:
        provenance[name] = value
    decode_entry(with_header(msgpack.packb(dict(RECORD_FIELDS, provenance=provenance), use_bin_type=True)))


# --- shared-tier envelopes ---------------------------------------------------------------------------------------


def open_envelope(data: bytes, signing_key: bytes | None) -> Entry | None:
    try:
        return unseal(data, ENTRY.key, signing_key)
    except Rejected:
        return None


SEALED = {(signed, size): seal(make_entry(0, size).encode(), SIGNING_KEY if signed else None)
          for signed in (False, True) for size in (100, 3000)}


@PROPERTY
@given(st.binary(max_size=300), st.booleans())
def test_envelope_random_bytes(data: bytes, signed: bool) -> None:
    key = SIGNING_KEY if signed else None
    open_envelope(data, key)
    open_envelope(b"LTSHARE\0" + data, key)


@PROPERTY
@given(st.sampled_from(sorted(SEALED)), st.lists(st.integers(0, 1 << 20), min_size=1, max_size=3),
       st.integers(1, 255), st.integers(0, 1 << 20), st.booleans())
def test_envelope_flipped_and_truncated(which: tuple[bool, int], positions: list[int], xor: int, cut: int,
                                        check: bool) -> None:
    sealed = SEALED[which]
    key = SIGNING_KEY if check else None
    open_envelope(flip(sealed, positions, xor), key)
    open_envelope(sealed[:cut % (len(sealed) + 1)], key)


@PROPERTY
@given(st.binary(max_size=3000), st.booleans(), st.booleans())
def test_envelope_valid_mac_over_bad_content(content: bytes, as_entry: bool, signed: bool) -> None:
    """Sealed (so header, sizes and MAC are right) over random bytes, or over an entry with a random payload."""
    inner = with_header(content) if as_entry else content
    key = SIGNING_KEY if signed else None
    assert open_envelope(seal(inner, key), key) is None


@PROPERTY
@given(st.binary(min_size=1, max_size=2000), st.integers(0, 1 << 16))
def test_envelope_bad_zstd_frames(frame_tail: bytes, claimed: int) -> None:
    """A compressed envelope whose frame is junk after a valid zstd magic, with any declared entry length."""
    payload = b"\x28\xb5\x2f\xfd" + frame_tail
    header = struct.pack("<8sBBHII", b"LTSHARE\0", 1, 0x02, 0, len(payload), claimed)
    open_envelope(header + bytes(32) + payload, None)


# --- images ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory)


def image_bytes(codec: str) -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "valid.ltimg"
        write_image(path, [make_entry(i, 2000 + 100 * i) for i in range(10)], codec=codec, level=3,
                    dict_bytes=4096)
        return path.read_bytes()


IMAGES = {codec: image_bytes(codec) for codec in ("none", "zstd", "zstd-dict")}


def exercise_image(path: Path, data: bytes) -> int:
    """Open ``data`` as an image and read all of it; the entries that came out valid (errors: ImageError only)."""
    path.write_bytes(data)
    try:
        image = Image(path)
    except ImageError:
        return -1
    good = 0
    with image:
        for key in image.keys():
            key in image  # noqa: B015 - the lookup itself is exercised
            try:
                good += image.read(key) is not None
            except ImageError:
                pass
        image.verify()
        assert image.read("0" * 32) is None or True
    return good


def reseal(data: bytes) -> bytes:
    """``data`` with every checksum recomputed (blobs, index, dictionary+meta, header), where the header fits."""
    if len(data) < HEADER_SIZE:
        return data
    fields = list(IMAGE_HEADER.unpack_from(data, 0))
    dict_off, dict_len, index_off, index_len, meta_off, meta_len = fields[5:11]
    out = bytearray(data)
    if index_off + index_len <= len(out) and index_len % RECORD_SIZE == 0:
        for i in range(index_len // RECORD_SIZE):
            at = index_off + i * RECORD_SIZE
            raw_key, offset, stored, raw_len, _ = RECORD.unpack_from(out, at)
            if offset + stored <= len(out):
                RECORD.pack_into(out, at, raw_key, offset, stored, raw_len,
                                 xxhash.xxh3_64_intdigest(bytes(out[offset:offset + stored])))
        fields[11] = xxhash.xxh3_64_intdigest(bytes(out[index_off:index_off + index_len]))
    fields[12] = xxhash.xxh3_64_intdigest(bytes(out[dict_off:dict_off + dict_len] + out[meta_off:meta_off + meta_len]))
    header = IMAGE_HEADER.pack(*fields[:13], 0)
    out[:HEADER_SIZE] = header[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(header[:-8]))
    return bytes(out)


def sections(data: bytes) -> dict[str, tuple[int, int]]:
    fields = IMAGE_HEADER.unpack_from(data, 0)
    return {"dict": (fields[5], fields[6]), "index": (fields[7], fields[8]), "meta": (fields[9], fields[10]),
            "blobs": (fields[5] + fields[6], fields[7] - fields[5] - fields[6])}


def replace_section(data: bytes, name: str, content: bytes) -> bytes:
    """``data`` with one section's bytes replaced by ``content`` (offsets after it shifted), resealed."""
    fields = list(IMAGE_HEADER.unpack_from(data, 0))
    start, length = sections(data)[name]
    delta = len(content) - length
    grown = data[:start] + content + data[start + length:]
    if name == "dict":
        fields[6] += delta
        fields[7] += delta
        fields[9] += delta
        out = bytearray(grown)
        for i in range(fields[8] // RECORD_SIZE):  # blobs moved with the dictionary
            at = fields[7] + i * RECORD_SIZE
            raw_key, offset, stored, raw_len, blob_sum = RECORD.unpack_from(out, at)
            RECORD.pack_into(out, at, raw_key, offset + delta, stored, raw_len, blob_sum)
        grown = bytes(out)
    elif name == "meta":
        fields[10] += delta
    elif name == "index":
        fields[8] += delta
        fields[9] += delta
    header = IMAGE_HEADER.pack(*fields)
    return reseal(header + grown[HEADER_SIZE:])


@PROPERTY
@given(st.binary(max_size=600))
def test_image_random_bytes(scratch: Path, data: bytes) -> None:
    exercise_image(scratch / "random.ltimg", data)
    exercise_image(scratch / "random.ltimg", reseal(b"LTIMAGE\0\x01\0\0\0" + data))


@PROPERTY
@given(st.sampled_from(sorted(IMAGES)), st.lists(st.integers(0, 1 << 20), min_size=1, max_size=4),
       st.integers(1, 255), st.integers(0, 1 << 20))
def test_image_flipped_and_truncated(scratch: Path, codec: str, positions: list[int], xor: int, cut: int) -> None:
    data = IMAGES[codec]
    flipped = flip(data, positions, xor)
    exercise_image(scratch / "flipped.ltimg", flipped)
    exercise_image(scratch / "resealed.ltimg", reseal(flipped))
    exercise_image(scratch / "truncated.ltimg", data[:cut % len(data)])
    exercise_image(scratch / "truncated.ltimg", reseal(data[:cut % len(data)]))


@PROPERTY
@given(st.sampled_from(sorted(IMAGES)), st.integers(3, 13), st.integers(0, 2**64 - 1))
def test_image_header_fields_of_any_value(scratch: Path, codec: str, field: int, value: int) -> None:
    """Counts, offsets and lengths of any value under a valid header checksum."""
    fields = list(IMAGE_HEADER.unpack_from(IMAGES[codec], 0))
    fields[field] = value % (2**32 if field < 5 else 2**64)
    exercise_image(scratch / "header.ltimg", reseal(IMAGE_HEADER.pack(*fields) + IMAGES[codec][HEADER_SIZE:]))


@PROPERTY
@given(values)
def test_image_meta_of_any_type(scratch: Path, meta: Any) -> None:
    data = replace_section(IMAGES["zstd"], "meta", msgpack.packb(meta, use_bin_type=True))
    exercise_image(scratch / "meta.ltimg", data)


@PROPERTY
@given(st.binary(max_size=3000), st.booleans(), st.booleans())
def test_image_crafted_dictionary(scratch: Path, tail: bytes, dict_magic: bool, compressed: bool) -> None:
    """Finding 6: a dictionary with a valid magic and bad tables is an ImageError, never a ZstdError."""
    raw = (b"\x37\xa4\x30\xec" if dict_magic else b"") + tail
    section = zstandard.ZstdCompressor(level=1).compress(raw) if compressed else raw
    exercise_image(scratch / "dict.ltimg", replace_section(IMAGES["zstd-dict"], "dict", section))


@PROPERTY
@given(st.integers(0, 9), st.one_of(st.binary(max_size=400), values.map(lambda v: msgpack.packb(v))),
       st.booleans(), st.booleans())
def test_image_blob_with_valid_checksums_over_bad_content(scratch: Path, which: int, content: bytes,
                                                         as_entry: bool, keep_raw_len: bool) -> None:
    """One entry's blob replaced by a well-formed zstd frame of junk (or of an entry header over junk)."""
    data = bytearray(IMAGES["zstd"])
    index_off = sections(bytes(data))["index"][0]
    raw_key, offset, stored, raw_len, _ = RECORD.unpack_from(data, index_off + which * RECORD_SIZE)
    raw = with_header(content) if as_entry else content
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
    blobs_end = index_off
    rebuilt = bytes(data[:offset]) + frame + bytes(data[offset + stored:])
    delta = len(frame) - stored
    out = bytearray(rebuilt)
    fields = list(IMAGE_HEADER.unpack_from(out, 0))
    fields[7] += delta
    fields[9] += delta
    for i in range(fields[3]):
        at = fields[7] + i * RECORD_SIZE
        key_i, off_i, stored_i, raw_i, sum_i = RECORD.unpack_from(out, at)
        if i == which:
            stored_i, raw_i = len(frame), raw_len if keep_raw_len else len(raw)
        elif off_i > offset:
            off_i += delta
        RECORD.pack_into(out, at, key_i, off_i, stored_i, raw_i, sum_i)
    assert blobs_end + delta == fields[7]
    out[:HEADER_SIZE] = IMAGE_HEADER.pack(*fields)
    good = exercise_image(scratch / "blob.ltimg", reseal(bytes(out)))
    assert good <= 9, "the replaced entry never decodes (its key or checksum cannot match)"
