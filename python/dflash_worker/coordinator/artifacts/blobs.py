"""The coordinator's blob store: artifact bytes kept once per sha256, on a local disk or in S3.

The coordinator stages an upload on its own disk and checks its sha256
(`staging.py`); only then does it hand the verified file to a `BlobStore`,
which keeps it as blob ``sha256``. Records (attempt, name -> sha256) live in
SQLite and point at blobs; a blob no record points at is garbage that the
coordinator's GC removes with `BlobStore.delete`. The store is content
addressed, so two artifacts with the same bytes share one blob, and a blob is
never rewritten: `put` of a blob that exists is a no-op.

Backends (`open_blob_store` picks one from a URL):

- **local**, ``PATH`` or ``file:PATH`` / ``file:///PATH``: a directory on the
  coordinator (`LocalBlobStore`). The directory is created on first use.
- **s3**, ``s3://BUCKET[/PREFIX]``: any S3-compatible endpoint through boto3
  (`S3BlobStore`): AWS, MinIO, Ceph RGW, Garage, ... The bucket must exist.

Layout, the same in both: blob ``ab12...`` (64 lowercase hex digits) is the
file or key ``sha256/ab/ab12...`` under the directory or the prefix. The first
two hex digits are a fan-out level so no directory (and no S3 listing page)
holds every blob; the full digest stays in the name so a listing alone says
which blobs exist. Every method checks its ``sha256`` argument (64 lowercase
hex digits, `InvalidRequestError` otherwise) before any I/O, because it
becomes a path or a key: ``../..`` never reaches the file system.

Atomicity: a reader never sees a partial blob.

- local: `put` hard-links the source (or, on another file system, copies
  it) to a temporary name in the blob's own directory
  (``.tmp-<sha256>-<random>``, which `list` skips), fsyncs it, renames it over
  the final name with ``os.replace`` (atomic within one file system) and
  fsyncs the directory, so after `put` returns the blob survives a power loss.
  A copy reads the source in 1 MiB chunks: memory stays bounded whatever the
  size. The link shares the source's inode, so the caller must not write to
  the source after `put` (it may delete it: the coordinator's staging file is
  only ever deleted); it saves a second write of every byte, which a 1 GiB
  upload measured at about a second and a burst of dirty pages. A source whose length
  is not the declared size (it changed after it was verified) is refused and
  leaves nothing behind. A crash mid-copy leaves only a temporary file, which
  `check` removes once it is older than `STALE_TEMP_SECONDS`.
- s3: `put` is boto3's ``upload_file`` with a `TransferConfig`: files past 8
  MiB go up as a multipart upload of 8 MiB parts (at most `S3_CONCURRENCY` in
  flight, so memory stays at a few parts), and S3 makes the object visible
  only when the upload completes. A failed upload is aborted by boto3; one cut
  short by a coordinator crash stays as an incomplete multipart upload that is
  invisible but billed: give the bucket an ``AbortIncompleteMultipartUpload``
  lifecycle rule. After the upload the object's length is checked against the
  declared size (a source that changed mid-upload); a wrong object is deleted
  and `put` fails.

Reads are ranged and streamed (`read` yields chunks from an offset; s3 uses
``GetObject`` with a ``Range`` header), so a download resumes where it stopped
and a multi-GB checkpoint never sits in memory.

Errors: every backend failure (``OSError``, ENOSPC included; botocore's
``ClientError``, ``EndpointConnectionError``, timeouts, missing credentials) is
raised as `StorageError` (gRPC UNAVAILABLE: the client retries later), naming
the store and the blob; a blob that does not exist is `NotFoundError` from
`read` and ``None`` from `size`. On S3 a ``HEAD`` cannot tell a missing bucket
from a missing key, so `size` says ``None`` for both; `check` (run at startup)
tells them apart.

Credentials and endpoint (s3) come from boto3's usual chain: the
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``)
environment variables, ``AWS_PROFILE`` and ``~/.aws/config`` /
``~/.aws/credentials``, ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``),
``AWS_DEFAULT_REGION``. ``s3_endpoint_url`` (the coordinator's flag) overrides
the endpoint. For an endpoint outside AWS, requests use path-style addressing
(``http://host/bucket/key``), which every S3-compatible server accepts;
virtual-hosted style would need a DNS name per bucket. Timeouts and retries
are bounded (`S3_CONNECT_TIMEOUT`, `S3_READ_TIMEOUT`, `S3_MAX_ATTEMPTS`) so an
unreachable endpoint fails in seconds, not minutes. An older S3-compatible
server that rejects boto3's default CRC32 checksums can be served by setting
``AWS_REQUEST_CHECKSUM_CALCULATION=when_required`` (botocore reads it).

Threads: every method blocks (the coordinator calls them through
``asyncio.to_thread``) and may be called from several threads at once. The
local store keeps no state; the S3 store makes its boto3 session once, in the
constructor (sessions are not thread-safe), and shares one client (clients
are).

Why the tests use moto: ``tests/coordinator/test_blobs.py`` runs one suite
over both backends, the s3 half against moto's standalone server started as a
real subprocess on 127.0.0.1. It speaks the S3 wire protocol (multipart
uploads, ranged GETs, paginated listings), so the code under test is the
production boto3 path, and a test can SIGKILL the process to see what an
outage does, then start it again on the same port.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import urlsplit

import boto3
import botocore.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from ...errors import ConfigError, InvalidRequestError, NotFoundError, StorageError
from .directio import BUFFER_BYTES, ChunkReader

# A blob id: 64 lowercase hex digits (use with fullmatch). Shared with the artifact checks.
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
LAYOUT_DIR = "sha256"
CHUNK_BYTES = 1 << 20
TEMP_PREFIX = ".tmp-"
# A temporary file older than this is a crashed put's leftover (a live put writes to it continuously).
STALE_TEMP_SECONDS = 3600
S3_PART_BYTES = 8 << 20
S3_CONCURRENCY = 4
S3_CONNECT_TIMEOUT = 5.0
# Per socket operation, not per request: a slow but moving transfer is never cut off.
S3_READ_TIMEOUT = 60.0
# Attempts per request, the first included (botocore's "standard" mode: exponential backoff with jitter).
S3_MAX_ATTEMPTS = 3

T = TypeVar("T")


class BlobStore(Protocol):
    """Content-addressed blob storage; every method blocks and is safe to call from several threads."""

    describe: str
    """Where the blobs are, for messages: ``local /path`` or ``s3://bucket/prefix at https://...``."""

    def put(self, path: Path, sha256: str, size: int) -> None:
        """Store the (already verified) file `path` as blob `sha256`; an existing blob is kept.

        Atomic (no reader sees a partial blob) and bounded in memory; the caller may
        delete `path` afterwards. A file whose length is not `size` is refused.
        """
        ...

    def size(self, sha256: str) -> int | None:
        """The blob's length in bytes, or ``None`` when it is absent."""
        ...

    def read(self, sha256: str, offset: int = 0, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The blob's bytes from `offset` on, in chunks of at most `chunk` bytes.

        Checks run on the call, not on the first ``next``: `NotFoundError` when the
        blob is absent, `InvalidRequestError` when `offset` is past its end.
        """
        ...

    def delete(self, sha256: str) -> None:
        """Remove the blob; an absent blob is fine."""
        ...

    def list(self) -> Iterator[str]:
        """Every stored blob's sha256, in no particular order."""
        ...

    def check(self) -> None:
        """Raise `StorageError` when the store is unusable (directory not writable, bucket missing or unreachable)."""
        ...


def check_sha256(sha256: object) -> str:
    """`sha256` itself when it is 64 lowercase hex digits; `InvalidRequestError` otherwise."""
    if not isinstance(sha256, str) or not SHA256_HEX.fullmatch(sha256):
        raise InvalidRequestError(f"blob id `{sha256!r:.80}` is not a sha256\nhint: 64 lowercase hex digits")
    return sha256


def blob_key(sha256: str) -> str:
    """The blob's path below the store's root or prefix: ``sha256/ab/ab12...``."""
    check_sha256(sha256)
    return f"{LAYOUT_DIR}/{sha256[:2]}/{sha256}"


def _check_read_args(offset: int, chunk: int) -> None:
    if offset < 0:
        raise InvalidRequestError(f"read offset `{offset}` is negative")
    if not 1 <= chunk <= BUFFER_BYTES // 2:
        raise InvalidRequestError(f"read chunk `{chunk}` must be between 1 and {BUFFER_BYTES // 2} bytes")


def _past_end(describe: str, sha256: str, offset: int, size: int) -> InvalidRequestError:
    return InvalidRequestError(f"blob `{sha256}` in {describe} is {size} bytes; offset `{offset}` is past its end")


def _short_source(describe: str, sha256: str, path: Path, got: int, size: int) -> StorageError:
    return StorageError(
        f"blob store {describe}: cannot store blob `{sha256}`: source `{path}` holds {got} bytes, not the declared {size}\n"
        "hint: the staged file changed after it was verified; upload it again"
    )


def open_blob_store(url: str, *, s3_endpoint_url: str | None = None) -> BlobStore:
    """The store `url` names: ``s3://BUCKET[/PREFIX]``, or a local directory (``PATH``, ``file:PATH``, ``file:///PATH``).

    `s3_endpoint_url` overrides the S3 endpoint (boto3's own settings otherwise);
    it is refused for a local store. Nothing is contacted here: call `check`.
    """
    if not url:
        raise ConfigError("blob store URL is empty\nhint: a directory, or `s3://BUCKET[/PREFIX]`")
    scheme = url.split(":", 1)[0].lower() if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", url) else ""
    if scheme == "s3":
        parts = urlsplit(url)
        if not parts.netloc or parts.query or parts.fragment or "@" in parts.netloc:
            raise ConfigError(f"blob store URL `{url}` is not `s3://BUCKET[/PREFIX]`")
        return S3BlobStore(parts.netloc, parts.path, endpoint_url=s3_endpoint_url)
    if s3_endpoint_url is not None:
        raise ConfigError(f"an S3 endpoint URL (`{s3_endpoint_url}`) was given for the local blob store `{url}`")
    if scheme == "file":
        rest = url[len("file:") :]
        if rest.startswith("//"):
            parts = urlsplit(url)
            if parts.netloc not in ("", "localhost"):
                raise ConfigError(f"blob store URL `{url}` names a host; a local store is a directory on this machine")
            rest = parts.path
        return LocalBlobStore(Path(rest))
    if scheme and len(scheme) > 1:  # `C:` is a Windows drive, not a scheme
        raise ConfigError(f"blob store URL `{url}` has an unknown scheme `{scheme}`\nhint: a directory, or `s3://BUCKET[/PREFIX]`")
    return LocalBlobStore(Path(url))


class LocalBlobStore:
    """Blobs as files ``<root>/sha256/ab/ab12...`` in a directory on the coordinator."""

    def __init__(self, root: Path) -> None:
        if not str(root):
            raise ConfigError("local blob store directory is empty")
        self.root = Path(os.path.abspath(root))
        self.describe = f"local {self.root}"

    def _path(self, sha256: str) -> Path:
        return self.root / blob_key(sha256)

    def _error(self, what: str, sha256: str | None, exc: OSError) -> StorageError:
        blob = f" blob `{sha256}`" if sha256 else ""
        hint = "\nhint: the disk is full; free space or move the blob store" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return StorageError(f"blob store {self.describe}: cannot {what}{blob}: {exc}{hint}")

    def put(self, path: Path, sha256: str, size: int) -> None:
        dest = self._path(sha256)
        try:
            if os.stat(dest).st_size == size:
                return
            # The same name with another length cannot be this content: a damaged blob, replaced below.
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._error("store", sha256, exc) from exc
        tmp = dest.parent / f"{TEMP_PREFIX}{sha256}-{secrets.token_hex(4)}"
        try:
            created = self._make_dirs(dest.parent)
            try:
                self._copy(path, tmp, sha256, size)
                os.replace(tmp, dest)
                # rename() of two links to one inode (a racing put linked the same staged
                # file) does nothing and succeeds: the temporary name would stay behind.
                tmp.unlink(missing_ok=True)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            # The rename lives in the fan-out directory; each directory made for it lives in its parent.
            for d in {dest.parent, *(c.parent for c in created)}:
                _fsync_dir(d)
        except OSError as exc:
            raise self._error("store", sha256, exc) from exc

    def _make_dirs(self, fanout: Path) -> list[Path]:
        """Create the fan-out directory (and above) when missing; the directories made, for fsync."""
        created = [d for d in (self.root, fanout.parent, fanout) if not d.is_dir()]
        fanout.mkdir(parents=True, exist_ok=True)
        return created

    def _copy(self, src: Path, tmp: Path, sha256: str, size: int) -> None:
        # Same file system (the coordinator's staging directory sits next to this store by
        # default): a hard link costs no second write of the bytes. The caller never writes
        # to `src` after `put` (it only deletes it), so sharing the inode is safe.
        try:
            os.link(src, tmp)
        except FileNotFoundError:
            raise
        except OSError:
            pass  # another file system, or links not allowed: copy below
        else:
            try:
                got = os.stat(tmp).st_size
                if got != size:
                    raise _short_source(self.describe, sha256, src, got, size)
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            return
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        copied = 0
        with open(src, "rb") as fin, open(tmp, "xb") as fout:
            while n := fin.readinto(buf):
                fout.write(view[:n])
                copied += n
                if copied > size:
                    break
            if copied != size:
                raise _short_source(self.describe, sha256, src, copied, size)
            fout.flush()
            os.fsync(fout.fileno())

    def size(self, sha256: str) -> int | None:
        path = self._path(sha256)
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error("stat", sha256, exc) from exc

    def read(self, sha256: str, offset: int = 0, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
        path = self._path(sha256)
        _check_read_args(offset, chunk)
        try:
            # O_DIRECT where the file system allows it (`directio`): a download of any size
            # costs a 4 MiB buffer, and reading a blob does not fill the page cache.
            reader = ChunkReader(path, offset, chunk)
        except FileNotFoundError:
            raise NotFoundError(f"blob `{sha256}` is not in {self.describe}") from None
        except OSError as exc:
            raise self._error("read", sha256, exc) from exc
        if offset > reader.size:
            reader.close()
            raise _past_end(self.describe, sha256, offset, reader.size)
        return self._chunks(reader, sha256)

    def _chunks(self, reader: ChunkReader, sha256: str) -> Iterator[bytes]:
        try:
            yield from reader
        except OSError as exc:
            raise self._error("read", sha256, exc) from exc
        finally:
            reader.close()

    def delete(self, sha256: str) -> None:
        path = self._path(sha256)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise self._error("delete", sha256, exc) from exc

    def list(self) -> Iterator[str]:
        top = self.root / LAYOUT_DIR
        try:
            fanouts = sorted(e.name for e in os.scandir(top) if e.is_dir(follow_symlinks=False) and len(e.name) == 2)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._error("list", None, exc) from exc
        for fanout in fanouts:
            try:
                names = [e.name for e in os.scandir(top / fanout) if e.is_file(follow_symlinks=False)]
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise self._error("list", None, exc) from exc
            # Temporary files and anything else that is not a blob in its right place are not blobs.
            yield from (n for n in names if SHA256_HEX.fullmatch(n) and n[:2] == fanout)

    def check(self) -> None:
        """Create the directory when missing, prove it writable with a probe file, and sweep stale temporary files."""
        probe = self.root / f"{TEMP_PREFIX}check-{secrets.token_hex(4)}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(probe, "xb") as f:
                f.write(b"probe")
                f.flush()
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as exc:
            try:
                probe.unlink(missing_ok=True)
            except OSError:
                pass  # the root is not a directory: there is no probe to remove
            raise self._error("write a probe file", None, exc) from exc
        self._sweep_temps()

    def _sweep_temps(self) -> None:
        top = self.root / LAYOUT_DIR
        if not top.is_dir():
            return
        cutoff = time.time() - STALE_TEMP_SECONDS
        try:
            for tmp in top.glob(f"*/{TEMP_PREFIX}*"):
                if tmp.lstat().st_mtime < cutoff:
                    tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise self._error("sweep temporary files", None, exc) from exc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# botocore error codes that mean "no such key" (HEAD answers with a bare status code).
_S3_MISSING = {"404", "NoSuchKey", "NotFound"}
_S3_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
_S3_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError)


def _s3_code(exc: BaseException) -> str:
    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


def _is_aws(endpoint_url: str) -> bool:
    host = urlsplit(endpoint_url).hostname or ""
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


class S3BlobStore:
    """Blobs as objects ``<prefix>sha256/ab/ab12...`` in an S3(-compatible) bucket."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        connect_timeout: float = S3_CONNECT_TIMEOUT,
        read_timeout: float = S3_READ_TIMEOUT,
        max_attempts: int = S3_MAX_ATTEMPTS,
    ) -> None:
        if not bucket or "/" in bucket or any(c.isspace() for c in bucket):
            raise ConfigError(f"S3 bucket name `{bucket}` is invalid")
        self.bucket = bucket
        prefix = prefix.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            # One connection per in-flight part, for a few concurrent uploads and downloads.
            max_pool_connections=4 * S3_CONCURRENCY,
        )
        # A session is not thread-safe; make it here, once. The client it makes is.
        session = boto3.session.Session()
        try:
            client = session.client("s3", endpoint_url=endpoint_url, config=config)
            if not _is_aws(client.meta.endpoint_url):
                client = session.client("s3", endpoint_url=endpoint_url, config=config.merge(Config(s3={"addressing_style": "path"})))
        except (botocore.exceptions.BotoCoreError, ValueError) as exc:
            raise ConfigError(f"cannot set up the S3 client for `s3://{bucket}/{self.prefix}`: {exc}") from exc
        self.client = client
        self.endpoint_url = client.meta.endpoint_url
        self.describe = f"s3://{bucket}/{self.prefix} at {self.endpoint_url}"
        self._transfer = TransferConfig(
            multipart_threshold=S3_PART_BYTES,
            multipart_chunksize=S3_PART_BYTES,
            max_concurrency=S3_CONCURRENCY,
            use_threads=True,
        )

    def _key(self, sha256: str) -> str:
        return self.prefix + blob_key(sha256)

    def _error(self, what: str, sha256: str | None, exc: BaseException) -> StorageError:
        blob = f" blob `{sha256}`" if sha256 else ""
        code = _s3_code(exc)
        if isinstance(exc, botocore.exceptions.NoCredentialsError):
            hint = "\nhint: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile in ~/.aws/config (AWS_PROFILE)"
        elif code == "NoSuchBucket":
            hint = f"\nhint: create the bucket `{self.bucket}`"
        elif code in _S3_DENIED:
            hint = "\nhint: check the S3 credentials and the bucket's policy"
        elif isinstance(exc, botocore.exceptions.EndpointConnectionError | botocore.exceptions.ConnectTimeoutError):
            hint = "\nhint: is the S3 endpoint up and reachable? (AWS_ENDPOINT_URL or the coordinator's S3 endpoint flag)"
        else:
            hint = ""
        return StorageError(f"blob store {self.describe}: cannot {what}{blob}: {exc}{hint}")

    def _call(self, what: str, sha256: str | None, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except _S3_ERRORS as exc:
            raise self._error(what, sha256, exc) from exc

    def _head(self, sha256: str) -> int | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(sha256))
        except botocore.exceptions.ClientError as exc:
            if _s3_code(exc) in _S3_MISSING:
                return None
            raise
        return int(head["ContentLength"])

    def put(self, path: Path, sha256: str, size: int) -> None:
        key = self._key(sha256)
        if self._call("stat", sha256, lambda: self._head(sha256)) == size:
            return
        try:
            got = os.stat(path).st_size
        except OSError as exc:
            raise self._error("store", sha256, exc) from exc
        if got != size:
            raise _short_source(self.describe, sha256, path, got, size)
        self._call("store", sha256, lambda: self.client.upload_file(str(path), self.bucket, key, Config=self._transfer))
        stored = self._call("stat", sha256, lambda: self._head(sha256))
        if stored != size:
            # The source changed while it was read: the object is not this blob.
            self._call("delete", sha256, lambda: self.client.delete_object(Bucket=self.bucket, Key=key))
            raise _short_source(self.describe, sha256, path, -1 if stored is None else stored, size)

    def size(self, sha256: str) -> int | None:
        self._key(sha256)
        return self._call("stat", sha256, lambda: self._head(sha256))

    def read(self, sha256: str, offset: int = 0, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
        key = self._key(sha256)
        _check_read_args(offset, chunk)
        size = self._call("read", sha256, lambda: self._head(sha256))
        if size is None:
            raise NotFoundError(f"blob `{sha256}` is not in {self.describe}")
        if offset > size:
            raise _past_end(self.describe, sha256, offset, size)
        if offset == size:
            return iter(())
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-")
        except botocore.exceptions.ClientError as exc:
            if _s3_code(exc) in _S3_MISSING:  # deleted since the HEAD
                raise NotFoundError(f"blob `{sha256}` is not in {self.describe}") from None
            raise self._error("read", sha256, exc) from exc
        except _S3_ERRORS as exc:
            raise self._error("read", sha256, exc) from exc
        return self._chunks(resp["Body"], sha256, chunk, size - offset)

    def _chunks(self, body, sha256: str, chunk: int, expected: int) -> Iterator[bytes]:
        got = 0
        try:
            while data := body.read(chunk):
                got += len(data)
                yield data
        except _S3_ERRORS as exc:
            raise self._error("read", sha256, exc) from exc
        finally:
            body.close()
        if got != expected:
            raise StorageError(f"blob store {self.describe}: blob `{sha256}` ended after {got} of {expected} bytes\nhint: retry the read")

    def delete(self, sha256: str) -> None:
        key = self._key(sha256)
        self._call("delete", sha256, lambda: self.client.delete_object(Bucket=self.bucket, Key=key))

    def list(self) -> Iterator[str]:
        top = f"{self.prefix}{LAYOUT_DIR}/"
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=top)
        try:
            for page in pages:
                for obj in page.get("Contents", ()):
                    rest = obj["Key"][len(top) :]
                    fanout, _, name = rest.partition("/")
                    # Anything else under the prefix (another tool's keys) is not a blob.
                    if SHA256_HEX.fullmatch(name) and fanout == name[:2]:
                        yield name
        except _S3_ERRORS as exc:
            raise self._error("list", None, exc) from exc

    def check(self) -> None:
        """The bucket exists and these credentials may use it (``HeadBucket``)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except botocore.exceptions.ClientError as exc:
            if _s3_code(exc) in _S3_MISSING | {"NoSuchBucket"}:
                raise StorageError(f"blob store {self.describe}: bucket `{self.bucket}` does not exist\nhint: create it") from exc
            raise self._error("use the bucket", None, exc) from exc
        except _S3_ERRORS as exc:
            raise self._error("reach the bucket", None, exc) from exc
