"""Real compiled entries, compiled once per test session and shared by the xdist workers.

Small variants (head dim 64, fp16, 64x32 tiles) keep each compile to a second
or three. The first worker to ask compiles under a file lock into the session's
base temp folder; the others read the encoded entry from there.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lazytriton.cache_format import Entry
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant

SMALL = Config(64, 32, 4, 2)


def small_variant(target: str, causal: bool = False) -> Variant:
    """A quick-to-compile flash_fwd variant for ``target``."""
    return fwd_dispatch.flash_fwd_variant(Target.parse(target), "fp16", 64, causal, True, 4096, config=SMALL)


def shared_dir(factory: pytest.TempPathFactory) -> Path:
    """A folder all xdist workers of this session see (the parent of each worker's base temp)."""
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    directory = root / "lazytriton-compiled"
    directory.mkdir(exist_ok=True)
    return directory


def compiled(variant: Variant, directory: Path) -> Entry:
    """The entry of ``variant``, compiled by the first caller of the session, read by the rest."""
    from filelock import FileLock

    key = variant.key()
    path = directory / f"{key}.entry"
    with FileLock(str(directory / f"{key}.lock")):
        if not path.exists():
            from lazytriton.compiler import compile_variant

            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(compile_variant(variant).encode())
            os.replace(tmp, path)
    return Entry.decode(path.read_bytes(), expected_key=key)
