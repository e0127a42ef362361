"""The image tier: read-only images found on a search path, before the local tier.

The search path is ``LAZYTRITON_IMAGES`` (colon-separated files, or folders
whose ``*.ltimg`` files are taken in name order), then the images installed
beside the package (``lazytriton/images/``). Images are opened lazily, on the
first lookup, and layered in that order: the first image holding a key serves
it. A damaged image or entry is logged and skipped, never launched.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

from lazytriton.cache_format import Entry
from lazytriton.cache_format.image_reader import Image, ImageError
from lazytriton.keys import check_key
from lazytriton.store import TierStats

log = logging.getLogger("lazytriton.store.image")

IMAGE_SUFFIX = ".ltimg"
# Absolute, links left as they are (files are told apart by device and inode below): no lstat of every folder.
PACKAGE_IMAGES = Path(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) / "images"


def image_files(search_path: Sequence[Path], include_package: bool = True) -> list[Path]:
    """The image files a search path names, in order, each once; anything but a regular file is skipped.

    A FIFO, a device, a directory named ``*.ltimg`` or a symlink loop gets one
    warning and is left out; a symlink to a regular file is followed (the
    path stays as named). Files are told apart by ``os.stat`` (never by
    opening them, which blocks on a FIFO) and made unique by device and inode;
    ``Image`` checks again on the descriptor it opens.
    """
    unique: dict[tuple[int, int], Path] = {}
    for item in [*search_path, *([PACKAGE_IMAGES] if include_package else [])]:
        info = _stat(item, warn=item != PACKAGE_IMAGES)
        if info is None:
            continue
        if stat.S_ISDIR(info.st_mode):
            candidates = sorted(item.glob(f"*{IMAGE_SUFFIX}"))
        else:
            candidates = [item]
        for path in candidates:
            found = info if path is item else _stat(path, warn=True)
            if found is None:
                continue
            if not stat.S_ISREG(found.st_mode):
                log.warning("image path %s is not a regular file; skipped", path)
                continue
            unique.setdefault((found.st_dev, found.st_ino), path)
    return list(unique.values())


def _stat(path: Path, warn: bool) -> os.stat_result | None:
    """``os.stat`` of ``path`` (following links), or None with a warning if it cannot be read."""
    try:
        return os.stat(path)
    except OSError as exc:
        if warn:
            reason = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc.strerror})"
            log.warning("image path %s %s; skipped", path, reason)
        return None


class ImageTier:
    """Entries from read-only images, layered in search-path order."""

    writable = False

    def __init__(self, search_path: Sequence[Path], name: str = "image", include_package: bool = True) -> None:
        self.name = name
        self._search_path = tuple(search_path)
        self._include_package = include_package
        self._images: list[Image] | None = None

    @property
    def images(self) -> list[Image]:
        """The opened images (opened on first use; damaged ones are logged and left out)."""
        if self._images is None:
            opened = []
            for path in image_files(self._search_path, self._include_package):
                try:
                    opened.append(Image(path))
                except (ImageError, OSError) as exc:
                    log.warning("image %s skipped: %s", path, exc)
            self._images = opened
        return self._images

    def get(self, key: str) -> Entry | None:
        check_key(key)
        for image in self.images:
            try:
                entry = image.read(key)
            except ImageError as exc:
                log.warning("image entry skipped: %s", exc)
                continue
            if entry is not None:
                return entry
        return None

    def where(self, key: str) -> Path | None:
        """The first image that holds ``key`` (damaged or not)."""
        check_key(key)
        for image in self.images:
            if key in image:
                return image.path
        return None

    def put(self, key: str, entry: Entry) -> bool:
        return False

    def keys(self) -> Iterator[str]:
        seen: set[str] = set()
        for image in self.images:
            for key in image.keys():
                if key not in seen:
                    seen.add(key)
                    yield key

    def stats(self) -> TierStats:
        return TierStats(self.name, sum(1 for _ in self.keys()), sum(i.size for i in self.images))

    def close(self) -> None:
        for image in self._images or []:
            image.close()
        self._images = None
