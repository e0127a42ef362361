"""The form of a cache key: 32 lowercase hex digits (an xxh3-128 digest of a variant and its provenance).

Every tier checks the keys it reads from files and shared stores here before using one as a name.
"""

from __future__ import annotations

import re

KEY_LEN = 32  # hex digits of an xxh3-128 digest
_KEY = re.compile(r"[0-9a-f]{32}")


def check_key(key: object) -> str:
    """Return ``key`` if it is a well-formed cache key, else raise ValueError.

    Keys arrive from files and shared tiers: only 32 lowercase hex digits pass,
    so a key can never name a path outside the cache.
    """
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"cache key must be {KEY_LEN} lowercase hex digits, got {key!r}")
    return key
