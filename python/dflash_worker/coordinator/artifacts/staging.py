"""The upload staging area: where an upload's bytes wait until they are verified and committed.

A provider's report is its upload: the coordinator keeps only bytes it
received itself. An upload (`UploadArtifact`) goes through three places:

1. **staging**, ``<root>/staging/<attempt_id>/<key>.part`` (``key`` is the
   sha256 of ``name`` NUL ``sha256``): bytes land here as they arrive, never
   past the declared size. Nothing here is visible to anyone; an interrupted
   upload resumes from the staged length. Staging is local to the
   coordinator whatever the blob backend is, so it survives a coordinator
   restart; an attempt's staging is dropped when the attempt ends, and a
   file no one has written to for the idle limit is swept. Staged uploads count
   against the quotas until they are committed or dropped: each reserves its
   declared size from admission on (`Staging.reserve`; after a restart, the
   length found on disk), so uploads that stop short cannot pile up past an
   attempt's quota; and an upload is admitted only if the coordinator's disk
   has room for what is still to come (`Staging.check_space`: UNAVAILABLE while
   it lacks the free space, RESOURCE_EXHAUSTED past the disk's whole size).
2. **verification**: when the staged length reaches the declared size, the
   whole file's sha256 must be the declared one (it is hashed as it arrives;
   a resumed upload is rehashed from the start, off the event loop).
3. **commit**: the verified file becomes blob ``sha256`` in the blob store
   (`blobs.BlobStore`: content-addressed, each blob stored once), then one
   record row (attempt, name -> sha256) is written. A reader sees the record
   only after the blob is complete.

What an upload claims (its name, kind, sha256 and size) is checked before it reaches
staging (`names.Claim`); the upload engine that drives the three steps is
`coordinator.grpc.uploads`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import PolicyError, QuotaError, StorageError
from ...manifest import sha256_file
from .directio import AppendFile
from .names import Claim


@dataclass(frozen=True)
class Staged:
    """Uploads staged and not yet committed or dropped, as the quotas count them: records and declared bytes."""

    attempt_records: int = 0
    attempt_bytes: int = 0
    run_records: int = 0
    run_bytes: int = 0


NOTHING_STAGED = Staged()


def disk_space(path: Path) -> tuple[int, int]:
    """`(free, total)` bytes of the file system holding `path` (or its nearest existing parent); `free` is what an
    unprivileged writer may still write."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p.parent != p:
        p = p.parent
    usage = shutil.disk_usage(p)
    return usage.free, usage.total


def _storage(what: str, exc: OSError) -> StorageError:
    return StorageError(f"coordinator storage: cannot {what}: {exc.strerror or exc}\nhint: retry later; the coordinator's disk may be full")


class Staging:
    """Partial uploads on the coordinator's local disk, one file per (attempt, name, sha256).

    File operations block: call them off the loop. The reservations the quotas count (`staged`,
    `reserve`) and `check_space` (one statvfs) are cheap and run on it; a lock guards the
    reservations against the janitor's `sweep` on its thread."""

    def __init__(self, root: Path, *, blob_dir: Path | None = None):
        """`blob_dir`: a local blob store's directory; on another file system its free space is checked too."""
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _storage(f"create the staging directory `{self.root}`", exc) from None
        self.blob_dir = None
        if blob_dir is not None and _device(blob_dir) != _device(self.root):
            self.blob_dir = Path(blob_dir)
        # attempt -> (its run, {staged path: (declared size, when reserved)}); run "" when not known yet (found at start).
        self._reserved: dict[str, tuple[str, dict[Path, tuple[int, float]]]] = {}
        self._lock = threading.Lock()
        self._reserve_found()

    def _reserve_found(self) -> None:
        """Reserve what an earlier process left staged (the attempts may still be live): its length on disk."""
        for part in self.root.glob("*/*.part"):
            try:
                size = part.stat().st_size
            except OSError:
                continue
            self._reserved.setdefault(part.parent.name, ("", {}))[1][part] = (size, time.time())

    def check_space(self, claim: Claim, offset: int) -> None:
        """Refuse, naming both numbers, an upload the coordinator's disk cannot hold: RESOURCE_EXHAUSTED when it is
        larger than the whole disk (it never will fit), UNAVAILABLE when it is larger than the free space now (the
        provider retries, as for any storage trouble, and the work lands once the admin frees space)."""
        for what, directory, need in (("staging", self.root, claim.size_bytes - offset), ("blob store", self.blob_dir, claim.size_bytes)):
            if directory is None:
                continue
            try:
                free, total = disk_space(directory)
            except OSError as exc:
                raise _storage(f"read the free space of `{directory}`", exc) from None
            if need <= free:
                continue
            declared = f"artifact `{claim.name}` declares {claim.size_bytes} bytes" + (f" ({need} still to come)" if need != claim.size_bytes else "")
            if need > total:
                raise QuotaError(
                    f"{declared}; the coordinator's {what} disk (`{directory}`) holds {total} bytes in all ({free} bytes free)\n"
                    "hint: the coordinator's admin must give it a larger disk; retrying will not help"
                )
            raise StorageError(
                f"{declared}; the coordinator's {what} disk (`{directory}`) has {free} bytes free\n"
                "hint: retry later; the coordinator's admin must free space on that disk"
            )

    def staged(self, run_id: str, attempt_id: str, exclude: Path) -> Staged:
        """What the attempt's and the run's staged uploads reserve, less `exclude` (the upload being admitted)."""
        a_n = a_b = r_n = r_b = 0
        with self._lock:
            for attempt, (run, paths) in self._reserved.items():
                if attempt == attempt_id and run != run_id:
                    self._reserved[attempt] = (run, paths) = (run_id, paths)
                sizes = [size for path, (size, _) in paths.items() if path != exclude]
                if attempt == attempt_id:
                    a_n, a_b = a_n + len(sizes), a_b + sum(sizes)
                if run == run_id:
                    r_n, r_b = r_n + len(sizes), r_b + sum(sizes)
        return Staged(attempt_records=a_n, attempt_bytes=a_b, run_records=r_n, run_bytes=r_b)

    def reserve(self, run_id: str, attempt_id: str, claim: Claim) -> None:
        """Count `claim`'s declared size against the quotas until it is committed or its staged file goes."""
        with self._lock:
            self._reserved.setdefault(attempt_id, (run_id, {}))[1][self.path(attempt_id, claim)] = (claim.size_bytes, time.time())

    def _unreserve(self, attempt_id: str, path: Path | None = None) -> None:
        with self._lock:
            if path is None:
                self._reserved.pop(attempt_id, None)
                return
            entry = self._reserved.get(attempt_id)
            if entry is not None:
                entry[1].pop(path, None)
                if not entry[1]:
                    del self._reserved[attempt_id]

    def path(self, attempt_id: str, claim: Claim) -> Path:
        key = hashlib.sha256(f"{claim.name}\x00{claim.sha256}\x00{claim.size_bytes}".encode()).hexdigest()
        return self.root / attempt_id / f"{key}.part"

    def offset(self, attempt_id: str, claim: Claim) -> int:
        try:
            return self.path(attempt_id, claim).stat().st_size
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise _storage("read the staging area", exc) from None

    def open(self, attempt_id: str, claim: Claim, offset: int):
        """Open the staged file for appending at `offset` (which must be its length): `(AppendFile, hasher or None)`.

        Staged bytes go to the disk with O_DIRECT where it can (`directio`): an
        upload of any size costs the coordinator a 4 MiB buffer, not page cache.

        The hasher covers the bytes from 0 when `offset` is 0; a resumed upload
        gets None and is rehashed at commit.
        """
        p = self.path(attempt_id, claim)
        have = self.offset(attempt_id, claim)
        if offset != have:
            raise PolicyError(
                f"artifact `{claim.name}`: the upload starts at offset {offset}, the coordinator holds {have} bytes of it\n"
                f"hint: call UploadOffset and resume from offset {have}"
            )
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            f = AppendFile(p, offset)
        except OSError as exc:
            raise _storage(f"stage artifact `{claim.name}`", exc) from None
        return f, (hashlib.sha256() if offset == 0 else None)

    @staticmethod
    def write(f, hasher, chunk: bytes) -> None:
        try:
            f.write(chunk)
        except OSError as exc:
            raise _storage("stage the upload", exc) from None
        if hasher is not None:
            hasher.update(chunk)

    @staticmethod
    def close(f: AppendFile, *, sync: bool) -> None:
        """Write out what `f` buffers (fsynced when `sync`) and close it; closed also on error."""
        try:
            f.close(sync=sync)
        except OSError as exc:
            raise _storage("stage the upload", exc) from None

    def digest(self, attempt_id: str, claim: Claim) -> str:
        try:
            return sha256_file(self.path(attempt_id, claim))
        except OSError as exc:
            raise _storage("read the staged upload", exc) from None

    def discard(self, attempt_id: str, claim: Claim) -> None:
        path = self.path(attempt_id, claim)
        path.unlink(missing_ok=True)
        self._unreserve(attempt_id, path)

    def drop_attempt(self, attempt_id: str) -> None:
        shutil.rmtree(self.root / attempt_id, ignore_errors=True)
        self._unreserve(attempt_id)

    def sweep(self, idle_seconds: float, live: set[str], busy: set[Path]) -> int:
        """Remove staged files of ended attempts, and files idle longer than `idle_seconds`; returns how many.

        A reservation older than `idle_seconds` whose upload is not in progress (`busy`) and that has no
        staged file (the upload was refused before a byte was written) goes too."""
        now = time.time()
        removed = 0
        try:
            attempts = list(self.root.iterdir())
        except OSError:
            return 0
        for d in attempts:
            if d.name not in live:
                shutil.rmtree(d, ignore_errors=True)
                self._unreserve(d.name)
                removed += 1
                continue
            for p in d.glob("*.part"):
                try:
                    if p not in busy and now - p.stat().st_mtime > idle_seconds:
                        p.unlink()
                        self._unreserve(d.name, p)
                        removed += 1
                except OSError:
                    pass
        with self._lock:
            old = [(attempt, path) for attempt, (_, paths) in self._reserved.items() for path, (_, since) in paths.items() if now - since > idle_seconds]
        gone = [(attempt, path) for attempt, path in old if path not in busy and not path.exists()]
        with self._lock:
            for attempt, path in gone:
                entry = self._reserved.get(attempt)
                # Reserved again meanwhile (a new upload of it was admitted): it stays.
                if entry is not None and path in entry[1] and now - entry[1][path][1] > idle_seconds:
                    del entry[1][path]
                    if not entry[1]:
                        del self._reserved[attempt]
        return removed


def _device(path: Path) -> int:
    p = Path(os.path.abspath(path))
    while not p.exists() and p.parent != p:
        p = p.parent
    return p.stat().st_dev
