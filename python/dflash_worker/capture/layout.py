"""On-disk layout of a capture cache: shard names, shard tensors, sidecars, manifest.

A capture dir holds::

    shard-00000.safetensors   tensors of whole examples (below)
    shard-00000.json          sidecar: sha256 of the shard, example range, capture key
    ...
    manifest.json             written last, once every shard is committed

Shard tensors (N examples, T tokens in total, F = len(target_layer_ids) * hidden):

    input_ids   int32  [T]        token ids, examples concatenated
    loss_mask   uint8  [T]        1 on response tokens
    features    dtype  [T, F]     hidden_states[id + 1] of each target layer id, concatenated on the last dim
    offsets     int64  [N + 1]    example i is tokens offsets[i]:offsets[i+1]
    index       int64  [N]        position of each example in the capture order

An online capture (`[train].features = "online"`) has no `features` tensor: its
shards hold the token ids and loss mask only (5 bytes per token plus the tables),
and training computes the features with the frozen target (`capture.teacher`).

Shard metadata (strings, fixed content, no timestamps): `format`,
`capture_key`, `target_layer_ids`, `hidden_size`, `dtype`, `examples` (JSON list of
``[split, id]``), and ``features: "online"`` in an online capture only. The same
inputs give the same bytes.

A shard is complete when its sidecar exists, names the current capture key,
and the shard's sha256 matches the sidecar. Shard then sidecar are each
written atomically, so a crash between them leaves a shard without a sidecar,
which is rewritten on resume.
"""

from __future__ import annotations

from pathlib import Path

FORMAT = "dflash-worker/capture/v1"
SHARD_FORMAT = "dflash-worker/capture-shard/v1"
MANIFEST = "manifest.json"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def sidecar_name(index: int) -> str:
    return f"shard-{index:05d}.json"


def shard_path(root: Path, index: int) -> Path:
    return root / shard_name(index)


def sidecar_path(root: Path, index: int) -> Path:
    return root / sidecar_name(index)
