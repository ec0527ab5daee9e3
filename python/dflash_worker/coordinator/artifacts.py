"""The coordinator's local artifact store and artifact-name checks.

Artifacts arrive two ways:

- inline ``content``: the bytes are hashed, compared with the claimed sha256
  and size, then written atomically (temporary file, fsync, rename, fsync of
  the directory) to ``<root>/<run_id>/<job_id>/<name>``;
- a ``file://`` URI: the file must resolve (symlinks followed) inside one of
  the allowed roots; it is read in full and must match the claimed sha256 and
  size. The coordinator records the URI; it does not copy the bytes.

Names are relative paths inside a job's namespace; anything that could step
outside it (``..``, absolute paths, backslashes, NUL, empty segments) is
refused before any file is touched.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..errors import InvalidRequestError
from .policy import ARTIFACT_KINDS

MAX_NAME_CHARS = 512
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ArtifactRecord:
    """An artifact as the coordinator records it."""

    name: str
    kind: str
    sha256: str
    size_bytes: int
    uri: str
    step: int


def check_name(name: str) -> str:
    """Return `name` if it is a safe relative path, else raise INVALID_ARGUMENT."""
    if not name:
        raise InvalidRequestError("`artifact.name` is empty")
    if len(name) > MAX_NAME_CHARS:
        raise InvalidRequestError(f"`artifact.name` has {len(name)} characters; at most {MAX_NAME_CHARS} are allowed")
    if "\x00" in name:
        raise InvalidRequestError("`artifact.name` contains a NUL byte")
    if "\\" in name:
        raise InvalidRequestError(f"`artifact.name` `{name}` contains a backslash\nhint: separate directories with `/`")
    if name.startswith("/"):
        raise InvalidRequestError(f"`artifact.name` `{name}` is absolute; names are relative to the job's namespace")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise InvalidRequestError("`artifact.name` contains a control character")
    for part in name.split("/"):
        if part in ("", ".", ".."):
            raise InvalidRequestError(
                f"`artifact.name` `{name}` has a `{part or '(empty)'}` path segment; "
                "names may not contain `..`, `.` or empty segments"
            )
    return name


def check_sha256(value: str) -> str:
    """Return the lowercase hex digest, or raise naming the field."""
    v = (value or "").lower()
    if not _SHA256.match(v):
        raise InvalidRequestError(f"`artifact.sha256` must be 64 hex digits, got `{(value or '')[:80]}`")
    return v


def check_kind(kind: str) -> str:
    if kind not in ARTIFACT_KINDS:
        raise InvalidRequestError(f"`artifact.kind` `{kind[:40]}` is not one of {list(ARTIFACT_KINDS)}")
    return kind


def _inside(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:
        return False


class ArtifactStore:
    """Writes inline artifacts under `root`; verifies `file://` artifacts under allowed roots."""

    def __init__(self, root: Path, *, allowed_roots: tuple[Path, ...] = ()):
        root.mkdir(parents=True, exist_ok=True)
        self.root = Path(os.path.realpath(root))
        self.allowed_roots = tuple(dict.fromkeys([str(self.root)] + [os.path.realpath(r) for r in allowed_roots]))

    def job_dir(self, run_id: str, job_id: str) -> Path:
        return self.root / run_id / job_id

    @staticmethod
    def check_content(name: str, content: bytes, sha256: str, size_bytes: int) -> None:
        """Raise INVALID_ARGUMENT unless `content` has exactly the claimed sha256 and size."""
        found = hashlib.sha256(content).hexdigest()
        if found != sha256:
            raise InvalidRequestError(
                f"artifact `{name}`: content sha256 is `{found}`, the report claims `{sha256}`\n"
                "hint: the upload was corrupted or the hash was computed over other bytes"
            )
        if size_bytes != len(content):
            raise InvalidRequestError(f"artifact `{name}`: `size_bytes` is {size_bytes}, content has {len(content)} bytes")

    def store_inline(self, run_id: str, job_id: str, name: str, content: bytes, sha256: str, size_bytes: int) -> str:
        """Verify `content` against `sha256` and `size_bytes`, write it atomically, return its file:// URI."""
        check_name(name)
        self.check_content(name, content, sha256, size_bytes)
        base = self.job_dir(run_id, job_id)
        target = base / name
        target.parent.mkdir(parents=True, exist_ok=True)
        # check_name already rules out escapes by name; this guards against a
        # symlink planted inside the store itself.
        if not _inside(os.path.realpath(target.parent), str(self.root)) or os.path.islink(target):
            raise InvalidRequestError(f"artifact `{name}` resolves outside the artifact store")
        tmp = target.parent / f".{target.name}.tmp-{secrets.token_hex(6)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(content)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dfd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return target.as_uri()

    def verify_uri(self, name: str, uri: str, sha256: str, size_bytes: int) -> str:
        """Check that a `file://` artifact lies inside an allowed root and matches; return its canonical URI."""
        parsed = urlparse(uri)
        if parsed.scheme != "file":
            raise InvalidRequestError(
                f"artifact `{name}`: `artifact.uri` scheme `{parsed.scheme}` is not supported\n"
                "hint: send small files inline as `content`, or a `file://` URI inside the coordinator's artifact roots"
            )
        if parsed.netloc not in ("", "localhost"):
            raise InvalidRequestError(f"artifact `{name}`: `artifact.uri` names host `{parsed.netloc}`; only local files are read")
        raw = unquote(parsed.path)
        if "\x00" in raw or not raw.startswith("/"):
            raise InvalidRequestError(f"artifact `{name}`: `artifact.uri` `{uri[:200]}` is not an absolute file path")
        real = os.path.realpath(raw)
        if not any(_inside(real, r) for r in self.allowed_roots):
            raise InvalidRequestError(
                f"artifact `{name}`: `{raw}` is outside the allowed artifact roots\n"
                "hint: start the coordinator with `--allow-artifact-root DIR` for that directory"
            )
        if not os.path.isfile(real):
            raise InvalidRequestError(f"artifact `{name}`: `{raw}` is not a regular file")
        h = hashlib.sha256()
        n = 0
        with open(real, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                n += len(chunk)
        if h.hexdigest() != sha256:
            raise InvalidRequestError(f"artifact `{name}`: `{raw}` has sha256 `{h.hexdigest()}`, the report claims `{sha256}`")
        if n != size_bytes:
            raise InvalidRequestError(f"artifact `{name}`: `{raw}` has {n} bytes, the report claims {size_bytes}")
        return Path(real).as_uri()
