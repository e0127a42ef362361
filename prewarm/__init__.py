"""Prewarm: compile variants ahead of time, for any target, into images.

- ``enumeration``: which variants to build, the ones dispatch would select
  (from axes and the tuning table, or from a miss log); pure functions.
- ``build``: reuse what a killed or earlier run built, compile the rest in
  worker processes (``pool`` runs them, ``worker`` is one), write the image;
  merge images and work dirs.
- ``workdir``: the resumable work directory beside the image.
- ``progress``: the progress bar with an ETA.
- ``cli``: ``lazytriton prewarm``.

Only the worker processes import triton; ``import lazytriton.prewarm`` does not.
"""

from lazytriton.prewarm.build import BuildReport, build, merge
from lazytriton.prewarm.enumeration import Axes, Planned, enumerate_variants, select_shard, variants_from_misses

__all__ = ["Axes", "BuildReport", "Planned", "build", "enumerate_variants", "merge", "select_shard",
           "variants_from_misses"]
