"""The native core's own XXH3 digests (capi/native/lt_xxh3.c) against Python's xxhash, and a build without xxhash.h.

tests/capi/native_xxh3.c, built with lt_xxh3.c alone (under ASan and UBSan where they run, each input at an
unaligned address), answers XXH3-64, XXH3-128 (canonical) and XXH3-64 of the input cut in two buffers for
every length 0..2048 and larger ones from a seeded generator, and for hypothesis's inputs; each must be
xxhash's xxh3_64_intdigest and xxh3_128_digest. The native library builds with an xxhash.h that stops the
compiler ahead of the system's on the include path, and no source of the C API includes it.
"""

from __future__ import annotations

import os
import random
import re
import select
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_decoders_property as props
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from nativelib import NATIVE, REPO, SANITIZE, SANITIZER_ENV, need_toolchain, sanitizers_work

from lazytriton.capi import native_build

RECORD = struct.Struct("<QQ")  # the input's length, the split point (tests/capi/native_xxh3.c)
LARGE = (4095, 4096, 4097, 65_537, 999_983, 1 << 20, (1 << 20) + 1)
INCLUDES_XXHASH = re.compile(rb'^\s*#\s*include\s*[<"]xxhash\.h[>"]', re.MULTILINE)


def expected(data: bytes) -> tuple[str, str, str]:
    """Python's digests in the program's answer: XXH3-64, XXH3-128 canonical, XXH3-64 again (the cut input)."""
    h64 = f"{xxhash.xxh3_64_intdigest(data):016x}"
    return h64, xxhash.xxh3_128_digest(data).hex(), h64


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("xxh3")
    cc = need_toolchain()
    built = directory / "native_xxh3"
    command = [cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-g", "-O1",
               *(SANITIZE if sanitizers_work(cc, directory) else []), f"-I{NATIVE}", str(NATIVE / "lt_xxh3.c"),
               str(REPO / "tests" / "capi" / "native_xxh3.c"), "-o", str(built)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stderr}"
    return built


class Digests:
    """One running native_xxh3; each input answered within ``timeout`` seconds or the test fails."""

    def __init__(self, program: Path, timeout: float = 120) -> None:
        self.timeout = timeout
        self.process = subprocess.Popen([str(program)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env={**os.environ, **SANITIZER_ENV})

    def ask(self, data: bytes, split: int) -> tuple[str, ...]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(RECORD.pack(len(data), split) + data)
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        if not ready:
            self.process.kill()
            pytest.fail(f"native_xxh3 gave no answer in {self.timeout} s for {len(data)} bytes")
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=30)
            stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
            pytest.fail(f"native_xxh3 died on {len(data)} bytes (exit {self.process.returncode}):\n{stderr[-4000:]}")
        return tuple(line.decode().split())

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        code = self.process.wait(timeout=60)
        stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
        assert code == 0, f"native_xxh3 exited {code} at the end (a leak report?):\n{stderr[-4000:]}"


@pytest.fixture(scope="module")
def digests(program: Path) -> Iterator[Digests]:
    served = Digests(program)
    yield served
    served.close()


def test_every_length_to_2048_and_large_inputs_match_python(program: Path) -> None:
    rng = random.Random(20260312)
    inputs = [(data, rng.randrange(len(data) + 1))
              for data in (rng.randbytes(n) for n in (*range(2049), *LARGE))]
    stream = b"".join(RECORD.pack(len(data), split) + data for data, split in inputs)
    done = subprocess.run([str(program)], input=stream, capture_output=True, env={**os.environ, **SANITIZER_ENV},
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-4000:]
    answers = [tuple(line.split()) for line in done.stdout.decode().splitlines()]
    assert len(answers) == len(inputs)
    wrong = [(len(data), split, answer, expected(data))
             for (data, split), answer in zip(inputs, answers, strict=True) if answer != expected(data)]
    assert not wrong, f"{len(wrong)} of {len(inputs)} inputs differ; the first (length, split, C, Python): {wrong[:5]}"


@props.PROPERTY
@given(data=st.one_of(st.binary(max_size=300), st.binary(min_size=200, max_size=5000)), cut=st.floats(0, 1))
def test_random_bytes_match_python(digests: Digests, data: bytes, cut: float) -> None:
    split = round(cut * len(data))
    assert digests.ask(data, split) == expected(data)


def test_no_source_of_the_c_api_includes_xxhash_h() -> None:
    sources = [path for folder in ("capi", "lazytriton", "kernels") for path in (REPO / folder).rglob("*")
               if path.suffix in (".c", ".h", ".cpp", ".cc", ".hpp", ".in")]
    assert any(path.name == "lt_image.c" for path in sources)
    including = [str(path.relative_to(REPO)) for path in sources if INCLUDES_XXHASH.search(path.read_bytes())]
    assert not including, f"these include xxhash.h, which deployments lack: {including}"


def test_native_library_builds_without_xxhash_h(tmp_path: Path) -> None:
    need_toolchain()
    stop = tmp_path / "include"
    stop.mkdir()
    (stop / "xxhash.h").write_text('#error "the native core must not need xxhash.h"\n')
    library = native_build.build(tmp_path / "lib", extra_flags=(f"-I{stop}",))
    assert library.is_file()
