"""The form of a cache key: 32 lowercase hex digits (an xxh3-128 digest of a variant and its provenance).

Every tier checks the keys it reads from files and shared stores here before using one as a name.
"""

from __future__ import annotations

from typing import TypeGuard

KEY_LEN = 32  # hex digits of an xxh3-128 digest
HEX_DIGITS = "0123456789abcdef"


def is_key(key: object) -> TypeGuard[str]:
    """Whether ``key`` is 32 lowercase hex digits (a plain string test: no pattern compiled at import)."""
    return isinstance(key, str) and len(key) == KEY_LEN and not key.strip(HEX_DIGITS)


def check_key(key: object) -> str:
    """Return ``key`` if it is a well-formed cache key, else raise ValueError.

    Keys arrive from files and shared tiers: only 32 lowercase hex digits pass,
    so a key can never name a path outside the cache.
    """
    if not is_key(key):
        raise ValueError(f"cache key must be {KEY_LEN} lowercase hex digits, got {key!r}")
    return key
