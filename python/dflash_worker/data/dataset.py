"""Reading a directory written by `prepare-data`, with its hashes verified first."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..manifest import read_manifest_json, sha256_file
from .prepare import FORMAT, SPLIT_NAMES
from .schema import Conversation


@dataclass(frozen=True)
class Example(Conversation):
    """One prepared row; `file`/`line` locate it in the prepared split file."""

    split: str
    file: Path
    line: int
    id: str
    messages: tuple[dict[str, str], ...]
    source: str
    origin: dict[str, Any]


class PreparedData:
    """A prepared data directory. Construction checks the manifest and every split's sha256."""

    def __init__(self, path: str | Path, *, verify: bool = True) -> None:
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        self.manifest: dict[str, Any] = read_manifest_json(
            mpath, fmt=FORMAT, kind="prepared-data",
            missing_hint=f"\nhint: run `dflash-worker prepare-data --output {self.path}` first",
        )
        if verify:
            for split in SPLIT_NAMES:
                fp = self.split_path(split)
                want = self.manifest["files"][f"{split}.jsonl"]["sha256"]
                if not fp.is_file():
                    raise DataError(f"`{fp}` is missing\nhint: rerun `prepare-data`")
                got = sha256_file(fp)
                if got != want:
                    raise DataError(
                        f"`{fp}` changed after prepare-data: sha256 `{got}`, manifest says `{want}`\n"
                        "hint: rerun `prepare-data` instead of editing split files"
                    )

    @property
    def split_fingerprint(self) -> str:
        return self.manifest["split_fingerprint"]

    def split_path(self, split: str) -> Path:
        if split not in SPLIT_NAMES:
            raise DataError(f"unknown split `{split}`")
        return self.path / f"{split}.jsonl"

    def iter_split(self, split: str) -> Iterator[Example]:
        """Examples of one split in file order."""
        fp = self.split_path(split)
        with open(fp, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    obj = json.loads(raw)
                    yield Example(
                        split=split,
                        file=fp,
                        line=lineno,
                        id=obj["id"],
                        messages=tuple(obj["messages"]),
                        source=obj["source"],
                        origin=obj.get("origin", {}),
                    )
                except (ValueError, KeyError, TypeError) as exc:
                    raise DataError(f"`{fp}` line {lineno}: not a prepared row ({exc})") from None

    def examples(self, splits: Sequence[str] = SPLIT_NAMES) -> Iterator[Example]:
        """Examples of `splits`, split by split in the order given."""
        for split in splits:
            yield from self.iter_split(split)
