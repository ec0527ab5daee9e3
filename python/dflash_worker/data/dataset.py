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
from .render import row_thinking
from .schema import Conversation


@dataclass(frozen=True)
class Example(Conversation):
    """One prepared row; `file`/`line` locate it in the prepared split file.

    `thinking`: the row's own mode (the prepared row's `"thinking"`; for data prepared before it
    was stored, whether an assistant turn has reasoning); what `[data].thinking = "per_row"`
    renders it in (`render.resolve_thinking`). `tools`: the function schemas passed to the chat
    template as `tools=` (None: the row has none).
    """

    split: str
    file: Path
    line: int
    id: str
    messages: tuple[dict[str, Any], ...]
    source: str
    origin: dict[str, Any]
    thinking: bool = False
    tools: tuple[dict[str, Any], ...] | None = None

    @property
    def earlier_turns(self) -> bool:
        """Whether an assistant turn comes before the response: where `[data].train_turns` changes what trains."""
        return any(m.get("role") == "assistant" for m in self.prompt_messages)


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
                    messages = tuple(obj["messages"])
                    thinking = obj.get("thinking")
                    tools = obj.get("tools")
                    yield Example(
                        split=split,
                        file=fp,
                        line=lineno,
                        id=obj["id"],
                        messages=messages,
                        source=obj["source"],
                        origin=obj.get("origin", {}),
                        thinking=thinking if isinstance(thinking, bool) else row_thinking(messages),
                        tools=None if tools is None else tuple(tools),
                    )
                except (ValueError, KeyError, TypeError) as exc:
                    raise DataError(f"`{fp}` line {lineno}: not a prepared row ({exc})") from None

    def examples(self, splits: Sequence[str] = SPLIT_NAMES) -> Iterator[Example]:
        """Examples of `splits`, split by split in the order given."""
        for split in splits:
            yield from self.iter_split(split)
