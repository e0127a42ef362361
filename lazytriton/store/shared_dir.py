"""The shared directory tier: entries on a filesystem that many nodes mount (NFS, Lustre, CephFS, ...).

Layout under the root::

    entries/<first two hex digits of the key>/<key>.lte    one sealed envelope per entry
    entries/<xx>/.tmp-<key>-<owner>                       a write in progress (or left by a killed writer)
    leases/<key>.lease                                    a compile lease: {"owner": ..., "expires": ...}

Writes are atomic: the envelope goes to a temp file in the entry's own
directory, is fsynced, then renamed over the final name (rename is atomic on
POSIX and NFS), so a reader sees the old bytes or the new, never a mix. Every
read is verified (``store.gate.Gate``). Network filesystems raise ESTALE, EBUSY
or EIO in races with other nodes: those are retried briefly and then read as
a miss; nothing is raised to the caller.

Leases use the one primitive NFS has always made atomic: a lease file is
written under a temp name, then hard-linked to ``<key>.lease`` (link fails if
the name exists). A lease past its expiry is taken over by renaming it aside,
re-reading what was renamed, and putting it back if it turned out to be a
fresh one. Expiry compares wall clocks, so nodes' clocks must agree (NTP) to
well within the lease time.

Nothing in a lease file is trusted: whatever it claims, a lease expires at
most the lease time after its file was written (mtime) or first seen by this
node, whichever is earlier. Nodes that share a directory should therefore use
the same ``lease_s``.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import random
import stat
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import NamedTuple, TypeVar

from lazytriton.cache_format import Entry
from lazytriton.cache_format.envelope import MAX_ENVELOPE_BYTES, Rejected, check_signing_key, seal, unseal
from lazytriton.fsutil import read_fd_bounded
from lazytriton.store import TierStats
from lazytriton.store.gate import Counter, Gate
from lazytriton.store.lease import DEFAULT_LEASE_S, Lease, LockUnavailable, owner_token
from lazytriton.variant import check_key

log = logging.getLogger("lazytriton.store.shared_dir")

SUFFIX = ".lte"
TEMP_PREFIX = ".tmp-"
# Errors a network filesystem raises while another node renames or removes
# the same file: worth another try.
RETRY_ERRNOS = frozenset({errno.EBUSY, errno.ESTALE, errno.EIO, errno.EAGAIN, errno.EINTR})
# Three retries, ~21 ms in all: long enough for an NFS client to revalidate a
# stale handle, short enough that a miss is cheaper than waiting.
RETRY_DELAYS_S = (0.001, 0.004, 0.016)
# Temp files older than this were left by killed writers; a put sweeps its own
# directory of them once in SWEEP_EVERY puts.
STALE_TEMP_S = 3600.0
SWEEP_EVERY = 64
_MAX_LEASE_BYTES = 1024

T = TypeVar("T")


def retrying(op: Callable[[], T]) -> T:
    """Run ``op``, retrying the errors of network-filesystem races; the last one is raised."""
    for delay in RETRY_DELAYS_S:
        try:
            return op()
        except OSError as exc:
            if exc.errno not in RETRY_ERRNOS:
                raise
            time.sleep(delay)
    return op()


class LeaseFile(NamedTuple):
    """A lease file as read: its claim, and its identity (a renewal writes a new file: new inode, new mtime)."""

    owner: str
    claimed: float | None  # the expiry it claims (wall clock), None for garbage, Infinity or NaN
    ino: int
    mtime_ns: int


class NotAFile(OSError):
    """Something other than a regular file sits where an entry or lease should be (a link, a FIFO, ...)."""


def read_bounded(path: Path, limit: int) -> bytes | None:
    """At most ``limit + 1`` bytes of ``path`` (one more shows it is over), or None if it is not there.

    Opened without following a symlink and without blocking (a FIFO planted
    at an entry's name would otherwise hang the call); only a regular file is
    read, else NotAFile.
    """
    read = read_with_stat(path, limit)
    return None if read is None else read[0]


def read_with_stat(path: Path, limit: int) -> tuple[bytes, os.stat_result] | None:
    """``read_bounded``, and the status of the very file read (a lease's identity: inode and mtime)."""
    def read() -> tuple[bytes, os.stat_result]:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotAFile(errno.ELOOP, "a symbolic link, not a file", str(path)) from None
            raise
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise NotAFile(errno.EINVAL, "not a regular file", str(path))
            return read_fd_bounded(fd, limit), status
        finally:
            os.close(fd)

    try:
        return retrying(read)
    except FileNotFoundError:
        return None


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable; some filesystems cannot open a directory, which is fine."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


class SharedDirTier:
    """Entries and compile leases in a directory that many nodes share."""

    writable = True

    def __init__(self, root: str | os.PathLike[str], name: str = "shared", signing_key: bytes | None = None,
                 lease_s: float = DEFAULT_LEASE_S, count: Counter | None = None) -> None:
        self.name = name
        self.root = Path(root)
        self.signing_key = check_signing_key(signing_key)
        self.lease_s = lease_s
        self.gate: Gate[Entry] = Gate(name, partial(unseal, signing_key=self.signing_key), Rejected, count)
        self._warned: set[str] = set()
        self._puts = 0
        self._first_seen: dict[tuple[str, LeaseFile], float] = {}  # lease file -> when this node first saw it

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def entry_path(self, key: str) -> Path:
        """Where ``key``'s envelope lives (tests damage it on purpose)."""
        key = check_key(key)
        return self.root / "entries" / key[:2] / f"{key}{SUFFIX}"

    def lease_path(self, key: str) -> Path:
        return self.root / "leases" / f"{check_key(key)}.lease"

    # --- entries ------------------------------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The verified entry for ``key``; a missing, racing, unreadable or refused one is a miss."""
        path = self.entry_path(key)
        try:
            data = read_bounded(path, MAX_ENVELOPE_BYTES)
        except NotAFile as exc:
            self.gate.refuse(key, "rejected", str(exc))
            return None
        except OSError as exc:
            self._warn_once("read", f"shared directory {self.root} read failed ({exc}); treated as a miss")
            return None
        if data is None:
            return None
        return self.gate.admit(key, data)

    def put(self, key: str, entry: Entry) -> bool:
        """Publish ``entry`` atomically (temp file, fsync, rename); on any failure log once and return False."""
        path = self.entry_path(key)
        data = seal(entry.encode(), self.signing_key)
        temp = path.with_name(f"{TEMP_PREFIX}{key}-{owner_token().replace(':', '-')}")
        try:
            self._make_dirs(path.parent)
            write_file(temp, data)
            retrying(partial(os.replace, temp, path))
        except OSError as exc:
            self._warn_once("write", f"shared directory {self.root} write failed ({self._why(exc)}); "
                                     "entries are not shared with other nodes")
            try:
                os.unlink(temp)
            except OSError:
                pass
            return False
        _fsync_dir(path.parent)
        self._puts += 1
        if self._puts % SWEEP_EVERY == 1:
            self.sweep_all()
        return True

    def _make_dirs(self, directory: Path) -> None:
        """Create ``directory`` and the levels between it and the root, never the root itself.

        A root that is missing is a network filesystem that is not mounted:
        creating it would hide the real one behind an empty local directory.
        """
        here = self.root
        for part in directory.relative_to(self.root).parts:
            here = here / part
            try:
                os.mkdir(here)
            except FileExistsError:
                pass

    def _why(self, exc: OSError) -> str:
        if isinstance(exc, FileNotFoundError) and not os.path.isdir(self.root):
            return f"{self.root} does not exist (not mounted?); it is not created"
        return str(exc)

    def sweep(self, directory: Path, older_than_s: float = STALE_TEMP_S) -> int:
        """Remove temp files that killed writers left in ``directory``; how many went."""
        removed = 0
        now = time.time()
        try:
            items = list(os.scandir(directory))
        except OSError:
            return 0  # the directory went away, or was never made
        for item in items:
            try:
                if (item.name.startswith(TEMP_PREFIX) and item.is_file(follow_symlinks=False)
                        and now - item.stat(follow_symlinks=False).st_mtime >= older_than_s):
                    os.unlink(item.path)
                    removed += 1
            except OSError:
                pass  # another node swept it first
        return removed

    def sweep_all(self, older_than_s: float = STALE_TEMP_S) -> int:
        """Sweep every entry directory and the leases: temp files are found wherever they are.

        A writer killed before its key was ever published leaves its temp file
        in a directory no published key shares; sweeping only beside
        published keys would keep it forever. A put calls this once in
        SWEEP_EVERY puts: a listing of at most 257 directories, after a
        compile that took seconds.
        """
        base = self.root / "entries"
        try:
            fanout = sorted(os.listdir(base))
        except OSError:
            fanout = []
        removed = sum(self.sweep(base / sub, older_than_s) for sub in fanout
                      if len(sub) == 2 and all(c in "0123456789abcdef" for c in sub))
        return removed + self.sweep(self.root / "leases", older_than_s)

    def keys(self) -> Iterator[str]:
        """Keys of the published entries; temp files and anything that is not a key are skipped."""
        base = self.root / "entries"
        try:
            fanout = sorted(os.listdir(base))
        except OSError:
            return
        for sub in fanout:
            try:
                names = sorted(os.listdir(base / sub))
            except OSError:
                continue
            for file_name in names:
                key = file_name[:-len(SUFFIX)] if file_name.endswith(SUFFIX) else ""
                try:
                    check_key(key)
                except ValueError:
                    if not file_name.startswith(TEMP_PREFIX):
                        log.debug("shared directory: %s/%s is not an entry; skipped", sub, file_name)
                    continue
                if key[:2] == sub:
                    yield key

    def stats(self) -> TierStats:
        count = size = 0
        for key in self.keys():
            try:
                size += self.entry_path(key).stat().st_size
                count += 1
            except OSError:
                continue
        return TierStats(self.name, count, size)

    def close(self) -> None:
        """Nothing is held open between calls."""

    # --- compile leases -----------------------------------------------------------------------------------------

    def try_lease(self, key: str) -> Lease | None:
        """Take ``key``'s compile lease (None if a live holder has it); LockUnavailable if the directory fails."""
        path = self.lease_path(key)
        owner = owner_token()
        try:
            self._make_dirs(path.parent)
            for _ in range(3):  # a stale lease taken away, then a race for the freed name: a few rounds at most
                held = self._read_lease(path)
                expires = None if held is None else self._expiry(path, held)
                if expires is not None and expires > time.time():
                    return None  # a live holder: nothing is written while we wait (waiters poll often)
                if held is None and self._create_lease(path, owner):
                    return Lease(key, owner, self.lease_s, renew=partial(self._renew, path, owner),
                                 release=partial(self._release, path, owner))
                if held is None or expires is None:
                    continue  # someone linked a lease between our read and our link: look again
                log.warning("compile lease for %s held by %s expired %.1f s ago; taking it over",
                            key, held.owner, time.time() - expires)
                self._remove_if(path, held.__eq__)  # only if still that expired lease (not renewed)
            return None
        except OSError as exc:
            raise LockUnavailable(f"shared directory {self.root}: {self._why(exc)}") from exc

    def _lease_record(self, owner: str) -> bytes:
        return json.dumps({"owner": owner, "expires": round(time.time() + self.lease_s, 3)}).encode()

    def _create_lease(self, path: Path, owner: str) -> bool:
        """Link a fully written lease file to ``path``; False if someone holds that name."""
        temp = path.with_name(f"{TEMP_PREFIX}{path.name}-{random.getrandbits(48):012x}")
        write_file(temp, self._lease_record(owner))
        try:
            os.link(temp, path)
            return True
        except FileExistsError:
            return False
        except OSError:
            # NFS may apply a link and lose the reply; the link count says whether it happened.
            return os.stat(temp).st_nlink == 2
        finally:
            try:
                os.unlink(temp)
            except OSError:
                pass

    def _read_lease(self, path: Path) -> LeaseFile | None:
        """The lease file at ``path``, as found; None if there is none. Garbage has owner "?" and no claim."""
        try:
            read = read_with_stat(path, _MAX_LEASE_BYTES)
        except NotAFile:  # a link, a FIFO, a directory: garbage, capped like any other, then renamed aside
            try:
                read = b"", os.lstat(path)
            except FileNotFoundError:
                return None
        if read is None:
            return None
        data, status = read
        owner, claimed = "?", None
        try:
            record = json.loads(data[:_MAX_LEASE_BYTES])
            owner, claimed = str(record["owner"])[:200], float(record["expires"])
        except (ValueError, KeyError, TypeError, OverflowError):
            pass
        if claimed is not None and not math.isfinite(claimed):
            claimed = None  # Infinity or NaN: no claim at all
        return LeaseFile(owner, claimed, status.st_ino, status.st_mtime_ns)

    def _expiry(self, path: Path, held: LeaseFile) -> float:
        """When ``held`` expires: what it claims, capped at the lease time after it was written or first seen.

        Nothing in a lease file is trusted: ``{"expires": 1e18}``, Infinity,
        NaN or garbage with an mtime in the future would otherwise hold every
        waiting node for good. A renewal writes a new file (new inode and
        mtime), so only a lease nobody renews is ever capped by first sight.
        """
        if len(self._first_seen) >= 4096:  # a bound on memory, whatever a hostile directory holds
            self._first_seen.clear()
        first_seen = self._first_seen.setdefault((str(path), held), time.time())
        cap = min(held.mtime_ns / 1e9, first_seen) + self.lease_s
        return cap if held.claimed is None else min(held.claimed, cap)

    def _remove_if(self, path: Path, matches: Callable[[LeaseFile], bool]) -> bool:
        """Remove the lease at ``path`` if what it holds ``matches``; put back a lease that does not."""
        aside = path.with_name(f"{TEMP_PREFIX}{path.name}-{random.getrandbits(48):012x}.aside")
        try:
            retrying(partial(os.rename, path, aside))
        except FileNotFoundError:
            return False
        try:
            held = self._read_lease(aside)
            if held is not None and matches(held):
                return True
            # It was renewed or retaken since we looked: give it back, unless a new lease took the name.
            try:
                os.link(aside, path)
            except OSError:
                log.warning("a compile lease at %s was displaced by a race; its holder will see it lost", path)
            return False
        finally:
            try:
                os.unlink(aside)
            except OSError:
                pass

    def _renew(self, path: Path, owner: str) -> bool:
        # Read, then replace: a takeover between the two is overwritten. It needs a holder that missed
        # every renewal for a whole lease time, and costs at most a second compile (see lease.py).
        held = self._read_lease(path)
        if held is None or held.owner != owner:
            return False
        temp = path.with_name(f"{TEMP_PREFIX}{path.name}-{random.getrandbits(48):012x}")
        try:
            write_file(temp, self._lease_record(owner))
            retrying(partial(os.replace, temp, path))
        except OSError:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise
        return True

    def _release(self, path: Path, owner: str) -> None:
        self._remove_if(path, lambda held: held.owner == owner)
