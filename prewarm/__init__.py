"""Prewarm: compile variants ahead of time, for any target, into images.

- ``enumeration``: which variants to build, the ones dispatch would select
  for every kernel of the chosen families (from axes and the tuning tables,
  or from a miss log); pure functions.
- ``builder``: reuse what a killed or earlier run built, compile the rest in
  worker processes (``pool`` runs them, ``worker`` is one), write the image;
  merge images and work dirs.
- ``schedule``: the order variants are compiled in: longest first, from an estimate; pure.
- ``workdir``: the resumable work directory beside the image.
- ``limits``: the targets prewarm knows, and variants refused before compiling
  (tiles too large, more shared memory than the target has); pure.
- ``progress``: the progress bar with an ETA.
- ``cli``: ``lazytriton prewarm``.

Only the worker processes import triton; ``import lazytriton.prewarm`` does not.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use: ``lazytriton --help`` registers the prewarm command
# without loading the builder.
_LAZY = {"BuildReport": "builder", "build": "builder", "merge": "builder", "Limits": "pool", "Axes": "enumeration",
         "Planned": "enumeration", "enumerate_variants": "enumeration", "select_shard": "enumeration",
         "variants_from_misses": "enumeration", "parse_kernels": "enumeration", "all_kernels": "enumeration"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"lazytriton.prewarm.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'lazytriton.prewarm' has no attribute {name!r}")


__all__ = sorted(_LAZY)
