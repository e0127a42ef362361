"""A build's image, compressed while the build still compiles: little is left to do after the last compile.

``write_image`` needs every entry before it compresses any: its dictionary
was trained on all of them. That write (dictionary training, then each entry
compressed at zstd level 19) came after the last compile, 1.55-1.65 s of a
10.0 s build of 96 variants at -j 16 on the H200 host, while 15 of 16 cores
idled (benchmarks/NOTES.md, "Prewarm scaling").

The dictionary is now trained on the image's first ``DICT_SAMPLES`` (32) entries
in key order alone (``cache_format.image.choose_compression``). A build knows
its planned keys, so it compiles those samples first
(``schedule.samples_first``), and ``Packer`` trains the dictionary the moment
the first ``DICT_SAMPLES`` keys of the plan that have not failed are all
built, then compresses every entry, in a few threads of this process, as it
arrives. ``write`` hands the dictionary and the blobs to ``write_image``,
which uses them only if they are what it would have chosen itself for the
entries it is given (``Compression.fits``), else starts over: the image's
bytes depend on its entries alone, never on -j or on the order of arrival.

Everything here is in memory and in this process: a build killed at any
instant leaves the work directory as before (each entry is a whole file
written by its worker), and nothing is written but the image itself.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lazytriton.cache_format import Entry
from lazytriton.cache_format.image import (
    CODEC_NONE,
    DICT_SAMPLES,
    Compression,
    ImageInfo,
    choose_compression,
    write_image,
)

# One compression thread per this many workers (at least one). An entry took
# 0.057 s CPU to compress at level 19 and its compile 1.2 s CPU on average (the
# 96 bench variants, Triton 3.6 sm_90, this 2-core machine, 2026-11-30): one
# thread keeps up with 20 workers once the dictionary exists, but the entries
# built before it (the samples, and what finished beside them) wait for it.
# In a simulation of the 16-core host (benchmarks/NOTES.md, "Prewarm scaling")
# two threads cleared that backlog before the last compile, and one left 0.37 s
# of it after; more than two changed nothing.
WORKERS_PER_THREAD = 8
# Left with more than this many blobs per thread still to compress at the end,
# ``write`` leaves them to ``write_image``, which compresses over every core:
# a new compressor costs about 0.2 s to load the dictionary, against 0.06 s a blob.
BACKLOG_PER_THREAD = 4


def compression_threads(jobs: int) -> int:
    """How many threads compress while ``jobs`` workers compile."""
    return max(1, math.ceil(jobs / WORKERS_PER_THREAD))


class Packer:
    """The entries of one build, compressed in background threads as soon as the dictionary can be trained.

    ``planned``: the keys the image is expected to hold; ``codec``: the image's
    (``write_image``'s: ``zstd-dict``, ``zstd`` or ``none``). ``add`` each entry
    once it is built (or reused), ``drop`` each planned key that will not be
    in the image (failed, refused, unreadable), then ``write``; ``close``
    (or the context manager) stops the threads whatever happened.
    """

    def __init__(self, planned: Iterable[str], threads: int, codec: str = "zstd-dict") -> None:
        self._planned = set(planned)
        self._codec = codec
        self._dropped: set[str] = set()
        self._entries: dict[str, Entry] = {}
        self._raws: dict[str, bytes] = {}
        self._threads = max(1, threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="lazytriton-pack")
        self._local = threading.local()
        self._compression: concurrent.futures.Future[Compression] | None = None
        self._blobs: dict[str, concurrent.futures.Future[bytes]] = {}

    def sample_keys(self) -> list[str]:
        """The keys whose entries train the dictionary, as far as is known now: compile them first."""
        return sorted((self._planned - self._dropped) | set(self._entries))[:DICT_SAMPLES]

    def add(self, entry: Entry) -> None:
        """One built entry of the image (ValueError if its key was added already)."""
        if entry.key in self._entries:
            raise ValueError(f"entry {entry.key} given twice")
        self._entries[entry.key] = entry
        self._raws[entry.key] = entry.encode()
        if self._compression is not None:
            self._blobs[entry.key] = self._pool.submit(self._compress, self._raws[entry.key])
        else:
            self._start()

    def drop(self, key: str) -> None:
        """A planned key whose entry will not be in the image."""
        self._dropped.add(key)
        if self._compression is None:
            self._start()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[Entry]:
        """The entries added so far."""
        return list(self._entries.values())

    @property
    def compressed(self) -> int:
        """How many blobs are compressed already (the bench reports it at the last compile)."""
        return sum(1 for blob in self._blobs.values() if blob.done() and not blob.cancelled())

    def _start(self) -> None:
        """Train the dictionary once every sample is built, then compress every entry built so far."""
        keys = self.sample_keys()
        if not keys or any(key not in self._raws for key in keys):
            return
        samples = [self._raws[key] for key in keys]
        self._compression = self._pool.submit(choose_compression, samples, self._codec)
        for key, raw in self._raws.items():
            self._blobs[key] = self._pool.submit(self._compress, raw)

    def _compress(self, raw: bytes) -> bytes:
        """One blob, by this thread's own compressor (the compression is trained by the first task)."""
        assert self._compression is not None
        compression = self._compression.result()
        if compression.codec == CODEC_NONE:
            return raw
        if getattr(self._local, "compression", None) is not compression:
            self._local.compression, self._local.compressor = compression, compression.compressor()
        return bytes(self._local.compressor.compress(raw))

    def write(self, out: Path, meta: dict[str, Any]) -> ImageInfo:
        """The image of the entries added, with what is compressed already; the rest is compressed here."""
        pending = [blob for blob in self._blobs.values() if not blob.done()]
        if len(pending) > BACKLOG_PER_THREAD * self._threads:
            for blob in pending:
                blob.cancel()  # those not started: write_image compresses them over every core
        self._pool.shutdown(wait=True)
        compression = None
        if self._compression is not None and self._compression.exception() is None:
            compression = self._compression.result()
        blobs = {self._raws[key]: blob.result() for key, blob in self._blobs.items()
                 if blob.done() and not blob.cancelled() and blob.exception() is None}
        return write_image(out, self.entries, codec=self._codec, meta=meta, compression=compression, blobs=blobs)

    def close(self) -> None:
        """Stop the threads: the blobs not started are dropped, those running are waited for."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Packer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
