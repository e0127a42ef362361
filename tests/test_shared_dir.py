"""The shared directory tier: atomic publishing, verified reads, NFS races, hostile files, and compile leases."""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sharedlib import SIGNING_KEY, count_renewals, make_entry

from lazytriton.cache_format.envelope import seal
from lazytriton.store import lease as lease_module
from lazytriton.store import shared_dir
from lazytriton.store.lease import LockUnavailable, lease_or_entry
from lazytriton.store.shared_dir import SharedDirTier

KEY, OTHER = "a1" * 16, "b2" * 16


def counted() -> tuple[list[str], Any]:
    seen: list[str] = []
    return seen, lambda name, amount=1: seen.append(name)


def test_put_get_round_trip_layout_and_listing(tmp_path: Path) -> None:
    tier = SharedDirTier(tmp_path)
    entry = make_entry(KEY)
    assert tier.get(KEY) is None
    assert tier.put(KEY, entry)
    assert tier.get(KEY) == entry
    assert tier.entry_path(KEY) == tmp_path / "entries" / "a1" / f"{KEY}.lte"
    assert sorted(p.name for p in (tmp_path / "entries" / "a1").iterdir()) == [f"{KEY}.lte"], "no temp file left"
    assert tier.put(OTHER, make_entry(OTHER))
    (tmp_path / "entries" / "a1" / "notes.txt").write_text("not an entry")
    (tmp_path / "entries" / "a1" / f"{OTHER}.lte").write_bytes(b"filed under the wrong prefix")
    assert list(tier.keys()) == [KEY, OTHER]
    stats = tier.stats()
    assert stats.entries == 2 and stats.bytes > 100_000


def test_a_signed_tier_refuses_unsigned_and_foreign_entries(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    seen, count = counted()
    signed = SharedDirTier(tmp_path, signing_key=SIGNING_KEY, count=count)
    SharedDirTier(tmp_path).put(KEY, make_entry(KEY))  # a node without the key
    SharedDirTier(tmp_path, signing_key=b"another-deployment-0000").put(OTHER, make_entry(OTHER))
    with caplog.at_level(logging.WARNING, "lazytriton"):
        assert signed.get(KEY) is None and signed.get(OTHER) is None
        assert signed.get(KEY) is None  # the same bytes again: refused, but logged and counted once
    assert seen == ["rejected", "rejected"]
    messages = [r.getMessage() for r in caplog.records]
    assert any(KEY in m and "unsigned" in m for m in messages)
    assert any(OTHER in m and "HMAC-SHA256 does not match" in m for m in messages)
    assert signed.put(KEY, make_entry(KEY)) and signed.get(KEY) == make_entry(KEY)


@pytest.mark.parametrize("key", ["../" * 10 + "etc/passwd", "A" * 32, "a" * 31, "/abs" + "0" * 28])
def test_keys_that_are_not_keys_never_reach_the_filesystem(tmp_path: Path, key: str) -> None:
    tier = SharedDirTier(tmp_path / "shared")
    for call in (lambda: tier.get(key), lambda: tier.put(key, make_entry(KEY)), lambda: tier.try_lease(key)):
        with pytest.raises(ValueError, match="cache key must be 32 lowercase hex digits"):
            call()
    assert not (tmp_path / "shared").exists()


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EBUSY, errno.EIO])
def test_network_filesystem_races_are_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    tier = SharedDirTier(tmp_path)
    tier.put(KEY, make_entry(KEY))
    real_open, failures = os.open, []

    def flaky_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path).endswith(".lte") and len(failures) < 2:
            failures.append(path)
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(shared_dir.os, "open", flaky_open)
    assert tier.get(KEY) == make_entry(KEY)
    assert len(failures) == 2


@pytest.mark.parametrize("code", [errno.ESTALE, errno.EBUSY, errno.EIO, errno.EACCES])
def test_a_race_that_does_not_clear_is_a_miss_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int) -> None:
    tier = SharedDirTier(tmp_path)
    tier.put(KEY, make_entry(KEY))

    def failing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(shared_dir.os, "open", failing_open)
    with caplog.at_level(logging.WARNING, "lazytriton"):
        start = time.perf_counter()
        assert tier.get(KEY) is None and tier.get(KEY) is None
        elapsed = time.perf_counter() - start
        assert not tier.put(OTHER, make_entry(OTHER))
    assert elapsed < 0.2, "retries are brief"
    assert len(caplog.records) == 2, [r.getMessage() for r in caplog.records]  # one for reads, one for writes
    assert not list((tmp_path / "entries").rglob(".tmp-*")), "a failed write leaves no temp file"


def test_a_vanishing_file_is_a_quiet_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    tier = SharedDirTier(tmp_path)
    tier.put(KEY, make_entry(KEY))
    monkeypatch.setattr(shared_dir.os, "open",
                        lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError(errno.ENOENT, "")))
    with caplog.at_level(logging.WARNING, "lazytriton"):
        assert tier.get(KEY) is None
    assert not caplog.records


def test_a_write_that_fails_midway_leaves_the_old_entry_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = SharedDirTier(tmp_path)
    old = make_entry(KEY, seed=1)
    tier.put(KEY, old)

    def full_disk(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_dir.os, "write", full_disk)
    assert not tier.put(KEY, make_entry(KEY, seed=2))
    monkeypatch.undo()
    assert tier.get(KEY) == old
    assert [p.name for p in tier.entry_path(KEY).parent.iterdir()] == [f"{KEY}.lte"]


@pytest.mark.parametrize("plant", ["symlink", "fifo", "directory", "huge"])
def test_hostile_files_are_refused_without_blocking(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                     plant: str) -> None:
    seen, count = counted()
    tier = SharedDirTier(tmp_path, count=count)
    path = tier.entry_path(KEY)
    path.parent.mkdir(parents=True)
    if plant == "symlink":
        (tmp_path / "secret").write_bytes(b"x" * 100)
        path.symlink_to(tmp_path / "secret")
    elif plant == "fifo":
        os.mkfifo(path)  # opening it for reading would block forever without O_NONBLOCK
    elif plant == "directory":
        path.mkdir()
    else:
        with open(path, "wb") as out:  # sparse: 80 MiB of nothing, past the 64 MiB bound
            out.truncate(80 << 20)
    with caplog.at_level(logging.WARNING, "lazytriton"):
        assert tier.get(KEY) is None
    assert seen == ["rejected"], caplog.text
    assert KEY in caplog.text and ("not a" in caplog.text or "oversized" in caplog.text or "symbolic" in caplog.text)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("link", ["entries/a1", "entries", "leases"])
def test_a_folder_replaced_by_a_symlink_is_never_read_written_or_swept_through(tmp_path: Path, link: str) -> None:
    root, outside = tmp_path / "shared", tmp_path / "outside"
    stamp = time.time() - 7200
    for folder in (outside, outside / "a1"):  # what entries/a1 or entries would lead to through the link
        folder.mkdir(parents=True)
        (folder / f"{KEY}.lte").write_bytes(seal(make_entry(KEY).encode(), None))
        (folder / f".tmp-{KEY}-deadhost-1-000000000000").write_bytes(b"not the tier's")
        (folder / f".tmp-{KEY}.lease-00000000beef").write_bytes(b"not the tier's")
        for path in folder.iterdir():
            os.utime(path, (stamp, stamp))
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    (root / link).symlink_to(outside / "a1" if link == "entries/a1" else outside, target_is_directory=True)
    before = _tree(outside)
    seen, count = counted()
    tier = SharedDirTier(root, count=count)
    if link == "leases":
        with pytest.raises(LockUnavailable):
            tier.try_lease(KEY)
        assert tier.put(KEY, make_entry(KEY)) and tier.get(KEY) == make_entry(KEY)
    else:
        assert tier.get(KEY) is None and seen == ["rejected"], "read through a link"
        assert not tier.put(KEY, make_entry(KEY)), "written through a link"
        assert list(tier.keys()) == [] and tier.stats().entries == 0
        lease = tier.try_lease(KEY)
        assert lease is not None
        lease.release()
    tier.sweep_all(older_than_s=0)
    assert _tree(outside) == before
    assert (root / link).is_symlink()


def test_temp_files_of_killed_writers_are_swept(tmp_path: Path) -> None:
    tier = SharedDirTier(tmp_path)
    tier.put(KEY, make_entry(KEY))
    stale = tier.entry_path(KEY).with_name(f".tmp-{KEY}-deadhost-1-000000000000")
    stale.write_bytes(b"half an entry")
    assert tier.sweep(stale.parent) == 0, "a young temp file may be a live write"
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert tier.sweep(stale.parent) == 1 and not stale.exists()
    assert tier.get(KEY) == make_entry(KEY)


def test_temp_files_are_swept_wherever_they_are(tmp_path: Path) -> None:
    tier = SharedDirTier(tmp_path)
    # Writers killed before their key was ever published, a killed lease writer: no published key beside them.
    stale = [tier.entry_path(KEY).with_name(f".tmp-{KEY}-deadhost-1-000000000000"),
             tier.entry_path(OTHER).with_name(f".tmp-{OTHER}-deadhost-2-000000000000"),
             tier.lease_path(KEY).with_name(f".tmp-{KEY}.lease-00000000beef")]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half a file")
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    young = tier.entry_path(KEY).with_name(f".tmp-{KEY}-livehost-3-000000000000")
    young.write_bytes(b"a live write")
    third = "c3" * 16
    assert tier.put(third, make_entry(third))  # the first put of a process sweeps the whole tree
    assert [p for p in stale if p.exists()] == [] and young.exists()
    assert tier.sweep_all(older_than_s=0) == 1 and not young.exists()
    assert list(tier.keys()) == [third]


# --- compile leases ---------------------------------------------------------------------------------------------


def test_a_lease_is_held_once_and_given_back(tmp_path: Path) -> None:
    tier = SharedDirTier(tmp_path, lease_s=5)
    lease = tier.try_lease(KEY)
    assert lease is not None
    record = json.loads(tier.lease_path(KEY).read_text())
    assert record["owner"] == lease.owner and record["expires"] > time.time() + 4
    assert tier.try_lease(KEY) is None
    assert SharedDirTier(tmp_path, lease_s=5).try_lease(KEY) is None  # another node
    lease.release()
    assert not tier.lease_path(KEY).exists()
    again = tier.try_lease(KEY)
    assert again is not None
    again.release()
    assert sorted(p.name for p in (tmp_path / "leases").iterdir()) == []


def test_a_lease_is_renewed_while_held_and_taken_over_once_it_expires(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    tier = SharedDirTier(tmp_path, lease_s=2)
    held = tier.try_lease(KEY)
    assert held is not None
    assert count_renewals(held, 4) == 4  # every 0.67 s: over a lease time in all
    assert tier.try_lease(KEY) is None and not held.lost
    held._stop.set()  # the holder dies: renewals stop
    held._thread.join()
    deadline = time.monotonic() + 60
    with caplog.at_level(logging.WARNING, "lazytriton"):
        while (taken := tier.try_lease(KEY)) is None:
            assert time.monotonic() < deadline, "the dead holder's lease never expired"
            time.sleep(0.05)
    assert "taking it over" in caplog.text
    held._release()  # the dead holder's release (were it to come back) leaves the new lease alone
    assert json.loads(tier.lease_path(KEY).read_text())["owner"] == taken.owner
    assert not held._renew(), "the old holder sees its lease lost"
    taken.release()


def test_a_garbage_lease_file_expires_by_its_age(tmp_path: Path) -> None:
    tier = SharedDirTier(tmp_path, lease_s=1)
    path = tier.lease_path(KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x00garbage")  # a crashed or hostile writer
    assert tier.try_lease(KEY) is None
    os.utime(path, (time.time() - 5, time.time() - 5))
    lease = tier.try_lease(KEY)
    assert lease is not None
    lease.release()


def test_a_fresh_lease_taken_aside_by_a_slow_reaper_is_put_back(tmp_path: Path) -> None:
    tier = SharedDirTier(tmp_path, lease_s=5)
    lease = tier.try_lease(KEY)
    assert lease is not None
    # A reaper that judged an older lease expired renames away this fresh one: it must give it back.
    assert not tier._remove_if(tier.lease_path(KEY), lambda held: held == ("someone-else", 0.0))
    assert json.loads(tier.lease_path(KEY).read_text())["owner"] == lease.owner
    lease.release()


def test_lease_or_entry_waits_for_the_holder_then_takes_what_it_published(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    holder, waiter = SharedDirTier(tmp_path, lease_s=5), SharedDirTier(tmp_path, lease_s=5)
    lease = holder.try_lease(KEY)
    assert lease is not None
    polls: list[float] = []

    def publish_after_three_polls(seconds: float) -> None:
        polls.append(seconds)
        if len(polls) == 3:
            holder.put(KEY, make_entry(KEY))
            lease.release()

    monkeypatch.setattr(lease_module.time, "sleep", publish_after_three_polls)
    got_lease, entry = lease_or_entry(waiter, KEY, timeout_s=60)
    assert got_lease is None and entry == make_entry(KEY) and len(polls) == 3


@pytest.mark.parametrize(("lease_s", "bound_s"), [(30, 60), (1, 10)])  # two lease times, at least 10 s
def test_a_lease_rewritten_forever_holds_a_miss_for_two_lease_times_at_most(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lease_s: float, bound_s: float) -> None:
    # A co-tenant rewrites the lease file every 2 s (a new file each time, as a renewal): leases are unsigned,
    # so a signing key changes nothing. Time passes only when the waiter sleeps (an injected clock).
    tier = SharedDirTier(tmp_path, lease_s=lease_s, signing_key=SIGNING_KEY)
    path = tier.lease_path(KEY)
    path.parent.mkdir(parents=True)
    now, written = [0.0], [0.0]

    def rewrite() -> None:
        temp = path.with_name(".planting")
        temp.write_text(json.dumps({"owner": "co-tenant", "expires": time.time() + lease_s}))
        os.replace(temp, path)

    def sleep(seconds: float) -> None:
        now[0] += seconds
        if now[0] - written[0] >= 2:
            rewrite()
            written[0] = now[0]

    rewrite()
    monkeypatch.setattr(lease_module, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    assert lease_or_entry(tier, KEY, timeout_s=300) == (None, None)
    assert bound_s <= now[0] <= bound_s + 1, f"the miss waited {now[0]:.0f} s on leases"


def test_an_unusable_directory_gives_no_lease_and_no_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    tier = SharedDirTier(blocker / "shared")
    with pytest.raises(LockUnavailable):
        tier.try_lease(KEY)
    assert lease_or_entry(tier, KEY, timeout_s=60) == (None, None)
    assert tier.get(KEY) is None and not tier.put(KEY, make_entry(KEY)) and list(tier.keys()) == []


@pytest.mark.parametrize("planted", ["1e18", "infinity", "nan", "garbage, future mtime", "1e18, future mtime"])
def test_a_lease_that_claims_to_never_expire_is_taken_over_after_one_lease_time(tmp_path: Path,
                                                                              planted: str) -> None:
    # Leases are unsigned: a signing key changes nothing, the cap alone protects the waiters.
    tier = SharedDirTier(tmp_path, lease_s=1, signing_key=SIGNING_KEY)
    path = tier.lease_path(KEY)
    path.parent.mkdir(parents=True)
    body = {"1e18": '{"owner": "x", "expires": 1e18}', "infinity": '{"owner": "x", "expires": Infinity}',
            "nan": '{"owner": "x", "expires": NaN}'}.get(planted.partition(",")[0], "\x00garbage")
    path.write_text(body)
    if "future" in planted:
        os.utime(path, (time.time() + 10**9, time.time() + 10**9))
    assert tier.try_lease(KEY) is None, "a fresh lease is respected for its lease time"
    start = time.monotonic()
    lease, entry = lease_or_entry(SharedDirTier(tmp_path, lease_s=1, signing_key=SIGNING_KEY), KEY, timeout_s=120)
    waited = time.monotonic() - start
    assert lease is not None and entry is None, f"the planted lease held the waiter for {waited:.1f} s"
    assert json.loads(path.read_text())["owner"] == lease.owner
    lease.release()


def test_a_renewed_lease_is_never_capped_by_first_sight(tmp_path: Path) -> None:
    holder, waiter = SharedDirTier(tmp_path, lease_s=2), SharedDirTier(tmp_path, lease_s=2)
    lease = holder.try_lease(KEY)
    assert lease is not None
    start = time.monotonic()
    renewals = 0
    while renewals < 8 or time.monotonic() - start < 3:  # past 1.5 lease times since the waiter first saw it
        seen = holder._read_lease(holder.lease_path(KEY))
        assert holder._renew(holder.lease_path(KEY), lease.owner)
        renewals += 1
        assert waiter.try_lease(KEY) is None, f"taken over after {renewals} renewals"
        assert holder._read_lease(holder.lease_path(KEY)) != seen, "a renewal writes a new file"
        time.sleep(0.4)  # time passing, not a wait for anything: each check follows its renewal at once
    lease.release()
