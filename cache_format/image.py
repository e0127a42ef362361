"""Image: a read-only pack of many entries, one file, each entry compressed alone.

Layout (all integers little-endian; SPEC.md has the full description):

    header (96 bytes) | dictionary | entry blobs ... | index | meta

The header holds the magic, format version, codec, entry count, the offset and
length of each section, checksums of the index and of dictionary+meta, and a
checksum of itself. The index is an array of fixed 40-byte records sorted by
key (16 raw key bytes, blob offset, stored length, raw length, xxh3-64 of the
blob), searched in place over an mmap: one entry is found, its blob checked,
decompressed (bounded by its recorded raw length) and decoded as an Entry
(which checks its own checksum) without touching any other entry.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from lazytriton.cache_format.entry import MAX_ENTRY_BYTES, Entry, EntryError

MAGIC = b"LTIMAGE\0"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIII6Q3Q")
HEADER_SIZE = _HEADER.size  # 96
_RECORD = struct.Struct("<16sQIIQ")
RECORD_SIZE = _RECORD.size  # 40

CODEC_NONE, CODEC_ZSTD, CODEC_ZSTD_DICT = 0, 1, 2
CODEC_NAMES = {CODEC_NONE: "none", CODEC_ZSTD: "zstd", CODEC_ZSTD_DICT: "zstd-dict"}

MAX_DICT_BYTES = 16 << 20
MAX_META_BYTES = 1 << 20
# zstd level 19 with a dictionary trained on the image's own entries: chosen by
# measurement, figures in SPEC.md.
DEFAULT_LEVEL = 19
DEFAULT_DICT_BYTES = 110 << 10
_MIN_DICT_SAMPLES = 8


class ImageError(ValueError):
    """A file that is not a valid image, or a damaged part of one."""


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What ``write_image`` produced."""

    path: Path
    entries: int
    stored_bytes: int
    raw_bytes: int
    codec: str


def _key_bytes(key: str) -> bytes:
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raise ImageError(f"image key must be 32 hex digits, got {key!r}") from None
    if len(raw) != 16:
        raise ImageError(f"image key must be 32 hex digits, got {key!r}")
    return raw


def _compressor(codec: int, level: int, dictionary: bytes) -> Any:
    import zstandard

    if codec == CODEC_ZSTD_DICT:
        return zstandard.ZstdCompressor(level=level, dict_data=zstandard.ZstdCompressionDict(dictionary),
                                        write_checksum=False, write_content_size=True, write_dict_id=False)
    return zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)


def _train(samples: list[bytes], size: int) -> bytes:
    import zstandard

    if len(samples) < _MIN_DICT_SAMPLES or size <= 0:
        return b""
    try:
        # Fixed parameters and one thread: the same entries give the same dictionary.
        return zstandard.train_dictionary(size, samples, k=1024, d=8, threads=1).as_bytes()  # type: ignore[no-any-return]
    except zstandard.ZstdError:
        return b""


def write_image(path: str | os.PathLike[str], entries: Iterable[Entry], *, level: int = DEFAULT_LEVEL,
                dict_bytes: int = DEFAULT_DICT_BYTES, codec: str = "zstd-dict",
                meta: dict[str, Any] | None = None) -> ImageInfo:
    """Write ``entries`` (keys unique) to an image at ``path``, atomically (temp file, then rename).

    Entries are stored in key order and the dictionary is trained on them in
    that order with fixed parameters, so the same entries give the same bytes.
    """
    by_key: dict[bytes, bytes] = {}
    targets: set[str] = set()
    for entry in entries:
        raw_key = _key_bytes(entry.key)
        if raw_key in by_key:
            raise ImageError(f"entry {entry.key} given twice")
        by_key[raw_key] = entry.encode()
        targets.add(entry.target)
    ordered = sorted(by_key.items())
    codec_id = {v: k for k, v in CODEC_NAMES.items()}.get(codec)
    if codec_id is None:
        raise ValueError(f"codec must be one of {sorted(CODEC_NAMES.values())}, got {codec!r}")
    dictionary = _train([raw for _, raw in ordered], dict_bytes) if codec_id == CODEC_ZSTD_DICT else b""
    if codec_id == CODEC_ZSTD_DICT and not dictionary:
        codec_id = CODEC_ZSTD  # too few entries to train on
    compress = None if codec_id == CODEC_NONE else _compressor(codec_id, level, dictionary).compress

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * HEADER_SIZE)
            f.write(dictionary)
            records = []
            offset = HEADER_SIZE + len(dictionary)
            for raw_key, raw in ordered:
                blob = compress(raw) if compress else raw
                records.append(_RECORD.pack(raw_key, offset, len(blob), len(raw), xxhash.xxh3_64_intdigest(blob)))
                f.write(blob)
                offset += len(blob)
            index = b"".join(records)
            meta_record = {"format": FORMAT_VERSION, "codec": CODEC_NAMES[codec_id], "level": level,
                           "targets": sorted(targets), "entries": len(ordered), **(meta or {})}
            meta_bytes = msgpack.packb(meta_record, use_bin_type=True)
            f.write(index)
            f.write(meta_bytes)
            index_offset, meta_offset = offset, offset + len(index)
            fields = (MAGIC, FORMAT_VERSION, codec_id, len(ordered), 0,
                      HEADER_SIZE, len(dictionary), index_offset, len(index), meta_offset, len(meta_bytes),
                      xxhash.xxh3_64_intdigest(index), xxhash.xxh3_64_intdigest(dictionary + meta_bytes), 0)
            header = _HEADER.pack(*fields)
            header = header[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(header[:-8]))
            f.seek(0)
            f.write(header)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return ImageInfo(path, len(ordered), meta_offset + len(meta_bytes), sum(len(r) for _, r in ordered),
                     CODEC_NAMES[codec_id])


class Image:
    """An image opened read-only over mmap. Thread-safe for reads."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER_SIZE:
                raise ImageError(f"{self.path}: {size} bytes is too short for an image header")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse_header(size)
        except BaseException:
            self._mm.close()
            raise
        self._decompressor: Any = None
        self._lock = threading.Lock()  # a zstd decompressor serves one thread at a time

    def _parse_header(self, size: int) -> None:
        mm = self._mm
        header = mm[:HEADER_SIZE]
        (magic, version, codec, count, _flags, dict_off, dict_len, index_off, index_len, meta_off, meta_len,
         index_sum, meta_sum, header_sum) = _HEADER.unpack(header)
        if magic != MAGIC:
            raise ImageError(f"{self.path}: not an image (magic {magic!r})")
        if version != FORMAT_VERSION:
            raise ImageError(f"{self.path}: image format version {version} is not {FORMAT_VERSION}")
        if xxhash.xxh3_64_intdigest(header[:-8]) != header_sum:
            raise ImageError(f"{self.path}: image header checksum mismatch")
        if codec not in CODEC_NAMES:
            raise ImageError(f"{self.path}: unknown codec {codec}")
        sections_ok = (dict_off == HEADER_SIZE and dict_len <= MAX_DICT_BYTES and index_len == count * RECORD_SIZE
                       and dict_off + dict_len <= index_off and index_off + index_len == meta_off
                       and meta_len <= MAX_META_BYTES and meta_off + meta_len == size)
        if not sections_ok:
            raise ImageError(f"{self.path}: image sections do not fit the file ({size} bytes)")
        if xxhash.xxh3_64_intdigest(mm[index_off:index_off + index_len]) != index_sum:
            raise ImageError(f"{self.path}: image index checksum mismatch")
        dictionary = mm[dict_off:dict_off + dict_len]
        meta_bytes = mm[meta_off:meta_off + meta_len]
        if xxhash.xxh3_64_intdigest(dictionary + meta_bytes) != meta_sum:
            raise ImageError(f"{self.path}: image dictionary or meta checksum mismatch")
        try:
            meta = msgpack.unpackb(meta_bytes, raw=False, max_bin_len=0, max_str_len=4096, max_array_len=4096,
                                   max_map_len=256, max_ext_len=0)
        except Exception as exc:
            raise ImageError(f"{self.path}: image meta is not valid msgpack: {exc}") from None
        if not isinstance(meta, dict):
            raise ImageError(f"{self.path}: image meta is not a map")
        self.meta: dict[str, Any] = meta
        self.codec = codec
        self.count = count
        self._dictionary = dictionary
        self._index_off = index_off
        self._data_end = index_off

    def _record(self, i: int) -> tuple[bytes, int, int, int, int]:
        start = self._index_off + i * RECORD_SIZE
        return _RECORD.unpack(self._mm[start:start + RECORD_SIZE])  # type: ignore[return-value]

    def _find(self, raw_key: bytes) -> int:
        mm, base, lo, hi = self._mm, self._index_off, 0, self.count
        while lo < hi:
            mid = (lo + hi) // 2
            start = base + mid * RECORD_SIZE
            if mm[start:start + 16] < raw_key:
                lo = mid + 1
            else:
                hi = mid
        if lo < self.count and mm[base + lo * RECORD_SIZE:base + lo * RECORD_SIZE + 16] == raw_key:
            return lo
        return -1

    def __contains__(self, key: str) -> bool:
        return self._find(_key_bytes(key)) >= 0

    def keys(self) -> Iterator[str]:
        """Keys held, in key order."""
        for i in range(self.count):
            yield self._record(i)[0].hex()

    def sizes(self, key: str) -> tuple[int, int]:
        """(stored, raw) bytes of one entry."""
        i = self._find(_key_bytes(key))
        if i < 0:
            raise KeyError(key)
        _, _, stored, raw, _ = self._record(i)
        return stored, raw

    def read(self, key: str) -> Entry | None:
        """The verified entry for ``key``, None if absent; ImageError if its bytes are damaged."""
        i = self._find(_key_bytes(key))
        if i < 0:
            return None
        _, offset, stored, raw_len, checksum = self._record(i)
        if offset < HEADER_SIZE or offset + stored > self._data_end or raw_len > MAX_ENTRY_BYTES:
            raise ImageError(f"{self.path}: entry {key} lies outside the data section")
        blob = self._mm[offset:offset + stored]
        if xxhash.xxh3_64_intdigest(blob) != checksum:
            raise ImageError(f"{self.path}: entry {key} checksum mismatch")
        data = self._decompress(blob, raw_len, key) if self.codec != CODEC_NONE else blob
        if len(data) != raw_len:
            raise ImageError(f"{self.path}: entry {key} decompressed to {len(data)} bytes, index says {raw_len}")
        try:
            return Entry.decode(data, expected_key=key)
        except EntryError as exc:
            raise ImageError(f"{self.path}: entry {key}: {exc}") from None

    def _decompress(self, blob: bytes, raw_len: int, key: str) -> bytes:
        import zstandard

        if self._decompressor is None:
            if self.codec == CODEC_ZSTD_DICT:
                dictionary = zstandard.ZstdCompressionDict(self._dictionary)
                self._decompressor = zstandard.ZstdDecompressor(dict_data=dictionary)
            else:
                self._decompressor = zstandard.ZstdDecompressor()
        try:
            # Bounded by the recorded size: a crafted frame cannot expand past it.
            with self._lock:
                return self._decompressor.decompress(blob, max_output_size=raw_len)  # type: ignore[no-any-return]
        except zstandard.ZstdError as exc:
            raise ImageError(f"{self.path}: entry {key} does not decompress: {exc}") from None

    def verify(self) -> list[tuple[str, str]]:
        """Read every entry; the (key, problem) pairs of those that fail."""
        problems = []
        for key in self.keys():
            try:
                self.read(key)
            except ImageError as exc:
                problems.append((key, str(exc)))
        return problems

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> Image:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
