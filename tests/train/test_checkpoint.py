"""`checkpoint.save`: ``trainable.safetensors`` is written by `weights.write` in the layout
`safetensors.torch.save_file` gave it, so checkpoints of older versions hash the same."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from dflash_worker.train import checkpoint as ckpt


def _trainable() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    # names out of order and mixed dtypes: `save_file` sorts by dtype (largest first), then name
    return {
        "layers.1.w": torch.randn(3, 5, generator=gen),
        "layers.0.w": torch.randn(4, generator=gen).to(torch.bfloat16),
        "b.step": torch.tensor(7, dtype=torch.int64),
        "a.scale": torch.randn(2, 2, generator=gen),
        "c.empty": torch.zeros(0, 3),
        "d.view": torch.randn(6, 4, generator=gen).t(),  # not contiguous: `save` makes it so
    }


def test_trainable_is_the_bytes_safetensors_save_file_writes(tmp_path):
    trainable = _trainable()
    path = ckpt.save(tmp_path / "run", 3, trainable=trainable, optimizer={"state": {}, "param_groups": []},
                     rng={"seed": 1}, state={"cursor": 0})
    theirs = tmp_path / "theirs.safetensors"
    save_file({k: v.contiguous() for k, v in trainable.items()}, str(theirs), metadata={"format": ckpt.FORMAT})
    assert (path / "trainable.safetensors").read_bytes() == theirs.read_bytes()
    back = ckpt.load(path).trainable
    for name, t in trainable.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
