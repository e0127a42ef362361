"""Image: a read-only pack of many entries, one file, each entry compressed alone; the writer.

Layout: image_reader.py's docstring and SPEC.md, "Image (format version 1)".
``write_image`` packs entries (``train_dictionary``, ``choose_compression``:
the codec and its dictionary); the reader (``Image``, ``ImageError`` and the
format's constants) lives in ``image_reader.py``, which a lookup imports
alone, and its names are importable from here too.
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import xxhash

from lazytriton.cache_format import mpack
from lazytriton.cache_format.entry import MAX_ENTRY_BYTES, Entry
from lazytriton.cache_format.image_reader import (
    CODEC_NAMES,
    CODEC_NONE,
    CODEC_ZSTD,
    CODEC_ZSTD_DICT,
    FORMAT_VERSION,
    HEADER_SIZE,
    HEADER_STRUCT,
    MAGIC,
    MAX_DICT_BYTES,
    MAX_META_BYTES,
    META_BOUNDS,
    RECORD_SIZE,
    RECORD_STRUCT,
    Image,
    ImageError,
    key_bytes,
    open_regular,
)
from lazytriton.fsutil import write_atomically
from lazytriton.record import record

# The reader's names, importable from here as well (``from lazytriton.cache_format.image import Image``).
__all__ = [
    "CODEC_NAMES", "CODEC_NONE", "CODEC_ZSTD", "CODEC_ZSTD_DICT", "DEFAULT_DICT_BYTES", "DEFAULT_LEVEL", "DICT_D",
    "DICT_K", "DICT_SAMPLES", "DICT_SECTION_LEVEL", "DICT_TRAIN_LEVEL", "FORMAT_VERSION", "HEADER_SIZE",
    "HEADER_STRUCT", "MAGIC", "MAX_DICT_BYTES", "MAX_META_BYTES", "META_BOUNDS", "RECORD_SIZE", "RECORD_STRUCT",
    "Compression", "Image", "ImageError", "ImageInfo", "choose_compression", "key_bytes", "open_regular",
    "train_dictionary", "write_image",
]

_CODEC_IDS = {name: codec for codec, name in CODEC_NAMES.items()}

DICT_SECTION_LEVEL = 19
_META_RESERVED = ("format", "codec", "level", "dict", "targets", "entries")

# Chosen by measurement (table in SPEC.md, "Codec choice"): zstd level 19 with
# a 64 KiB dictionary trained by fastCOVER (k=8192, d=6) on the image's own
# entries, stored compressed. Every process pays the dictionary's load before
# its first kernel: on the default sm_90 flash_fwd set (73 entries, 4.44 MiB of
# cubins without their debug sections, 2-core AMD EPYC, a fresh process's CPU
# time to open the image and read one entry) 0.75 ms at 64 KiB, 1.51 ms at
# 256 KiB and 0.47 ms without a dictionary, for 0.224, 0.212 and 0.258 of the
# binaries' bytes. LZMA-9 per entry: 0.215 at 0.47 ms a read. Level 22 stores
# the same bytes as 19, more slowly.
DEFAULT_LEVEL = 19
DEFAULT_DICT_BYTES = 64 << 10
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
    data = mpack.packb(meta)
    if len(data) > MAX_META_BYTES:
        raise ValueError(f"image meta is {len(data)} bytes, the bound is {MAX_META_BYTES}")
    try:
        mpack.unpackb(data, **META_BOUNDS)
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
        records.append(RECORD_STRUCT.pack(raw_key, offset, len(blob), len(raw), xxhash.xxh3_64_intdigest(blob)))
        offset += len(blob)
    index = b"".join(records)
    index_offset, meta_offset = offset, offset + len(index)
    header = HEADER_STRUCT.pack(MAGIC, FORMAT_VERSION, codec_id, len(ordered), 0,
                          HEADER_SIZE, len(dict_section), index_offset, len(index), meta_offset, len(meta_bytes),
                          xxhash.xxh3_64_intdigest(index), xxhash.xxh3_64_intdigest(dict_section + meta_bytes), 0)
    header = header[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(header[:-8]))
    write_atomically(path, [header, dict_section, *blobs, index, meta_bytes])
    return ImageInfo(path, len(ordered), meta_offset + len(meta_bytes), sum(len(raw) for _, raw in ordered),
                     CODEC_NAMES[codec_id], binary_bytes, len(dictionary))

