"""Image: a read-only pack of many entries, one file, each entry compressed alone; the reader.

Layout (all integers little-endian; SPEC.md, "Image (format version 1)", has it byte by byte):

    header (96 bytes) | dictionary (one zstd frame) | entry blobs ... | index | meta

The header holds the magic, format version, codec, entry count, the offset and
length of each section, checksums of the index and of dictionary+meta, and a
checksum of itself. The dictionary, trained on the image's first
``DICT_SAMPLES`` entries in key order, is stored compressed and decompressed
once, on the image's first read. The index
is an array of fixed 40-byte records sorted by key (16 raw key bytes, blob
offset, stored length, raw length, xxh3-64 of the blob), read once at open
and searched in memory: one entry is found, its blob read with ``pread``
(never through an mmap: a file truncated in place would be a SIGBUS),
checked, decompressed (bounded by its recorded raw length) and decoded as an
Entry (which checks its own checksum) without touching any other entry.

Everything read is bounded before it is trusted: section sizes against the
file, a blob's offset against the data section, its raw length against
``MAX_ENTRY_BYTES``, and the size a zstd frame claims against the raw length
the index recorded (zstandard would otherwise allocate whatever a frame claims).

This module reads images and nothing else (a lookup imports it alone);
``image.py`` writes them, and names the reader's public names too.
"""

from __future__ import annotations

import os
import stat
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from lazytriton.cache_format import mpack
from lazytriton.cache_format.entry import HEADER_SIZE as ENTRY_HEADER_SIZE
from lazytriton.cache_format.entry import MAX_ENTRY_BYTES, Entry, EntryError
from lazytriton.keys import is_key

MAGIC = b"LTIMAGE\0"
FORMAT_VERSION = 1
HEADER_STRUCT = struct.Struct("<8sIIII6Q3Q")
HEADER_SIZE = HEADER_STRUCT.size  # 96
RECORD_STRUCT = struct.Struct("<16sQIIQ")
RECORD_SIZE = RECORD_STRUCT.size  # 40

CODEC_NONE, CODEC_ZSTD, CODEC_ZSTD_DICT = 0, 1, 2
CODEC_NAMES = {CODEC_NONE: "none", CODEC_ZSTD: "zstd", CODEC_ZSTD_DICT: "zstd-dict"}

MAX_DICT_BYTES = 16 << 20  # the decompressed dictionary
MAX_META_BYTES = 1 << 20
# The meta map's bounds, for the reader and for the writer's check of what it wrote.
META_BOUNDS = {"max_bin_len": 0, "max_str_len": 4096, "max_array_len": 4096, "max_map_len": 256}


class ImageError(ValueError):
    """A file that is not a valid image, or a damaged part of one."""



def key_bytes(key: str) -> bytes:
    """The 16 raw bytes of a cache key (32 lowercase hex digits); ValueError naming the key otherwise."""
    if not is_key(key):
        raise ValueError(f"image key must be 32 lowercase hex digits, got {key!r}")
    return bytes.fromhex(key)


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, or ImageError if it is not a regular file.

    O_NONBLOCK keeps a FIFO or a device named ``*.ltimg`` from blocking the
    open (it has no effect on a regular file); fstat on the descriptor then
    decides on the file actually opened, so a swap after any earlier check
    changes nothing. Symlinks are followed: a user's link to an image works,
    and a loop fails with ELOOP (an OSError) instead of hanging.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ImageError(f"{path}: not a regular file ({_file_kind(mode)}); an image must be one")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), f"mode {mode:o}")



class Image:
    """An image opened read-only. Thread-safe for reads.

    Every read is a ``pread`` on the descriptor, never a slice of an mmap: a
    file truncated in place while open (``cp new.ltimg live.ltimg``) then
    gives a short read and an ImageError, where a mapped page past the new end
    of file would kill the process with SIGBUS. The header, dictionary, index
    and meta are read once, at open; each lookup reads only its own blob.
    Images are meant to be replaced by rename (write a new file, then
    ``os.replace``): an open Image keeps reading the file it opened.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd = open_regular(self.path)
        try:
            size = os.fstat(self._fd).st_size
            if size < HEADER_SIZE:
                raise ImageError(f"{self.path}: {size} bytes is too short for an image header")
            self._parse_header(size)
        except BaseException:
            os.close(self._fd)
            raise
        self._decompressor: Any = None
        self._dictionary_error = ""
        self._lock = threading.Lock()  # a zstd decompressor serves one thread at a time

    def _pread(self, offset: int, length: int, what: str) -> bytes:
        """Exactly ``length`` bytes at ``offset``, or ImageError if the file ends first (it shrank)."""
        data = os.pread(self._fd, length, offset)
        while len(data) < length:
            more = os.pread(self._fd, length - len(data), offset + len(data))
            if not more:
                raise ImageError(f"{self.path}: {what} at [{offset}, {offset + length}) lies past the end of the "
                                 "file: it shrank after it was opened (replace images by rename, not in place)")
            data += more
        return data

    def _parse_header(self, size: int) -> None:
        header = self._pread(0, HEADER_SIZE, "the header")
        (magic, version, codec, count, flags, dict_off, dict_len, index_off, index_len, meta_off, meta_len,
         index_sum, meta_sum, header_sum) = HEADER_STRUCT.unpack(header)
        if magic != MAGIC:
            raise ImageError(f"{self.path}: not an image (magic {magic!r})")
        if version != FORMAT_VERSION:
            raise ImageError(f"{self.path}: image format version {version} is not {FORMAT_VERSION}")
        if xxhash.xxh3_64_intdigest(header[:-8]) != header_sum:
            raise ImageError(f"{self.path}: image header checksum mismatch")
        if codec not in CODEC_NAMES or flags != 0 or (dict_len > 0) != (codec == CODEC_ZSTD_DICT):
            raise ImageError(f"{self.path}: codec {codec}, flags {flags}, dictionary of {dict_len} bytes "
                             "do not go together")
        sections_ok = (dict_off == HEADER_SIZE and dict_len <= MAX_DICT_BYTES and index_len == count * RECORD_SIZE
                       and dict_off + dict_len <= index_off and index_off + index_len == meta_off
                       and meta_len <= MAX_META_BYTES and meta_off + meta_len == size)
        if not sections_ok:
            raise ImageError(f"{self.path}: image sections do not fit the file ({size} bytes)")
        index = self._pread(index_off, index_len, "the index")
        if xxhash.xxh3_64_intdigest(index) != index_sum:
            raise ImageError(f"{self.path}: image index checksum mismatch")
        dictionary = self._pread(dict_off, dict_len, "the dictionary")
        meta_bytes = self._pread(meta_off, meta_len, "the meta")
        if xxhash.xxh3_64_intdigest(dictionary + meta_bytes) != meta_sum:
            raise ImageError(f"{self.path}: image dictionary or meta checksum mismatch")
        try:
            meta = mpack.unpackb(meta_bytes, **META_BOUNDS)
        except ValueError as exc:
            raise ImageError(f"{self.path}: image meta is not valid msgpack: {exc}") from None
        if not isinstance(meta, dict):
            raise ImageError(f"{self.path}: image meta is not a map")
        self.meta: dict[str, Any] = meta
        self.size = size  # the file's size when opened
        self.codec = codec
        self.count = count
        self._dict_section = dictionary
        self._index = index
        self._data_start = dict_off + dict_len
        self._data_end = index_off

    @property
    def codec_name(self) -> str:
        return CODEC_NAMES[self.codec]

    def _record(self, i: int) -> tuple[bytes, int, int, int, int]:
        return RECORD_STRUCT.unpack_from(self._index, i * RECORD_SIZE)  # type: ignore[return-value]

    def _find(self, raw_key: bytes) -> int:
        index, lo, hi = self._index, 0, self.count
        while lo < hi:
            mid = (lo + hi) // 2
            start = mid * RECORD_SIZE
            if index[start:start + 16] < raw_key:
                lo = mid + 1
            else:
                hi = mid
        if lo < self.count and index[lo * RECORD_SIZE:lo * RECORD_SIZE + 16] == raw_key:
            return lo
        return -1

    def __contains__(self, key: str) -> bool:
        return self._find(key_bytes(key)) >= 0

    def __len__(self) -> int:
        return self.count

    def keys(self) -> Iterator[str]:
        """Keys held, in index order (key order in a valid image)."""
        for i in range(self.count):
            yield self._record(i)[0].hex()

    def sizes(self, key: str) -> tuple[int, int]:
        """(stored, raw) bytes of one entry."""
        i = self._find(key_bytes(key))
        if i < 0:
            raise KeyError(key)
        _, _, stored, raw, _ = self._record(i)
        return stored, raw

    def read(self, key: str) -> Entry | None:
        """The verified entry for ``key``, None if absent; ImageError if its bytes are damaged."""
        i = self._find(key_bytes(key))
        if i < 0:
            return None
        _, offset, stored, raw_len, checksum = self._record(i)
        if offset < self._data_start or offset + stored > self._data_end:
            raise ImageError(f"{self.path}: entry {key} at [{offset}, {offset + stored}) lies outside the data "
                             f"section [{self._data_start}, {self._data_end})")
        if not ENTRY_HEADER_SIZE <= raw_len <= MAX_ENTRY_BYTES:
            raise ImageError(f"{self.path}: entry {key} claims {raw_len} raw bytes, outside "
                             f"[{ENTRY_HEADER_SIZE}, {MAX_ENTRY_BYTES}]")
        blob = self._pread(offset, stored, f"entry {key}")
        if xxhash.xxh3_64_intdigest(blob) != checksum:
            raise ImageError(f"{self.path}: entry {key} checksum mismatch")
        data = self._decompress(blob, raw_len, key) if self.codec != CODEC_NONE else blob
        if len(data) != raw_len:
            raise ImageError(f"{self.path}: entry {key} is {len(data)} bytes, index says {raw_len}")
        try:
            return Entry.decode(data, expected_key=key)
        except EntryError as exc:
            raise ImageError(f"{self.path}: entry {key}: {exc}") from None

    def _decompress(self, blob: bytes, raw_len: int, key: str) -> bytes:
        import zstandard

        try:
            # zstandard allocates the size a frame header claims, whatever max_output_size says:
            # refuse a frame that claims anything but the raw length the index recorded.
            claimed = zstandard.frame_content_size(blob)
        except zstandard.ZstdError as exc:
            raise ImageError(f"{self.path}: entry {key} is not a zstd frame: {exc}") from None
        if claimed != raw_len:
            raise ImageError(f"{self.path}: entry {key} frame claims {claimed} bytes, index says {raw_len}")
        with self._lock:
            if self._decompressor is None:
                if self._dictionary_error:  # refused once: not decompressed again on every lookup
                    raise ImageError(self._dictionary_error)
                try:
                    self._decompressor = self._new_decompressor()
                except ImageError as exc:
                    self._dictionary_error = str(exc)
                    raise
            try:
                return bytes(self._decompressor.decompress(blob, max_output_size=raw_len, allow_extra_data=False))
            except zstandard.ZstdError as exc:
                # A dictionary with a valid magic and bad tables is only refused here, by the first use.
                raise ImageError(f"{self.path}: entry {key} does not decompress: {exc}") from None

    def _new_decompressor(self) -> Any:
        import zstandard

        dictionary = self._load_dictionary()
        try:
            decompressor = zstandard.ZstdDecompressor(dict_data=dictionary)
        except zstandard.ZstdError as exc:
            raise ImageError(f"{self.path}: image dictionary is damaged: {exc}") from None
        return decompressor

    def _load_dictionary(self) -> Any:
        """The dictionary, decompressed from its section (bounded like an entry), or None without one."""
        import zstandard

        if not self._dict_section:
            return None
        try:
            claimed = zstandard.frame_content_size(self._dict_section)
            if not 0 < claimed <= MAX_DICT_BYTES:
                raise ImageError(f"{self.path}: dictionary frame claims {claimed} bytes, outside [1, {MAX_DICT_BYTES}]")
            raw = zstandard.ZstdDecompressor().decompress(self._dict_section, max_output_size=claimed,
                                                          allow_extra_data=False)
            dictionary = zstandard.ZstdCompressionDict(raw)
        except zstandard.ZstdError as exc:
            raise ImageError(f"{self.path}: image dictionary is damaged: {exc}") from None
        return dictionary

    def check_order(self) -> list[tuple[str, str]]:
        """The (key, problem) pairs of index records out of key order (a lookup could miss them)."""
        problems = []
        previous = b""
        for i in range(self.count):
            raw_key = self._record(i)[0]
            if i and raw_key <= previous:
                problems.append((raw_key.hex(), f"{self.path}: index record {i} is out of key order"))
            previous = raw_key
        return problems

    def verify(self) -> list[tuple[str, str]]:
        """Check the index order and read every entry; the (key, problem) pairs of what fails."""
        problems = self.check_order()
        for key in self.keys():
            try:
                self.read(key)
            except ImageError as exc:
                problems.append((key, str(exc)))
        return problems

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Image:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
