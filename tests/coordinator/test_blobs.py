"""The blob store (`coordinator/artifacts/blobs.py`): one suite over both backends.

``local`` runs in a temporary directory; ``s3`` runs against moto's S3 server as a
real subprocess on 127.0.0.1 (`s3_server.py`), a fresh bucket per test. Tests that
kill the server start their own. The s3 cases skip only where moto is not
installed; `make install` installs it, so CI runs them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import resource
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import botocore.exceptions
import pytest
from s3_server import HAVE_MOTO, NO_MOTO, MotoServer, aws_test_env, free_port

from dflash_worker.coordinator.artifacts.blobs import (
    CHUNK_BYTES,
    S3_PART_BYTES,
    STALE_TEMP_SECONDS,
    TEMP_PREFIX,
    BlobStore,
    LocalBlobStore,
    S3BlobStore,
    blob_key,
    open_blob_store,
)
from dflash_worker.errors import ConfigError, InvalidRequestError, NotFoundError, StorageError

needs_moto = pytest.mark.skipif(not HAVE_MOTO, reason=NO_MOTO)
BACKENDS = ["local", pytest.param("s3", marks=needs_moto)]
# A failure must surface as an error, not a hang: generous next to the ~1 s it takes here.
OUTAGE_BOUND_S = 30.0


@pytest.fixture(autouse=True)
def aws_env(monkeypatch):
    for name, value in aws_test_env().items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def moto_server(tmp_path_factory):
    server = MotoServer(tmp_path_factory.mktemp("moto")).start()
    yield server
    server.kill()


@pytest.fixture
def own_moto_server(tmp_path):
    """A server only this test uses, so it may kill it."""
    server = MotoServer(tmp_path).start()
    yield server
    server.kill()


def s3_store(server: MotoServer, prefix: str = "blobs", bucket: str | None = None) -> S3BlobStore:
    store = open_blob_store(f"s3://{bucket or 'test-' + secrets.token_hex(6)}/{prefix}", s3_endpoint_url=server.url)
    assert isinstance(store, S3BlobStore)
    if bucket is None:
        store.client.create_bucket(Bucket=store.bucket)
    return store


@pytest.fixture(params=BACKENDS)
def store(request, tmp_path) -> BlobStore:
    if request.param == "local":
        return open_blob_store(str(tmp_path / "blobs"))
    return s3_store(request.getfixturevalue("moto_server"))


def blob_file(tmp_path: Path, data: bytes) -> tuple[Path, str, int]:
    sha = hashlib.sha256(data).hexdigest()
    path = tmp_path / f"staged-{sha[:12]}"
    path.write_bytes(data)
    return path, sha, len(data)


def read_all(store: BlobStore, sha: str, offset: int = 0, chunk: int = CHUNK_BYTES) -> bytes:
    chunks = list(store.read(sha, offset, chunk))
    assert all(0 < len(c) <= chunk for c in chunks)
    return b"".join(chunks)


def plant(store: BlobStore, key: str, data: bytes) -> None:
    """Write raw bytes under the store's root or prefix, bypassing `put` (damage, stray files)."""
    if isinstance(store, LocalBlobStore):
        path = store.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    else:
        assert isinstance(store, S3BlobStore)
        store.client.put_object(Bucket=store.bucket, Key=store.prefix + key, Body=data)


def leftovers(store: BlobStore) -> list[str]:
    """Everything under the store's root or prefix (temporary files included)."""
    if isinstance(store, LocalBlobStore):
        return sorted(str(p.relative_to(store.root)) for p in store.root.rglob("*") if p.is_file()) if store.root.exists() else []
    assert isinstance(store, S3BlobStore)
    resp = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.prefix)
    return sorted(o["Key"] for o in resp.get("Contents", ()))


def random_bytes(n: int) -> bytes:
    return secrets.token_bytes(n) if n < (1 << 20) else os.urandom(n)


# --- round trips ---


@pytest.mark.parametrize("n", [0, 1, CHUNK_BYTES + 7])
def test_round_trip(store, tmp_path, n):
    path, sha, size = blob_file(tmp_path, random_bytes(n))
    assert store.size(sha) is None
    store.put(path, sha, size)
    path.unlink()  # the store keeps its own copy
    assert store.size(sha) == n
    got = read_all(store, sha, chunk=64 << 10)
    assert hashlib.sha256(got).hexdigest() == sha
    assert list(store.list()) == [sha]


def test_large_file_goes_up_in_parts(store, tmp_path):
    n = 20 << 20  # past the 8 MiB multipart threshold: 3 parts
    path, sha, size = blob_file(tmp_path, random_bytes(n))
    store.put(path, sha, size)
    assert store.size(sha) == n
    digest = hashlib.sha256()
    for chunk in store.read(sha):
        assert len(chunk) <= CHUNK_BYTES
        digest.update(chunk)
    assert digest.hexdigest() == sha
    if isinstance(store, S3BlobStore):
        etag = store.client.head_object(Bucket=store.bucket, Key=store.prefix + blob_key(sha))["ETag"].strip('"')
        # A multipart object's ETag is md5-of-part-md5s followed by `-<number of parts>`.
        assert etag.endswith(f"-{-(-n // S3_PART_BYTES)}"), etag


def test_read_from_offsets(store, tmp_path):
    data = random_bytes(3 * 1000 + 1)
    path, sha, size = blob_file(tmp_path, data)
    store.put(path, sha, size)
    for offset in (0, 1, size // 2, size - 1, size):
        assert read_all(store, sha, offset, chunk=1000) == data[offset:], offset
    assert list(store.read(sha, size)) == []
    with pytest.raises(InvalidRequestError, match="past its end"):
        store.read(sha, size + 1)
    with pytest.raises(InvalidRequestError, match="negative"):
        store.read(sha, -1)
    with pytest.raises(InvalidRequestError, match="chunk"):
        store.read(sha, 0, 0)


def test_put_is_idempotent(store, tmp_path):
    path, sha, size = blob_file(tmp_path, random_bytes(5000))
    store.put(path, sha, size)
    path.unlink()
    store.put(path, sha, size)  # the blob exists: the (now missing) source is not even opened
    assert hashlib.sha256(read_all(store, sha)).hexdigest() == sha
    assert list(store.list()) == [sha]


def test_damaged_blob_is_replaced(store, tmp_path):
    data = random_bytes(5000)
    path, sha, size = blob_file(tmp_path, data)
    plant(store, blob_key(sha), data[:100])  # same name, wrong length: cannot be this content
    store.put(path, sha, size)
    assert read_all(store, sha) == data


def test_concurrent_puts_and_reads(store, tmp_path):
    blobs = [blob_file(tmp_path, random_bytes(200_000 + i)) for i in range(6)]
    shared = blobs[0]

    def work(i: int) -> bool:
        path, sha, size = blobs[i % len(blobs)]
        store.put(*shared)  # every thread races to store the same blob
        store.put(path, sha, size)
        return hashlib.sha256(read_all(store, sha)).hexdigest() == sha

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(16)))
    assert sorted(store.list()) == sorted(sha for _, sha, _ in blobs)
    assert all(name.split("/")[-1] in {sha for _, sha, _ in blobs} for name in leftovers(store))


# --- delete and list ---


def test_delete(store, tmp_path):
    path, sha, size = blob_file(tmp_path, random_bytes(100))
    keep_path, keep, keep_size = blob_file(tmp_path, random_bytes(101))
    store.put(path, sha, size)
    store.put(keep_path, keep, keep_size)
    store.delete(sha)
    assert store.size(sha) is None
    with pytest.raises(NotFoundError, match=sha):
        store.read(sha)
    store.delete(sha)  # absent is fine
    assert list(store.list()) == [keep]
    assert store.size(keep) == keep_size


def test_list_reports_blobs_only(store, tmp_path):
    shas = set()
    for i in range(5):
        path, sha, size = blob_file(tmp_path, random_bytes(10 + i))
        store.put(path, sha, size)
        shas.add(sha)
    other = hashlib.sha256(b"misplaced").hexdigest()
    wrong_fanout = "00" if other[:2] != "00" else "01"
    for stray in (
        f"sha256/{wrong_fanout}/{other}",  # a digest under the wrong fan-out is not a blob
        f"sha256/{other[:2]}/{other.upper()}",
        f"sha256/{other[:2]}/{TEMP_PREFIX}{other}-0123abcd",  # a put in progress
        "sha256/zz/readme",
        "notes.txt",
    ):
        plant(store, stray, b"x")
    assert set(store.list()) == shas
    assert len(list(store.list())) == len(shas)


def test_empty_store_lists_nothing(store):
    assert list(store.list()) == []
    store.check()


@needs_moto
def test_s3_prefixes_keep_stores_apart(moto_server, tmp_path):
    a = s3_store(moto_server, prefix="run-a")
    b = s3_store(moto_server, prefix="run-b/", bucket=a.bucket)
    root = s3_store(moto_server, prefix="", bucket=a.bucket)
    path, sha, size = blob_file(tmp_path, b"only in a")
    a.put(path, sha, size)
    assert b.size(sha) is None and list(b.list()) == []
    assert root.size(sha) is None and list(root.list()) == []
    assert a.client.head_object(Bucket=a.bucket, Key=f"run-a/sha256/{sha[:2]}/{sha}")["ContentLength"] == size
    assert b.describe == f"s3://{a.bucket}/run-b/ at {moto_server.url}"


# --- refused input ---

BAD_SHAS = [
    "../../etc/passwd",
    "../" + "0" * 61,
    "0" * 62 + "/.",
    "A" * 64,
    "ab" * 31 + "AB",
    "a" * 63,
    "a" * 65,
    "",
    "a" * 64 + "\n",
    "g" * 64,
    None,
]


@pytest.fixture(params=BACKENDS)
def broken_store(request, tmp_path) -> BlobStore:
    """A store where any I/O fails: a local root that is a file, an S3 endpoint where nothing listens."""
    if request.param == "local":
        root = tmp_path / "not-a-dir"
        root.write_bytes(b"")
        return open_blob_store(str(root))
    return open_blob_store("s3://bucket-x/p", s3_endpoint_url=f"http://127.0.0.1:{free_port()}")


@pytest.mark.parametrize("bad", BAD_SHAS, ids=repr)
def test_bad_sha256_is_refused_before_any_io(broken_store, tmp_path, bad):
    path = tmp_path / "source"
    path.write_bytes(b"x")
    calls = {
        "put": lambda: broken_store.put(path, bad, 1),
        "size": lambda: broken_store.size(bad),
        "read": lambda: broken_store.read(bad),
        "delete": lambda: broken_store.delete(bad),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidRequestError, match="is not a sha256"):
            call()
        assert path.exists(), name
    # The same store with a valid id does reach its (broken) backend.
    with pytest.raises(StorageError):
        broken_store.size("0" * 64)


def test_unusable_store_fails_fast(broken_store, tmp_path):
    path, sha, size = blob_file(tmp_path, b"data")
    for call in (
        broken_store.check,
        lambda: broken_store.put(path, sha, size),
        lambda: broken_store.size(sha),
        lambda: broken_store.read(sha),
        lambda: list(broken_store.list()),
        lambda: broken_store.delete(sha),
    ):
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="blob store"):
            call()
        assert time.monotonic() - t0 < OUTAGE_BOUND_S


# --- failures leave no blob ---


@pytest.mark.parametrize("declared", [-1, +1], ids=["source-grew", "source-truncated"])
def test_source_of_another_size_leaves_no_blob(store, tmp_path, declared):
    path, sha, size = blob_file(tmp_path, random_bytes(CHUNK_BYTES + 10))
    with pytest.raises(StorageError, match="not the declared"):
        store.put(path, sha, size + declared)
    assert store.size(sha) is None
    assert list(store.list()) == []
    assert leftovers(store) == []


def test_missing_source_leaves_no_blob(store, tmp_path):
    sha = hashlib.sha256(b"gone").hexdigest()
    with pytest.raises(StorageError, match=sha):
        store.put(tmp_path / "missing", sha, 4)
    (tmp_path / "a-dir").mkdir()
    with pytest.raises(StorageError, match=sha):
        store.put(tmp_path / "a-dir", sha, 4)
    assert store.size(sha) is None
    assert leftovers(store) == []


def _no_links(*args, **kwargs):
    raise OSError(errno.EXDEV, "Invalid cross-device link")


def test_local_put_links_on_one_file_system_and_copies_across(tmp_path, monkeypatch):
    store = LocalBlobStore(tmp_path / "blobs")
    path, sha, size = blob_file(tmp_path, random_bytes(300_000))
    store.put(path, sha, size)
    assert os.stat(store.root / blob_key(sha)).st_ino == os.stat(path).st_ino, "same file system: a hard link, no second write"
    path.unlink()  # the staging file goes; the blob stays
    assert hashlib.sha256(read_all(store, sha)).hexdigest() == sha
    monkeypatch.setattr(os, "link", _no_links)
    path2, sha2, size2 = blob_file(tmp_path, random_bytes(300_001))
    store.put(path2, sha2, size2)
    assert os.stat(store.root / blob_key(sha2)).st_ino != os.stat(path2).st_ino
    assert hashlib.sha256(read_all(store, sha2)).hexdigest() == sha2
    assert leftovers(store) == sorted([blob_key(sha), blob_key(sha2)])


def test_local_write_failing_midway_leaves_no_blob(tmp_path, monkeypatch):
    store = LocalBlobStore(tmp_path / "blobs")
    path, sha, size = blob_file(tmp_path, random_bytes(8 << 20))
    monkeypatch.setattr(os, "link", _no_links)  # another file system: the bytes are copied
    # A file-size limit makes the kernel refuse writes past 2 MiB (EFBIG) halfway through the
    # copy, as a full disk would with ENOSPC; SIGXFSZ would otherwise kill the process.
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, old_limit[1]))
    try:
        with pytest.raises(StorageError, match=f"cannot store blob `{sha}`"):
            store.put(path, sha, size)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert store.size(sha) is None
    assert leftovers(store) == []
    store.put(path, sha, size)  # and with room again it works
    assert store.size(sha) == size


def test_local_disk_full_names_the_fix(tmp_path, monkeypatch):
    store = LocalBlobStore(tmp_path / "blobs")
    path, sha, size = blob_file(tmp_path, b"abc")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StorageError, match="(?s)No space left.*hint: the disk is full"):
        store.put(path, sha, size)
    monkeypatch.undo()
    assert leftovers(store) == []


@needs_moto
def test_s3_upload_cut_midway_leaves_no_blob(moto_server, tmp_path):
    store = s3_store(moto_server)
    path, sha, size = blob_file(tmp_path, random_bytes(3 * S3_PART_BYTES))
    cut = threading.Event()

    def cut_part_two(request, **_):
        # The network fails from part 2 on; the server (and its state) stays up to be inspected.
        if "partNumber=2" in request.url:
            cut.set()
            raise botocore.exceptions.EndpointConnectionError(endpoint_url=request.url)

    store.client.meta.events.register("before-send.s3.UploadPart", cut_part_two)
    with pytest.raises(StorageError, match=f"cannot store blob `{sha}`"):
        store.put(path, sha, size)
    assert cut.is_set()
    assert store.size(sha) is None and list(store.list()) == []
    # boto3 aborted the multipart upload: nothing is left in the bucket, not even invisible parts.
    assert store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []
    assert leftovers(store) == []


# --- outages ---


def test_local_root_replaced_by_a_file(tmp_path):
    root = tmp_path / "blobs"
    store = LocalBlobStore(root)
    path, sha, size = blob_file(tmp_path, b"before")
    store.put(path, sha, size)
    moved = tmp_path / "moved"
    root.rename(moved)
    root.write_bytes(b"")
    with pytest.raises(StorageError, match=f"{root}.*probe"):
        store.check()
    for call in (lambda: store.put(path, sha, size), lambda: store.size(sha), lambda: store.read(sha), lambda: list(store.list())):
        with pytest.raises(StorageError, match=str(root)):
            call()
    root.unlink()
    moved.rename(root)
    store.check()
    assert read_all(store, sha) == b"before"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_local_read_only_root(tmp_path):
    root = tmp_path / "blobs"
    store = LocalBlobStore(root)
    store.check()
    root.chmod(0o555)
    try:
        with pytest.raises(StorageError, match="probe"):
            store.check()
    finally:
        root.chmod(0o755)


def test_local_check_creates_root_and_sweeps_stale_temporaries(tmp_path):
    store = LocalBlobStore(tmp_path / "new" / "blobs")
    store.check()
    assert store.root.is_dir() and leftovers(store) == []
    fanout = store.root / "sha256" / "ab"
    fanout.mkdir(parents=True)
    stale, fresh = fanout / f"{TEMP_PREFIX}{'ab' * 32}-00000000", fanout / f"{TEMP_PREFIX}{'ab' * 32}-11111111"
    stale.write_bytes(b"crashed put")
    fresh.write_bytes(b"put in progress")
    old = time.time() - STALE_TEMP_SECONDS - 60
    os.utime(stale, (old, old))
    store.check()
    assert not stale.exists() and fresh.exists()


@needs_moto
def test_s3_server_killed_then_restarted(own_moto_server, tmp_path):
    store = s3_store(own_moto_server)
    path, sha, size = blob_file(tmp_path, random_bytes(1000))
    store.put(path, sha, size)
    own_moto_server.kill()
    for call in (
        store.check,
        lambda: store.put(path, hashlib.sha256(b"other").hexdigest(), size),
        lambda: store.size(sha),
        lambda: store.read(sha),
        lambda: list(store.list()),
        lambda: store.delete(sha),
    ):
        t0 = time.monotonic()
        with pytest.raises(StorageError, match=f"(?s){own_moto_server.url}.*hint: is the S3 endpoint up"):
            call()
        assert time.monotonic() - t0 < OUTAGE_BOUND_S
    own_moto_server.start()  # same port; moto's state is in memory, so the bucket is gone
    with pytest.raises(StorageError, match=f"bucket `{store.bucket}` does not exist"):
        store.check()
    store.client.create_bucket(Bucket=store.bucket)
    store.check()  # the same store (and client) works again without being rebuilt
    store.put(path, sha, size)
    assert read_all(store, sha) == path.read_bytes()


@needs_moto
def test_s3_server_killed_during_multipart_upload(own_moto_server, tmp_path):
    store = s3_store(own_moto_server)
    path, sha, size = blob_file(tmp_path, random_bytes(3 * S3_PART_BYTES))

    def kill_at_part_two(request, **_):
        if "partNumber=2" in request.url:
            own_moto_server.kill()

    store.client.meta.events.register("before-send.s3.UploadPart", kill_at_part_two)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=f"cannot store blob `{sha}`"):
        store.put(path, sha, size)
    assert time.monotonic() - t0 < OUTAGE_BOUND_S
    assert own_moto_server.proc is None, "the server was not killed mid-upload"
    store.client.meta.events.unregister("before-send.s3.UploadPart", kill_at_part_two)
    # A real S3 would keep the incomplete upload invisible (and abort it by lifecycle rule);
    # the restarted moto has lost all state, so only "the store works again" is checked here.
    own_moto_server.start()
    store.client.create_bucket(Bucket=store.bucket)
    assert store.size(sha) is None and list(store.list()) == []
    store.put(path, sha, size)
    assert store.size(sha) == size


@needs_moto
def test_s3_missing_bucket(moto_server):
    store = s3_store(moto_server, bucket="no-such-bucket")
    with pytest.raises(StorageError, match="(?s)bucket `no-such-bucket` does not exist.*hint: create it"):
        store.check()
    assert store.size("0" * 64) is None  # HEAD cannot tell a missing bucket from a missing key; check can


@needs_moto
def test_s3_without_credentials(moto_server, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = s3_store(moto_server, bucket="any-bucket")
    with pytest.raises(StorageError, match="(?s)credentials.*hint: set AWS_ACCESS_KEY_ID"):
        store.check()


@needs_moto
def test_s3_endpoint_from_the_environment(moto_server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.url)
    store = open_blob_store("s3://env-bucket")
    assert isinstance(store, S3BlobStore)
    assert store.describe == f"s3://env-bucket/ at {moto_server.url}"
    store.client.create_bucket(Bucket="env-bucket")
    store.check()


# --- URLs ---


def test_open_blob_store_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url, root in (
        (str(tmp_path / "a"), tmp_path / "a"),
        ("rel/dir", tmp_path / "rel/dir"),
        (f"file:{tmp_path}/b", tmp_path / "b"),
        (f"file://{tmp_path}/c", tmp_path / "c"),
        ("file:rel", tmp_path / "rel"),
    ):
        store = open_blob_store(url)
        assert isinstance(store, LocalBlobStore) and store.root == root, url
        assert store.describe == f"local {root}"
    store = open_blob_store("s3://bucket-1/a/b/", s3_endpoint_url="http://127.0.0.1:9")
    assert isinstance(store, S3BlobStore)
    assert (store.bucket, store.prefix, store.describe) == ("bucket-1", "a/b/", "s3://bucket-1/a/b/ at http://127.0.0.1:9")
    assert open_blob_store("s3://bucket-1", s3_endpoint_url="http://127.0.0.1:9").prefix == ""
    for bad in ("", "s3://", "s3:///prefix", "s3://b?versionId=1", "s3://user@b/p", "http://host/x", "file://otherhost/x"):
        with pytest.raises(ConfigError):
            open_blob_store(bad)
    with pytest.raises(ConfigError, match="S3 endpoint"):
        open_blob_store(str(tmp_path), s3_endpoint_url="http://127.0.0.1:9")
