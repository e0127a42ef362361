"""Image format v1: spec conformance, round trip, determinism, atomic writes, damage and hostile input.

Most images here hold synthetic entries (the format does not care what a binary is; these are
built from a shared pool of 64-byte "instructions", so that a dictionary trains on them). The
image tier tests at the end use real sm_90 cubins (compiled once per session).
"""

from __future__ import annotations

import json
import os
import random
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import xxhash
import zstandard
from compiled_once import compiled, shared_dir, small_variant
from conftest import run_python

from lazytriton import record
from lazytriton.cache_format import Entry, Provenance
from lazytriton.cache_format import image as image_format
from lazytriton.cache_format.entry import MAX_ENTRY_BYTES
from lazytriton.cache_format.image import Image, ImageError, train_dictionary, write_image
from lazytriton.store.image import ImageTier

# The byte layout as SPEC.md writes it, spelled out here rather than taken from the module.
HEADER = struct.Struct("<8s I I I I Q Q Q Q Q Q Q Q Q")  # 96 bytes
RECORD = struct.Struct("<16s Q I I Q")  # 40 bytes


def synthetic_entries(n: int, seed: int = 0, size: int = 24_000) -> list[Entry]:
    rng = random.Random(seed)
    pool = [bytes(rng.getrandbits(8) for _ in range(64)) for _ in range(256)]
    entries = []
    for i in range(n):
        body = b"".join(rng.choice(pool) for _ in range(size // 64))
        key = xxhash.xxh3_128_hexdigest(f"{seed}:{i}".encode())
        entries.append(Entry(
            key=key, variant=f"flash_fwd:sm_90:fp16:ALIGN16=true,BLOCK_D={16 << (i % 5)}::", target="sm_90",
            kind="cubin", binary=b"\x7fELF" + body, name="flash_fwd_kernel", num_warps=4, num_ctas=1, warp_size=32,
            shared=1024 * i, global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
            profile_scratch_align=1, arg_types=("*fp16", "i32"), hidden_args=("global_scratch", "profile_scratch"),
            provenance=Provenance("triton", "3.9.0", "0123456789abcdef", 1.5e9 + i, 1)))
    return entries


@pytest.fixture(scope="module")
def entries() -> list[Entry]:
    return synthetic_entries(12)


@pytest.fixture(scope="module")
def image_path(tmp_path_factory: pytest.TempPathFactory, entries: list[Entry]) -> Path:
    path = tmp_path_factory.mktemp("image") / "synthetic.ltimg"
    info = write_image(path, entries, meta={"source": "test"})
    assert info.codec == "zstd-dict" and info.dict_bytes > 0
    return path


# --- a reader and a writer written from SPEC.md ----------------------------------------------------------------


def parse_by_hand(data: bytes) -> dict[str, object]:
    """Every section of an image, parsed as SPEC.md describes it (no library reader involved)."""
    fields = HEADER.unpack_from(data, 0)
    (magic, version, codec, count, flags, dict_off, dict_len, index_off, index_len, meta_off, meta_len,
     index_sum, meta_sum, header_sum) = fields
    assert (magic, version, flags) == (b"LTIMAGE\0", 1, 0)
    assert header_sum == xxhash.xxh3_64_intdigest(data[:88])
    assert dict_off == 96 and index_len == 40 * count and meta_off == index_off + index_len
    assert meta_off + meta_len == len(data)
    assert index_sum == xxhash.xxh3_64_intdigest(data[index_off:meta_off])
    dict_section = data[dict_off:dict_off + dict_len]
    meta_bytes = data[meta_off:]
    assert meta_sum == xxhash.xxh3_64_intdigest(dict_section + meta_bytes)
    dictionary = zstandard.ZstdDecompressor().decompress(dict_section) if dict_len else b""
    assert (codec == 2) == bool(dictionary)
    if dictionary:
        assert dictionary[:4] == b"\x37\xa4\x30\xec"  # a zstd dictionary's magic
    decompressor = zstandard.ZstdDecompressor(dict_data=zstandard.ZstdCompressionDict(dictionary)) \
        if dictionary else zstandard.ZstdDecompressor()
    records = [RECORD.unpack_from(data, index_off + 40 * i) for i in range(count)]
    assert [r[0] for r in records] == sorted({r[0] for r in records}), "index sorted by key, keys unique"
    position = dict_off + dict_len
    decoded = {}
    for raw_key, offset, stored, raw_len, checksum in records:
        assert offset == position, "blobs are contiguous, in key order, right after the dictionary"
        blob = data[offset:offset + stored]
        assert xxhash.xxh3_64_intdigest(blob) == checksum
        if codec == 0:
            raw = blob
        else:
            assert zstandard.frame_content_size(blob) == raw_len
            params = zstandard.get_frame_parameters(blob)
            assert (params.has_checksum, params.dict_id) == (False, 0)
            raw = decompressor.decompress(blob)
        assert len(raw) == raw_len
        decoded[raw_key.hex()] = Entry.decode(raw, expected_key=raw_key.hex())
        position += stored
    assert position == index_off
    meta = msgpack.unpackb(meta_bytes, raw=False)
    return {"codec": codec, "count": count, "entries": decoded, "meta": meta, "dictionary": dictionary}


def write_by_hand(path: Path, blobs: list[tuple[bytes, bytes, int]], codec: int = 1, dict_section: bytes = b"",
                  meta: dict[str, object] | None = None, flags: int = 0, version: int = 1) -> Path:
    """An image from (raw key, blob, raw length) triples, laid out and checksummed as SPEC.md says."""
    meta_bytes = msgpack.packb(meta if meta is not None else {"format": 1}, use_bin_type=True)
    offset = 96 + len(dict_section)
    records = []
    for raw_key, blob, raw_len in sorted(blobs):
        records.append(RECORD.pack(raw_key, offset, len(blob), raw_len, xxhash.xxh3_64_intdigest(blob)))
        offset += len(blob)
    index = b"".join(records)
    header = HEADER.pack(b"LTIMAGE\0", version, codec, len(records), flags, 96, len(dict_section), offset,
                         len(index), offset + len(index), len(meta_bytes), xxhash.xxh3_64_intdigest(index),
                         xxhash.xxh3_64_intdigest(dict_section + meta_bytes), 0)
    header = header[:88] + struct.pack("<Q", xxhash.xxh3_64_intdigest(header[:88]))
    path.write_bytes(header + dict_section + b"".join(blob for _, blob, _ in sorted(blobs)) + index + meta_bytes)
    return path


def zstd_blobs(entries: list[Entry]) -> list[tuple[bytes, bytes, int]]:
    compressor = zstandard.ZstdCompressor(level=3, write_checksum=False, write_content_size=True)
    return [(bytes.fromhex(e.key), compressor.compress(e.encode()), len(e.encode())) for e in entries]


# --- conformance and round trip --------------------------------------------------------------------------------


def test_an_image_parses_by_hand_as_the_spec_says(image_path: Path, entries: list[Entry]) -> None:
    parsed = parse_by_hand(image_path.read_bytes())
    assert parsed["codec"] == 2 and parsed["count"] == len(entries)
    assert parsed["entries"] == {e.key: e for e in entries}
    meta = parsed["meta"]
    assert isinstance(meta, dict)
    assert (meta["format"], meta["codec"], meta["entries"], meta["targets"], meta["source"]) == (
        1, "zstd-dict", len(entries), ["sm_90"], "test")
    assert meta["level"] == image_format.DEFAULT_LEVEL and meta["dict"]["bytes"] == len(parsed["dictionary"])
    with Image(image_path) as image:
        assert image.meta == meta and image.count == len(entries) and image.codec_name == "zstd-dict"
        assert list(image.keys()) == sorted(e.key for e in entries)


def test_an_image_written_by_hand_from_the_spec_reads(tmp_path: Path, entries: list[Entry]) -> None:
    path = write_by_hand(tmp_path / "hand.ltimg", zstd_blobs(entries))
    with Image(path) as image:
        for entry in entries:
            assert image.read(entry.key) == entry
    plain = [(bytes.fromhex(e.key), e.encode(), len(e.encode())) for e in entries]
    with Image(write_by_hand(tmp_path / "plain.ltimg", plain, codec=0)) as image:
        assert [image.read(e.key) for e in entries] == entries


@pytest.mark.parametrize("codec", ["none", "zstd", "zstd-dict"])
def test_round_trip(tmp_path: Path, entries: list[Entry], codec: str) -> None:
    info = write_image(tmp_path / "x.ltimg", entries, codec=codec)
    assert (info.codec, info.entries) == (codec, len(entries))
    assert info.stored_bytes == (tmp_path / "x.ltimg").stat().st_size
    assert info.raw_bytes == sum(len(e.encode()) for e in entries)
    assert info.binary_bytes == sum(len(e.binary) for e in entries)
    if codec != "none":
        assert info.stored_bytes < info.raw_bytes * 0.8
    with Image(info.path) as image:
        assert len(image) == len(entries)
        for entry in entries:
            assert entry.key in image
            assert image.read(entry.key) == entry
            stored, raw = image.sizes(entry.key)
            assert raw == len(entry.encode()) and stored > 0
        assert image.read("f" * 32) is None and "f" * 32 not in image
        with pytest.raises(KeyError):
            image.sizes("f" * 32)
        assert image.verify() == []
    parse_by_hand(info.path.read_bytes())


def test_too_few_entries_for_a_dictionary_fall_back_to_plain_zstd(tmp_path: Path, entries: list[Entry]) -> None:
    info = write_image(tmp_path / "few.ltimg", entries[:3])
    assert info.codec == "zstd" and info.dict_bytes == 0
    with Image(info.path) as image:
        assert [image.read(e.key) for e in entries[:3]] == entries[:3]
    empty = write_image(tmp_path / "empty.ltimg", [])
    with Image(empty.path) as image:
        assert image.count == 0 and list(image.keys()) == [] and image.read("a" * 32) is None


def test_concurrent_reads_from_threads(image_path: Path, entries: list[Entry]) -> None:
    errors: list[BaseException] = []
    with Image(image_path) as image:
        def work(seed: int) -> None:
            order = random.Random(seed).sample(entries, len(entries))
            try:
                for entry in order * 3:
                    assert image.read(entry.key) == entry
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []


# --- one entry without the others ------------------------------------------------------------------------------


def test_one_entry_is_read_without_touching_the_others(tmp_path: Path, image_path: Path,
                                                       entries: list[Entry]) -> None:
    # Overwrite every other entry's blob with garbage: the one read must not notice.
    data = bytearray(image_path.read_bytes())
    fields = HEADER.unpack_from(data, 0)
    index_off, count = fields[7], fields[3]
    records = [RECORD.unpack_from(data, index_off + 40 * i) for i in range(count)]
    kept = records[count // 2]
    for raw_key, offset, stored, _, _ in records:
        if raw_key != kept[0]:
            data[offset:offset + stored] = b"\xa5" * stored
    damaged = tmp_path / "others-damaged.ltimg"
    damaged.write_bytes(bytes(data))
    with Image(damaged) as image:
        assert image.read(kept[0].hex()) == next(e for e in entries if e.key == kept[0].hex())
        for raw_key, *_ in records:
            if raw_key != kept[0]:
                with pytest.raises(ImageError, match="checksum"):
                    image.read(raw_key.hex())
        assert len(image.verify()) == count - 1


# --- determinism and atomic writes -----------------------------------------------------------------------------


def test_same_entries_in_any_order_give_the_same_bytes(tmp_path: Path, entries: list[Entry]) -> None:
    first = write_image(tmp_path / "a.ltimg", entries, meta={"source": "test"}).path.read_bytes()
    shuffled = random.Random(7).sample(entries, len(entries))
    second = write_image(tmp_path / "b.ltimg", shuffled, meta={"source": "test"}, threads=1).path.read_bytes()
    assert first == second
    samples = [e.encode() for e in sorted(entries, key=lambda e: e.key)]
    assert train_dictionary(samples, 16 << 10) == train_dictionary(samples, 16 << 10)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_a_failed_write_leaves_no_file_and_keeps_the_old_image(tmp_path: Path, entries: list[Entry],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def failing() -> Iterator[Entry]:
        yield from entries[:5]
        raise RuntimeError("producer died")

    target = tmp_path / "out.ltimg"
    with pytest.raises(RuntimeError, match="producer died"):
        write_image(target, failing())
    assert not target.exists() and _leftovers(tmp_path) == []

    old = write_image(target, entries[:4]).path.read_bytes()

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    for call in ("fsync", "replace"):  # the temp file is written, then flushing or renaming it fails
        with monkeypatch.context() as patch:
            patch.setattr(image_format.os, call, disk_full)
            with pytest.raises(OSError, match="No space left"):
                write_image(target, entries)
        assert target.read_bytes() == old and _leftovers(tmp_path) == []


def test_an_image_is_readable_by_others(tmp_path: Path, entries: list[Entry]) -> None:
    umask = os.umask(0o022)
    try:
        path = write_image(tmp_path / "shared.ltimg", entries[:2]).path
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644


# --- damage ----------------------------------------------------------------------------------------------------


def _sections(data: bytes) -> dict[str, tuple[int, int]]:
    fields = HEADER.unpack_from(data, 0)
    dict_off, dict_len, index_off, index_len, meta_off, meta_len = fields[5:11]
    return {"header": (0, 96), "dictionary": (dict_off, dict_off + dict_len), "blobs": (dict_off + dict_len, index_off),
            "index": (index_off, index_off + index_len), "meta": (meta_off, meta_off + meta_len)}


def _positions(start: int, end: int, rng: random.Random, n: int) -> list[int]:
    inside = list(range(start, end))
    return sorted({start, end - 1, *rng.sample(inside, min(n, len(inside)))})


@pytest.mark.parametrize("section", ["header", "dictionary", "index", "meta"])
def test_a_flipped_byte_outside_the_blobs_stops_the_image_from_opening(
        tmp_path: Path, image_path: Path, section: str) -> None:
    data = image_path.read_bytes()
    start, end = _sections(data)[section]
    assert end > start
    damaged = tmp_path / "damaged.ltimg"
    for position in _positions(start, end, random.Random(section), 24):
        for bit in (0x01, 0x80):
            copy = bytearray(data)
            copy[position] ^= bit
            damaged.write_bytes(bytes(copy))
            with pytest.raises(ImageError):
                Image(damaged).close()


def test_a_flipped_byte_in_a_blob_fails_that_entry_alone(tmp_path: Path, image_path: Path,
                                                         entries: list[Entry]) -> None:
    data = image_path.read_bytes()
    fields = HEADER.unpack_from(data, 0)
    records = [RECORD.unpack_from(data, fields[7] + 40 * i) for i in range(fields[3])]
    by_key = {e.key: e for e in entries}
    damaged = tmp_path / "damaged.ltimg"
    rng = random.Random(3)
    for raw_key, offset, stored, _, _ in rng.sample(records, 4):
        for position in _positions(offset, offset + stored, rng, 6):
            copy = bytearray(data)
            copy[position] ^= 0x10
            damaged.write_bytes(bytes(copy))
            with Image(damaged) as image:
                with pytest.raises(ImageError, match=raw_key.hex()):
                    image.read(raw_key.hex())
                for key, entry in by_key.items():
                    if key != raw_key.hex():
                        assert image.read(key) == entry


def test_a_truncated_or_extended_image_does_not_open(tmp_path: Path, image_path: Path) -> None:
    data = image_path.read_bytes()
    damaged = tmp_path / "cut.ltimg"
    sections = _sections(data)
    cuts = {0, 1, 95, 96, 97, len(data) // 2, len(data) - 1, *(s for s, _ in sections.values() if s)}
    for length in sorted(cuts):
        damaged.write_bytes(data[:length])
        with pytest.raises(ImageError):
            Image(damaged).close()
    damaged.write_bytes(data + b"\0")
    with pytest.raises(ImageError, match="do not fit"):
        Image(damaged).close()


def test_a_damaged_entry_inside_a_valid_blob_is_caught_by_the_entry_checksum(tmp_path: Path,
                                                                             entries: list[Entry]) -> None:
    # The blob's own checksum is consistent (a crafted image): the entry's xxh3 still catches it.
    raw = bytearray(entries[0].encode())
    raw[len(raw) // 2] ^= 0x01
    path = write_by_hand(tmp_path / "x.ltimg", [(bytes.fromhex(entries[0].key), bytes(raw), len(raw))], codec=0)
    with Image(path) as image, pytest.raises(ImageError, match="checksum"):
        image.read(entries[0].key)


# --- hostile images --------------------------------------------------------------------------------------------


def _frame_claiming(size: int, payload: bytes) -> bytes:
    """A zstd frame whose header claims ``size`` bytes of content, holding ``payload`` as one raw block."""
    magic = struct.pack("<I", 0xFD2FB528)
    descriptor = bytes([0b1110_0000])  # 8-byte frame content size, single segment, no checksum, no dict ID
    block_header = (len(payload) << 3 | 0b00 << 1 | 1).to_bytes(3, "little")  # last block, raw
    return magic + descriptor + struct.pack("<Q", size) + block_header + payload


def test_a_frame_claiming_more_than_its_recorded_size_is_refused_before_allocating(
        tmp_path: Path, entries: list[Entry]) -> None:
    raw = entries[0].encode()
    key = bytes.fromhex(entries[0].key)
    assert zstandard.ZstdDecompressor().decompress(_frame_claiming(len(raw), raw)) == raw  # the crafting is sound
    bomb = write_by_hand(tmp_path / "bomb.ltimg", [(key, _frame_claiming(1 << 40, raw), len(raw))])
    with Image(bomb) as image, pytest.raises(ImageError, match="claims 1099511627776 bytes"):
        image.read(entries[0].key)
    short = write_by_hand(tmp_path / "short.ltimg", [(key, _frame_claiming(len(raw) - 1, raw), len(raw))])
    with Image(short) as image, pytest.raises(ImageError, match="claims"):
        image.read(entries[0].key)
    padded = zstandard.ZstdCompressor().compress(raw) + b"trailing"
    extra = write_by_hand(tmp_path / "extra.ltimg", [(key, padded, len(raw))])
    with Image(extra) as image, pytest.raises(ImageError, match="does not decompress"):
        image.read(entries[0].key)
    garbage = write_by_hand(tmp_path / "garbage.ltimg", [(key, b"not zstd at all", len(raw))])
    with Image(garbage) as image, pytest.raises(ImageError, match="not a zstd frame"):
        image.read(entries[0].key)


def test_a_record_above_the_entry_bound_or_outside_the_data_is_refused(tmp_path: Path,
                                                                       entries: list[Entry]) -> None:
    raw = entries[0].encode()
    key = bytes.fromhex(entries[0].key)
    huge = write_by_hand(tmp_path / "huge.ltimg", [(key, _frame_claiming(MAX_ENTRY_BYTES + 1, raw),
                                                    MAX_ENTRY_BYTES + 1)])
    with Image(huge) as image, pytest.raises(ImageError, match="raw bytes, outside"):
        image.read(entries[0].key)
    # A record pointing into the index itself (checksums all consistent).
    path = write_by_hand(tmp_path / "outside.ltimg", zstd_blobs(entries[:2]))
    data = bytearray(path.read_bytes())
    fields = HEADER.unpack_from(data, 0)
    record = list(RECORD.unpack_from(data, fields[7]))
    record[1] = fields[7]
    data[fields[7]:fields[7] + 40] = RECORD.pack(*record)
    index = bytes(data[fields[7]:fields[7] + fields[8]])
    data[72:80] = struct.pack("<Q", xxhash.xxh3_64_intdigest(index))
    data[88:96] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[:88])))
    path.write_bytes(bytes(data))
    with Image(path) as image, pytest.raises(ImageError, match="outside the data section"):
        image.read(record[0].hex())


def test_a_dictionary_claiming_too_much_is_refused(tmp_path: Path, entries: list[Entry]) -> None:
    blobs = zstd_blobs(entries[:2])
    path = write_by_hand(tmp_path / "dict.ltimg", blobs, codec=2,
                         dict_section=_frame_claiming(image_format.MAX_DICT_BYTES + 1, b"\x37\xa4\x30\xec"))
    with Image(path) as image, pytest.raises(ImageError, match="dictionary frame claims"):
        image.read(entries[0].key)


@pytest.mark.parametrize("change", ["version", "codec", "flags", "dictionary without codec", "meta not a map",
                                    "index out of order"])
def test_consistently_checksummed_but_invalid_headers_are_refused(tmp_path: Path, entries: list[Entry],
                                                                  change: str) -> None:
    blobs = zstd_blobs(entries[:3])
    path = tmp_path / "x.ltimg"
    if change == "version":
        write_by_hand(path, blobs, version=2)
    elif change == "codec":
        write_by_hand(path, blobs, codec=7)
    elif change == "flags":
        write_by_hand(path, blobs, flags=1)
    elif change == "dictionary without codec":
        write_by_hand(path, blobs, codec=1, dict_section=b"x" * 64)
    elif change == "meta not a map":
        write_by_hand(path, blobs, meta=[1, 2])  # type: ignore[arg-type]
    else:
        write_by_hand(path, blobs)
        data = bytearray(path.read_bytes())
        fields = HEADER.unpack_from(data, 0)
        first, second = data[fields[7]:fields[7] + 40], data[fields[7] + 40:fields[7] + 80]
        data[fields[7]:fields[7] + 80] = second + first
        data[72:80] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[fields[7]:fields[7] + fields[8]])))
        data[88:96] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(data[:88])))
        path.write_bytes(bytes(data))
        with Image(path) as image:
            assert any("out of key order" in problem for _, problem in image.verify())
        return
    with pytest.raises(ImageError):
        Image(path).close()


def test_not_an_image(tmp_path: Path) -> None:
    for name, data in {"empty": b"", "short": b"LTIMAGE\0", "elf": b"\x7fELF" + bytes(200)}.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ImageError):
            Image(path).close()
    with pytest.raises(FileNotFoundError):
        Image(tmp_path / "missing.ltimg")


# --- argument and key validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["A" * 32, "a" * 31, "a" * 33, "../" + "a" * 29, " " + "a" * 31, "g" * 32, 123])
def test_bad_keys_are_argument_errors_not_damage(image_path: Path, key: object) -> None:
    with Image(image_path) as image:
        for call in (image.read, image.__contains__, image.sizes):
            with pytest.raises(ValueError, match="32 lowercase hex digits") as info:
                call(key)  # type: ignore[operator]
            assert not isinstance(info.value, ImageError)


def test_write_image_rejects_bad_arguments(tmp_path: Path, entries: list[Entry]) -> None:
    bad_key = record.replace(entries[0], key="Z" * 32)
    cases = {
        "32 lowercase hex digits": dict(entries=[bad_key]),
        "given twice": dict(entries=[entries[0], entries[0]]),
        "codec must be one of": dict(entries=entries, codec="lzma"),
        "level must be": dict(entries=entries, level=0),
        "dict_bytes must be": dict(entries=entries, dict_bytes=-1),
        "reserved": dict(entries=entries, meta={"entries": 3}),
        "exceeds what a reader accepts": dict(entries=entries, meta={"blob": b"bytes"}),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=message):
            write_image(tmp_path / "x.ltimg", **kwargs)  # type: ignore[arg-type]
        assert not (tmp_path / "x.ltimg").exists()


# --- the image tier, with real cubins --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def real_entry(tmp_path_factory: pytest.TempPathFactory) -> Entry:
    return compiled(small_variant("sm_90"), shared_dir(tmp_path_factory))


def test_the_image_tier_layers_images_in_search_path_order(tmp_path: Path, real_entry: Entry) -> None:
    other = record.replace(real_entry, binary=real_entry.binary + b"\0")
    first = write_image(tmp_path / "a" / "first.ltimg", [other]).path
    second = write_image(tmp_path / "b" / "second.ltimg", [real_entry]).path
    tier = ImageTier([first.parent, second], include_package=False)
    assert tier.get(real_entry.key) == other
    assert tier.where(real_entry.key) == first
    stats = tier.stats()
    assert stats.entries == 1 and stats.bytes == first.stat().st_size + second.stat().st_size
    tier.close()
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF  # the first image no longer opens: the second serves
    first.write_bytes(bytes(data))
    assert ImageTier([first, second], include_package=False).get(real_entry.key) == real_entry


SERVED_WITHOUT_TRITON = """
import json, os, sys
sys.modules["triton"] = None  # any "import triton" now raises ImportError
from lazytriton import runtime
from lazytriton.variant import Variant
rt = runtime.get()
resolved = rt.resolve(Variant.parse(os.environ["VARIANT"]))
try:
    import triton  # noqa: F401
    blocked = False
except ImportError:
    blocked = True
print(json.dumps({"source": resolved.source, "compiles": rt.compiles, "key": resolved.key, "blocked": blocked,
                  "binary": resolved.entry.binary.hex()[:64],
                  "local": sorted(rt.local.keys())}))
"""


def test_a_call_is_served_from_an_image_while_triton_cannot_be_imported(
        tmp_path: Path, cache_dir: Path, real_entry: Entry) -> None:
    image = write_image(tmp_path / "deploy" / "sm_90.ltimg", [real_entry]).path
    env = {"LAZYTRITON_IMAGES": str(image.parent), "VARIANT": real_entry.variant, "LAZYTRITON_JIT": "1"}
    result = run_python(SERVED_WITHOUT_TRITON, env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["blocked"] is True
    assert (report["source"], report["compiles"], report["key"]) == ("image", 0, real_entry.key)
    assert report["binary"] == real_entry.binary.hex()[:64]
    assert report["local"] == [], "an image hit is not copied into the local tier"
    assert not (cache_dir / "misses.jsonl").exists()
    # Without the image, the same process setup has to compile, and the blocked import makes that fail.
    missing = run_python(SERVED_WITHOUT_TRITON, {**env, "LAZYTRITON_IMAGES": str(tmp_path / "nothing-here")})
    assert missing.returncode != 0 and "triton" in missing.stderr
