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

from lazytriton.cache_format import mpack
from lazytriton.record import record

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


# --- launch facts: what the binary was built for, checked against its entry's launch metadata --------------------

# .nv.info attributes (NVIDIA's EIATTR_*): each record is format (1 byte), attribute (1 byte), then a 2-byte value
# for formats 1-3, or a 2-byte size and that many bytes for EIFMT_SVAL. ptxas writes the PTX ``.reqntid`` (Triton
# 3.9: ``.reqntid 128`` for num_warps=4) as REQNTID, and ``.maxntid`` (older Tritons) as MAX_THREADS: x, y, z.
EIFMT_SVAL = 0x04
EIATTR_MAX_THREADS = 0x05
EIATTR_REQNTID = 0x10
NT_AMDGPU_METADATA = 32
_MAX_NOTE_BYTES = 1 << 20

# Largest dynamic shared memory (LDS) one block may use, by target (CUDA's sharedMemPerBlockOptin; the LDS size
# on AMD). Triton refuses a kernel above it at launch; an entry claiming more cannot be what its variant built.
MAX_SHARED = {
    "sm_70": 96 << 10, "sm_72": 96 << 10, "sm_75": 64 << 10, "sm_80": 163 << 10, "sm_86": 99 << 10,
    "sm_87": 163 << 10, "sm_89": 99 << 10, "sm_90": 227 << 10, "sm_100": 227 << 10, "sm_120": 99 << 10,
    "gfx90a": 64 << 10, "gfx940": 64 << 10, "gfx941": 64 << 10, "gfx942": 64 << 10, "gfx950": 160 << 10,
}


@record
class LaunchFacts:
    """What a code object records about how it must be launched (None: it does not say).

    ``threads``: threads per block it was built for (cubin: REQNTID or
    MAX_THREADS in ``.nv.info.<kernel>``; HSACO: ``.max_flat_workgroup_size``
    in the AMDGPU metadata note). ``wavefront``: the HSACO's wavefront size.
    ``static_shared``: shared memory (LDS) it declares itself, beyond the
    dynamic amount the launch passes (cubin: ``.nv.shared.<kernel>``; HSACO:
    ``.group_segment_fixed_size``).
    """

    threads: int | None
    wavefront: int | None
    static_shared: int | None


def _named_sections(data: bytes) -> dict[str, tuple[int, int, int]]:
    """Section name -> (type, offset, size), names read from the section header string table."""
    sections = _sections(data)
    if not sections:
        return {}
    strtab = sections[_header(data)[13]]
    named: dict[str, tuple[int, int, int]] = {}
    for name_at, kind, _, _, offset, size, *_rest in sections:
        if name_at < strtab[5]:
            name = _c_string(data, strtab[4] + name_at, strtab[4] + strtab[5]).decode("utf-8", "replace")
            named.setdefault(name, (kind, offset, size))
    return named


def section_contents(data: bytes) -> dict[str, bytes]:
    """Each named section's bytes (empty for a section that takes no room in the file); ElfError if malformed."""
    return {name: b"" if kind == SHT_NOBITS else data[offset:offset + size]
            for name, (kind, offset, size) in _named_sections(data).items()}


def nv_info_attributes(blob: bytes) -> list[tuple[int, bytes]]:
    """The (attribute, value) records of a ``.nv.info`` section; ElfError if one runs past the section."""
    records, at = [], 0
    while at + 4 <= len(blob):
        fmt, attr = blob[at], blob[at + 1]
        if fmt == EIFMT_SVAL:
            size = struct.unpack_from("<H", blob, at + 2)[0]
            if at + 4 + size > len(blob):
                raise ElfError(f".nv.info record at {at} ({size} bytes) runs past the {len(blob)} byte section")
            records.append((attr, blob[at + 4:at + 4 + size]))
            at += 4 + size
        elif fmt in (1, 2, 3):
            records.append((attr, blob[at + 2:at + 4]))
            at += 4
        else:
            raise ElfError(f".nv.info record at {at} has unknown format {fmt}")
    return records


def _cubin_facts(data: bytes, symbol: str) -> LaunchFacts:
    named = _named_sections(data)
    threads = None
    info = named.get(f".nv.info.{symbol}")
    if info is not None:
        for attr, value in nv_info_attributes(data[info[1]:info[1] + info[2]]):
            if attr in (EIATTR_REQNTID, EIATTR_MAX_THREADS) and len(value) == 12:
                x, y, z = struct.unpack("<III", value)
                threads = x * y * z
                if attr == EIATTR_REQNTID:
                    break  # the exact requirement wins over a bound
    shared = named.get(f".nv.shared.{symbol}")
    return LaunchFacts(threads, None, shared[2] if shared is not None else None)


def amdgpu_kernel_metadata(data: bytes, symbol: str) -> dict[str, Any] | None:
    """The HSACO's metadata map (msgpack, in an NT_AMDGPU_METADATA note) of kernel ``symbol``, None if absent."""
    for kind, offset, size in _named_sections(data).values():
        if kind != 7:  # SHT_NOTE
            continue
        at, end = offset, offset + size
        while at + 12 <= end:
            namesz, descsz, note_type = struct.unpack_from("<III", data, at)
            desc_at = at + 12 + (namesz + 3) // 4 * 4
            if desc_at + descsz > end:
                raise ElfError(f"note at {at} runs past its section")
            if note_type == NT_AMDGPU_METADATA and data[at + 12:at + 12 + namesz].rstrip(b"\0") == b"AMDGPU":
                if descsz > _MAX_NOTE_BYTES:
                    raise ElfError(f"AMDGPU metadata note of {descsz} bytes exceeds {_MAX_NOTE_BYTES}")
                try:
                    meta = mpack.unpackb(data[desc_at:desc_at + descsz], max_bin_len=0, max_str_len=4096,
                                         max_array_len=4096, max_map_len=256)
                except ValueError as exc:
                    raise ElfError(f"AMDGPU metadata note is not valid msgpack: {exc}") from None
                kernels = meta.get("amdhsa.kernels") if isinstance(meta, dict) else None
                for kernel in kernels if isinstance(kernels, list) else []:
                    if isinstance(kernel, dict) and kernel.get(".name") == symbol:
                        return kernel
            at = desc_at + (descsz + 3) // 4 * 4
    return None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def launch_facts(kind: str, binary: bytes, symbol: str) -> LaunchFacts:
    """What the ``kind`` code object records about launching ``symbol``; ElfError if it is malformed."""
    if kind == "cubin":
        return _cubin_facts(binary, symbol)
    if kind == "hsaco":
        kernel = amdgpu_kernel_metadata(binary, symbol) or {}
        return LaunchFacts(_int_or_none(kernel.get(".max_flat_workgroup_size")),
                           _int_or_none(kernel.get(".wavefront_size")),
                           _int_or_none(kernel.get(".group_segment_fixed_size")))
    raise ElfError(f"binary kind {kind!r} is not cubin or hsaco")


def check_launch(kind: str, target: str, binary: bytes, symbol: str, *, num_warps: int, warp_size: int,
                 shared: int) -> list[str]:
    """Problems between an entry's launch metadata and what its binary records (empty: they agree).

    Triton launches ``num_warps * warp_size`` threads per block with
    ``shared`` bytes of dynamic shared memory; a binary built for another
    block size fails to launch or computes garbage, and one given less shared
    memory than it uses corrupts memory. The binary records its block size
    (cubin, HSACO) and wavefront size (HSACO); the dynamic shared memory it
    uses is not recorded, so only the target's bound is checked.
    """
    try:
        facts = launch_facts(kind, binary, symbol)
    except ElfError as exc:
        return [f"{kind}: {exc}"]
    problems = []
    threads = num_warps * warp_size
    if facts.threads is None:
        problems.append(f"{kind}: records no threads per block for {symbol} (REQNTID/MAX_THREADS, "
                        ".max_flat_workgroup_size), so the launch metadata cannot be confirmed")
    elif facts.threads != threads:
        problems.append(f"{kind}: built for {facts.threads} threads per block, entry launches {threads} "
                        f"(num_warps={num_warps} x warp_size={warp_size})")
    if facts.wavefront is not None and facts.wavefront != warp_size:
        problems.append(f"{kind}: built for wavefront size {facts.wavefront}, entry says warp_size={warp_size}")
    bound = MAX_SHARED.get(target)
    if bound is not None and shared > bound:
        problems.append(f"entry asks for {shared} bytes of shared memory, {target} allows {bound} per block")
    if bound is not None and facts.static_shared is not None and facts.static_shared > bound:
        problems.append(f"{kind}: declares {facts.static_shared} bytes of static shared memory, "
                        f"{target} allows {bound} per block")
    return problems
