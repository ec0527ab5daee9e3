"""Reading a capture cache: what the training stage iterates over.

    cache = open_capture("runs/x/capture")          # verifies every shard's sha256
    for ex in cache:                                 # capture order, shard by shard
        ex.input_ids   # int64  [T]
        ex.loss_mask   # bool   [T]
        ex.features    # dtype  [T, len(target_layer_ids) * hidden]; None in an online capture

Shards are opened with `safe_open` (memory-mapped) and examples are sliced out
one at a time, so iterating never holds more than one example's features.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..manifest import read_manifest_json, sha256_file
from .layout import FORMAT, MANIFEST


@dataclass(frozen=True)
class CapturedExample:
    """One cached example. `index` is its position in capture order."""

    index: int
    split: str
    id: str
    input_ids: Any
    loss_mask: Any
    features: Any  # None in an online capture (`[train].features = "online"`)


class CaptureReader:
    """A finished capture dir. Construction reads the manifest and (by default) verifies shard hashes."""

    def __init__(self, path: str | Path, *, verify: bool = True) -> None:
        self.path = Path(path)
        mpath = self.path / MANIFEST
        self.manifest: dict[str, Any] = read_manifest_json(
            mpath, fmt=FORMAT, kind="capture",
            missing_hint=": the capture is missing or unfinished\nhint: run (or rerun to resume) `dflash-worker capture`",
        )
        self.shards = [self.path / s["file"] for s in self.manifest["shards"]]
        if verify:
            for s, p in zip(self.manifest["shards"], self.shards):
                if not p.is_file():
                    raise DataError(f"capture shard `{p}` is missing\nhint: rerun `dflash-worker capture` to rebuild it")
                if sha256_file(p) != s["sha256"]:
                    raise DataError(
                        f"capture shard `{p}` does not match its sha256 in `{mpath}`\nhint: rerun `dflash-worker capture` to rebuild it"
                    )

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.manifest["target_layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def feature_dim(self) -> int:
        return int(self.manifest["feature_dim"])

    @property
    def thinking(self) -> str:
        return self.manifest["thinking"]

    def __len__(self) -> int:
        return int(self.manifest["totals"]["examples"])

    def iter_shard(self, i: int) -> Iterator[CapturedExample]:
        """Examples of shard `i`, in order."""
        from safetensors import safe_open

        path = self.shards[i]
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("dflash_capture", "{}"))
            names = meta.get("examples")
            offsets = f.get_tensor("offsets").tolist()
            index = f.get_tensor("index").tolist()
            ids = f.get_tensor("input_ids")
            mask = f.get_tensor("loss_mask")
            if names is None or len(names) != len(index) or len(offsets) != len(index) + 1:
                raise DataError(f"capture shard `{path}` has inconsistent example tables")
            feats = f.get_slice("features") if "features" in f.keys() else None  # online: token ids only
            for k, (split, ex_id) in enumerate(names):
                a, b = offsets[k], offsets[k + 1]
                yield CapturedExample(
                    index=index[k],
                    split=split,
                    id=ex_id,
                    input_ids=ids[a:b].long(),
                    loss_mask=mask[a:b].bool(),
                    features=feats[a:b] if feats is not None else None,
                )

    def __iter__(self) -> Iterator[CapturedExample]:
        for i in range(len(self.shards)):
            yield from self.iter_shard(i)


def open_capture(path: str | Path, *, verify: bool = True) -> CaptureReader:
    """Open a finished capture dir for reading (see module docstring)."""
    return CaptureReader(path, verify=verify)
