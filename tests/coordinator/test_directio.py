"""directio: O_DIRECT appends and reads give the same bytes as plain file I/O, at every alignment."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest

from dflash_worker.coordinator.artifacts import directio
from dflash_worker.coordinator.artifacts.directio import ALIGN, BUFFER_BYTES, AppendFile, ChunkReader

MiB = 1 << 20


def _data(n: int, seed: int = 0) -> bytes:
    out, i = bytearray(), seed
    while len(out) < n:
        out += hashlib.sha256(i.to_bytes(8, "little")).digest()
        i += 1
    return bytes(out[:n])


def _direct_works(path) -> bool:
    try:
        fd = os.open(path / "probe", os.O_WRONLY | os.O_CREAT | directio._O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return directio._O_DIRECT != 0


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(
    "size, pieces",
    [
        (0, [0]),
        (1, [1]),
        (ALIGN, [ALIGN]),
        (BUFFER_BYTES, [MiB] * 4),
        (BUFFER_BYTES + ALIGN + 7, [MiB, 3, MiB - 3, 2 * MiB, ALIGN + 7]),
        (3 * BUFFER_BYTES - 5, [BUFFER_BYTES + 11, BUFFER_BYTES, BUFFER_BYTES - 16]),
    ],
)
def test_append_file_holds_every_byte_written(tmp_path, direct, size, pieces):
    data = _data(size)
    f = AppendFile(tmp_path / "a.bin", 0, direct=direct)
    if direct:
        assert f.direct == _direct_works(tmp_path)
    at = 0
    for n in pieces:
        f.write(data[at : at + n])
        at += n
    f.close(sync=True)
    f.close(sync=True)  # idempotent
    assert (tmp_path / "a.bin").read_bytes() == data


@pytest.mark.parametrize("first", [0, ALIGN, 5, BUFFER_BYTES + 3])
def test_append_resumes_from_any_offset(tmp_path, first):
    """A resumed upload appends from the staged length; an unaligned one goes through the page cache."""
    data = _data(2 * BUFFER_BYTES + 100, seed=1)
    f = AppendFile(tmp_path / "a.bin", 0)
    f.write(data[:first])
    f.close(sync=False)
    assert (tmp_path / "a.bin").stat().st_size == first
    g = AppendFile(tmp_path / "a.bin", first)
    if first % ALIGN:
        assert not g.direct
    g.write(data[first:])
    g.close(sync=True)
    assert (tmp_path / "a.bin").read_bytes() == data


def test_append_write_error_closes_the_file_and_keeps_a_prefix(tmp_path, monkeypatch):
    data = _data(3 * BUFFER_BYTES, seed=2)
    f = AppendFile(tmp_path / "a.bin", 0)
    real = os.pwrite
    calls = []

    def pwrite(fd, buf, pos):
        calls.append(pos)
        if len(calls) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buf, pos)

    monkeypatch.setattr(directio.os, "pwrite", pwrite)
    with pytest.raises(OSError) as e:
        f.write(data)
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        f.close(sync=True)
    assert f.closed
    with pytest.raises(OSError):
        os.fstat(f.fd)  # the descriptor is closed, not leaked
    got = (tmp_path / "a.bin").read_bytes()
    assert data.startswith(got) and len(got) == BUFFER_BYTES


def test_short_direct_write_finishes_through_the_page_cache(tmp_path, monkeypatch):
    data = _data(BUFFER_BYTES + 10, seed=3)
    f = AppendFile(tmp_path / "a.bin", 0)
    real = os.pwrite
    state = {"short": True}

    def pwrite(fd, buf, pos):
        if state["short"]:
            state["short"] = False
            return real(fd, buf[: ALIGN * 3], pos)
        return real(fd, buf, pos)

    monkeypatch.setattr(directio.os, "pwrite", pwrite)
    f.write(data)
    f.close(sync=True)
    assert (tmp_path / "a.bin").read_bytes() == data


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("size", [0, 1, ALIGN, BUFFER_BYTES - 1, BUFFER_BYTES, 2 * BUFFER_BYTES + 12345])
@pytest.mark.parametrize("offset_of", [lambda n: 0, lambda n: min(n, 1), lambda n: n // 2, lambda n: n])
@pytest.mark.parametrize("chunk", [MiB, 1000])
def test_chunk_reader_gives_the_bytes_from_offset_in_chunks(tmp_path, direct, size, offset_of, chunk):
    data = _data(size, seed=4)
    (tmp_path / "b.bin").write_bytes(data)
    offset = offset_of(size)
    r = ChunkReader(tmp_path / "b.bin", offset, chunk, direct=direct)
    assert r.size == size
    pieces = list(r)
    assert b"".join(pieces) == data[offset:]
    assert all(len(p) == chunk for p in pieces[:-1]) and all(0 < len(p) <= chunk for p in pieces)
    assert r.closed


def test_chunk_reader_of_a_file_cut_short_while_read_raises_eio(tmp_path):
    data = _data(3 * BUFFER_BYTES, seed=5)
    p = tmp_path / "b.bin"
    p.write_bytes(data)
    it = iter(ChunkReader(p, 0, MiB))
    assert next(it) == data[:MiB]
    os.truncate(p, BUFFER_BYTES + 100)
    with pytest.raises(OSError) as e:
        list(it)
    assert e.value.errno == errno.EIO and "ended at" in str(e.value)


def test_chunk_reader_refuses_bad_chunk_and_closes_unread(tmp_path):
    (tmp_path / "b.bin").write_bytes(b"x")
    with pytest.raises(ValueError):
        ChunkReader(tmp_path / "b.bin", 0, 0)
    with pytest.raises(ValueError):
        ChunkReader(tmp_path / "b.bin", 0, BUFFER_BYTES)
    r = ChunkReader(tmp_path / "b.bin", 0, 1)
    r.close()
    with pytest.raises(OSError):
        os.fstat(r.fd)
    with pytest.raises(FileNotFoundError):
        ChunkReader(tmp_path / "missing.bin", 0, 1)


def test_background_writer_writes_in_order_and_reports_the_first_error():
    from dflash_worker.coordinator.artifacts.directio import BackgroundWriter

    got, closes = [], []
    w = BackgroundWriter(got.append, closes.append, depth=2)
    for i in range(50):
        w.put(i)
    w.finish(sync=True)
    w.finish(sync=True)  # idempotent
    assert got == list(range(50)) and closes == [True]

    def write(x):
        if x == 3:
            raise OSError(errno.ENOSPC, "full")
        got.append(x)

    got, closes = [], []
    w = BackgroundWriter(write, closes.append, depth=1)
    with pytest.raises(OSError) as e:
        for i in range(100):
            w.put(i)
        w.finish(sync=True)
    assert e.value.errno == errno.ENOSPC
    with pytest.raises(OSError):
        w.finish(sync=True)
    # Nothing after the failed chunk is written, and a failed file is closed without fsync.
    assert got == [0, 1, 2] and closes == [False]


def test_chunk_reader_without_preadv_reads_the_same_bytes(tmp_path, monkeypatch):
    """Platforms without `os.preadv` (older macOS) read with `pread` and a copy."""
    data = _data(2 * BUFFER_BYTES + 77, seed=6)
    (tmp_path / "b.bin").write_bytes(data)
    monkeypatch.delattr(directio.os, "preadv")
    assert b"".join(ChunkReader(tmp_path / "b.bin", 5, MiB)) == data[5:]
