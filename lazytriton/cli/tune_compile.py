"""What every family's tuner shares: compiling the candidates the cache lacks, in parallel, before timing them.

``lazytriton tune`` (``cli.tune``) and the per-family tuners (``cli.tune_bwd``, ``cli.tune_decode``) call
``compile_all`` through this module, so a test replaces it in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from lazytriton import runtime
from lazytriton.variant import Variant


def _resolve(text: str) -> tuple[str, str]:
    """Resolve one variant through the runtime (compile lock, lease, miss log, every tier); the error, if any."""
    try:
        runtime.get().resolve(Variant.parse(text))
        return text, ""
    except Exception as exc:
        return text, f"{type(exc).__name__}: {str(exc)[:200]}"


def compile_all(variants: Sequence[Variant], jobs: int) -> dict[str, str]:
    """Compile what the cache lacks in ``jobs`` processes, each through its runtime; the failures by variant.

    Each worker resolves exactly as a call does, so a candidate is compiled
    under the key's file lock (and the shared tier's lease), stored in every
    writable tier and recorded in the miss log; the parent then loads it from
    the cache.
    """
    rt = runtime.get()
    missing = [str(v) for v in variants if rt.chain.get(v.key()) is None]
    failures: dict[str, str] = {}
    if missing:
        with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
            for text, error in pool.map(_resolve, missing):
                if error:
                    failures[text] = error
    return failures
