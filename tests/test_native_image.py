"""The native core's readers (capi/native) against the Python ones: same entries, same verdicts on hostile bytes.

Valid images written by the Python writer (synthetic entries under each codec, real sm_90 cubins, a
host-descriptor entry) read back through the C reader give byte-identical binaries and identical
metadata. Damaged ones (a truncation at every offset, a flipped bit at every byte, and the hypothesis
strategies of tests/test_decoders_property.py) get the Python reader's verdict, open or refused and
each entry read or refused, with a status, from a driver built with AddressSanitizer and UBSan where
they run: a crash, a sanitizer finding or a hang fails the test.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import test_decoders_property as props
import xxhash
import zstandard
from compiled_once import compiled, shared_dir, small_variant
from hypothesis import given
from hypothesis import strategies as st
from nativelib import STATUS, Driver, build_driver

from lazytriton.cache_format import Entry, EntryError, Provenance
from lazytriton.cache_format.image import Image, ImageError, write_image
from lazytriton.cache_format.tensordesc import TensorDescMeta
from lazytriton.record import asdict

PROPERTY = props.PROPERTY


@pytest.fixture(scope="module")
def driver_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    program, _ = build_driver(tmp_path_factory.mktemp("native"))
    return program


@pytest.fixture(scope="module")
def driver(driver_program: Path) -> Iterator[Driver]:
    served = Driver(driver_program)
    yield served
    served.close()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile")


# --- what each side makes of an image ----------------------------------------------------------------------------


def python_verdict(path: Path) -> dict[str, Any]:
    """The Python reader's verdict in the driver's shape: opened or not, each index record's read, an absent key."""
    try:
        image = Image(path)
    except (ImageError, OSError):
        return {"open": False}
    with image:
        reads = []
        for key in image.keys():
            try:
                reads.append("ok" if image.read(key) is not None else "absent")
            except ImageError as exc:
                zstd = "does not decompress: decompression error" in str(exc) or "dictionary is damaged" in str(exc)
                reads.append("damaged-in-zstd" if zstd else "damaged")
        absent = image.read("0" * 32)
        return {"open": True, "count": image.count, "misordered": len(image.check_order()), "reads": reads,
                "absent": "absent" if absent is None else "ok"}


def c_verdict(driver: Driver, path: Path) -> dict[str, Any]:
    answer = driver.image(path)
    if answer["open"] != 0:
        assert answer["open"] in (2, 3), answer  # damaged, or the file cannot be read: never anything else
        return {"open": False}
    reads = [STATUS[s] for s in answer["reads"]]
    assert set(reads) <= {"ok", "absent", "damaged"}, answer
    return {"open": True, "count": answer["count"], "misordered": answer["misordered"],
            "reads": reads, "absent": STATUS[answer["absent"]]}


def same_verdict(driver: Driver, path: Path, data: bytes) -> dict[str, Any]:
    """Both readers' verdicts on ``data``, which must agree; the Python one.

    One leeway: a frame that python-zstandard's libzstd (1.5.7) calls corrupt while the system's (1.5.4,
    which the C reader links) decodes it, flipped bits in a stream's padding, say. The C reader serves that
    entry only if it then passes every entry check, its payload checksum included: the bytes written.
    """
    path.write_bytes(data)
    expected = python_verdict(path)
    got = c_verdict(driver, path)
    if expected["open"] and got["open"]:
        expected["reads"] = [mine if theirs == "damaged-in-zstd" and mine in ("ok", "damaged") else theirs
                             for theirs, mine in zip(expected["reads"], got["reads"], strict=False)]
    assert got == expected
    return expected


def python_entry_verdict(data: bytes, key: str | None) -> bool:
    try:
        Entry.decode(data, expected_key=key)
    except EntryError:
        return False
    return True


def same_entry_verdict(driver: Driver, path: Path, data: bytes, key: str | None = props.ENTRY.key) -> None:
    path.write_bytes(data)
    answer = driver.entry(path, key)
    assert answer["status"] in (0, 2), answer
    assert (answer["status"] == 0) == python_entry_verdict(data, key), answer


# --- valid images: the same entries, byte for byte ----------------------------------------------------------------


def expected_record(entry: Entry) -> dict[str, Any]:
    record = asdict(entry)
    record["binary_size"] = len(record.pop("binary"))
    record["format_version"] = 2 if entry.tensordesc_meta else 1
    record["arg_types"], record["hidden_args"] = list(entry.arg_types), list(entry.hidden_args)
    record["provenance"] = asdict(entry.provenance)
    record["tensordesc_meta"] = [asdict(m) | {"block_size": list(m.block_size)} for m in entry.tensordesc_meta]
    return record


def descriptor_entry() -> Entry:
    """An entry of format version 2: two host descriptors (a real Gluon kernel's parameter types)."""
    base = props.make_entry(99, 5000)
    kinds = ("tensordesc<bf16[1, 1, 64, 128],NVMMASharedLayout(swizzle_byte_width=128)>", "i32",
             "tensordesc<fp32[128]>")
    metas = (TensorDescMeta(3, 2, 10, (1, 1, 64, 64)), TensorDescMeta(0, 4, 7, (128,)))
    return Entry(**{**asdict(base), "provenance": base.provenance, "arg_types": kinds, "tensordesc_meta": metas})


@pytest.fixture(scope="module")
def real_entries(tmp_path_factory: pytest.TempPathFactory) -> list[Entry]:
    """Real sm_90 cubins (Triton compiles them on the CPU)."""
    directory = shared_dir(tmp_path_factory)
    return [compiled(small_variant("sm_90", causal), directory) for causal in (False, True)]


def dumped(program: Path, image: Path, out: Path) -> dict[str, dict[str, Any]]:
    out.mkdir()
    done = subprocess.run([str(program), "dump", str(image), str(out)], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return {record["key"]: record for record in map(json.loads, done.stdout.splitlines())}


@pytest.mark.parametrize("codec", ["none", "zstd", "zstd-dict"])
def test_every_entry_reads_back_identical(tmp_path: Path, driver_program: Path, real_entries: list[Entry],
                                          codec: str) -> None:
    entries = [props.make_entry(i, 2000 + 300 * i) for i in range(12)] + real_entries + [descriptor_entry()]
    image = tmp_path / "image.ltimg"
    info = write_image(image, entries, codec=codec, level=3)
    assert info.codec == codec
    records = dumped(driver_program, image, tmp_path / "out")
    assert sorted(records) == sorted(entry.key for entry in entries)
    for entry in entries:
        assert records[entry.key] == expected_record(entry)
        assert (tmp_path / "out" / f"{entry.key}.bin").read_bytes() == entry.binary


def test_keys_that_are_not_hex_are_argument_errors_and_absent_keys_absent(tmp_path: Path, driver: Driver) -> None:
    image = tmp_path / "image.ltimg"
    write_image(image, [props.make_entry(i) for i in range(3)], codec="zstd", level=3)
    answer = driver.image(image)
    assert answer["open"] == 0 and answer["reads"] == [0, 0, 0] and answer["absent"] == 1
    entry_file = tmp_path / "entry"
    entry_file.write_bytes(props.ENCODED)
    assert driver.entry(entry_file, props.ENTRY.key)["status"] == 0
    other = xxhash.xxh3_128_hexdigest(b"other")
    refused = driver.entry(entry_file, other)
    assert refused["status"] == 2 and f"expected {other}" in refused["error"]


def test_files_that_are_not_regular_files_are_refused(tmp_path: Path, driver: Driver) -> None:
    import os

    fifo = tmp_path / "fifo.ltimg"
    os.mkfifo(fifo)
    assert driver.image(fifo)["open"] == 2  # O_NONBLOCK: the open returns, fstat refuses
    assert driver.image(tmp_path)["open"] == 2
    assert driver.image(tmp_path / "missing.ltimg")["open"] == 3


# --- damaged images: every truncation, every flipped byte ----------------------------------------------------------


def test_a_truncation_at_every_offset_gets_the_python_verdict(scratch: Path, driver: Driver) -> None:
    data = props.IMAGES["zstd-dict"]  # 2 KB: header, dictionary, blobs, index and meta
    for cut in range(len(data)):
        verdict = same_verdict(driver, scratch / "cut.ltimg", data[:cut])
        assert not verdict["open"]
        same_verdict(driver, scratch / "cut-resealed.ltimg", props.reseal(data[:cut]))


def test_a_flipped_bit_at_every_byte_gets_the_python_verdict(scratch: Path, driver: Driver) -> None:
    data = props.IMAGES["zstd-dict"]
    for at in range(len(data)):
        flipped = props.flip(data, [at], 1 << (at % 8))
        verdict = same_verdict(driver, scratch / "flip.ltimg", flipped)
        assert not verdict["open"] or "damaged" in verdict["reads"]
        same_verdict(driver, scratch / "flip-resealed.ltimg", props.reseal(flipped))


# --- the hypothesis strategies of the Python decoders' property tests ----------------------------------------------


@PROPERTY
@given(st.binary(max_size=600))
def test_image_random_bytes(scratch: Path, driver: Driver, data: bytes) -> None:
    same_verdict(driver, scratch / "random.ltimg", data)
    same_verdict(driver, scratch / "random.ltimg", props.reseal(b"LTIMAGE\0\x01\0\0\0" + data))


@PROPERTY
@given(st.sampled_from(sorted(props.IMAGES)), st.lists(st.integers(0, 1 << 20), min_size=1, max_size=4),
       st.integers(1, 255), st.integers(0, 1 << 20))
def test_image_flipped_and_truncated(scratch: Path, driver: Driver, codec: str, positions: list[int], xor: int,
                                     cut: int) -> None:
    data = props.IMAGES[codec]
    flipped = props.flip(data, positions, xor)
    same_verdict(driver, scratch / "flipped.ltimg", flipped)
    same_verdict(driver, scratch / "resealed.ltimg", props.reseal(flipped))
    same_verdict(driver, scratch / "truncated.ltimg", props.reseal(data[:cut % len(data)]))


@PROPERTY
@given(st.sampled_from(sorted(props.IMAGES)), st.integers(3, 13), st.integers(0, 2**64 - 1))
def test_image_header_fields_of_any_value(scratch: Path, driver: Driver, codec: str, field: int, value: int) -> None:
    fields = list(props.IMAGE_HEADER.unpack_from(props.IMAGES[codec], 0))
    fields[field] = value % (2**32 if field < 5 else 2**64)
    data = props.reseal(props.IMAGE_HEADER.pack(*fields) + props.IMAGES[codec][props.HEADER_SIZE:])
    same_verdict(driver, scratch / "header.ltimg", data)


@PROPERTY
@given(props.values)
def test_image_meta_of_any_type(scratch: Path, driver: Driver, meta: Any) -> None:
    data = props.replace_section(props.IMAGES["zstd"], "meta", msgpack.packb(meta, use_bin_type=True))
    same_verdict(driver, scratch / "meta.ltimg", data)


@PROPERTY
@given(st.binary(max_size=3000), st.booleans(), st.booleans())
def test_image_crafted_dictionary(scratch: Path, driver: Driver, tail: bytes, dict_magic: bool,
                                  compressed: bool) -> None:
    raw = (b"\x37\xa4\x30\xec" if dict_magic else b"") + tail
    section = zstandard.ZstdCompressor(level=1).compress(raw) if compressed else raw
    same_verdict(driver, scratch / "dict.ltimg", props.replace_section(props.IMAGES["zstd-dict"], "dict", section))


@PROPERTY
@given(st.integers(0, 9), st.one_of(st.binary(max_size=400), props.values.map(lambda v: msgpack.packb(v))),
       st.booleans(), st.booleans())
def test_image_blob_with_valid_checksums_over_bad_content(scratch: Path, driver: Driver, which: int, content: bytes,
                                                         as_entry: bool, keep_raw_len: bool) -> None:
    data = props.IMAGES["zstd"]
    index_off = props.sections(data)["index"][0]
    raw_key, offset, stored, raw_len, _ = props.RECORD.unpack_from(data, index_off + which * props.RECORD_SIZE)
    raw = props.with_header(content) if as_entry else content
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
    out = bytearray(data[:offset] + frame + data[offset + stored:])
    delta = len(frame) - stored
    fields = list(props.IMAGE_HEADER.unpack_from(out, 0))
    fields[7] += delta
    fields[9] += delta
    for i in range(fields[3]):
        at = fields[7] + i * props.RECORD_SIZE
        key_i, off_i, stored_i, raw_i, sum_i = props.RECORD.unpack_from(out, at)
        if i == which:
            stored_i, raw_i = len(frame), raw_len if keep_raw_len else len(raw)
        elif off_i > offset:
            off_i += delta
        props.RECORD.pack_into(out, at, key_i, off_i, stored_i, raw_i, sum_i)
    out[:props.HEADER_SIZE] = props.IMAGE_HEADER.pack(*fields)
    same_verdict(driver, scratch / "blob.ltimg", props.reseal(bytes(out)))


@PROPERTY
@given(st.binary(max_size=400))
def test_entry_random_bytes(scratch: Path, driver: Driver, data: bytes) -> None:
    same_entry_verdict(driver, scratch / "entry", data)
    same_entry_verdict(driver, scratch / "entry", b"LTENTRY\0\x01\0\0\0" + data)


@PROPERTY
@given(st.lists(st.integers(0, len(props.ENCODED) - 1), min_size=1, max_size=4, unique=True), st.integers(1, 255),
       st.integers(0, len(props.ENCODED)))
def test_entry_flipped_and_truncated(scratch: Path, driver: Driver, positions: list[int], xor: int, cut: int) -> None:
    flipped = props.flip(props.ENCODED, positions, xor)
    same_entry_verdict(driver, scratch / "entry", flipped)
    same_entry_verdict(driver, scratch / "entry", props.with_header(flipped[24:]))
    same_entry_verdict(driver, scratch / "entry", props.ENCODED[:cut])


@PROPERTY
@given(props.values)
def test_entry_valid_checksum_over_any_msgpack_value(scratch: Path, driver: Driver, value: Any) -> None:
    same_entry_verdict(driver, scratch / "entry", props.with_header(msgpack.packb(value, use_bin_type=True)))


@PROPERTY
@given(st.sampled_from(sorted(props.RECORD_FIELDS)), props.values,
       st.sampled_from(["replace", "drop", "bytes-key", "extra", "twice"]))
def test_entry_wrong_type_in_every_field(scratch: Path, driver: Driver, name: str, value: Any, how: str) -> None:
    payload = msgpack.packb(props.mutated_fields(name, value, how), use_bin_type=True)
    if how == "twice":  # the field again at the end of the map, with another value: the last one counts
        extra = msgpack.packb({name: value}, use_bin_type=True)[1:]
        payload = bytes([payload[0] + 1]) + payload[1:] + extra
    same_entry_verdict(driver, scratch / "entry", props.with_header(payload))


@PROPERTY
@given(st.sampled_from(sorted(props.RECORD_FIELDS["provenance"])), props.values, st.booleans())
def test_entry_wrong_type_in_every_provenance_field(scratch: Path, driver: Driver, name: str, value: Any,
                                                    bytes_key: bool) -> None:
    provenance = dict(props.RECORD_FIELDS["provenance"])
    if bytes_key:
        provenance[name.encode()] = provenance.pop(name)
    else:
        provenance[name] = value
    payload = msgpack.packb(dict(props.RECORD_FIELDS, provenance=provenance), use_bin_type=True)
    same_entry_verdict(driver, scratch / "entry", props.with_header(payload))


DESCRIPTOR = descriptor_entry()
DESCRIPTOR_FIELDS = msgpack.unpackb(DESCRIPTOR.encode()[24:], raw=False)


@PROPERTY
@given(st.sampled_from(["swizzle", "elem_size", "elem_type", "block_size"]), props.values | st.integers(0, 300),
       st.integers(0, 1))
def test_entry_host_descriptors_of_any_value(scratch: Path, driver: Driver, name: str, value: Any, which: int) -> None:
    metas = [dict(m) for m in DESCRIPTOR_FIELDS["tensordesc_meta"]]
    metas[which][name] = value
    payload = msgpack.packb(dict(DESCRIPTOR_FIELDS, tensordesc_meta=metas), use_bin_type=True)
    data = props.with_header(payload)[:8] + b"\x02\0\0\0" + props.with_header(payload)[12:]
    same_entry_verdict(driver, scratch / "entry", data, DESCRIPTOR.key)


@PROPERTY
@given(st.lists(st.sampled_from(["tensordesc<bf16[1, 64]>", "tensordesc<fp32[128]>", "tensordesc<bf16[64],L>",
                                 "tensordesc<bf16[ 64 ,]>", "tensordesc<x[1]>", "tensordesc<fp16[1,2,3,4,5,6]>",
                                 "tensordesc<input_rank[1]>", "tensordesc<bf16[64],input_rank=1>",
                                 "tensordesc<bf16[64]>>", "tensordesc<bf16 [64]>",
                                 "tensordescx", "i32", "*bf16"]), max_size=3))
def test_entry_descriptor_parameter_types(scratch: Path, driver: Driver, kinds: list[str]) -> None:
    payload = msgpack.packb(dict(DESCRIPTOR_FIELDS, arg_types=kinds), use_bin_type=True)
    data = props.with_header(payload)[:8] + b"\x02\0\0\0" + props.with_header(payload)[12:]
    same_entry_verdict(driver, scratch / "entry", data, DESCRIPTOR.key)


@pytest.mark.parametrize("text", [b"flash", "caf\u00e9 \u2603 \U0001f600".encode(), b"\xed\xa0\x80", b"\xc0\xaf",
                                  b"\xe0\x80\xaf", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\x80",
                                  b"\xe2\x82", b"\xff", b"a\x00b"])
def test_strings_must_be_utf8_as_python_decodes_them(scratch: Path, driver: Driver, text: bytes) -> None:
    """Overlong forms, surrogates, code points past U+10FFFF and cut sequences are refused; NUL is a character."""
    payload = msgpack.packb(dict(props.RECORD_FIELDS, name="\x00" * len(text)), use_bin_type=True)
    at = payload.index(b"\xa4name") + 5
    assert payload[at] == 0xA0 + len(text)
    payload = payload[:at + 1] + text + payload[at + 1 + len(text):]
    same_entry_verdict(driver, scratch / "entry", props.with_header(payload))


def test_a_provenance_of_the_right_shape_decodes(scratch: Path, driver: Driver) -> None:
    """The property tests above must see the valid case succeed too, or they prove nothing."""
    same_entry_verdict(driver, scratch / "entry", props.ENCODED)
    assert driver.entry(scratch / "entry", props.ENTRY.key)["entry"]["provenance"] == asdict(
        Provenance("triton", "3.9.0", "0123456789abcdef", 1.5e9, 1))
    encoded = DESCRIPTOR.encode()
    (scratch / "descriptor").write_bytes(encoded)
    assert driver.entry(scratch / "descriptor", DESCRIPTOR.key)["entry"] == expected_record(DESCRIPTOR) | {
        "binary_size": len(DESCRIPTOR.binary)}
