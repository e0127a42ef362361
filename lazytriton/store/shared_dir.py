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

Nor is any folder below the root: each level (``entries``, ``entries/<xx>``,
``leases``) is opened from its parent's descriptor without following a link,
and every file is opened, written, renamed, linked and removed relative to its
folder's descriptor. A folder a co-tenant replaced by a symlink is refused
(``NotAFolder``): a read through it is refused and counted, a write fails, a
lease is unavailable, a sweep and a listing skip it; nothing is read, written
or removed outside the root. The root itself is the deployment's setting, and
may be a link.
"""

from __future__ import annotations

import contextlib
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
from typing import TypeVar

from lazytriton.cache_format import Entry
from lazytriton.cache_format.envelope import MAX_ENVELOPE_BYTES, Rejected, check_signing_key, seal, unseal
from lazytriton.fsutil import read_fd_bounded
from lazytriton.keys import check_key
from lazytriton.record import NamedTuple
from lazytriton.store import TierStats
from lazytriton.store.gate import Counter, Gate
from lazytriton.store.lease import DEFAULT_LEASE_S, Lease, LockUnavailable, owner_token

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
_FOLDER_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)

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


class NotAFolder(OSError):
    """Something other than a folder (a symbolic link, a file) sits where a folder of the tier should be."""


def read_with_stat(name: str | os.PathLike[str], limit: int,
                   dir_fd: int | None = None) -> tuple[bytes, os.stat_result] | None:
    """At most ``limit + 1`` bytes of ``name`` and the status of the file read; None if it is not there.

    One byte more than ``limit`` shows the file is over it; the status is the
    very file's (a lease's identity: inode and mtime). Opened relative to
    ``dir_fd``, without following a symlink and without blocking (a FIFO
    planted at an entry's name would otherwise hang the call); only a regular
    file is read, else NotAFile.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotAFile(errno.ELOOP, "a symbolic link, not a file", str(name)) from None
        raise
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise NotAFile(errno.EINVAL, "not a regular file", str(name))
        return read_fd_bounded(fd, limit), status
    finally:
        os.close(fd)


def write_file(name: str, data: bytes, dir_fd: int | None = None) -> None:
    """Create ``name`` (it must not exist) relative to ``dir_fd``, write ``data`` and fsync it."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(name: str, dir_fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


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

    @contextlib.contextmanager
    def _folder(self, folder: Path, create: bool = False) -> Iterator[int]:
        """A descriptor of ``folder`` (the root or below it), opened from the root one level at a time.

        The root is opened as configured; each level below it without
        following a link (NotAFolder for a link or a file). ``create`` makes
        missing levels below the root, never the root itself: a missing root
        is a network filesystem that is not mounted, and creating it would
        hide the real one behind an empty local directory.
        """
        fd = os.open(self.root, _FOLDER_FLAGS)
        try:
            for part in folder.relative_to(self.root).parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                try:
                    inner = os.open(part, _FOLDER_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    raise NotAFolder(exc.errno, "a symbolic link or a file, not a folder of the tier",
                                     str(folder)) from None
                os.close(fd)
                fd = inner
            yield fd
        finally:
            os.close(fd)

    def _read(self, path: Path, limit: int) -> tuple[bytes, os.stat_result] | None:
        """``read_with_stat`` of ``path`` through its folder's descriptor, retried; None if either is missing."""
        def read() -> tuple[bytes, os.stat_result] | None:
            with self._folder(path.parent) as fd:
                return read_with_stat(path.name, limit, fd)

        try:
            return retrying(read)
        except FileNotFoundError:
            return None

    # --- entries ------------------------------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The verified entry for ``key``; a missing, racing, unreadable or refused one is a miss."""
        path = self.entry_path(key)
        try:
            read = self._read(path, MAX_ENVELOPE_BYTES)
        except (NotAFile, NotAFolder) as exc:
            self.gate.refuse(key, "rejected", str(exc))
            return None
        except OSError as exc:
            self._warn_once("read", f"shared directory {self.root} read failed ({exc}); treated as a miss")
            return None
        if read is None:
            return None
        return self.gate.admit(key, read[0])

    def put(self, key: str, entry: Entry) -> bool:
        """Publish ``entry`` atomically (temp file, fsync, rename); on any failure log once and return False."""
        path = self.entry_path(key)
        data = seal(entry.encode(), self.signing_key)
        temp = f"{TEMP_PREFIX}{key}-{owner_token().replace(':', '-')}"
        try:
            with self._folder(path.parent, create=True) as fd:
                try:
                    write_file(temp, data, fd)
                    retrying(partial(os.replace, temp, path.name, src_dir_fd=fd, dst_dir_fd=fd))
                except OSError:
                    _unlink(temp, fd)
                    raise
                with contextlib.suppress(OSError):  # make the rename durable where the filesystem allows it
                    os.fsync(fd)
        except OSError as exc:
            self._warn_once("write", f"shared directory {self.root} write failed ({self._why(exc)}); "
                                     "entries are not shared with other nodes")
            return False
        self._puts += 1
        if self._puts % SWEEP_EVERY == 1:
            self.sweep_all()
        return True

    def _why(self, exc: OSError) -> str:
        if isinstance(exc, FileNotFoundError) and not os.path.isdir(self.root):
            return f"{self.root} does not exist (not mounted?); it is not created"
        return str(exc)

    def sweep(self, directory: Path, older_than_s: float = STALE_TEMP_S) -> int:
        """Remove temp files that killed writers left in ``directory``; how many went."""
        removed = 0
        now = time.time()
        try:
            with self._folder(directory) as fd:
                for name in os.listdir(fd):
                    try:
                        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        if (name.startswith(TEMP_PREFIX) and stat.S_ISREG(info.st_mode)
                                and now - info.st_mtime >= older_than_s):
                            os.unlink(name, dir_fd=fd)
                            removed += 1
                    except OSError:
                        pass  # another node swept it first
        except OSError:
            return removed  # the directory went away, was never made, or is a link: not ours to sweep
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
        fanout = self._list(base)
        removed = sum(self.sweep(base / sub, older_than_s) for sub in fanout
                      if len(sub) == 2 and all(c in "0123456789abcdef" for c in sub))
        return removed + self.sweep(self.root / "leases", older_than_s)

    def keys(self) -> Iterator[str]:
        """Keys of the published entries; temp files and anything that is not a key are skipped."""
        base = self.root / "entries"
        for sub in self._list(base):
            for file_name in self._list(base / sub):
                key = file_name[:-len(SUFFIX)] if file_name.endswith(SUFFIX) else ""
                try:
                    check_key(key)
                except ValueError:
                    if not file_name.startswith(TEMP_PREFIX):
                        log.debug("shared directory: %s/%s is not an entry; skipped", sub, file_name)
                    continue
                if key[:2] == sub:
                    yield key

    def _list(self, folder: Path) -> list[str]:
        """The names in ``folder``, sorted; none when it is missing, unreadable or a link."""
        try:
            with self._folder(folder) as fd:
                return sorted(os.listdir(fd))
        except OSError:
            return []

    def stats(self) -> TierStats:
        count = size = 0
        for key in self.keys():
            path = self.entry_path(key)
            try:
                with self._folder(path.parent) as fd:
                    size += os.stat(path.name, dir_fd=fd, follow_symlinks=False).st_size
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
            with self._folder(path.parent, create=True):
                pass
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
        temp = f"{TEMP_PREFIX}{path.name}-{random.getrandbits(48):012x}"
        with self._folder(path.parent) as fd:
            write_file(temp, self._lease_record(owner), fd)
            try:
                os.link(temp, path.name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                return True
            except FileExistsError:
                return False
            except OSError:
                # NFS may apply a link and lose the reply; the link count says whether it happened.
                return os.stat(temp, dir_fd=fd, follow_symlinks=False).st_nlink == 2
            finally:
                _unlink(temp, fd)

    def _read_lease(self, path: Path) -> LeaseFile | None:
        """The lease file at ``path``, as found; None if there is none. Garbage has owner "?" and no claim."""
        with self._folder(path.parent) as fd:
            return self._read_lease_at(path.name, fd)

    def _read_lease_at(self, name: str, fd: int) -> LeaseFile | None:
        """``_read_lease`` of ``name`` in the folder open at ``fd``."""
        try:
            read = retrying(partial(read_with_stat, name, _MAX_LEASE_BYTES, fd))
        except NotAFile:  # a link, a FIFO, a directory: garbage, capped like any other, then renamed aside
            try:
                read = b"", os.stat(name, dir_fd=fd, follow_symlinks=False)
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
        aside = f"{TEMP_PREFIX}{path.name}-{random.getrandbits(48):012x}.aside"
        with self._folder(path.parent) as fd:
            try:
                retrying(partial(os.rename, path.name, aside, src_dir_fd=fd, dst_dir_fd=fd))
            except FileNotFoundError:
                return False
            try:
                held = self._read_lease_at(aside, fd)
                if held is not None and matches(held):
                    return True
                # It was renewed or retaken since we looked: give it back, unless a new lease took the name.
                try:
                    os.link(aside, path.name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                except OSError:
                    log.warning("a compile lease at %s was displaced by a race; its holder will see it lost", path)
                return False
            finally:
                _unlink(aside, fd)

    def _renew(self, path: Path, owner: str) -> bool:
        # Read, then replace: a takeover between the two is overwritten. It needs a holder that missed
        # every renewal for a whole lease time, and costs at most a second compile (see lease.py).
        temp = f"{TEMP_PREFIX}{path.name}-{random.getrandbits(48):012x}"
        with self._folder(path.parent) as fd:
            held = self._read_lease_at(path.name, fd)
            if held is None or held.owner != owner:
                return False
            try:
                write_file(temp, self._lease_record(owner), fd)
                retrying(partial(os.replace, temp, path.name, src_dir_fd=fd, dst_dir_fd=fd))
            except OSError:
                _unlink(temp, fd)
                raise
        return True

    def _release(self, path: Path, owner: str) -> None:
        self._remove_if(path, lambda held: held.owner == owner)
