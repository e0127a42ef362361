"""msgpack, the subset the entry and image formats use, in Python: no extension module to load.

A process served from an image encodes each variant's canonical record (its
key) and decodes an image's meta and each entry it reads. msgpack-python
does both in C, but its import (a Cython module, its ``ext`` and exceptions
modules) costs ~3.4 M instructions (callgrind, after torch's import), ~0.9
ms at the rate the H100 host imports lazytriton: four times what this
module's decoding and key encoding add to one kernel's first call.

``packb`` writes what ``msgpack.packb(obj, use_bin_type=True)`` writes, byte
for byte, for None, bool, int (-2**63 to 2**64 - 1), float (always 64-bit),
str, bytes, bytearray, list, tuple and dict (in its order), subclasses
included, as msgpack-python's default ``strict_types=False`` takes them;
anything else is a TypeError, an int out of range an OverflowError, a
value nested over ``MAX_PACK_DEPTH`` deep a ValueError (msgpack-python packs
up to 1024; the formats' records nest 3 deep).

``unpackb`` reads what ``msgpack.unpackb(data, raw=False, strict_map_key=True,
use_list=True, max_ext_len=0, ...)`` reads and refuses what it refuses
(``ValueError``): lengths over the bounds given, strings that are not
UTF-8, map keys that are neither str nor bytes, containers nested over 1024
deep, the byte 0xc1, truncated input, data after the value. It refuses
every ext value, where msgpack-python returns an empty one (``c7 00 <type>``)
as an ``ExtType``: no field of either format holds one. It never calls
itself: a crafted nesting costs a list per level, not a Python frame.
``capi/native/lt_msgpack.c`` is the C API's reader of the same subset.
"""

from __future__ import annotations

import struct
from typing import Any

MAX_DEPTH = 1024  # msgpack-python refuses a 1025th nested container
MAX_PACK_DEPTH = 256  # packb recurses: msgpack-python's own limit, 1024, is past Python's default recursion limit

_DOUBLE = struct.Struct(">d")
_UNSIGNED = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I"), 8: struct.Struct(">Q")}
_SIGNED = {1: struct.Struct(">b"), 2: struct.Struct(">h"), 4: struct.Struct(">i"), 8: struct.Struct(">q")}


def packb(obj: Any) -> bytes:
    """``obj`` as msgpack-python's ``packb(obj, use_bin_type=True)`` writes it."""
    out = bytearray()
    _pack(obj, out, 0)
    return bytes(out)


def _pack(obj: Any, out: bytearray, depth: int) -> None:
    if depth > MAX_PACK_DEPTH:
        raise ValueError(f"recursion limit exceeded: containers nested over {MAX_PACK_DEPTH} deep")
    if obj is None:
        out.append(0xC0)
    elif obj is True or obj is False:
        out.append(0xC3 if obj else 0xC2)
    elif isinstance(obj, int):
        _pack_int(int(obj), out)
    elif isinstance(obj, float):
        out.append(0xCB)
        out += _DOUBLE.pack(obj)
    elif isinstance(obj, str):
        data = obj.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError, as msgpack-python does
        _header(len(data), out, 0xA0, 32, (0xD9, 0xDA, 0xDB))
        out += data
    elif isinstance(obj, (bytes, bytearray)):
        _header(len(obj), out, None, 0, (0xC4, 0xC5, 0xC6))
        out += obj
    elif isinstance(obj, (list, tuple)):
        _header(len(obj), out, 0x90, 16, (None, 0xDC, 0xDD))
        inline = depth < MAX_PACK_DEPTH
        for item in obj:
            kind = type(item)  # the records' common items written here, without a call
            if not inline:
                _pack(item, out, depth + 1)
            elif kind is int and 0 <= item < 0x80:
                out.append(item)
            elif kind is str and len(item) < 32 and item.isascii():
                out.append(0xA0 | len(item))
                out += item.encode()
            else:
                _pack(item, out, depth + 1)
    elif isinstance(obj, dict):
        _header(len(obj), out, 0x80, 16, (None, 0xDE, 0xDF))
        for key, value in obj.items():
            _pack(key, out, depth + 1)
            _pack(value, out, depth + 1)
    else:
        raise TypeError(f"can not serialize {type(obj).__name__!r} object")


def _pack_int(n: int, out: bytearray) -> None:
    if 0 <= n < 0x80 or -32 <= n < 0:
        out.append(n & 0xFF)
    elif n >= 0:
        for size, code in ((1, 0xCC), (2, 0xCD), (4, 0xCE), (8, 0xCF)):
            if n < 1 << (8 * size):
                out.append(code)
                out += _UNSIGNED[size].pack(n)
                return
        raise OverflowError("Integer value out of range")
    else:
        for size, code in ((1, 0xD0), (2, 0xD1), (4, 0xD2), (8, 0xD3)):
            if n >= -(1 << (8 * size - 1)):
                out.append(code)
                out += _SIGNED[size].pack(n)
                return
        raise OverflowError("Integer value out of range")


def _header(n: int, out: bytearray, fix: int | None, fix_limit: int, codes: tuple[int | None, int, int]) -> None:
    """A str, bin, array or map header: the fix form under ``fix_limit``, else 8-, 16- or 32-bit lengths."""
    if fix is not None and n < fix_limit:
        out.append(fix | n)
    elif codes[0] is not None and n < 0x100:
        out += bytes((codes[0], n))
    elif n < 0x10000:
        out.append(codes[1])
        out += _UNSIGNED[2].pack(n)
    elif n < 1 << 32:
        out.append(codes[2])
        out += _UNSIGNED[4].pack(n)
    else:
        raise ValueError(f"{n} items or bytes is too large for msgpack")


_INT = {0xCC: (1, "B"), 0xCD: (2, "H"), 0xCE: (4, "I"), 0xCF: (8, "Q"),
        0xD0: (1, "b"), 0xD1: (2, "h"), 0xD2: (4, "i"), 0xD3: (8, "q"), 0xCA: (4, "f"), 0xCB: (8, "d")}
_LENGTH = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4, 0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
_NO_KEY = object()


def unpackb(data: bytes | memoryview, *, max_str_len: int, max_bin_len: int, max_array_len: int,
            max_map_len: int) -> Any:
    """The one value ``data`` holds (see the module docstring); ValueError for anything else.

    One loop, no recursion: ``stack`` holds the containers being filled, each as [container, items still to
    read, the map key read and not yet given a value].
    """
    data = bytes(data)
    end = len(data)
    at = 0
    stack: list[list[Any]] = []
    unpack_from = struct.unpack_from
    while True:
        if at >= end:
            raise ValueError("Unpack failed: incomplete input")
        c = data[at]
        at += 1
        container: Any = None
        if c <= 0x7F:
            value: Any = c
        elif c >= 0xE0:
            value = c - 0x100
        elif 0xA0 <= c <= 0xBF or c in (0xD9, 0xDA, 0xDB):  # str
            n, at = _count(data, at, end, c, 0xBF, max_str_len, "max_str_len")
            if at + n > end:
                raise ValueError("Unpack failed: incomplete input")
            value = data[at:at + n].decode("utf-8")  # UnicodeDecodeError is a ValueError
            at += n
        elif c <= 0x8F or c == 0xDE or c == 0xDF:  # map
            n, at = _count(data, at, end, c, 0x8F, max_map_len, "max_map_len")
            container = [{}, n, _NO_KEY]
        elif c <= 0x9F or c == 0xDC or c == 0xDD:  # array
            n, at = _count(data, at, end, c, 0x9F, max_array_len, "max_array_len")
            container = [[], n, None]
        elif c == 0xC0:
            value = None
        elif c == 0xC2 or c == 0xC3:
            value = c == 0xC3
        elif c in _INT:  # ints and floats
            size, code = _INT[c]
            if at + size > end:
                raise ValueError("Unpack failed: incomplete input")
            value = unpack_from(">" + code, data, at)[0]
            at += size
        elif c == 0xC4 or c == 0xC5 or c == 0xC6:  # bin
            n, at = _count(data, at, end, c, -1, max_bin_len, "max_bin_len")
            if at + n > end:
                raise ValueError("Unpack failed: incomplete input")
            value = data[at:at + n]
            at += n
        elif c in (0xC7, 0xC8, 0xC9) or 0xD4 <= c <= 0xD8:
            raise ValueError("ext values are not allowed (max_ext_len=0)")
        else:
            raise ValueError(f"Unpack failed: byte 0x{c:02x} is not a value")  # 0xc1
        if container is not None:
            if container[1]:
                if len(stack) >= MAX_DEPTH:
                    raise ValueError(f"Unpack failed: containers nested over {MAX_DEPTH} deep")
                stack.append(container)
                continue
            value = container[0]  # an empty container is a value at once
        while True:  # give the value to its container, closing each that is full
            if not stack:
                if at != end:
                    raise ValueError("ExtraData: data after the value")
                return value
            top = stack[-1]
            filling = top[0]
            if type(filling) is list:
                filling.append(value)
                top[1] -= 1
            elif top[2] is _NO_KEY:
                if type(value) is not str and type(value) is not bytes:
                    raise ValueError(f"{type(value).__name__} is not allowed for map key when strict_map_key=True")
                top[2] = value
                break
            else:
                filling[top[2]] = value
                top[2] = _NO_KEY
                top[1] -= 1
            if top[1]:
                break
            value = stack.pop()[0]


def _count(data: bytes, at: int, end: int, c: int, fix_top: int, bound: int, name: str) -> tuple[int, int]:
    """A str's, bin's, array's or map's length and where its bytes end; ValueError past ``bound``.

    The length is in the first byte ``c`` up to ``fix_top``, else in the big-endian bytes after it.
    """
    if c <= fix_top:
        n = c & (0x1F if fix_top == 0xBF else 0x0F)
    else:
        size = _LENGTH[c]
        if at + size > end:
            raise ValueError("Unpack failed: incomplete input")
        n, at = int.from_bytes(data[at:at + size], "big"), at + size
    if n > bound:
        raise ValueError(f"{n} exceeds {name}({bound})")
    return n, at
