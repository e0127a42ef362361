"""``cache_format/mpack.py`` against msgpack-python: the same bytes written, the same values read, the same refusals.

Hypothesis draws values of every type the subset holds (and nestings of them) for ``packb``, and values, their
truncations, flips and plain random bytes for ``unpackb``, under the bounds the entry and image readers pass.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytriton.cache_format import mpack

BOUNDS = {"max_str_len": 64, "max_bin_len": 64, "max_array_len": 8, "max_map_len": 8}

scalars = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False)
           | st.text(max_size=300) | st.binary(max_size=300)
           | st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, -32, -33, -128, -129,
                              -32768, -32769, -(1 << 31), -(1 << 31) - 1, "x" * 31, "x" * 32, "y" * 255, "y" * 256,
                              b"z" * 255, b"z" * 256, b"z" * 65536, "w" * 65536]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=20) | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4) | st.integers(-99, 1 << 40), inner,
                                        max_size=20), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(values)
def test_packb_writes_msgpack_pythons_bytes(value: Any) -> None:
    assert mpack.packb(value) == msgpack.packb(value, use_bin_type=True)


def test_packb_refuses_what_msgpack_python_refuses() -> None:
    for value in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(OverflowError):
            mpack.packb(value)
    for value in (object(), {1, 2}, 1j):
        with pytest.raises(TypeError):
            mpack.packb(value)
    deep: Any = 0
    for _ in range(mpack.MAX_PACK_DEPTH):
        deep = [deep]
    assert mpack.packb(deep) == msgpack.packb(deep, use_bin_type=True)
    with pytest.raises(ValueError, match="recursion limit"):
        mpack.packb([deep])


def _read(unpack: Any, data: bytes, bounds: dict[str, int]) -> tuple[str, Any]:
    try:
        return "ok", unpack(data, **bounds)
    except (ValueError, msgpack.ExtraData) as exc:  # msgpack-python's errors are ValueErrors but ExtraData
        return "refused", type(exc).__name__
    except (RecursionError, TypeError, OverflowError, MemoryError) as exc:
        return "refused", type(exc).__name__


def _theirs(data: bytes, **bounds: int) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, max_ext_len=0, **bounds)


def _same(data: bytes, bounds: dict[str, int] = BOUNDS) -> None:
    ours, theirs = _read(mpack.unpackb, data, bounds), _read(_theirs, data, bounds)
    if theirs[0] == "ok" and isinstance(theirs[1], msgpack.ExtType):
        assert ours[0] == "refused"  # the one documented difference: an empty ext value
        return
    assert ours[0] == theirs[0], (data.hex(), ours, theirs)
    if ours[0] == "ok":
        assert _canon(ours[1]) == _canon(theirs[1])


def _canon(value: Any) -> Any:
    """A value with NaN made comparable and containers typed (a list and a tuple differ, 1 and True too)."""
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else value)
    if isinstance(value, list):
        return ("list", [_canon(v) for v in value])
    if isinstance(value, dict):
        return ("dict", [(_canon(k), _canon(v)) for k, v in value.items()])
    if isinstance(value, msgpack.ExtType):
        return ("ext", value.code, value.data)
    return (type(value).__name__, value)


@settings(max_examples=300, deadline=None)
@given(values)
def test_unpackb_reads_what_msgpack_python_reads(value: Any) -> None:
    data = msgpack.packb(value, use_bin_type=True)
    _same(data, {"max_str_len": 1 << 20, "max_bin_len": 1 << 20, "max_array_len": 1 << 20, "max_map_len": 1 << 20})
    _same(data)


@settings(max_examples=500, deadline=None)
@given(values, st.data())
def test_unpackb_refuses_what_msgpack_python_refuses(value: Any, data: st.DataObject) -> None:
    raw = bytearray(msgpack.packb(value, use_bin_type=True))
    cut = data.draw(st.integers(0, len(raw)))
    _same(bytes(raw[:cut]))
    if raw:
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
        _same(bytes(raw))
    _same(bytes(raw) + data.draw(st.binary(min_size=1, max_size=3)))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_unpackb_of_any_bytes_agrees(data: bytes) -> None:
    _same(data)


@pytest.mark.parametrize("data", [
    bytes([0xC1]), bytes([0xD6, 0xFF, 0, 0, 0, 1]), bytes([0xD4, 1, 0]), bytes([0xC7, 1, 5, 0]), b"\x81\x01\x02",
    b"\x81\xc0\x02", b"\xa2\xff\xfe", b"\xcb\x00", b"\x92\x01", b"\xc0\xc0", b"\x81\xc4\x00\x01", b"\x80", b"\x90",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00", b"\xca\x7f\xc0\x00\x00",
    b"\x91" * 1024 + b"\xc0", b"\x91" * 1025 + b"\xc0", b"\x81\xa1a" * 1024 + b"\xc0", b"\x81\xa1a" * 1025 + b"\xc0",
    b"\xdf\xff\xff\xff\xff", b"\xdd\x00\x00\x00\x09" + b"\xc0" * 9, b"\xdb\x00\x00\x00\x41" + b"a" * 65,
])
def test_unpackb_edges_agree(data: bytes) -> None:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))  # comparing 1024 nested lists recurses
    try:
        _same(data, {**BOUNDS, "max_map_len": 1 << 20, "max_array_len": 1 << 20} if len(data) > 1000 else BOUNDS)
    finally:
        sys.setrecursionlimit(limit)


def test_an_empty_ext_value_is_refused() -> None:
    data = bytes([0xC7, 0, 5])
    assert isinstance(_theirs(data, **BOUNDS), msgpack.ExtType)
    with pytest.raises(ValueError, match="ext values"):
        mpack.unpackb(data, **BOUNDS)


def test_unpackb_reads_a_memoryview_and_needs_no_recursion() -> None:
    data = msgpack.packb({"binary": b"\x00" * 1000, "xs": [1, 2.5, None, True]}, use_bin_type=True)
    assert mpack.unpackb(memoryview(data), **{**BOUNDS, "max_bin_len": 1000}) == _theirs(data, **{
        **BOUNDS, "max_bin_len": 1000})
    deep = b"\x91" * 1024 + b"\xc0"
    nested = mpack.unpackb(deep, **BOUNDS)
    for _ in range(1024):
        assert type(nested) is list and len(nested) == 1
        nested = nested[0]
    assert nested is None
