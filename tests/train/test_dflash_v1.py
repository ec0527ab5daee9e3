"""DFlash (v1) drafts through the CLI: init-draft, train, export (BF16 and AF4G64), evaluate; the BF16
export loads in the upstream reference with no missing or unexpected keys; scopes and objectives that need
a candidate selector are refused by name before anything is written."""

from __future__ import annotations

import copy
import hashlib
import json
import os

import pytest
import torch
from pipeline import _toml
from prewarmed import worker_cli
from safetensors.torch import load_file

from dflash_worker.recipe import load_recipe
from dflash_worker.train import train
from dflash_worker.weights import resolve_checkpoint


def _cli(*args):
    return worker_cli(*args, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def _recipe(pipeline, draft, run, **train_over):
    raw = copy.deepcopy(pipeline.recipe_base)
    raw["model"]["draft"] = str(draft)
    raw["train"] = {"scope": "full", "steps": 4, "lr": 3e-3, "blocks_per_sequence": 4, "val_every": 2,
                    "checkpoint_every": 2, "val_examples": 4, "device": "cpu", "warmup_steps": 1,
                    "output": str(pipeline.root / run), **train_over}
    raw["evaluate"] = {"max_prompts": 2, "max_new_tokens": 12, "device": "cpu"}
    path = pipeline.root / f"{run}.toml"
    path.write_text(_toml(raw))
    return path


@pytest.fixture(scope="module")
def v1_draft(pipeline):
    out = pipeline.root / "v1-draft"
    # the pipeline's capture taps the same target layers ([0, 2]) as the tiny v1 geometry
    proc = _cli("init-draft", "--target", pipeline.target, "--geometry", "tiny", "--kind", "dflash", "-o", out)
    assert proc.returncode == 0, proc.stderr
    return out


def _tensor_sha(draft_dir):
    out = {}
    for shard in resolve_checkpoint(draft_dir).shards:
        with open(shard.path, "rb") as f:
            for key, info in shard.tensors.items():
                f.seek(info.begin)
                out[key] = hashlib.sha256(f.read(info.nbytes)).hexdigest()
    return out


def test_v1_trains_exports_and_evaluates_through_the_cli(pipeline, v1_draft):
    from dflash.model import DFlashDraftModel

    recipe = _recipe(pipeline, v1_draft, "v1-run")
    run = pipeline.root / "v1-run"
    proc = _cli("train", "--recipe", recipe, "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "completed" and result["step"] == result["total_steps"] == 4

    # BF16: the upstream v1 class loads it whole, with exactly our bytes in every tensor
    export = run / "export"
    ref, info = DFlashDraftModel.from_pretrained(str(export), dtype=torch.bfloat16, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    assert not info["error_msgs"]
    ours = load_file(str(export / "model.safetensors"))
    theirs = {k: v for k, v in ref.state_dict().items() if not k.startswith("rotary_emb.")}
    assert set(theirs) == set(ours)
    for name, t in ours.items():
        assert torch.equal(theirs[name].view(torch.int16), t.view(torch.int16)), name
    assert json.loads((export / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    # full scope moved every tensor of the fresh draft
    released, trained = _tensor_sha(v1_draft), _tensor_sha(export)
    assert set(released) == set(trained) and all(released[n] != trained[n] for n in released)

    # AF4G64 of the same checkpoint
    proc = _cli("export", "--run", run, "--format", "af4g64", "--json")
    assert proc.returncode == 0, proc.stderr
    q = load_file(str(run / "export-af4g64" / "model.safetensors"))
    assert q["fc.weight"].dtype == torch.uint32 and "fc.scales" in q and "fc.biases" in q
    assert not any(k.startswith("candidate_selector.") for k in q)

    # evaluate: real speculative generation with the v1 draft, lossless against the teacher
    proc = _cli("evaluate", "--run", run, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["prompts"] == 2 and report["lossless"] is True
    assert report["trained"]["tau_pooled"] >= 1.0 and report["verdict"] in ("improved", "tied", "regressed")


def test_v1_recall_scope_keeps_every_other_tensor_byte_identical(pipeline, v1_draft):
    res = train(load_recipe(_recipe(pipeline, v1_draft, "v1-recall", scope="recall", lr=1e-2)))
    assert res.status == "completed"
    released, trained = _tensor_sha(v1_draft), _tensor_sha(res.export_dir)
    moved = {n for n in released if released[n] != trained[n]}
    last = max(int(n.split(".")[1]) for n in released if n.startswith("layers."))
    expected = {n for n in released if n.startswith(("fc.", "hidden_norm.", f"layers.{last}.", "norm."))}
    assert moved and moved <= expected, moved - expected
    assert {n for n in released if n not in expected and released[n] != trained[n]} == set()


@pytest.mark.parametrize(
    "over, message",
    [
        ({"scope": "selector"}, "scope `selector` needs a DFlash2 draft with a candidate selector"),
        ({"selector_weight": 1.0}, "the draft is a DFlash (v1) draft, which has no candidate selector"),
    ],
)
def test_selector_training_is_refused_for_v1_by_name(pipeline, v1_draft, over, message):
    run = f"v1-refused-{next(iter(over))}"
    proc = _cli("train", "--recipe", _recipe(pipeline, v1_draft, run, **over))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert message in proc.stderr
    assert not (pipeline.root / run / "checkpoints").exists() or not any((pipeline.root / run / "checkpoints").iterdir())


def test_a_capture_of_other_target_layers_is_refused(pipeline):
    # same number of taps as the capture ([0, 2]) but other layers: the features would be the wrong ones
    other = pipeline.root / "v1-other-taps"
    proc = _cli("init-draft", "--target", pipeline.target, "--geometry", "tiny", "--kind", "dflash",
                "--target-layer-ids", "1,3", "-o", other)
    assert proc.returncode == 0, proc.stderr
    proc = _cli("train", "--recipe", _recipe(pipeline, other, "v1-other-taps-run"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "holds the features of target layers `[0, 2]`" in proc.stderr and "taps target layers `[1, 3]`" in proc.stderr
    assert not (pipeline.root / "v1-other-taps-run").exists()
