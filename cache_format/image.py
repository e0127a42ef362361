"""Image: a read-only pack of many entries, one file, each entry compressed alone.

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
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from lazytriton.cache_format.entry import HEADER_SIZE as ENTRY_HEADER_SIZE
from lazytriton.cache_format.entry import MAX_ENTRY_BYTES, Entry, EntryError
from lazytriton.fsutil import write_atomically
from lazytriton.keys import is_key
from lazytriton.record import record

MAGIC = b"LTIMAGE\0"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIII6Q3Q")
HEADER_SIZE = _HEADER.size  # 96
_RECORD = struct.Struct("<16sQIIQ")
RECORD_SIZE = _RECORD.size  # 40

CODEC_NONE, CODEC_ZSTD, CODEC_ZSTD_DICT = 0, 1, 2
CODEC_NAMES = {CODEC_NONE: "none", CODEC_ZSTD: "zstd", CODEC_ZSTD_DICT: "zstd-dict"}
_CODEC_IDS = {name: codec for codec, name in CODEC_NAMES.items()}

MAX_DICT_BYTES = 16 << 20  # the decompressed dictionary
DICT_SECTION_LEVEL = 19
MAX_META_BYTES = 1 << 20
_META_BOUNDS = {"max_bin_len": 0, "max_str_len": 4096, "max_array_len": 4096, "max_map_len": 256, "max_ext_len": 0}
_META_RESERVED = ("format", "codec", "level", "dict", "targets", "entries")

# Chosen by measurement (table in SPEC.md, "Codec choice"): zstd level 19 with
# a 256 KiB dictionary trained by fastCOVER (k=8192, d=6) on the image's own
# entries, stored compressed. Every process pays the dictionary's load before
# its first kernel: on the sm_90 flash_fwd prewarm image (111 entries, 23.1 MiB
# of cubins, 2-core AMD EPYC, a fresh process's CPU time to open the image and
# read one entry) 2.85 ms at 256 KiB against 4.85 ms at 1 MiB, for 0.153 of the
# binaries' bytes against 0.139 (+10%). Plain zstd-19: 0.184; a 64 KiB
# dictionary: 0.167; LZMA-9 per entry: 0.155 at 1.1 ms a read. Level 22 stores
# the same bytes as 19, more slowly.
DEFAULT_LEVEL = 19
DEFAULT_DICT_BYTES = 256 << 10
# The level at which training computes the dictionary's entropy statistics: it
# compresses every sample once at this level, alone on one thread (then after
# every entry of a build was compiled). On 49 default sm_90 entries (11.9 MB, 2-core
# AMD EPYC, zstandard 0.25, 2026-11-30) level 19 trained in 9.2 s and level 3 in
# 0.3 s, for images of 1,629,184 and 1,634,474 bytes (+0.3%): the 9 s were the
# largest serial part of a parallel prewarm (benchmarks/NOTES.md, "Prewarm scaling").
DICT_TRAIN_LEVEL = 3
# The dictionary is trained on the first this many entries in key order (all
# of a smaller image), at most a quarter of their bytes: a prewarm trains it,
# and compresses each entry as it is built, while the rest still compile.
# Measured: SPEC.md, "Codec choice".
DICT_SAMPLES = 32
DICT_K = 8192
DICT_D = 6
_MIN_DICT_SAMPLES = 8
_MIN_DICT_BYTES = 1024


class ImageError(ValueError):
    """A file that is not a valid image, or a damaged part of one."""


@record
class ImageInfo:
    """What ``write_image`` produced: sizes in bytes (stored = the file's size)."""

    path: Path
    entries: int
    stored_bytes: int
    raw_bytes: int
    codec: str
    binary_bytes: int = 0
    dict_bytes: int = 0


def key_bytes(key: str) -> bytes:
    """The 16 raw bytes of a cache key (32 lowercase hex digits); ValueError naming the key otherwise."""
    if not is_key(key):
        raise ValueError(f"image key must be 32 lowercase hex digits, got {key!r}")
    return bytes.fromhex(key)


def train_dictionary(samples: list[bytes], size: int, *, k: int = DICT_K, d: int = DICT_D,
                     level: int = DICT_TRAIN_LEVEL) -> bytes:
    """A zstd dictionary of at most ``size`` bytes trained on ``samples``, or b"" if they are too few.

    Deterministic: fastCOVER with fixed ``k`` (at most ``size / 4``) and ``d``
    (no parameter search), one thread, every sample used for training (split_point 1.0), and the
    dictionary ID derived from the content, so the same samples in the same
    order give the same bytes.
    """
    import zstandard

    if len(samples) < _MIN_DICT_SAMPLES or size < _MIN_DICT_BYTES:
        return b""
    try:
        # fastCOVER refuses a segment size k above the dictionary size: small images get smaller segments.
        trained = zstandard.train_dictionary(size, list(samples), k=min(k, size // 4), d=d, split_point=1.0,
                                             level=level, threads=1)
    except zstandard.ZstdError:
        return b""  # samples too small or too uniform to train on
    return bytes(trained.as_bytes())


def _compressor(codec: int, level: int, dictionary: bytes) -> Any:
    import zstandard

    if codec == CODEC_ZSTD_DICT:
        return zstandard.ZstdCompressor(level=level, dict_data=zstandard.ZstdCompressionDict(dictionary),
                                        write_checksum=False, write_content_size=True, write_dict_id=False)
    return zstandard.ZstdCompressor(level=level, write_checksum=False, write_content_size=True)


@record
class Compression:
    """How an image's entries are compressed, chosen from its first ``DICT_SAMPLES`` entries alone.

    So it can be chosen before the other entries exist (prewarm does, while
    they compile); ``fits`` says whether it is what ``write_image`` chooses.
    A record, not a NamedTuple: every process that reads an image imports
    this module, and a NamedTuple class costs 0.2 ms to make (its annotations
    compile), a record 0.02.
    """

    codec: int
    level: int
    dictionary: bytes
    section: bytes  # the dictionary section: the dictionary, compressed
    options: tuple[Any, ...]  # (codec name, level, dict_bytes, dict_k, dict_d) as asked for
    samples: tuple[bytes, ...]  # the encoded entries it was chosen from, in key order

    def fits(self, options: tuple[Any, ...], samples: list[bytes]) -> bool:
        """Whether an image whose first encoded entries in key order are ``samples`` gets this for ``options``."""
        return self.options == options and (options[0] != "zstd-dict" or list(self.samples) == samples)

    def compressor(self) -> Any:
        """A new compressor of one blob at a time, for one thread (its first blob loads the dictionary, ~0.2 s)."""
        return _compressor(self.codec, self.level, self.dictionary)


def choose_compression(samples: list[bytes], codec: str = "zstd-dict", level: int = DEFAULT_LEVEL,
                       dict_bytes: int = DEFAULT_DICT_BYTES, dict_k: int = DICT_K, dict_d: int = DICT_D) -> Compression:
    """The compression of an image whose first ``DICT_SAMPLES`` encoded entries in key order are ``samples``.

    (All of them if it holds fewer.) The dictionary is trained on them, at
    most ``dict_bytes`` and a quarter of their bytes (SPEC.md, "Codec
    choice"); too few to train on give plain zstd.
    """
    codec_id = _CODEC_IDS.get(codec)
    if codec_id is None:
        raise ValueError(f"codec must be one of {sorted(_CODEC_IDS)}, got {codec!r}")
    if not isinstance(level, int) or not 1 <= level <= 22:
        raise ValueError(f"level must be a zstd level from 1 to 22, got {level!r}")
    if not 0 <= dict_bytes <= MAX_DICT_BYTES:
        raise ValueError(f"dict_bytes must be in [0, {MAX_DICT_BYTES}], got {dict_bytes}")
    if len(samples) > DICT_SAMPLES:
        raise ValueError(f"samples must be at most DICT_SAMPLES={DICT_SAMPLES} entries, got {len(samples)}")
    dictionary = section = b""
    if codec_id == CODEC_ZSTD_DICT:
        dictionary = train_dictionary(samples, min(dict_bytes, sum(map(len, samples)) // 4), k=dict_k, d=dict_d)
        if not dictionary:
            codec_id = CODEC_ZSTD  # too few entries to train on
        else:
            section = _compressor(CODEC_ZSTD, DICT_SECTION_LEVEL, b"").compress(dictionary)
    return Compression(codec_id, level if codec_id else 0, dictionary, section,
                       (codec, level, dict_bytes, dict_k, dict_d), tuple(samples))


def _compress_all(compression: Compression, raws: list[bytes], threads: int) -> list[bytes]:
    """Each raw entry compressed alone (a compressor per thread: they are not thread-safe)."""
    if compression.codec == CODEC_NONE:
        return raws
    local = threading.local()

    def compress(raw: bytes) -> bytes:
        if not hasattr(local, "compressor"):
            local.compressor = compression.compressor()
        return bytes(local.compressor.compress(raw))

    workers = max(1, min(threads or os.cpu_count() or 1, len(raws)))
    if workers == 1:
        return [compress(raw) for raw in raws]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(compress, raws))


def _meta_bytes(meta: dict[str, Any]) -> bytes:
    data = msgpack.packb(meta, use_bin_type=True)
    if len(data) > MAX_META_BYTES:
        raise ValueError(f"image meta is {len(data)} bytes, the bound is {MAX_META_BYTES}")
    try:
        msgpack.unpackb(data, raw=False, **_META_BOUNDS)
    except Exception as exc:
        raise ValueError(f"image meta exceeds what a reader accepts ({exc}); "
                         "use str, int, float, bool, lists and maps, strings under 4 KiB") from None
    return data


def _encode_entries(entries: Iterable[Entry]) -> tuple[list[tuple[bytes, bytes]], set[str], int]:
    """(raw key, encoded entry) pairs in key order, the targets, and the binaries' bytes."""
    by_key: dict[bytes, bytes] = {}
    targets: set[str] = set()
    binary_bytes = 0
    for entry in entries:
        raw_key = key_bytes(entry.key)
        if raw_key in by_key:
            raise ValueError(f"entry {entry.key} given twice")
        raw = entry.encode()
        if len(raw) > MAX_ENTRY_BYTES:
            raise ValueError(f"entry {entry.key} is {len(raw)} bytes, the bound is {MAX_ENTRY_BYTES}")
        by_key[raw_key] = raw
        targets.add(entry.target)
        binary_bytes += len(entry.binary)
    return sorted(by_key.items()), targets, binary_bytes


def write_image(path: str | os.PathLike[str], entries: Iterable[Entry], *, level: int = DEFAULT_LEVEL,
                dict_bytes: int = DEFAULT_DICT_BYTES, codec: str = "zstd-dict", dict_k: int = DICT_K,
                dict_d: int = DICT_D, meta: dict[str, Any] | None = None, threads: int = 0,
                compression: Compression | None = None, blobs: Mapping[bytes, bytes] | None = None) -> ImageInfo:
    """Write ``entries`` (keys unique) to an image at ``path``, atomically (temp file, then rename).

    Entries are stored in key order and the dictionary is trained on the
    first ``DICT_SAMPLES`` of them in that order with fixed parameters, so the
    same entries (in any order) give the same bytes. ``meta`` adds fields to
    the image's meta map (not the reserved ones). ``threads``: compression
    threads, 0 for one per core.

    ``compression`` and ``blobs`` let a caller that compressed entries ahead
    (prewarm, while the rest compiled) pass that work on: ``compression`` is
    used if it is the one these entries and options choose (``Compression.fits``),
    else made again; ``blobs`` maps an encoded entry to its blob under that
    compression (made by its ``compressor``); a missing blob is compressed
    here. The bytes are the same either way.
    """
    clash = sorted(set(meta or {}) & set(_META_RESERVED))
    if clash:
        raise ValueError(f"meta fields {clash} are reserved for the image itself")
    ordered, targets, binary_bytes = _encode_entries(entries)
    raws = [raw for _, raw in ordered]
    options, samples = (codec, level, dict_bytes, dict_k, dict_d), raws[:DICT_SAMPLES]
    if compression is None or not compression.fits(options, samples):
        compression, blobs = choose_compression(samples, *options), None
    ready = blobs or {}
    missing = [raw for raw in raws if raw not in ready]
    made = dict(zip(missing, _compress_all(compression, missing, threads), strict=True))
    stored = [ready[raw] if raw in ready else made[raw] for raw in raws]
    return _write_sections(Path(path), ordered, stored, compression, targets, meta, binary_bytes)


def _write_sections(path: Path, ordered: list[tuple[bytes, bytes]], blobs: list[bytes], compression: Compression,
                    targets: set[str], meta: dict[str, Any] | None, binary_bytes: int) -> ImageInfo:
    """Lay out header, dictionary section, blobs, index and meta (SPEC.md) and write them atomically."""
    dictionary, dict_section, codec_id = compression.dictionary, compression.section, compression.codec
    _, _, _, dict_k, dict_d = compression.options
    meta_record: dict[str, Any] = {
        "format": FORMAT_VERSION, "codec": CODEC_NAMES[codec_id], "level": compression.level,
        "dict": {"bytes": len(dictionary), "k": dict_k, "d": dict_d} if dictionary else {},
        "targets": sorted(targets), "entries": len(ordered), **(meta or {}),
    }
    meta_bytes = _meta_bytes(meta_record)

    records, offset = [], HEADER_SIZE + len(dict_section)
    for (raw_key, raw), blob in zip(ordered, blobs, strict=True):
        records.append(_RECORD.pack(raw_key, offset, len(blob), len(raw), xxhash.xxh3_64_intdigest(blob)))
        offset += len(blob)
    index = b"".join(records)
    index_offset, meta_offset = offset, offset + len(index)
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, codec_id, len(ordered), 0,
                          HEADER_SIZE, len(dict_section), index_offset, len(index), meta_offset, len(meta_bytes),
                          xxhash.xxh3_64_intdigest(index), xxhash.xxh3_64_intdigest(dict_section + meta_bytes), 0)
    header = header[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(header[:-8]))
    write_atomically(path, [header, dict_section, *blobs, index, meta_bytes])
    return ImageInfo(path, len(ordered), meta_offset + len(meta_bytes), sum(len(raw) for _, raw in ordered),
                     CODEC_NAMES[codec_id], binary_bytes, len(dictionary))


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
         index_sum, meta_sum, header_sum) = _HEADER.unpack(header)
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
            meta = msgpack.unpackb(meta_bytes, raw=False, **_META_BOUNDS)
        except Exception as exc:
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
        return _RECORD.unpack_from(self._index, i * RECORD_SIZE)  # type: ignore[return-value]

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
