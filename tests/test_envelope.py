"""The shared-tier envelope: round trips, every bit flip and truncation, signatures, and hostile bytes."""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgpack
import pytest
import xxhash
import zstandard
from sharedlib import SIGNING_KEY, make_entry

from lazytriton.cache_format import Entry
from lazytriton.cache_format.entry import MAGIC as ENTRY_MAGIC
from lazytriton.cache_format.entry import MAX_ENTRY_BYTES
from lazytriton.cache_format.envelope import (
    HEADER_SIZE,
    MAGIC,
    MAX_ENVELOPE_BYTES,
    Rejected,
    check_signing_key,
    seal,
    unseal,
)

KEY = "ab" * 16


def forge(entry_bytes: bytes, payload: bytes, flags: int, entry_len: int | None = None,
          signing_key: bytes | None = None) -> bytes:
    """An envelope made by hand, the way a hostile node could write one."""
    header = struct.pack("<8sBBHII", MAGIC, 1, flags, 0, len(payload), len(entry_bytes) if entry_len is None
                         else entry_len)
    mac = hmac.new(signing_key, header + payload, hashlib.sha256).digest() if signing_key else bytes(32)
    return header + mac + payload


def reason(data: bytes, signing_key: bytes | None = None, key: str = KEY) -> str:
    with pytest.raises(Rejected) as info:
        unseal(data, key, signing_key)
    return info.value.reason


@pytest.mark.parametrize("signing_key", [None, SIGNING_KEY])
@pytest.mark.parametrize("size", [10, 50_000])
def test_round_trip(signing_key: bytes | None, size: int) -> None:
    entry = make_entry(KEY, size=size)
    data = seal(entry.encode(), signing_key)
    assert data[:8] == MAGIC and unseal(data, KEY, signing_key) == entry


def compressible(key: str) -> Entry:
    """An entry whose binary is half zeros, as a cubin's padding is: stored zstd-compressed."""
    fields = {name: getattr(make_entry(key, size=2000), name) for name in Entry.__slots__}
    return Entry(**{**fields, "binary": fields["binary"] + bytes(4000)})


@pytest.mark.parametrize("stored", ["raw", "zstd"])
@pytest.mark.parametrize("signing_key", [None, SIGNING_KEY])
def test_every_bit_flip_and_truncation_is_detected(signing_key: bytes | None, stored: str) -> None:
    entry = make_entry(KEY, size=400) if stored == "raw" else compressible(KEY)  # under 1 KiB: stored raw
    data = seal(entry.encode(), signing_key)
    assert bool(data[9] & 0x02) == (stored == "zstd")
    flips = [(i, bit) for i in range(HEADER_SIZE) for bit in range(8)]  # every bit of the header and MAC
    flips += [(i, i % 8) for i in range(HEADER_SIZE, len(data))]  # one bit of every payload byte
    passed = []
    for i, bit in flips:
        damaged = bytearray(data)
        damaged[i] ^= 1 << bit
        try:
            opened = unseal(bytes(damaged), KEY, signing_key)
        except Rejected:
            continue
        passed.append((i, bit))
        assert opened == entry, f"bit {bit} of byte {i} changed the entry and went unnoticed"
    if signing_key is None:
        # Without a key a signed envelope's MAC cannot be checked; an unsigned one must hold zeros there,
        # so only the flag bit that marks it signed can flip unnoticed (and the entry is intact).
        assert passed == [(9, 0)]
    else:
        assert passed == []
    for length in [0, 1, 8, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, len(data) // 2, len(data) - 1]:
        assert reason(data[:length], signing_key) in ("truncated", "magic")
    print(f"\nenvelope ({stored}, {'signed' if signing_key else 'unsigned'}): {len(flips)} bit flips, 8 truncations, "
          f"{len(passed)} undetected (entry intact)")


def test_with_a_signing_key_unsigned_and_foreign_entries_are_refused() -> None:
    entry_bytes = make_entry(KEY).encode()
    assert reason(seal(entry_bytes), SIGNING_KEY) == "unsigned"
    assert reason(seal(entry_bytes, b"another-deployment-key-000"), SIGNING_KEY) == "signature"
    # A signed envelope moved to another key is refused by the entry's own key check.
    assert reason(seal(entry_bytes, SIGNING_KEY), SIGNING_KEY, key="cd" * 16) == "entry"
    # Without a key, signed entries are still read (the MAC is not checked; the checksum is).
    assert unseal(seal(entry_bytes, SIGNING_KEY), KEY).key == KEY


def test_a_forged_signature_is_checked_before_anything_is_decompressed(monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = zstandard.ZstdCompressor().compress(bytes(200 << 20))
    data = forge(b"x" * 1000, bomb, flags=0x03, entry_len=1000)  # "signed", with zeros for a MAC
    monkeypatch.setattr(zstandard, "ZstdDecompressor", lambda **kw: pytest.fail("decompressed before the MAC"))
    assert reason(data, SIGNING_KEY) == "signature"


def test_a_decompression_bomb_is_refused_without_inflating_it() -> None:
    zeros = bytes(200 << 20)
    claimed = zstandard.ZstdCompressor().compress(zeros)  # the frame says 200 MiB
    assert reason(forge(b"x" * 1000, claimed, flags=0x02, entry_len=1000)) == "bomb"
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(zeros)  # the frame says nothing
    assert reason(forge(b"x" * 1000, streamed, flags=0x02, entry_len=1000)) == "bomb"
    # A frame asking for a window beyond the decoder's bound is refused by zstd itself.
    params = zstandard.ZstdCompressionParameters(window_log=27, write_content_size=False)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()  # size unknown: a 128 MiB window
    wide = stream.compress(bytes(1 << 20)) + stream.flush()
    assert zstandard.get_frame_parameters(wide).window_size == 1 << 27
    assert reason(forge(b"x" * (1 << 20), wide, flags=0x02)) == "compression"


def test_an_oversized_length_field_or_envelope_is_refused() -> None:
    assert reason(forge(b"x" * 100, b"x" * 100, flags=0x02, entry_len=MAX_ENTRY_BYTES + 1)) == "oversized"
    assert reason(forge(b"", b"", flags=0, entry_len=0xFFFFFFFF)) == "oversized"
    header = struct.pack("<8sBBHII", MAGIC, 1, 0, 0, 0xFFFFFFF0, 100)
    assert reason(header + bytes(32) + b"x" * 100) == "truncated"  # a payload length that lies
    assert reason(bytes(MAX_ENVELOPE_BYTES + 1)) == "oversized"


def test_oversized_msgpack_is_refused() -> None:
    record = {"key": KEY, "name": "n" * (1 << 20)}  # a 1 MiB string where 4 KiB is the bound
    payload = msgpack.packb(record)
    entry_bytes = struct.pack("<8sIIQ", ENTRY_MAGIC, 1, len(payload), xxhash.xxh3_64_intdigest(payload)) + payload
    with pytest.raises(Rejected) as info:
        unseal(seal(entry_bytes), KEY)
    assert info.value.reason == "entry" and info.value.trust and "msgpack" in str(info.value)


def test_signing_keys_are_checked() -> None:
    assert check_signing_key(None) is None and check_signing_key(SIGNING_KEY) == SIGNING_KEY
    with pytest.raises(ValueError, match="signing_key must be at least 16 bytes, got 5"):
        check_signing_key(b"short")
    with pytest.raises(TypeError, match="signing_key must be bytes, got str"):
        check_signing_key("a-str-key-that-is-long")  # type: ignore[arg-type]
