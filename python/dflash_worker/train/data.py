"""Captured examples by split, with a deterministic order and seeded anchors.

Everything random here is a pure function of the recipe seed and a counter,
never of a generator's running state, so the data a step sees depends only on
the step number: a resumed run sees exactly what an uninterrupted one would.

- Order: example ``g`` (the g-th sequence the run consumes, counting from 0
  across steps and accumulation micro-batches) is ``perm_e[g % n]`` with
  ``e = g // n`` and ``perm_e = randperm(n)`` seeded by ``mix(seed, 0, e)``.
  The data cursor saved in a checkpoint is ``g``.
- Anchors: among positions ``a`` in ``[1, L - 2]`` whose next token is a
  response token (loss mask), up to ``blocks_per_sequence`` drawn without
  replacement by a generator seeded with ``mix(seed, 1, g)`` (validation:
  ``mix(seed, 2, i)`` for the i-th validation example, the same at every
  validation), sorted.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import DataError

if TYPE_CHECKING:
    from ..capture.teacher import Teacher


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (sha256 of their decimal form)."""
    digest = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class Sequence:
    input_ids: torch.Tensor  # int64 [L]
    loss_mask: torch.Tensor  # bool [L]
    features: torch.Tensor  # [L, F]
    id: str


class CapturedSplit:
    """Random access to the captured examples of one split (shards memory-mapped).

    Features come from one of two sources, the rest is the same: a cache capture's `features`
    tensor, or (`[train].features = "online"`, shards of token ids only) `teacher`, the frozen
    target that computes them for each sequence as it is read (`capture.teacher`, the component
    the capture itself calls)."""

    def __init__(self, capture_dir: str | Path, split: str, *, verify: bool = True, teacher: Teacher | None = None) -> None:
        from ..capture import open_capture

        self.reader = open_capture(capture_dir, verify=verify)
        self.split = split
        self.teacher = teacher
        online = self.reader.manifest.get("features", "cache") == "online"
        if online != (teacher is not None):
            raise DataError(
                f"capture `{capture_dir}` {'holds token ids only' if online else 'holds cached features'}, but training "
                f"{'has no target to compute them' if online else 'was given a target to compute them'}\n"
                "hint: `[train].features` must be the mode the capture was made with"
            )
        self._where: list[tuple[int, int, int, str]] = []  # (shard, begin, end, id)
        import json

        from safetensors import safe_open

        for si, path in enumerate(self.reader.shards):
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("dflash_capture", "{}"))
                names = meta.get("examples") or []
                offsets = f.get_tensor("offsets").tolist()
            if len(offsets) != len(names) + 1:
                raise DataError(f"capture shard `{path}` has inconsistent example tables")
            for k, (sp, ex_id) in enumerate(names):
                if sp == split:
                    self._where.append((si, offsets[k], offsets[k + 1], ex_id))
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._where)

    def id_of(self, i: int) -> str:
        """The example id of sequence `i`, without reading it."""
        return self._where[i][3]

    def get(self, i: int) -> Sequence:
        from safetensors import safe_open

        si, a, b, ex_id = self._where[i]
        f = self._open.get(si)
        if f is None:
            f = self._open[si] = safe_open(str(self.reader.shards[si]), framework="pt")
        # safetensors hands back buffers at whatever address its allocator chose; MKL's GEMM
        # takes alignment-dependent code paths, so an unaligned input can change the last bits
        # of `fc(features)` from one process to the next. `clone()` moves the data into a
        # torch allocation (64-byte aligned), which keeps resumed runs bit-identical.
        ids = f.get_slice("input_ids")[a:b].long()
        if self.teacher is None:
            feats = f.get_slice("features")[a:b].clone()
        else:
            # `clone()` outside inference mode: the draft's backward saves its input, which an
            # inference tensor cannot be
            feats = self.teacher.features(ids.tolist()).clone()
        return Sequence(input_ids=ids, loss_mask=f.get_slice("loss_mask")[a:b].bool(), features=feats, id=ex_id)


class Order:
    """Epoch-wise seeded permutation of `n` examples (see module docstring)."""

    def __init__(self, n: int, seed: int) -> None:
        if n <= 0:
            raise DataError("the training split has no captured examples\nhint: run `capture` with split `train`")
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, None

    def __call__(self, g: int) -> int:
        epoch = g // self.n
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(mix(self.seed, 0, epoch))
            self._perm, self._epoch = torch.randperm(self.n, generator=gen).tolist(), epoch
        return self._perm[g % self.n]


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a in [1, L-2] whose next token is a response token."""
    L = loss_mask.shape[0]
    if L < 3:
        return torch.zeros(0, dtype=torch.long)
    pos = torch.arange(1, L - 1)
    return pos[loss_mask[2:].bool()]


def sample_anchors(loss_mask: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """Up to `count` sorted anchors drawn without replacement with a generator seeded by `seed`."""
    cand = anchor_candidates(loss_mask)
    if cand.numel() <= count:
        return cand
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randperm(cand.numel(), generator=gen)[:count]
    return cand[pick].sort().values
