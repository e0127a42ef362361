"""The local tier trusts nothing in its directory (issue 13, findings 1, 3, 9 and 11; ``cache clear``).

A cache dir written by someone else must never run code: diskcache unpickles
keys and values stored in its pickle mode, so each test plants such rows with
a plain ``diskcache.Cache`` (whose payload, unpickled, creates a marker
directory) and shows that lookups, listings and every ``cache`` command leave
the marker absent and still work. A control test shows the payload does run
when plain diskcache reads it, so these tests can fail.
"""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import diskcache
import pytest
from compiled_once import compiled, shared_dir, small_variant
from conftest import run_python

from lazytriton import cli, compiler, runtime
from lazytriton.cache_format import Entry, Provenance
from lazytriton.store.local import ORPHAN_GRACE_S, LocalTier

KEY = "a" * 32
PICKLED_COUNTER = "counter:compiles"


def fake_entry(key: str, size: int = 6000) -> Entry:
    return Entry(key=key, variant="flash_fwd:sm_90:fp16:::", target="sm_90", kind="cubin",
                 binary=b"\x7fELF" + bytes(size), name="k", num_warps=4, num_ctas=1, warp_size=32, shared=0,
                 global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
                 arg_types=(), hidden_args=(), provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1))


class Payload:
    """Unpickled, it creates ``marker`` (a directory): the stand-in for running any code."""

    def __init__(self, marker: Path, padding: int = 0) -> None:
        self.marker, self.padding = marker, padding

    def __reduce__(self) -> tuple[Any, ...]:
        return os.makedirs, (str(self.marker), 0o755, "x" * max(self.padding, 1))  # exist_ok, padded


def plain(directory: Path) -> Any:
    """diskcache as it comes: its default Disk, which pickles and unpickles (the attacker's writer)."""
    return diskcache.Cache(str(directory), disk_min_file_size=4096)


def cache_main(*args: str) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = cli.main(list(args))
    return status, out.getvalue()


@pytest.fixture
def entries(cache_dir: Path) -> Path:
    return cache_dir / "entries"


@pytest.fixture
def good(tmp_path_factory: pytest.TempPathFactory) -> Entry:
    """A real sm_90 entry (``cache verify`` checks its ELF), compiled once per session."""
    return compiled(small_variant("sm_90"), shared_dir(tmp_path_factory))


@pytest.fixture
def planted(entries: Path, tmp_path: Path, good: Entry) -> Path:
    """A local tier holding one good entry and the three plants of finding 1; returns the marker path."""
    marker = tmp_path / "pwned"
    tier = LocalTier(entries)
    assert tier.put(good.key, good)
    tier.close()
    with plain(entries) as attacker:
        attacker.set(KEY, Payload(marker))  # a pickled value under an entry key (inline in SQLite)
        attacker.set("c" * 32, Payload(marker, padding=10_000))  # the same, in a value file
        attacker.set(PICKLED_COUNTER, Payload(marker))  # the old counters' place
        attacker.set(Payload(marker), b"value")  # a pickled key
    return marker


def test_the_planted_payload_runs_when_plain_diskcache_reads_it(entries: Path, planted: Path) -> None:
    with plain(entries) as victim:
        list(victim.iterkeys())
    assert planted.exists(), "the control: this plant runs code through diskcache's pickle mode"


def test_a_pickled_value_is_dropped_counted_and_rebuilt_never_unpickled(
        entries: Path, planted: Path, good: Entry, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    tier = LocalTier(entries)
    with caplog.at_level(logging.WARNING, "lazytriton"):
        assert tier.get(KEY) is None
        assert tier.get("c" * 32) is None
    assert "pickle" in caplog.text
    assert tier.counters() == {"corrupt": 2}
    assert tier.peek(KEY) is None and KEY not in set(tier.keys())
    assert tier.get(good.key) == good
    assert not planted.exists()
    # The call still works: the runtime drops the damaged row and rebuilds the entry.
    entry = good
    with plain(entries) as attacker:
        attacker.set(entry.key, Payload(planted))
    monkeypatch.setattr(compiler, "compile_variant", lambda variant, key=None: entry)
    try:
        rt = runtime.get()
        resolved = rt.resolve(small_variant("sm_90"))
        assert (resolved.source, resolved.entry) == ("jit", entry)
        assert rt.counters().get("corrupt") == 3
        assert rt.local.get(entry.key) == entry, "rebuilt as raw bytes"
    finally:
        runtime.reset()
    assert not planted.exists()


def test_pickled_keys_and_counters_are_never_unpickled_while_listing(
        entries: Path, planted: Path, good: Entry) -> None:
    tier = LocalTier(entries)
    # Rows under entry keys are entries (their values are checked when read); the others are not listed.
    assert sorted(tier.keys()) == sorted(["a" * 32, good.key, "c" * 32])
    assert tier.stats().entries == 3
    assert tier.counters() == {}, "counters live in counters.db, not among the entries"
    assert cache_main("info")[0] == 0
    status, out = cache_main("cache", "ls", "--tier", "local")
    assert status == 0 and "DAMAGED" in out and "pickled key" in out
    assert cache_main("cache", "stats")[0] == 0
    status, out = cache_main("cache", "verify")
    assert status == 1
    assert "a pickled key (never unpickled), not an entry key" in out
    assert f"{KEY}: value stored in diskcache's pickle mode" in out
    assert f"{PICKLED_COUNTER}: key must be" in out or PICKLED_COUNTER in out
    assert not planted.exists()
    status, out = cache_main("cache", "gc")
    assert status == 0 and "4 damaged rows" in out, out
    assert LocalTier(entries).counters() == {"corrupt": 4}
    status, out = cache_main("cache", "verify")
    assert status == 0 and "1 entry checked" in out and "all ok" in out
    assert not planted.exists()


def test_a_pickled_counter_in_counters_db_is_ignored(entries: Path, tmp_path: Path) -> None:
    import pickle

    tier = LocalTier(entries)
    tier.count("compiles", 2)
    marker = tmp_path / "pwned"
    with sqlite3.connect(entries / "counters.db") as con:
        con.execute("INSERT INTO counters VALUES ('hits', ?)", (pickle.dumps(Payload(marker)),))
        con.execute("INSERT INTO counters VALUES ('rejected', 'many')")
    assert tier.counters() == {"compiles": 2}
    assert not marker.exists()


@pytest.mark.parametrize("value", [12345, 1.5, "text", "t" * 10_000], ids=["int", "float", "str", "text-file"])
def test_a_value_stored_as_an_int_or_a_str_is_refused_not_a_crash(entries: Path, value: Any) -> None:
    LocalTier(entries).close()
    with plain(entries) as other:
        other.set(KEY, value)
    tier = LocalTier(entries)
    assert tier.get(KEY) is None
    assert tier.counters() == {"corrupt": 1}
    assert tier.get(KEY) is None and tier.counters() == {"corrupt": 1}, "dropped: counted once"
    assert tier.put(KEY, fake_entry(KEY)) and tier.get(KEY) == fake_entry(KEY)


def test_a_row_naming_a_file_outside_the_cache_neither_reads_nor_removes_it(entries: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    tier = LocalTier(entries)
    assert tier.put(KEY, fake_entry(KEY))
    tier.close()
    with sqlite3.connect(entries / "cache.db") as con:
        con.execute("UPDATE Cache SET filename = ? WHERE key = ?", (os.path.relpath(victim, entries), KEY))
    tier = LocalTier(entries)
    assert tier.get(KEY) is None and tier.counters() == {"corrupt": 1}
    assert victim.read_bytes() == b"keep me"


def test_a_value_file_replaced_by_a_symlink_is_damage(entries: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(fake_entry(KEY).encode())  # even a valid entry is not read through a link
    tier = LocalTier(entries)
    assert tier.put(KEY, fake_entry(KEY))
    path = tier.entry_path(KEY)
    assert path is not None
    path.unlink()
    path.symlink_to(secret)
    assert tier.get(KEY) is None and tier.counters() == {"corrupt": 1}
    assert secret.exists()


def test_counters_of_an_older_lazytriton_move_to_counters_db(entries: Path) -> None:
    LocalTier(entries).close()
    with plain(entries) as older:
        older.incr("counter:compiles", 7)
        older.set(KEY, fake_entry(KEY).encode())
    tier = LocalTier(entries)
    assert [row.key for row in tier.scan()] == [KEY], "not listed, not damage"
    assert tier.counters() == {}
    assert tier.drop_damaged() == 0
    assert tier.counters() == {"compiles": 7} and sorted(tier.keys()) == [KEY]
    assert tier.get(KEY) == fake_entry(KEY)


# --- finding 11: orphaned value files --------------------------------------------------------------------------

KILL_BETWEEN_FILE_AND_ROW = """
import os, signal, sys
from lazytriton.cache_format import Entry, Provenance
from lazytriton.store import local_disk
from lazytriton.store.local import LocalTier

store = local_disk.RawDisk.store
def store_then_die(self, value, read, key=None):
    result = store(self, value, read, key=key)
    os.kill(os.getpid(), signal.SIGKILL)  # the value file is written; its index row never will be
local_disk.RawDisk.store = store_then_die
entry = Entry(key=os.environ["KEY"], variant="flash_fwd:sm_90:fp16:::", target="sm_90", kind="cubin",
              binary=b"\\x7fELF" + bytes(200_000), name="k", num_warps=4, num_ctas=1, warp_size=32, shared=0,
              global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
              arg_types=(), hidden_args=(), provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1))
LocalTier(os.environ["ENTRIES"]).put(entry.key, entry)
"""


def _value_files(entries: Path) -> set[Path]:
    return {p for p in entries.rglob("*.val")}


def test_gc_sweeps_files_orphaned_by_killed_writers(entries: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = LocalTier(entries)
    assert tier.put(KEY, fake_entry(KEY))
    kept = _value_files(entries)
    tier.close()
    for key in ("d" * 32, "e" * 32):
        result = run_python(KILL_BETWEEN_FILE_AND_ROW, {"ENTRIES": str(entries), "KEY": key})
        assert result.returncode == -signal.SIGKILL, result.stderr
    orphans = _value_files(entries) - kept
    assert len(orphans) == 2 and sorted(LocalTier(entries).keys()) == [KEY]
    # One of them was written long ago; the other could be a write still in flight: it stays.
    old, young = sorted(orphans)
    stamp = time.time() - ORPHAN_GRACE_S - 60
    os.utime(old, (stamp, stamp))
    status, out = cache_main("cache", "gc")
    assert status == 0 and "1 orphaned files (195" in out, out
    assert _value_files(entries) == kept | {young}
    assert LocalTier(entries).get(KEY) == fake_entry(KEY)


def test_orphan_sweep_keeps_the_databases_and_referenced_files(entries: Path) -> None:
    tier = LocalTier(entries)
    assert tier.put(KEY, fake_entry(KEY))
    tier.count("compiles")
    stamp = time.time() - ORPHAN_GRACE_S - 60
    for path in entries.rglob("*"):
        os.utime(path, (stamp, stamp), follow_symlinks=False)
    assert tier.sweep_orphans() == (0, 0)
    assert tier.get(KEY) == fake_entry(KEY) and tier.counters() == {"compiles": 1}


# --- finding 9: a database that does not open ------------------------------------------------------------------


def _zero_header(entries: Path) -> None:
    tier = LocalTier(entries)
    assert tier.put(KEY, fake_entry(KEY))
    tier.close()
    with open(entries / "cache.db", "r+b") as f:
        f.write(bytes(100))


def test_a_zeroed_database_header_is_damage_not_all_ok(entries: Path, caplog: pytest.LogCaptureFixture) -> None:
    _zero_header(entries)
    status, out = cache_main("cache", "verify")
    assert status == 1, out
    assert "FAIL local" in out and "database cannot be opened" in out and "memory only" in out
    status, out = cache_main("info")
    assert status == 0 and "cannot be opened" in out and "memory only" in out, out
    runtime.reset()
    caplog.clear()
    entry = fake_entry(KEY)
    with caplog.at_level(logging.WARNING, "lazytriton"):
        rt = runtime.get()
        for _ in range(3):
            rt.local.get(KEY)
            rt.local.put(KEY, entry)
            rt.local.count("compiles")
        runtime.reset()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "running from memory only" in warnings[0], warnings
    # `cache clear` starts it afresh.
    status, out = cache_main("cache", "clear")
    assert status == 0, out
    status, out = cache_main("cache", "verify")
    assert status == 0 and "0 entries checked" in out and "all ok" in out, out
    assert LocalTier(entries).put(KEY, entry) and LocalTier(entries).get(KEY) == entry


# --- cache clear -----------------------------------------------------------------------------------------------


def test_clear_removes_entries_counters_misses_and_locks(cache_dir: Path, entries: Path, planted: Path) -> None:
    tier = LocalTier(entries)
    tier.count("compiles", 3)
    tier.close()
    (cache_dir / "misses.jsonl").write_text('{"variant": "x"}\n')
    (cache_dir / "locks").mkdir()
    (cache_dir / "locks" / f"{KEY}.lock").touch()
    keep = cache_dir / "keep.txt"
    keep.write_text("not ours")
    (cache_dir / "locks" / "unrelated").touch()
    status, out = cache_main("cache", "clear")
    assert status == 0 and "5 entries" in out and "1 compile locks" in out, out
    tier = LocalTier(entries)
    assert list(tier.keys()) == [] and tier.counters() == {} and tier.stats().entries == 0
    assert list(tier.scan()) == [] and not _value_files(entries)
    assert not (cache_dir / "misses.jsonl").exists() and not (cache_dir / "locks" / f"{KEY}.lock").exists()
    assert keep.exists() and (cache_dir / "locks" / "unrelated").exists()
    assert not planted.exists()
    assert tier.put(KEY, fake_entry(KEY)) and tier.get(KEY) == fake_entry(KEY)


@pytest.mark.parametrize("schema", [
    "CREATE TABLE Cache (x)",  # diskcache's table, without its columns
    "CREATE TABLE Settings (key TEXT, value); INSERT INTO Settings VALUES ('size', 'lots'), ('count', x'00')",
    "UPDATE Settings SET value = 'lots' WHERE key IN ('size', 'count')",  # diskcache's own tables
    "DROP INDEX Cache_key_raw; INSERT INTO Cache (key, raw, mode, value) VALUES ('aaa', 1, 1, x'00'), ('aaa', 1, 1, 3)",
], ids=["cache-table", "settings-table", "settings-values", "duplicate-keys"])
def test_a_foreign_schema_is_damage_not_a_traceback(entries: Path, schema: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    if schema.startswith(("UPDATE", "DROP")):
        made = LocalTier(entries)
        assert made.usable
        made.close()
    else:
        entries.mkdir(parents=True)
    with sqlite3.connect(entries / "cache.db") as con:
        con.executescript(schema.replace("'aaa'", f"'{KEY}'"))
    tier = LocalTier(entries)
    tier.get(KEY)
    list(tier.keys())
    tier.stats()
    for command in (["info"], ["cache", "ls"], ["cache", "stats"]):
        assert cache_main(*command)[0] in (0, 1), command
    tier.put(KEY, fake_entry(KEY))  # stored or not, never raised
    tier.count("compiles")
    for command in (["cache", "gc"], ["cache", "ls"]):
        assert cache_main(*command)[0] in (0, 1), command
    status, out = cache_main("cache", "verify")
    if schema.startswith("CREATE TABLE Cache"):
        assert status == 1 and "FAIL local" in out, out
    assert cache_main("cache", "clear")[0] == 0
    fresh = LocalTier(entries)
    assert fresh.put(KEY, fake_entry(KEY)) and fresh.get(KEY) == fake_entry(KEY)
