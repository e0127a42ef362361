"""Structural checks of the GPU code objects entries hold: cubin (NVIDIA) and HSACO (AMD).

Both are 64-bit little-endian ELF files. ``check_binary`` reads the ELF
header, the section table and the symbol tables, bounded by the file's size,
and returns the problems it finds (an empty list: the binary is what its entry
says). It does not disassemble or load anything.

- cubin: ``e_machine`` is EM_CUDA (190) and ``e_flags`` names the entry's SM.
  Where depends on ``e_ident[EI_ABIVERSION]`` (LLVM's ``ELF.h``): ABI 7
  (``ELFABIVERSION_CUDA_V1``) keeps it in the low byte (``EF_CUDA_SM``); ABI 8
  (``ELFABIVERSION_CUDA_V2``, ptxas of CUDA 12.8 and later, as bundled with
  Triton 3.9) in bits 8-15 (``EF_CUDA_SM_MASK``). A Triton 3.9 sm_90 cubin has
  ``e_flags`` 0x0a005a04: 0x5a = 90 in bits 8-15.
- HSACO: ``e_machine`` is EM_AMDGPU (224), ``EI_OSABI`` is ELFOSABI_AMDGPU_HSA
  (64) and ``e_flags & 0xff`` (``EF_AMDGPU_MACH``) is the gfx target's value
  (gfx942: 0x04c, gfx950: 0x04f; a gfx target missing from ``AMDGPU_MACH`` is
  not checked).
- Both: the section table and every section lie inside the file, and a symbol
  table holds the kernel's name (an HSACO also its kernel descriptor,
  ``<name>.kd``).
"""

from __future__ import annotations

import struct
from typing import Any

ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190
EM_AMDGPU = 224
ELFOSABI_AMDGPU_HSA = 64
ELFABIVERSION_CUDA_V1 = 7
ELFABIVERSION_CUDA_V2 = 8
SHT_SYMTAB, SHT_NOBITS, SHT_DYNSYM = 2, 8, 11

# EF_AMDGPU_MACH_AMDGCN_* from LLVM's BinaryFormat/ELF.h.
AMDGPU_MACH = {
    "gfx900": 0x02C, "gfx908": 0x030, "gfx90a": 0x03F, "gfx940": 0x040, "gfx941": 0x04B, "gfx942": 0x04C,
    "gfx950": 0x04F, "gfx1010": 0x033, "gfx1030": 0x036, "gfx1100": 0x041, "gfx1150": 0x043, "gfx1200": 0x048,
    "gfx1201": 0x04E,
}

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")  # 64 bytes
_SHDR = struct.Struct("<IIQQQQIIQQ")  # 64 bytes
_SYM = struct.Struct("<IBBHQQ")  # 24 bytes
_MAX_SYMBOLS = 1 << 16


class ElfError(ValueError):
    """Bytes that are not a well-formed 64-bit little-endian ELF file."""


def cuda_sm(ident: bytes, flags: int) -> int:
    """The SM number a cubin's ``e_flags`` encode, by its ELF ABI version."""
    abi = ident[8]
    if abi == ELFABIVERSION_CUDA_V1:
        return flags & 0xFF
    if abi == ELFABIVERSION_CUDA_V2:
        return (flags >> 8) & 0xFF
    raise ElfError(f"unknown CUDA ELF ABI version {abi} (expected {ELFABIVERSION_CUDA_V1} or {ELFABIVERSION_CUDA_V2})")


def _header(data: bytes) -> tuple[Any, ...]:
    """The ELF header's fields, once the file is known to be a 64-bit little-endian ELF."""
    if len(data) < _EHDR.size or data[:4] != ELF_MAGIC:
        raise ElfError("not an ELF file (no \\x7fELF magic)")
    header = _EHDR.unpack_from(data, 0)
    ident = header[0]
    if ident[4] != 2 or ident[5] != 1:
        raise ElfError(f"ELF class {ident[4]} / data {ident[5]}: expected 64-bit (2) little-endian (1)")
    return header


def _sections(data: bytes) -> list[tuple[int, ...]]:
    """The section headers, each bounded by the file."""
    header = _header(data)
    shoff, shentsize, shnum, shstrndx = header[6], header[11], header[12], header[13]
    if shnum == 0:
        return []
    if shentsize != _SHDR.size or shoff + shnum * _SHDR.size > len(data) or shstrndx >= shnum:
        raise ElfError(f"section table ({shnum} x {shentsize} bytes at {shoff}) does not fit the "
                       f"{len(data)} byte file")
    sections = [_SHDR.unpack_from(data, shoff + i * _SHDR.size) for i in range(shnum)]
    for i, (_, kind, _, _, offset, size, *_rest) in enumerate(sections):
        if kind != SHT_NOBITS and offset + size > len(data):
            raise ElfError(f"section {i} ([{offset}, {offset + size})) runs past the {len(data)} byte file")
    return sections


def _c_string(data: bytes, start: int, end: int) -> bytes:
    stop = data.find(b"\0", start, end)
    return data[start:stop if stop >= 0 else end]


def symbols(data: bytes) -> set[str]:
    """Names in the ELF file's symbol tables (.symtab and .dynsym)."""
    sections = _sections(data)
    names: set[str] = set()
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind not in (SHT_SYMTAB, SHT_DYNSYM) or entsize != _SYM.size or link >= len(sections):
            continue
        str_offset, str_size = sections[link][4], sections[link][5]
        for i in range(min(size // _SYM.size, _MAX_SYMBOLS)):
            name_at = _SYM.unpack_from(data, offset + i * _SYM.size)[0]
            if 0 < name_at < str_size:
                names.add(_c_string(data, str_offset + name_at, str_offset + str_size).decode("utf-8", "replace"))
    return names


def _arch_problems(kind: str, target: str, header: tuple[Any, ...]) -> list[str]:
    ident, machine, flags = header[0], header[2], header[7]
    if kind == "cubin":
        if machine != EM_CUDA:
            return [f"cubin: e_machine {machine}, expected EM_CUDA ({EM_CUDA})"]
        expected = int(target[3:]) if target.startswith("sm_") and target[3:].isdigit() else None
        try:
            sm = cuda_sm(ident, flags)
        except ElfError as exc:
            return [f"cubin: {exc}"]
        return [] if sm == expected else [f"cubin: e_flags 0x{flags:08x} encode sm_{sm}, entry target is {target}"]
    if kind == "hsaco":
        if machine != EM_AMDGPU:
            return [f"hsaco: e_machine {machine}, expected EM_AMDGPU ({EM_AMDGPU})"]
        problems = []
        if ident[7] != ELFOSABI_AMDGPU_HSA:
            problems.append(f"hsaco: EI_OSABI {ident[7]}, expected ELFOSABI_AMDGPU_HSA ({ELFOSABI_AMDGPU_HSA})")
        mach = AMDGPU_MACH.get(target)  # a target missing from the table is not checked, not failed
        if mach is not None and flags & 0xFF != mach:
            problems.append(f"hsaco: EF_AMDGPU_MACH 0x{flags & 0xFF:03x}, {target} is 0x{mach:03x}")
        return problems
    return [f"binary kind {kind!r} is not cubin or hsaco"]


def check_binary(kind: str, target: str, binary: bytes, symbol: str | None = None) -> list[str]:
    """Problems that keep ``binary`` from being a ``kind`` code object for ``target`` holding ``symbol``."""
    try:
        header = _header(binary)
    except ElfError as exc:
        return [f"{kind}: {exc}"]
    problems = _arch_problems(kind, target, header)
    try:
        _sections(binary)  # bounds of the section table and of every section
        found = symbols(binary) if symbol else set()
    except ElfError as exc:
        return [*problems, f"{kind}: {exc}"]
    if symbol:
        wanted = [symbol] + ([f"{symbol}.kd"] if kind == "hsaco" else [])
        missing = [name for name in wanted if name not in found]
        if missing:
            problems.append(f"{kind}: symbol table lacks {missing}")
    return problems
