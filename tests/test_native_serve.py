"""liblazytriton_native.so serving a C program from an image with no Python in the process.

The program (tests/capi/native_launch.c) opens the images LAZYTRITON_IMAGES names, loads a real sm_90
kernel from one and launches it against the fake libcuda (tests/fake_libcuda.py), with PYTHONHOME pointing
nowhere and no Python on PATH; then asks for a kernel no image holds: LT_MISS, whose message names the
variant and the prewarm command, and a miss log line Python's prewarm reads back.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import test_decoders_property as props
import xxhash
from compiled_once import compiled, shared_dir, small_variant
from nativelib import build_program

from lazytriton.cache_format import Entry
from lazytriton.cache_format.image import write_image
from lazytriton.prewarm.enumeration import variants_from_miss_log

REPO = Path(__file__).resolve().parents[1]
LT_MISS, LT_ERROR_IMAGE, LT_ERROR_INVALID_ARGUMENT = 16, 17, 1


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The library, the fake libcuda as libcuda.so.1, and the program linked against the library."""
    return build_program(tmp_path_factory.mktemp("native-serve"), "native_launch")


@pytest.fixture(scope="module")
def real_entry(tmp_path_factory: pytest.TempPathFactory) -> Entry:
    return compiled(small_variant("sm_90"), shared_dir(tmp_path_factory))


def serve(built: dict[str, Path], tmp_path: Path, images: str, *args: str) -> dict[str, Any]:
    """native_launch's report, run with no Python reachable: PYTHONHOME nowhere, PATH an empty folder."""
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    env = {"LAZYTRITON_IMAGES": images, "LD_LIBRARY_PATH": str(built["driver"]), "PYTHONHOME": "/nonexistent",
           "PATH": str(empty), "LAZYTRITON_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    done = subprocess.run([str(built["program"]), *args], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def test_the_library_links_no_libpython(built: dict[str, Path]) -> None:
    ldd = shutil.which("ldd")
    if ldd is None:
        pytest.skip("no ldd")
    linked = subprocess.run([ldd, str(built["library"])], capture_output=True, text=True, check=True).stdout
    assert "libzstd" in linked and "python" not in linked.lower(), linked


def test_a_kernel_is_served_from_an_image_and_launched_with_no_python(built: dict[str, Path], tmp_path: Path,
                                                                     real_entry: Entry) -> None:
    others = [props.make_entry(i, 3000) for i in range(199)]
    image = tmp_path / "served.ltimg"
    write_image(image, [real_entry, *others])
    empty_image = tmp_path / "other.ltimg"
    write_image(empty_image, others[:3])
    missing = small_variant("sm_90", causal=True)
    report = serve(built, tmp_path, f"{empty_image}:{image}", real_entry.key, str(real_entry.variant),
                   missing.key(), str(missing))
    assert report["python"] == 0
    assert report["images"] == 2 and report["load"] == 0, report
    n_args = len(real_entry.arg_types)
    assert (report["name"], report["variant"], report["n_args"]) == (real_entry.name, real_entry.variant, n_args)
    threads = real_entry.num_warps * real_entry.warp_size
    assert (report["block_threads"], report["shared"]) == (threads, real_entry.shared)
    launches, _, _, gx, gy, gz, block_x, block_yz, shared, stream, function, context, extra_null = report["state"]
    assert report["launch"] == 0 and launches == 1
    assert (gx, gy, gz, block_x, block_yz, shared) == (7, 5, 3, threads, 1001, real_entry.shared)
    assert (stream, function, context, extra_null) == (0x5EA, 0xF000, 0xC000, 1)
    hidden = len(real_entry.hidden_args)
    assert report["params"][:n_args + hidden] == [0x1111 * (i + 1) for i in range(n_args)] + [0] * hidden
    assert report["wrong_args"] == LT_ERROR_INVALID_ARGUMENT

    assert report["miss"] == LT_MISS
    message = report["miss_error"]
    log = tmp_path / "cache" / "misses.jsonl"
    assert str(missing) in message and missing.key() in message
    assert f"lazytriton prewarm --from-misses {log} --out IMAGE" in message
    line = json.loads(log.read_text())
    assert line["variant"] == str(missing) and line["key"] == missing.key()
    assert set(line) == {"variant", "key", "compile_s", "time"} and abs(line["time"] - time.time()) < 3600
    planned, problems = variants_from_miss_log(log)
    assert problems == [] and [p.variant.key() for p in planned] == [missing.key()]


def test_images_that_cannot_be_served_are_named(built: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken.ltimg"
    broken.write_bytes(props.IMAGES["zstd"][:-1])
    key = xxhash.xxh3_128_hexdigest(b"k")
    report = serve(built, tmp_path, str(broken), key, "v", key, "v")
    assert report["open"] == LT_ERROR_IMAGE and str(broken) in report["error"], report
    report = serve(built, tmp_path, str(tmp_path / "absent.ltimg"), key, "v", key, "v")
    assert report["open"] == LT_ERROR_IMAGE and "absent.ltimg" in report["error"], report


def test_a_damaged_entry_is_an_image_error_and_a_bad_key_an_argument_error(built: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    data = bytearray(props.IMAGES["none"])
    index_off = props.sections(bytes(data))["index"][0]
    raw_key, offset, stored, _, _ = props.RECORD.unpack_from(data, index_off)
    data[offset + stored - 1] ^= 1  # the entry's last byte: the blob checksum no longer matches
    image = tmp_path / "damaged.ltimg"
    image.write_bytes(bytes(data))
    report = serve(built, tmp_path, str(image), raw_key.hex(), "v", "NOT-A-KEY", "v")
    assert report["load"] == LT_ERROR_IMAGE and "checksum mismatch" in report["error"], report
    assert report["miss"] == LT_ERROR_INVALID_ARGUMENT and "32 lowercase hex" in report["miss_error"]
    assert not (tmp_path / "cache" / "misses.jsonl").exists()


def test_without_a_cache_dir_the_miss_names_the_line_to_build_from(built: dict[str, Path], tmp_path: Path) -> None:
    image = tmp_path / "small.ltimg"
    write_image(image, [props.make_entry(i) for i in range(3)])
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache dir should be")
    key = xxhash.xxh3_128_hexdigest(b"absent")
    report = serve(built, tmp_path, str(image), key, "flash_fwd:sm_90:fp16:::", key, "flash_fwd:sm_90:fp16:::")
    assert report["load"] == LT_MISS and report["miss"] == LT_MISS
    assert "could not be written" in report["miss_error"]
    assert '{"variant": "flash_fwd:sm_90:fp16:::"}' in report["miss_error"]

