"""The cache end to end: local tier, fresh processes, relocation, corruption, concurrency, no-JIT, no-triton.

Every entry here is a real sm_90 cubin (compiled on this CPU machine); none is launched. One small
variant (head dim 64, fp16, 64x32 tiles) keeps compiles to about a second each.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import run_python

import lazytriton.driver
from lazytriton import config, runtime
from lazytriton.cache_format import Entry, EntryError, Provenance
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.runtime import KernelNotFound
from lazytriton.store import Chain
from lazytriton.store.local import LocalTier
from lazytriton.target import Target
from lazytriton.tiles import Config

VARIANT = fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "fp16", 64, False, True, 4096,
                                         config=Config(64, 32, 4, 2))

# Resolves VARIANT in a fresh process and prints what happened as one JSON line.
RESOLVE = """
import json, os, sys, xxhash
from lazytriton import runtime
from lazytriton.variant import Variant
rt = runtime.get()
variant = Variant.parse(os.environ["VARIANT"])
first = rt.resolve(variant)
again = rt.resolve(variant)
print(json.dumps({"source": first.source, "again": again.source, "compiles": rt.compiles,
                  "counters": rt.counters(), "key": first.key, "binary": xxhash.xxh3_64_hexdigest(first.entry.binary),
                  "triton": sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))[:3]}))
"""


def resolve_in_subprocess(env: dict[str, str] | None = None) -> dict[str, Any]:
    result = run_python(RESOLVE, {"VARIANT": str(VARIANT), **(env or {})})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def fake_entry(key: str, binary: bytes = b"\x7fELF" + bytes(5000)) -> Entry:
    return Entry(
        key=key, variant=str(VARIANT), target="sm_90", kind="cubin", binary=binary, name="k",
        num_warps=4, num_ctas=1, warp_size=32, shared=0, global_scratch_size=0, global_scratch_align=1,
        profile_scratch_size=0, profile_scratch_align=1, arg_types=("i32",), hidden_args=(),
        provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1),
    )


@pytest.fixture(scope="module")
def compiled() -> Entry:
    """VARIANT compiled once per test worker (tests seed caches with it instead of compiling again)."""
    from lazytriton.compiler import compile_variant

    return compile_variant(VARIANT)


def seed(cache_dir: Path, entry: Entry) -> LocalTier:
    """Put ``entry`` into the local tier of ``cache_dir`` as the runtime would find it."""
    tier = LocalTier(cache_dir / "entries")
    assert tier.put(entry.key, entry)
    return tier


@pytest.fixture
def rt() -> Iterator[runtime.Runtime]:
    yield runtime.get()
    runtime.reset()


# --- the local tier --------------------------------------------------------------------------------------------


def test_local_tier_put_get_round_trip(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "entries")
    key, other = "a" * 32, "b" * 32
    entry = fake_entry(key)
    assert tier.get(key) is None
    assert tier.put(key, entry)
    assert tier.get(key) == entry
    assert tier.get(other) is None
    assert list(tier.keys()) == [key]
    path = tier.entry_path(key)
    assert path is not None and path.read_bytes() == entry.encode()
    tier.count("compiles")
    tier.count("compiles", 2)
    assert tier.counters() == {"compiles": 3}
    assert list(tier.keys()) == [key], "counters are not entries"
    stats = tier.stats()
    assert stats.entries == 1 and stats.bytes >= len(entry.encode())
    tier.close()
    reopened = LocalTier(tmp_path / "entries")
    assert reopened.get(key) == entry
    assert reopened.put(key, fake_entry(key, b"\x7fELF new"))
    assert reopened.get(key).binary == b"\x7fELF new"  # type: ignore[union-attr]
    assert reopened.delete(key) and reopened.get(key) is None
    assert not reopened.delete(key)


@pytest.mark.parametrize("key", ["../x", "A" * 32, "a" * 31])
def test_local_tier_rejects_bad_keys(tmp_path: Path, key: str) -> None:
    tier = LocalTier(tmp_path / "entries")
    with pytest.raises(ValueError):
        tier.get(key)
    with pytest.raises(ValueError):
        tier.put(key, fake_entry("a" * 32))


def test_local_tier_refuses_an_entry_stored_under_another_key(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = LocalTier(tmp_path / "entries")
    tier.put("a" * 32, fake_entry("b" * 32))
    with caplog.at_level(logging.WARNING, "lazytriton"):
        assert tier.get("a" * 32) is None
    assert tier.counters() == {"corrupt": 1}


def test_chain_writes_a_lower_hit_back(tmp_path: Path) -> None:
    upper, lower = LocalTier(tmp_path / "upper", "upper"), LocalTier(tmp_path / "lower", "lower")
    key = "c" * 32
    lower.put(key, fake_entry(key))
    chain = Chain([upper, lower])
    found = chain.get(key)
    assert found is not None and found[1] == "lower"
    assert upper.get(key) == fake_entry(key)
    assert chain.get(key)[1] == "upper"  # type: ignore[index]
    assert chain.get("d" * 32) is None


# --- fresh processes and relocation ----------------------------------------------------------------------------


def test_a_fresh_process_is_served_with_zero_compiles(cache_dir: Path) -> None:
    first = resolve_in_subprocess()
    assert (first["source"], first["again"], first["compiles"]) == ("jit", "memory", 1)
    assert first["counters"].get("compiles") == 1 and "hits" not in first["counters"]
    assert first["key"] == VARIANT.key()

    second = resolve_in_subprocess()
    assert (second["source"], second["again"], second["compiles"]) == ("local", "memory", 0)
    assert second["binary"] == first["binary"]
    assert second["triton"] == [], "a cache-served resolve imported triton"
    assert (second["counters"].get("compiles"), second["counters"].get("hits")) == (1, 1)

    info = run_python("import sys; from lazytriton.cli import main; sys.exit(main(['info']))")
    assert info.returncode == 0, info.stderr
    rows = dict(line.split(None, 1) if " " in line else (line, "") for line in info.stdout.splitlines())
    assert rows["entries"].startswith("1 ("), info.stdout
    assert rows["compiles"].startswith("1 "), info.stdout
    assert str(cache_dir) in info.stdout
    assert rows["jit"] == "on"


def test_a_copied_cache_dir_still_hits(cache_dir: Path, tmp_path: Path) -> None:
    first = resolve_in_subprocess()
    assert first["compiles"] == 1
    moved = tmp_path / "elsewhere" / "renamed-cache"
    shutil.copytree(cache_dir, moved)
    shutil.rmtree(cache_dir)  # nothing may still point into the old folder
    second = resolve_in_subprocess({"LAZYTRITON_CACHE_DIR": str(moved)})
    assert (second["source"], second["compiles"]) == ("local", 0)
    assert second["binary"] == first["binary"]
    assert not cache_dir.exists()


# --- corruption ------------------------------------------------------------------------------------------------


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "header":
        data[10] ^= 0x01  # format version
    elif how == "checksum":
        data[20] ^= 0x80
    elif how == "binary":
        data[len(data) // 2] ^= 0x01  # inside the cubin
    elif how == "last":
        data[-1] ^= 0xFF
    elif how == "truncated":
        del data[len(data) // 3:]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["header", "binary", "truncated"])
def test_a_corrupt_entry_is_dropped_logged_counted_rebuilt_and_never_launched(
        cache_dir: Path, compiled: Entry, rt: runtime.Runtime, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, how: str) -> None:
    tier = seed(cache_dir, compiled)
    path = tier.entry_path(compiled.key)
    assert path is not None and path.is_file()
    _damage(path, how)
    with pytest.raises(EntryError):
        Entry.decode(path.read_bytes(), expected_key=compiled.key)
    tier.close()

    loaded: list[Entry] = []

    def fake_load(entry: Entry, device_index: int, dependent: bool = False) -> object:
        loaded.append(entry)
        return ("handle", device_index)

    monkeypatch.setattr(lazytriton.driver, "load", fake_load)
    with caplog.at_level(logging.WARNING, "lazytriton"):
        handle = rt.kernel(VARIANT, 0)
    assert handle == ("handle", 0)
    assert rt.served["jit"] == 1 and rt.compiles == 1
    assert any("corrupt" in record.getMessage() and compiled.key in record.getMessage() for record in caplog.records)
    assert rt.counters().get("corrupt") == 1
    # Only a verified entry reached the driver, and it is the real kernel.
    assert len(loaded) == 1
    assert Entry.decode(loaded[0].encode(), expected_key=compiled.key) == loaded[0]
    assert loaded[0].binary == compiled.binary
    # The rebuilt entry replaced the damaged one on disk.
    assert LocalTier(cache_dir / "entries").get(compiled.key).binary == compiled.binary  # type: ignore[union-attr]
    assert rt.kernel(VARIANT, 0) is handle and len(loaded) == 1


def test_a_corrupt_entry_with_jit_off_raises_and_is_never_launched(
        cache_dir: Path, compiled: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = seed(cache_dir, compiled)
    _damage(tier.entry_path(compiled.key), "last")  # type: ignore[arg-type]
    tier.close()
    monkeypatch.setenv("LAZYTRITON_JIT", "0")
    config.reset()
    monkeypatch.setattr(lazytriton.driver, "load",
                        lambda entry, index, dependent=False: pytest.fail("launched a corrupt entry"))
    with pytest.raises(KernelNotFound):
        runtime.get().kernel(VARIANT, 0)
    assert runtime.get().counters().get("corrupt") == 1


# --- concurrency -----------------------------------------------------------------------------------------------

# Waits at a barrier (a file appearing), then resolves; prints the result as one JSON line.
RACE = """
import json, os, sys, time, xxhash
from pathlib import Path
from lazytriton import runtime
from lazytriton.variant import Variant
variant = Variant.parse(os.environ["VARIANT"])
rt = runtime.get()
Path(os.environ["READY"]).touch()
go = Path(os.environ["GO"])
while not go.exists():
    time.sleep(0.005)
resolved = rt.resolve(variant)
print(json.dumps({"source": resolved.source, "compiles": rt.compiles,
                  "binary": xxhash.xxh3_64_hexdigest(resolved.entry.binary)}))
"""


def test_processes_missing_the_same_key_compile_it_once(cache_dir: Path, tmp_path: Path) -> None:
    n = 8
    go = tmp_path / "go"
    procs = []
    for i in range(n):
        env = dict(os.environ, VARIANT=str(VARIANT), READY=str(tmp_path / f"ready{i}"), GO=str(go))
        procs.append(subprocess.Popen([sys.executable, "-c", RACE], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(n)):
            assert all(p.poll() is None for p in procs), "a racer died before the barrier"
            assert time.monotonic() < deadline, "racers never got ready"
            time.sleep(0.01)
        go.touch()
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["compiles"] for r in results) == 1, results
    assert sorted(r["source"] for r in results) == ["jit"] + ["local"] * (n - 1)
    assert len({r["binary"] for r in results}) == 1
    tier = LocalTier(cache_dir / "entries")
    assert tier.counters()["compiles"] == 1
    assert list(tier.keys()) == [VARIANT.key()]


# --- settings: no JIT, unusable cache dir ----------------------------------------------------------------------


def test_jit_off_makes_a_miss_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAZYTRITON_JIT", "0")
    config.reset()
    with pytest.raises(KernelNotFound) as info:
        runtime.get().resolve(VARIANT)
    assert str(VARIANT) in str(info.value) and VARIANT.key() in str(info.value)
    assert isinstance(info.value, LookupError)
    assert runtime.get().compiles == 0


def test_jit_off_still_serves_from_the_cache(cache_dir: Path, compiled: Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    seed(cache_dir, compiled).close()
    monkeypatch.setenv("LAZYTRITON_JIT", "0")
    config.reset()
    assert runtime.get().resolve(VARIANT).source == "local"


def _unusable_cache_dir(tmp_path: Path) -> tuple[Path, str]:
    """A cache dir this process cannot write: chmod 0o555 where that binds, else a path under a regular file."""
    directory = tmp_path / "readonly"
    directory.mkdir()
    directory.chmod(0o555)
    probe = directory / "probe"
    try:
        probe.touch()
    except OSError:
        return directory, "chmod"
    # Running as root: permissions do not stop writes. A path below a file can never be created.
    probe.unlink()
    directory.chmod(0o755)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return blocker / "cache", "under a file"


def test_an_unwritable_cache_dir_runs_from_memory_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    directory, how = _unusable_cache_dir(tmp_path)
    monkeypatch.setenv("LAZYTRITON_CACHE_DIR", str(directory))
    config.reset()
    try:
        with caplog.at_level(logging.WARNING, "lazytriton"):
            rt = runtime.get()
            first = rt.resolve(VARIANT)
            again = rt.resolve(VARIANT)
            assert rt.counters() == {}
            assert rt.local.stats().entries == 0
        if how == "chmod":
            assert list(directory.iterdir()) == []
        else:
            assert not directory.exists()
    finally:
        if how == "chmod":
            directory.chmod(0o755)  # let pytest clean up
    assert (first.source, again.source, rt.compiles) == ("jit", "memory", 1)
    assert first.entry.binary[:4] == b"\x7fELF"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("lazytriton")]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "memory" in warnings[0].getMessage()


# --- no triton on the serving path -----------------------------------------------------------------------------

NO_TRITON = """
import importlib.abc, json, os, sys

attempts = []

class BlockTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            attempts.append(name)
            raise ImportError(f"triton is blocked in this test ({name})")
        return None

sys.meta_path.insert(0, BlockTriton())
import lazytriton
from lazytriton import runtime
from lazytriton.variant import Variant
resolved = runtime.get().resolve(Variant.parse(os.environ["VARIANT"]))
import lazytriton.flash
import lazytriton.cli
import lazytriton.kernels.dispatch
import lazytriton.kernels.flash_fwd.dispatch
import lazytriton.kernels.flash_bwd.dispatch
import lazytriton.kernels.flash_decode.dispatch
import lazytriton.kernels.flash_fwd
print(json.dumps({"source": resolved.source, "attempts": attempts,
                  "loaded": sorted(m for m in sys.modules if m == "triton" or m.startswith("triton."))}))
"""


def test_import_and_a_cache_served_resolve_never_import_triton(cache_dir: Path) -> None:
    filled = resolve_in_subprocess()
    assert filled["source"] == "jit" and "triton" in filled["triton"]
    result = run_python(NO_TRITON, {"VARIANT": str(VARIANT)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"source": "local", "attempts": [], "loaded": []}


def test_the_triton_block_works(cache_dir: Path) -> None:
    # The check above is only worth something if a miss (which must compile) trips the block.
    result = run_python(NO_TRITON, {"VARIANT": str(VARIANT)})
    assert result.returncode != 0
    assert "triton is blocked" in result.stderr


# --- the demo --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_twice_compiles_once_then_serves_from_disk(cache_dir: Path) -> None:
    demo = "import sys; from lazytriton.cli import main; sys.exit(main(['demo', '--cpu']))"
    first = run_python(demo)
    assert first.returncode == 0, first.stderr
    # The forward's kernel and the backward's two (flash_bwd_dq, flash_bwd_dkdv)
    assert "compiles in this process: 3;" in first.stdout, first.stdout
    assert "served by jit" in first.stdout
    second = run_python(demo)
    assert second.returncode == 0, second.stderr
    assert "compiles in this process: 0;" in second.stdout, second.stdout
    assert "served by local disk cache" in second.stdout
    assert "in this cache since it was created: 3 (was 3)" in second.stdout
    assert str(cache_dir) in second.stdout


def test_info_names_the_tiers_and_hides_a_shared_password(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton import cli, config

    monkeypatch.setenv("LAZYTRITON_SHARED", "redis://user:s3cret@127.0.0.1:6399/0")
    config.reset()
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "shared      redis://user:***@127.0.0.1:6399/0" in out and "s3cret" not in out
    assert "images      none (LAZYTRITON_IMAGES)" in out and "signing     off" in out
    assert "cache dir" in out and "compiles    0" in out
