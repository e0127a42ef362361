"""Images on disk that are not what they seem: shrunk while mapped, not regular files, crafted dictionaries.

Issue 13, findings 4 (a file truncated in place under a running process was a SIGBUS), 5 (a FIFO named
``*.ltimg`` hung every lookup; a symlink loop raised RuntimeError) and 6 (a dictionary with a valid magic and
bad tables raised zstandard.ZstdError out of the tier and out of ``cache verify``).
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash
import zstandard

from lazytriton import config
from lazytriton.cache_format import Entry, Provenance
from lazytriton.cache_format.image import HEADER_SIZE, RECORD_SIZE, Image, ImageError, write_image
from lazytriton.cli import main
from lazytriton.store.image import ImageTier, image_files

IMAGE_HEADER = struct.Struct("<8sIIII6Q3Q")
RECORD = struct.Struct("<16sQIIQ")
DEADLINE = 60.0  # seconds; a hang (the bug) fails the test, a slow machine does not


def entries(n: int = 10) -> list[Entry]:
    made = []
    for i in range(n):
        key = xxhash.xxh3_128_hexdigest(f"image-files:{i}".encode())
        body = bytes((j * 13 + i) % 251 for j in range(3000 + 50 * i))
        made.append(Entry(key=key, variant="flash_fwd:sm_90:fp16:::", target="sm_90", kind="cubin",
                          binary=b"\x7fELF" + body, name="k", num_warps=4, num_ctas=1, warp_size=32, shared=0,
                          global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
                          profile_scratch_align=1, arg_types=(), hidden_args=(),
                          provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1)))
    return made


def within_deadline(fn: Callable[[], Any]) -> Any:
    """``fn()`` run in a daemon thread: a call that blocks (a FIFO opened for reading) fails instead of hanging."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # handed back to the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive(), f"blocked for {DEADLINE} s (a FIFO opened without O_NONBLOCK?)"
    if "error" in result:
        raise result["error"]
    return result.get("value")


# --- finding 4: an image truncated in place while a process reads it ---------------------------------------------

READER = """
import sys
from pathlib import Path
from lazytriton.cache_format.image import Image, ImageError
from lazytriton.store.image import ImageTier

path, first, second = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
image = Image(path)
tier = ImageTier([path], include_package=False)
assert image.read(first) is not None and tier.get(first) is not None
print("ready", flush=True)
sys.stdin.readline()  # the test truncates the file in place now
try:
    image.read(second)
    print("read: no error")
except ImageError as exc:
    print("read: ImageError", "shrank" in str(exc))
print("tier:", tier.get(second) is None)
"""


@pytest.mark.parametrize("new_size", [0, HEADER_SIZE + 10])
def test_an_image_truncated_in_place_is_an_image_error_not_a_sigbus(tmp_path: Path, new_size: int) -> None:
    made = entries()
    path = write_image(tmp_path / "live.ltimg", made, codec="zstd").path
    first, second = made[0].key, sorted(e.key for e in made)[-1]
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path), first, second], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline().strip() == "ready"
        with open(path, "r+b") as f:  # in place, as `cp new.ltimg live.ltimg` does
            f.truncate(new_size)
        reader.stdin.write("go\n")
        reader.stdin.flush()
        out, err = reader.communicate(timeout=DEADLINE * 2)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0, f"exit {reader.returncode} (-7 is SIGBUS): {err}"
    assert "read: ImageError True" in out and "tier: True" in out, out


def test_an_image_replaced_by_rename_keeps_serving_the_open_one(tmp_path: Path) -> None:
    made = entries()
    path = write_image(tmp_path / "live.ltimg", made[:5]).path
    with Image(path) as image:
        write_image(tmp_path / "next.ltimg", made[5:])
        os.replace(tmp_path / "next.ltimg", path)
        assert image.read(made[0].key) == made[0], "the open image still reads the file it opened"
    with Image(path) as image:
        assert image.read(made[0].key) is None and image.read(made[5].key) == made[5]


# --- finding 5: files among the images that are not regular files ------------------------------------------------


@pytest.fixture
def mixed_folder(tmp_path: Path) -> tuple[Path, Path, list[Entry]]:
    """A folder holding one good image and every kind of bad ``*.ltimg``."""
    folder = tmp_path / "images"
    made = entries(3)
    good = write_image(folder / "good.ltimg", made).path
    os.mkfifo(folder / "fifo.ltimg")
    (folder / "dir.ltimg").mkdir()
    os.symlink("loop.ltimg", folder / "loop.ltimg")  # a link to itself
    os.symlink("ping.ltimg", folder / "pong.ltimg")
    os.symlink("pong.ltimg", folder / "ping.ltimg")
    os.symlink("/dev/null", folder / "device.ltimg")
    os.symlink("missing.ltimg", folder / "dangling.ltimg")
    os.symlink(good, folder / "link-to-good.ltimg")  # followed: the same file, listed once
    return folder, good, made


def test_image_files_keeps_regular_files_and_skips_the_rest_with_one_warning_each(
        mixed_folder: tuple[Path, Path, list[Entry]], caplog: pytest.LogCaptureFixture) -> None:
    folder, good, _ = mixed_folder
    with caplog.at_level(logging.WARNING, logger="lazytriton.store.image"):
        found = within_deadline(lambda: image_files([folder], include_package=False))
    assert len(found) == 1 and os.path.samefile(found[0], good)
    skipped = ["fifo", "dir", "loop", "ping", "pong", "device", "dangling"]
    for name in skipped:
        assert sum(f"{name}.ltimg" in r.getMessage() for r in caplog.records) == 1, (name, caplog.text)
    assert len(caplog.records) == len(skipped)
    # Named one by one on the search path, the same: a user's symlink to an image is followed.
    named = [folder / f"{name}.ltimg" for name in skipped] + [folder / "link-to-good.ltimg"]
    found = within_deadline(lambda: image_files(named, include_package=False))
    assert found == [folder / "link-to-good.ltimg"]


def test_image_refuses_a_fifo_a_directory_and_a_device_without_blocking(
        mixed_folder: tuple[Path, Path, list[Entry]]) -> None:
    folder, _, _ = mixed_folder
    for name, kind in [("fifo", "a FIFO"), ("dir", "a directory"), ("device", "a character device")]:
        with pytest.raises(ImageError, match=f"not a regular file \\({kind}\\)"):
            within_deadline(lambda name=name: Image(folder / f"{name}.ltimg"))
    with pytest.raises(OSError):  # ELOOP: callers skip it as they skip any unreadable file
        Image(folder / "loop.ltimg")


def test_lookups_ls_and_verify_serve_past_bad_files(mixed_folder: tuple[Path, Path, list[Entry]],
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder, _, made = mixed_folder
    tier = ImageTier([folder, folder / "fifo.ltimg", folder / "loop.ltimg"], include_package=False)
    assert within_deadline(lambda: tier.get(made[0].key)) == made[0]
    tier.close()
    monkeypatch.setenv("LAZYTRITON_IMAGES", str(folder))
    config.reset()
    assert within_deadline(lambda: main(["cache", "ls"])) == 0
    assert within_deadline(lambda: main(["cache", "verify"])) in (0, 1)  # the fake binaries may fail ELF checks
    out = capsys.readouterr().out
    assert all(e.key in out for e in made)
    assert within_deadline(lambda: main(["info"])) == 0


# --- finding 6: a crafted dictionary -----------------------------------------------------------------------------


def with_dictionary(data: bytes, section: bytes) -> bytes:
    """An image's bytes with its dictionary section replaced (offsets shifted, every checksum recomputed)."""
    fields = list(IMAGE_HEADER.unpack_from(data, 0))
    dict_off, dict_len, index_off, index_len, meta_off, meta_len = fields[5:11]
    delta = len(section) - dict_len
    index = bytearray(data[index_off:index_off + index_len])
    for i in range(index_len // RECORD_SIZE):
        key, offset, stored, raw_len, blob_sum = RECORD.unpack_from(index, i * RECORD_SIZE)
        RECORD.pack_into(index, i * RECORD_SIZE, key, offset + delta, stored, raw_len, blob_sum)
    meta = data[meta_off:meta_off + meta_len]
    fields[6], fields[7], fields[9] = len(section), index_off + delta, meta_off + delta
    fields[11], fields[12] = xxhash.xxh3_64_intdigest(bytes(index)), xxhash.xxh3_64_intdigest(section + meta)
    header = IMAGE_HEADER.pack(*fields[:13], 0)
    header = header[:-8] + struct.pack("<Q", xxhash.xxh3_64_intdigest(header[:-8]))
    return header + section + data[dict_off + dict_len:index_off] + bytes(index) + meta


def test_a_crafted_dictionary_is_an_image_error_in_the_tier_and_in_verify(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    made = entries(12)
    good = write_image(tmp_path / "good.ltimg", made, dict_bytes=4096, level=3)
    assert good.codec == "zstd-dict"
    tables = b"\x37\xa4\x30\xec" + struct.pack("<I", 1234) + bytes(range(256)) * 8  # valid magic, junk tables
    path = tmp_path / "images" / "crafted.ltimg"
    path.parent.mkdir()
    path.write_bytes(with_dictionary(good.path.read_bytes(), zstandard.ZstdCompressor().compress(tables)))
    with Image(path) as image:
        for key in (made[0].key, made[1].key):  # refused again, from the remembered reason
            with pytest.raises(ImageError, match="dictionary is damaged"):
                image.read(key)
    assert ImageTier([path], include_package=False).get(made[0].key) is None
    monkeypatch.setenv("LAZYTRITON_IMAGES", str(path.parent))
    config.reset()
    assert main(["cache", "verify"]) == 1
    assert "dictionary is damaged" in capsys.readouterr().out
