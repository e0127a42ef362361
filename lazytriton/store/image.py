"""The image tier: read-only images found on a search path, before the local tier.

The search path is ``LAZYTRITON_IMAGES`` (colon-separated files, or folders
whose ``*.ltimg`` files are taken in name order), then the images installed
beside the package (``lazytriton/images/``). Images are opened lazily, on the
first lookup, and layered in that order: the first image holding a key serves
it. A damaged image or entry is logged and skipped, never launched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from lazytriton.cache_format import Entry
from lazytriton.cache_format.image import Image, ImageError
from lazytriton.store import TierStats
from lazytriton.variant import check_key

log = logging.getLogger("lazytriton.store.image")

IMAGE_SUFFIX = ".ltimg"
PACKAGE_IMAGES = Path(__file__).resolve().parent.parent / "images"


def image_files(search_path: Sequence[Path], include_package: bool = True) -> list[Path]:
    """The image files a search path names, in order, each once."""
    found: list[Path] = []
    for item in [*search_path, *([PACKAGE_IMAGES] if include_package else [])]:
        if item.is_dir():
            found.extend(sorted(item.glob(f"*{IMAGE_SUFFIX}")))
        elif item.is_file():
            found.append(item)
        elif item != PACKAGE_IMAGES:
            log.warning("image path %s does not exist; skipped", item)
    unique: dict[Path, None] = {}
    for path in found:
        unique.setdefault(path.resolve(), None)
    return list(unique)


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
        return TierStats(self.name, sum(1 for _ in self.keys()), sum(i.path.stat().st_size for i in self.images))

    def close(self) -> None:
        for image in self._images or []:
            image.close()
        self._images = None
