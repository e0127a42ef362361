r"""Envelope: how an entry travels through a shared tier (a directory or Redis that other nodes write too).

Bytes (see SPEC.md, "Shared envelope"):

    offset  size  field
    0       8     magic  b"LTSHARE\0"
    8       1     envelope version (1)
    9       1     flags: bit 0 signed (HMAC-SHA256), bit 1 zstd-compressed payload
    10      2     reserved, 0
    12      4     payload length n, uint32 little-endian
    16      4     entry length: the encoded entry's size once decompressed, uint32 little-endian
    20      32    HMAC-SHA256(signing key, bytes 0..19 + payload); zeros when unsigned
    52      n     payload: the encoded entry (cache_format.entry), zstd-compressed when flag 1 is set

The MAC covers the header and the payload exactly as stored, so a node with a
signing key checks it before a byte is decompressed or parsed: a foreign or
forged envelope is refused without touching zstd or msgpack. Decompression is
bounded by the declared entry length (itself bounded by ``MAX_ENTRY_BYTES``):
a frame that claims or produces more is refused, never allocated. The entry
inside is then verified as everywhere else (``Entry.decode``: checksum,
bounded msgpack, schema, key).
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from lazytriton.cache_format.entry import MAX_ENTRY_BYTES, Entry, EntryError

MAGIC = b"LTSHARE\0"
ENVELOPE_VERSION = 1
SIGNED = 0x01
COMPRESSED = 0x02
_HEADER = struct.Struct("<8sBBHII")  # magic, version, flags, reserved, payload length, entry length
_MAC_SIZE = hashlib.sha256().digest_size
HEADER_SIZE = _HEADER.size + _MAC_SIZE
MAX_ENVELOPE_BYTES = HEADER_SIZE + MAX_ENTRY_BYTES
MIN_KEY_BYTES = 16

# zstd level 3 shrinks a cubin to about a third in ~1 ms per 100 KiB; entries
# under 1 KiB are stored as they are (a zstd frame would barely shrink them).
_COMPRESS_LEVEL = 3
_COMPRESS_MIN = 1024
# Level 3 never uses a window above 8 MiB; refusing larger windows bounds the
# decoder's memory whatever a hostile frame asks for.
_MAX_WINDOW = 1 << 23


class Rejected(EntryError):
    """An envelope that is refused, with a short ``reason`` code for counters and logs.

    ``trust`` is True for policy refusals (unsigned, bad signature, over a
    bound, a decompression bomb) and False for damage (truncation, bit flips).
    """

    def __init__(self, reason: str, detail: str, trust: bool) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.trust = trust


def check_signing_key(signing_key: bytes | None) -> bytes | None:
    """Return ``signing_key`` if it is None or long enough, else raise ValueError naming it."""
    if signing_key is None:
        return None
    if not isinstance(signing_key, bytes):
        raise TypeError(f"signing_key must be bytes, got {type(signing_key).__name__}")
    if len(signing_key) < MIN_KEY_BYTES:
        raise ValueError(f"signing_key must be at least {MIN_KEY_BYTES} bytes, got {len(signing_key)}")
    return signing_key


def _mac(signing_key: bytes, header: bytes, payload: bytes | memoryview) -> bytes:
    mac = hmac.new(signing_key, header, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def seal(entry_bytes: bytes, signing_key: bytes | None = None) -> bytes:
    """Wrap encoded entry bytes for a shared tier: compressed when that helps, signed when a key is given."""
    if len(entry_bytes) > MAX_ENTRY_BYTES:
        raise ValueError(f"entry_bytes of {len(entry_bytes)} bytes exceed the {MAX_ENTRY_BYTES} byte bound")
    flags, payload = 0, entry_bytes
    if len(entry_bytes) >= _COMPRESS_MIN:
        import zstandard  # imported on first publish: serving from a shared tier is the rarer path

        packed = zstandard.ZstdCompressor(level=_COMPRESS_LEVEL).compress(entry_bytes)
        if len(packed) < len(entry_bytes):
            flags, payload = COMPRESSED, packed
    key = check_signing_key(signing_key)
    if key is not None:
        flags |= SIGNED
    header = _HEADER.pack(MAGIC, ENVELOPE_VERSION, flags, 0, len(payload), len(entry_bytes))
    mac = _mac(key, header, payload) if key is not None else bytes(_MAC_SIZE)
    return header + mac + payload


def _parse_header(data: bytes | memoryview) -> tuple[int, int, bytes]:
    """Flags, entry length and MAC of an envelope whose sizes are all within bounds."""
    if len(data) > MAX_ENVELOPE_BYTES:
        raise Rejected("oversized", f"{len(data)} bytes exceed the {MAX_ENVELOPE_BYTES} byte bound", trust=True)
    if len(data) < HEADER_SIZE:
        raise Rejected("truncated", f"{len(data)} bytes, the header needs {HEADER_SIZE}", trust=False)
    magic, version, flags, reserved, payload_len, entry_len = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise Rejected("magic", f"not a shared envelope: magic {bytes(magic)!r}", trust=False)
    if version != ENVELOPE_VERSION or reserved != 0 or flags & ~(SIGNED | COMPRESSED):
        raise Rejected("header", f"version {version}, flags {flags:#x}, reserved {reserved} not understood",
                       trust=False)
    if entry_len > MAX_ENTRY_BYTES:
        raise Rejected("oversized", f"entry length field {entry_len} exceeds the {MAX_ENTRY_BYTES} byte bound",
                       trust=True)
    if payload_len != len(data) - HEADER_SIZE:
        raise Rejected("truncated", f"payload is {len(data) - HEADER_SIZE} bytes, header says {payload_len}",
                       trust=False)
    if not flags & COMPRESSED and payload_len != entry_len:
        raise Rejected("header", f"uncompressed payload of {payload_len} bytes, entry length {entry_len}",
                       trust=False)
    mac = bytes(data[_HEADER.size:HEADER_SIZE])
    if not flags & SIGNED and mac != bytes(_MAC_SIZE):
        raise Rejected("header", "an unsigned envelope with a non-zero MAC field", trust=False)
    return flags, entry_len, mac


def _inflate(payload: memoryview, entry_len: int) -> bytes:
    """Decompress at most ``entry_len`` bytes; a frame that claims or yields more is a bomb."""
    import zstandard

    try:
        claimed = zstandard.frame_content_size(payload)
        if claimed not in (-1, entry_len):
            raise Rejected("bomb", f"zstd frame claims {claimed} bytes, the envelope {entry_len}", trust=True)
        reader = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW).stream_reader(payload)
        out = bytearray()
        while len(out) <= entry_len:
            chunk = reader.read(entry_len + 1 - len(out))
            if not chunk:
                break
            out += chunk
    except zstandard.ZstdError as exc:
        raise Rejected("compression", f"zstd payload does not decompress: {exc}", trust=False) from None
    if len(out) > entry_len:
        raise Rejected("bomb", f"zstd payload expands past the declared {entry_len} bytes", trust=True)
    if len(out) != entry_len:
        raise Rejected("truncated", f"zstd payload gives {len(out)} bytes, header says {entry_len}", trust=False)
    return bytes(out)


def unseal(data: bytes | memoryview, key: str, signing_key: bytes | None = None) -> Entry:
    """Verify and open an envelope read under ``key``; raise ``Rejected`` (an EntryError) if anything is off.

    With a ``signing_key``, only envelopes signed with it pass. Without one, the
    MAC is not checked (there is nothing to check it with) and the entry's own
    checksum is all that stands between damage and a launch.
    """
    view = memoryview(data)
    flags, entry_len, mac = _parse_header(view)
    payload = view[HEADER_SIZE:]
    if signing_key is not None:
        if not flags & SIGNED:
            raise Rejected("unsigned", "a signing key is set and the entry carries no signature", trust=True)
        if not hmac.compare_digest(mac, _mac(signing_key, bytes(view[:_HEADER.size]), payload)):
            raise Rejected("signature", "HMAC-SHA256 does not match this deployment's signing key", trust=True)
    entry_bytes = _inflate(payload, entry_len) if flags & COMPRESSED else payload
    try:
        return Entry.decode(entry_bytes, expected_key=key)
    except EntryError as exc:
        # A checksum that does not match is damage; anything refused after it matched was made that way.
        damage = "checksum" in str(exc) or "truncated" in str(exc)
        raise Rejected("entry", str(exc), trust=not damage) from None
