"""The cache's storage and its ``cache`` commands against a hostile co-tenant and hostile files.

Each test plants what a co-tenant could (a foreign ``entries/`` folder, a
symlink, a FIFO, a sparse 256 MiB miss log, a bad line, a bad setting) and
shows that lazytriton deletes nothing of theirs, never blocks, reads within
its bounds and says what it skipped. A command that could hang runs in a
child process: a hang there fails the test instead of the suite.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from compiled_once import small_variant

from lazytriton import cli, config, runtime
from lazytriton.cache_format import Entry, Provenance
from lazytriton.store.local import ORPHAN_GRACE_S, LocalTier

KEY = "a" * 32
ORPHAN = "12/34/" + "5" * 28 + ".val"  # a value file as diskcache names it, with no index row
FOREIGN = ("photos/2024/img1.jpg", "notes/todo.txt", "ab/cd/readme.txt", "ab/notes.val",
           "ab/cd/" + "0" * 28 + ".txt", "cd/ef/" + "A" * 28 + ".val", "cd/" + "1" * 28 + ".val")
# A hang is the failure these tests look for; this only bounds how long a hanging child is given.
HANG_S = 120


def fake_entry(key: str, size: int = 6000) -> Entry:
    return Entry(key=key, variant="flash_fwd:sm_90:fp16:::", target="sm_90", kind="cubin",
                 binary=b"\x7fELF" + bytes(size), name="k", num_warps=4, num_ctas=1, warp_size=32, shared=0,
                 global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
                 arg_types=(), hidden_args=(), provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1))


def main(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(list(args))
    return status, out.getvalue(), err.getvalue()


def lazytriton(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``lazytriton`` command in a child process (this test's environment)."""
    return subprocess.run([sys.executable, "-m", "lazytriton.cli", *args], capture_output=True, text=True,
                          timeout=HANG_S, check=False)


def plant(root: Path, names: tuple[str, ...] | list[str]) -> None:
    """Files of someone else's under ``root``, written long ago (past the orphan grace)."""
    stamp = time.time() - ORPHAN_GRACE_S - 60
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"not lazytriton's: {name}")
        os.utime(path, (stamp, stamp))


# --- gc and clear touch only what diskcache writes -------------------------------------------------------------


@pytest.mark.parametrize("command", ["gc", "clear"])
def test_gc_and_clear_remove_only_files_named_as_diskcache_names_them(cache_dir: Path, command: str) -> None:
    entries = cache_dir / "entries"
    plant(entries, (*FOREIGN, ORPHAN))  # LAZYTRITON_CACHE_DIR names a folder that already had an entries/
    tier = LocalTier(entries)
    assert tier.put(KEY, fake_entry(KEY))
    tier.close()
    status, out, err = main("cache", command)
    assert status == 0, out + err
    assert [name for name in FOREIGN if not (entries / name).exists()] == []
    assert not (entries / ORPHAN).exists(), "an old orphaned value file is swept"
    assert (LocalTier(entries).get(KEY) == fake_entry(KEY)) == (command == "gc")


@pytest.mark.parametrize("command", ["gc", "clear"])
@pytest.mark.parametrize("link", ["entries", "entries/56"])
def test_gc_and_clear_never_sweep_through_a_symlink(cache_dir: Path, tmp_path: Path, command: str,
                                                    link: str) -> None:
    elsewhere = tmp_path / "home"
    # Named as diskcache names value files, seen through the link: entries/78/9a/... or entries/56/9a/...
    names = [*FOREIGN, "78/9a/" + "b" * 28 + ".val", "9a/" + "b" * 28 + ".val", "bc/" + "c" * 30 + ".val"]
    plant(elsewhere, names)
    (cache_dir / link).parent.mkdir(parents=True, exist_ok=True)
    (cache_dir / link).symlink_to(elsewhere)
    tier = LocalTier(cache_dir / "entries")
    assert tier.put(KEY, fake_entry(KEY))
    tier.close()
    status, out, err = main("cache", command)
    assert status == 0, out + err
    assert [name for name in names if not (elsewhere / name).exists()] == []
    assert (cache_dir / link).is_symlink()


def test_clear_of_an_unusable_tier_removes_only_diskcache_files(cache_dir: Path) -> None:
    entries = cache_dir / "entries"
    plant(entries, (*FOREIGN, ORPHAN))
    entries.mkdir(parents=True, exist_ok=True)
    (entries / "cache.db").write_bytes(bytes(4096))  # not a database: the tier cannot be opened
    status, out, err = main("cache", "clear")
    assert status == 0, out + err
    assert [name for name in FOREIGN if not (entries / name).exists()] == []
    assert not (entries / ORPHAN).exists() and not (entries / "cache.db").exists()
    assert LocalTier(entries).put(KEY, fake_entry(KEY))


# --- a FIFO where a database journal or the miss log belongs -----------------------------------------------------


@pytest.mark.parametrize("name", ["cache.db-journal", "cache.db-wal", "counters.db-journal"])
def test_a_fifo_at_a_database_file_hangs_no_command_and_clear_removes_it(cache_dir: Path, name: str) -> None:
    entries = cache_dir / "entries"
    tier = LocalTier(entries)
    assert tier.put(KEY, fake_entry(KEY))
    tier.count("compiles")
    tier.close()
    os.mkfifo(entries / name)
    for command in (("cache", "ls"), ("cache", "stats"), ("info",)):
        result = lazytriton(*command)
        assert result.returncode == 0, (command, result.stdout, result.stderr)
        assert "not a regular file" in result.stdout + result.stderr, (command, result.stdout, result.stderr)
    result = lazytriton("cache", "verify")
    assert result.returncode == 1 and "not a regular file" in result.stdout, result.stdout + result.stderr
    result = lazytriton("cache", "clear")
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (entries / name).exists()
    assert LocalTier(entries).put(KEY, fake_entry(KEY)) and LocalTier(entries).get(KEY) == fake_entry(KEY)


def test_a_fifo_at_the_miss_log_hangs_neither_stats_nor_prewarm(cache_dir: Path) -> None:
    cache_dir.mkdir()
    os.mkfifo(cache_dir / "misses.jsonl")
    result = lazytriton("cache", "stats")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "misses 0" in result.stdout and "not a regular file" in result.stdout + result.stderr
    result = lazytriton("prewarm", "--from-misses", str(cache_dir / "misses.jsonl"), "--list")
    assert result.returncode == 2 and "not a regular file" in result.stderr, result.stdout + result.stderr


# --- a huge miss log -------------------------------------------------------------------------------------------


def _peak_bytes(fn: object) -> int:
    tracemalloc.start()
    try:
        fn()  # type: ignore[operator]
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_sparse_miss_log_is_read_within_bounds(cache_dir: Path) -> None:
    from lazytriton.misslog import MISS_LOG_MAX_BYTES

    line = f'{{"variant": "{small_variant("sm_90")}"}}\n'
    log = cache_dir / "misses.jsonl"
    cache_dir.mkdir()
    with open(log, "wb") as f:
        f.write(line.encode() * 3)
        f.truncate(256 << 20)  # 256 MiB of NUL bytes after the three lines, and no newline: one huge line
    main("cache", "stats")  # imports done outside the measurement
    main("prewarm", "--from-misses", str(log), "--list")
    results: list[tuple[int, str, str]] = []
    peak = _peak_bytes(lambda: results.append(main("cache", "stats")))
    status, out, err = results[0]
    assert status == 0 and "misses 3+" in out, out + err
    assert peak < 16 << 20, f"cache stats held {peak / 2**20:.0f} MiB"
    peak = _peak_bytes(lambda: results.append(main("prewarm", "--from-misses", str(log), "--list")))
    status, out, err = results[1]
    [listed] = out.splitlines()
    assert status == 0 and listed.split()[0] == small_variant("sm_90").key(), out + err
    assert listed.split()[-1] == str(small_variant("sm_90")), out
    assert peak < 16 << 20, f"prewarm --from-misses held {peak / 2**20:.0f} MiB"
    assert f"{log}:4: longer than" in err and f"read the first {MISS_LOG_MAX_BYTES >> 20} MiB" in err, err


# --- one bad line skips that line ------------------------------------------------------------------------------


def test_bad_bytes_and_deep_nesting_in_a_miss_log_skip_their_line(tmp_path: Path) -> None:
    good = f'{{"variant": "{small_variant("sm_90")}"}}\n'.encode()
    log = tmp_path / "misses.jsonl"
    log.write_bytes(good + b'{"variant": "\xff\xfe"}\n' + b"[" * 50_000 + b"\n" + b"{" * 50 + b"\n" + good)
    status, out, err = main("prewarm", "--from-misses", str(log), "--list")
    assert status == 0, err
    assert out.split()[0] == small_variant("sm_90").key() and len(out.splitlines()) == 1, out
    assert f"{log}:2: not UTF-8" in err, err
    assert f"{log}:3: " in err and f"{log}:4: not a JSON object" in err, err


# --- settings --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [str(2**63), str(2**64), "9" * 400, "1e400", "9" * 400 + ".5", "2000000T"])
def test_a_cache_bound_past_what_sqlite_holds_is_a_settings_error(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  value: str) -> None:
    monkeypatch.setenv("LAZYTRITON_CACHE_MAX_BYTES", value)
    config.reset()
    with pytest.raises(config.SettingsError, match="LAZYTRITON_CACHE_MAX_BYTES"):
        config.settings()
    status, _, err = main("cache", "stats")
    assert status == 2 and "LAZYTRITON_CACHE_MAX_BYTES" in err and "configuration error" in err, err
    monkeypatch.delenv("LAZYTRITON_CACHE_MAX_BYTES")
    config.reset()
    with pytest.raises(ValueError, match="cache_max_bytes"):
        config.configure(cache_max_bytes=2**63)


def test_the_largest_cache_bound_allowed_keeps_the_local_tier_usable(cache_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAZYTRITON_CACHE_MAX_BYTES", str(config.MAX_CACHE_MAX_BYTES))
    config.reset()
    tier = LocalTier(cache_dir / "entries", size_limit=config.settings().cache_max_bytes)
    assert tier.put(KEY, fake_entry(KEY)) and tier.get(KEY) == fake_entry(KEY) and tier.problem is None
    monkeypatch.setenv("LAZYTRITON_CACHE_MAX_BYTES", str(config.MAX_CACHE_MAX_BYTES + 1))
    config.reset()
    with pytest.raises(config.SettingsError, match="at most"):
        config.settings()


@pytest.mark.parametrize("variable", ["LAZYTRITON_CACHE_DIR", "LAZYTRITON_IMAGES"])
def test_a_home_that_cannot_be_found_is_a_settings_error_naming_the_variable(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "~nosuchuser-lazytriton/x")
    config.reset()
    with pytest.raises(config.SettingsError, match=variable):
        config.settings()
    status, _, err = main("cache", "stats")
    assert status == 2 and variable in err and "configuration error" in err, err
    config.reset()
    monkeypatch.setenv(variable, str(cache_dir))
    what = {"LAZYTRITON_CACHE_DIR": "cache_dir", "LAZYTRITON_IMAGES": "images"}[variable]
    argument = "~nosuchuser-lazytriton/x" if what == "cache_dir" else ["~nosuchuser-lazytriton/x"]
    with pytest.raises(ValueError, match=what):
        config.configure(**{what: argument})


# --- small ones ------------------------------------------------------------------------------------------------


def test_clear_goes_on_past_a_directory_at_the_miss_log(cache_dir: Path) -> None:
    entries = cache_dir / "entries"
    tier = LocalTier(entries)
    assert tier.put(KEY, fake_entry(KEY))
    tier.close()
    (cache_dir / "misses.jsonl").mkdir()
    (cache_dir / "locks").mkdir()
    (cache_dir / "locks" / f"{KEY}.lock").touch()
    status, out, err = main("cache", "clear")
    assert status == 0, out + err
    assert "1 entry" in out and "1 compile locks" in out and "misses.jsonl" in err and "left" in err, out + err
    assert (cache_dir / "misses.jsonl").is_dir() and not (cache_dir / "locks" / f"{KEY}.lock").exists()


def test_a_directory_at_the_database_name_is_named_by_gc_and_clear(cache_dir: Path) -> None:
    entries = cache_dir / "entries"
    (entries / "cache.db").mkdir(parents=True)
    (entries / "cache.db" / "x").write_text("someone's")
    status, out, err = main("cache", "gc")
    assert status == 1 and "is a directory" in err and "never removes a directory" in err, err
    status, out, err = main("cache", "clear")
    assert status == 1 and "is a directory" in err and "Traceback" not in err, out + err
    assert (entries / "cache.db" / "x").exists(), "a directory lazytriton did not make is never removed"


def test_ls_counts_no_entry_for_an_image_that_does_not_open(cache_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken.ltimg"
    broken.write_bytes(b"not an image")
    monkeypatch.setenv("LAZYTRITON_IMAGES", str(broken))
    config.reset()
    runtime.reset()
    status, out, err = main("cache", "ls")
    assert status == 0, err
    assert out.splitlines()[-1] == "0 entries" and "does not open" in out, out
    status, out, err = main("cache", "ls", "--json")
    import json

    report = json.loads(out)
    assert report["count"] == 0 and report["entries"] == []
    assert [p["where"] for p in report["problems"]] == [str(broken)]
