"""Artifact names, the checks on what an upload claims, artifact records and checkpoint manifests.

Every field a provider sends about an artifact is checked here before a byte is stored
(`Claim.of`: name, kind, sha256, sizes; `check_*` for the rest). Names are relative paths
inside a job's namespace; anything that could step outside it once written to a disk
(``..``, absolute paths, backslashes, NUL, control characters, empty segments, a segment over
255 bytes) is refused before any byte is stored. So is anything that makes a name read as another
one: invisible format characters (bidirectional overrides and isolates, LRM/RLM/ALM,
zero-width spaces and joiners, BOM: Unicode category Cf) and line or paragraph
separators; and, within a job, a name that differs from one of its recorded names
only by case or Unicode normalisation (`fold_name`: ``Model.bin`` and ``model.bin``,
NFC and NFD ``é``), which a case- or normalisation-insensitive disk (macOS, Windows)
would store as one file.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass

from ...errors import InvalidRequestError
from ...strict_json import no_duplicate_keys
from ..policy import ARTIFACT_KINDS
from .blobs import SHA256_HEX

MAX_NAME_CHARS = 512
MAX_SEGMENT_BYTES = 255
# Checkpoint manifests are small JSON files; the coordinator parses them, so it bounds them.
MAX_MANIFEST_BYTES = 1 << 20
MAX_MANIFEST_FILES = 256
CHUNK_BYTES = 1 << 20
# Protobuf uint64 fields go into SQLite INTEGER columns (signed 64-bit).
MAX_UINT = (1 << 63) - 1
URI_SCHEME = "dflash-artifact"


@dataclass(frozen=True, kw_only=True)
class ArtifactRecord:
    """An artifact as the coordinator records it."""

    name: str
    kind: str
    sha256: str
    size_bytes: int
    uri: str
    step: int


def artifact_uri(run_id: str, job_id: str, attempt: int, name: str) -> str:
    """The display URI of a record: where it is in the coordinator's namespace."""
    return f"{URI_SCHEME}://{run_id}/{job_id}/{attempt}/{name}"


def escape_name(name: str) -> str:
    """`name` with every character outside printable ASCII as a ``\\uXXXX`` escape: what a message shows of it,
    so an invisible or look-alike character is seen (and cannot reorder the terminal line it is printed on)."""
    return "".join(c if " " <= c <= "~" else f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}" for c in name)


def fold_name(name: str) -> str:
    """The key under which two names are one file on a case- and normalisation-insensitive disk
    (Unicode canonical caseless matching: NFD(casefold(NFD(name))))."""
    return unicodedata.normalize("NFD", unicodedata.normalize("NFD", name).casefold())


def _invisible(name: str) -> str | None:
    """The first character of `name` that changes how it reads without being seen (format, line or paragraph separator)."""
    for c in name:
        if unicodedata.category(c) in ("Cf", "Zl", "Zp"):
            return c
    return None


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
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        raise InvalidRequestError("`artifact.name` contains a control character")
    if (c := _invisible(name)) is not None:
        raise InvalidRequestError(
            f"`artifact.name` `{escape_name(name)}` contains U+{ord(c):04X} ({unicodedata.name(c, 'format character')}), "
            "an invisible character that changes how the name reads\nhint: name artifacts with visible characters only"
        )
    for part in name.split("/"):
        if part in ("", ".", ".."):
            raise InvalidRequestError(
                f"`artifact.name` `{name}` has a `{part or '(empty)'}` path segment; names may not contain `..`, `.` or empty segments"
            )
        if len(part.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES:
            raise InvalidRequestError(
                f"`artifact.name` has a path segment of {len(part.encode('utf-8', 'surrogatepass'))} bytes; at most {MAX_SEGMENT_BYTES} are allowed"
            )
    return name


def check_sha256(value: str, field: str = "artifact.sha256") -> str:
    """Return the lowercase hex digest, or raise naming the field."""
    v = (value or "").lower()
    if not SHA256_HEX.fullmatch(v):
        raise InvalidRequestError(f"`{field}` must be 64 hex digits, got `{(value or '')[:80]}`")
    return v


def check_kind(kind: str) -> str:
    if kind not in ARTIFACT_KINDS:
        raise InvalidRequestError(f"`artifact.kind` `{kind[:40]}` is not one of {list(ARTIFACT_KINDS)}")
    return kind


def check_uint(value: int, field: str) -> int:
    """Refuse a uint64 that SQLite cannot hold (>= 2**63) before anything is stored."""
    if value > MAX_UINT:
        raise InvalidRequestError(f"`{field}` is {value}; at most 2**63-1 is allowed")
    return value


@dataclass(frozen=True, kw_only=True)
class Claim:
    """What an upload says it is: checked before a byte is stored."""

    name: str
    kind: str
    sha256: str
    size_bytes: int
    step: int

    @classmethod
    def of(cls, a) -> Claim:
        """Check a `dflash.v1.Artifact` from a provider (its `uri` must be empty)."""
        name = check_name(a.name)
        if a.uri:
            raise InvalidRequestError(
                f"artifact `{name}`: `artifact.uri` must be empty; the coordinator records only bytes it received\n"
                "hint: upload the file with UploadArtifact (run-manager does)"
            )
        return cls(
            name=name,
            kind=check_kind(a.kind),
            sha256=check_sha256(a.sha256),
            size_bytes=check_uint(a.size_bytes, "artifact.size_bytes"),
            step=check_uint(a.step, "artifact.step"),
        )


def name_conflict(name: str, existing: str) -> bool:
    """Whether `name` and `existing` cannot both be paths on a disk (one is a directory of the other)."""
    return name.startswith(existing + "/") or existing.startswith(name + "/")


def checkpoint_dir(name: str) -> str:
    """The directory of a checkpoint manifest artifact `DIR/manifest.json` ("" at the top)."""
    return name.rpartition("/")[0]


def parse_checkpoint_manifest(name: str, data: bytes) -> dict[str, tuple[str, int]]:
    """The files a checkpoint manifest lists, `{FILE: (sha256, size)}`; INVALID_ARGUMENT when malformed.

    A manifest is a JSON object; its optional ``files`` maps a file name (one
    path segment) to ``{"sha256": HEX, "size": N}``.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidRequestError(f"checkpoint `{name}` is {len(data)} bytes; a checkpoint manifest is at most {MAX_MANIFEST_BYTES}")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"checkpoint `{name}` is not a JSON manifest: {str(exc)[:200]}") from None
    if not isinstance(doc, dict):
        raise InvalidRequestError(f"checkpoint `{name}` must be a JSON object")
    files = doc.get("files", {})
    if not isinstance(files, dict) or len(files) > MAX_MANIFEST_FILES:
        raise InvalidRequestError(f"checkpoint `{name}`: `files` must be an object of at most {MAX_MANIFEST_FILES} entries")
    out: dict[str, tuple[str, int]] = {}
    for fname, entry in files.items():
        if "/" in fname or fname == "manifest.json":
            raise InvalidRequestError(f"checkpoint `{name}`: file `{fname[:80]}` must be one path segment other than `manifest.json`")
        check_name(fname)
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or isinstance(entry.get("size"), bool) or entry["size"] < 0:
            raise InvalidRequestError(f"checkpoint `{name}`: file `{fname}` needs `sha256` and a non-negative integer `size`")
        out[fname] = (check_sha256(str(entry.get("sha256", "")), f"files.{fname}.sha256"), check_uint(entry["size"], f"files.{fname}.size"))
    return out
