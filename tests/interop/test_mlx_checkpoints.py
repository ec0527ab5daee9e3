"""The tiny test targets are laid out as released checkpoints are, so other engines load them as they load real ones.

`testing.tiny.save_tiny_target` shards every target as transformers' `save_pretrained` does
(`model-000NN-of-000MM.safetensors` + `model.safetensors.index.json`), keeps MTP tensors in those
shards and stores MoE experts as transformers saves them (per expert, or packed with
`save_original_format=False`). mlx-lm, which reads only `model*.safetensors`, loads them; the
project's own loader still accepts a checkpoint whose files are named otherwise.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_worker.testing.tiny import FAMILIES, HYBRID_FAMILIES, pack_experts, save_tiny_target

SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def _index(path: Path) -> dict[str, str]:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


LAYOUTS = [(f, "individual") for f in FAMILIES] + [(f, "packed") for f in FAMILIES if f.endswith("_moe")]


@pytest.mark.parametrize(("family", "layout"), LAYOUTS)
def test_every_tiny_target_is_sharded_as_save_pretrained_shards(family, layout, tmp_path) -> None:
    save_tiny_target(tmp_path, family=family, expert_layout=layout)
    weight_files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    numbers = [SHARD.match(name) for name in weight_files]
    assert all(numbers), f"weight files not named as save_pretrained names them: {weight_files}"
    total = int(numbers[0][2])
    assert total >= 2 and [int(m[1]) for m in numbers] == list(range(1, total + 1)) and {int(m[2]) for m in numbers} == {total}
    weight_map = _index(tmp_path)
    assert sorted(set(weight_map.values())) == weight_files
    for file in weight_files:
        with safe_open(str(tmp_path / file), "pt") as f:
            assert sorted(f.keys()) == sorted(k for k, v in weight_map.items() if v == file)
    mtp = sorted(k for k in weight_map if k.startswith("mtp."))
    assert bool(mtp) == (family in HYBRID_FAMILIES)
    experts = [k for k in weight_map if ".experts." in k]
    if family.endswith("_moe"):
        packed = [k for k in experts if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        assert (packed == experts) if layout == "packed" else not packed


def test_packed_experts_equal_transformers_own_packed_save(tmp_path) -> None:
    """`pack_experts` on a per-expert checkpoint gives the tensors transformers itself writes packed."""
    save_tiny_target(tmp_path / "own", family="qwen3_5_moe", expert_layout="packed", mtp=False)
    save_tiny_target(tmp_path / "repacked", family="qwen3_5_moe", mtp=False)
    assert pack_experts(tmp_path / "repacked") == 4

    def tensors(path: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(set(_index(path).values())) for k, v in load_file(str(path / f)).items()}

    own, repacked = tensors(tmp_path / "own"), tensors(tmp_path / "repacked")
    assert sorted(own) == sorted(repacked)
    assert all(torch.equal(own[k], repacked[k]) for k in own)


@pytest.mark.parametrize(("family", "layout"), [("qwen3", "individual"), ("qwen3_5", "individual"), ("qwen3_5_moe", "packed")])
def test_mlx_lm_loads_the_tiny_targets_as_it_loads_released_ones(family, layout, tmp_path) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    save_tiny_target(tmp_path, family=family, expert_layout=layout)
    model, _ = load_model(tmp_path)  # strict: every tensor of the model found in `model*.safetensors`
    assert tree_flatten(model.parameters())


def test_mlx_lm_cannot_stack_per_expert_qwen3_5_moe_tensors(tmp_path) -> None:
    """mlx-lm 0.32.2's `qwen3_5_moe` reads packed experts only (as released); documented in docs/native-silicon.md."""
    from mlx_lm.utils import load_model

    save_tiny_target(tmp_path, family="qwen3_5_moe")
    with pytest.raises(ValueError, match=r"(?s)parameters not in model:.*experts\.0\."):
        load_model(tmp_path)


@pytest.mark.parametrize("layout", ["one-file", "shards"])
def test_project_loader_accepts_weight_files_named_otherwise(layout, tmp_path) -> None:
    from dflash_worker.weights import load_model

    src = tmp_path / "released"
    save_tiny_target(src, family="qwen3_5")
    renamed = tmp_path / "renamed"
    shutil.copytree(src, renamed, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    weight_map = _index(src)
    if layout == "one-file":  # one file under a name no convention gives it, no index
        save_file({k: v for f in sorted(set(weight_map.values())) for k, v in load_file(str(src / f)).items()},
                  str(renamed / "weights.safetensors"), metadata={"format": "pt"})
    else:  # shards under other names, listed by the index
        names = {f: f"part-{i}.safetensors" for i, f in enumerate(sorted(set(weight_map.values())))}
        for old, new in names.items():
            shutil.copyfile(src / old, renamed / new)
        (renamed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: names[v] for k, v in weight_map.items()}}))
    want = load_model(src, dtype=torch.float32).state_dict()
    got = load_model(renamed, dtype=torch.float32).state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
