"""Family registry and target/draft pair validation (config.json + safetensors headers only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dflash_worker.errors import FamilyError
from dflash_worker.families import (
    FAMILIES,
    UNVERIFIED,
    detect_family,
    get_family,
    validate_pair,
    validate_target,
)
from dflash_worker.testing.tiny import (
    dflash2_draft_shapes,
    save_tiny_dflash2_draft,
    tiny_dflash2_draft_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
)

from .conftest import rewrite_target


def _draft(tmp_path, target_cfg, name="draft", **kw):
    path = tmp_path / name
    save_tiny_dflash2_draft(path, target_cfg, **kw)
    return path


def _fails(target, draft, field):
    with pytest.raises(FamilyError) as info:
        validate_pair(target, draft)
    msg = str(info.value)
    assert f"field `{field}`" in msg, msg
    return msg


# --------------------------------------------------------------------------- registry


def test_registry_records_released_pairs_without_invented_facts():
    assert set(FAMILIES) == {"qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe"}
    dense, moe = get_family("qwen3"), get_family("qwen3_moe")
    dense35, moe35 = get_family("qwen3_5"), get_family("qwen3_5_moe")
    assert not dense.moe and moe.moe and not dense35.moe and moe35.moe
    assert dense35.hybrid and moe35.hybrid and not dense.hybrid and not moe.hybrid
    # the seeds' released pairs are Qwen3.5-architecture targets (Qwen3.6 shares `qwen3_5_moe`)
    assert dense.released == () and moe.released == ()
    assert [(r.target, r.draft) for r in dense35.released] == [("Qwen/Qwen3.8-27B", "incoai/Qwen3.8-27B-DFlash2")]
    assert [(r.target, r.draft) for r in moe35.released] == [("Qwen/Qwen3.6-35B-A3B", "incoai/Qwen3.6-35B-A3B-DFlash2")]
    assert (dense35.released[0].hidden_size, dense35.released[0].num_hidden_layers) == (5120, 64)
    assert dense35.released[0].target_layer_ids == (1, 16, 31, 46, 61)
    assert (moe35.released[0].hidden_size, moe35.released[0].num_hidden_layers, moe35.released[0].num_experts) == (2048, 40, 256)
    for fam in (dense35, moe35):
        for r in fam.released:
            assert r.target_revision is None and r.draft_revision is None
            assert r.note.startswith(UNVERIFIED)
    assert detect_family({"model_type": "qwen3_5_moe_text"}) is moe35 and detect_family({"model_type": "qwen3_5"}) is dense35
    with pytest.raises(FamilyError, match="unknown target family `llama`"):
        get_family("llama")
    with pytest.raises(FamilyError, match="field `model_type`: `llama`"):
        detect_family({"model_type": "llama"})


def test_the_lists_of_families_and_model_types_are_read_from_the_registry():
    """The registry against literals (the oracle); every other list of family names or model types is derived from it."""
    from dflash_worker import recipe
    from dflash_worker.family_registry import MODEL_TYPES, WRAPPER_MODEL_TYPES
    from dflash_worker.testing import tiny
    from dflash_worker.weights import checkpoint, loader

    assert MODEL_TYPES == ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
    assert WRAPPER_MODEL_TYPES == ("qwen3_5", "qwen3_5_moe")
    assert [(f.model_types[0], f.architectures[0]) for f in FAMILIES.values() if f.wrapper] == [
        ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
        ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
    ]
    assert loader.SUPPORTED_MODEL_TYPES is MODEL_TYPES and checkpoint.WRAPPER_MODEL_TYPES is WRAPPER_MODEL_TYPES
    assert recipe.FAMILIES == tiny.FAMILIES == tuple(FAMILIES)
    assert tiny.HYBRID_FAMILIES == ("qwen3_5", "qwen3_5_moe")


def test_the_registry_and_the_checks_import_neither_torch_nor_the_loader():
    """`families` -> `weights.checkpoint` -> `family_registry`, never back: no import cycle, and header-only checks stay light."""
    code = (
        "import sys, dflash_worker.families, dflash_worker.weights.checkpoint\n"
        "print(sorted(m for m in ('torch', 'dflash_worker.weights.loader') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.strip() == "[]", out


def test_load_model_loads_a_registered_family(targets):
    from dflash_worker.weights import load_model

    m = load_model(targets["qwen3_moe"])
    assert type(m).__name__ == "Qwen3MoeForCausalLM" and not m.training
    assert m.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16


# --------------------------------------------------------------------------- pairs


@pytest.mark.parametrize("fam", ["qwen3", "qwen3_moe"])
def test_good_pairs(targets, tmp_path, fam):
    cfg = tiny_qwen3_config() if fam == "qwen3" else tiny_qwen3_moe_config()
    extra = {} if fam == "qwen3" else {"num_experts": 4, "num_experts_per_tok": 2}
    rep = validate_pair(targets[fam], _draft(tmp_path, cfg, **extra))
    assert rep.family == fam
    assert rep.target.hidden_size == 64 and rep.draft.target_layer_ids == [1, 2]
    assert rep.target.expert_storage == ("per-expert" if fam == "qwen3_moe" else None)


def test_hidden_size_mismatch(targets, tmp_path):
    d = _draft(tmp_path, tiny_qwen3_config(hidden_size=32, head_dim=8))
    msg = _fails(targets["qwen3"], d, "hidden_size")
    assert "`32` != target hidden_size `64`" in msg


def test_vocab_mismatch(targets, tmp_path):
    d = _draft(tmp_path, tiny_qwen3_config(vocab_size=300), mask_token_id=100)
    _fails(targets["qwen3"], d, "vocab_size")


def test_layer_ids_out_of_range(targets, tmp_path):
    d = _draft(tmp_path, tiny_qwen3_config(), target_layer_ids=[1, 4])
    msg = _fails(targets["qwen3"], d, "target_layer_ids")
    assert "`[4]` out of range" in msg and "`4` layers" in msg
    d = _draft(tmp_path, tiny_qwen3_config(), name="neg", target_layer_ids=[-1, 2])
    _fails(targets["qwen3"], d, "target_layer_ids")


def test_fc_width_mismatch(targets, tmp_path):
    cfg = tiny_qwen3_config()
    shapes = dflash2_draft_shapes(tiny_dflash2_draft_config(cfg))
    shapes["fc.weight"] = (64, 3 * 64)  # three target layers' worth, but the config lists two ids
    msg = _fails(targets["qwen3"], _draft(tmp_path, cfg, shapes=shapes), "fc.weight")
    assert "`2` x `64` = `128`" in msg


def test_mask_token_outside_vocab(targets, tmp_path):
    d = _draft(tmp_path, tiny_qwen3_config(), mask_token_id=256)
    msg = _fails(targets["qwen3"], d, "mask_token_id")
    assert "`256` is outside the target vocabulary" in msg


def test_draft_fields_read_dflash_config_first(targets, tmp_path):
    # a top-level value that would be wrong is shadowed by dflash_config
    d = _draft(tmp_path, tiny_qwen3_config())
    cfg = json.loads((d / "config.json").read_text())
    cfg["mask_token_id"] = 10_000
    cfg["target_layer_ids"] = [99]
    (d / "config.json").write_text(json.dumps(cfg))
    validate_pair(targets["qwen3"], d)
    # and the top level is used when dflash_config lacks the field
    del cfg["dflash_config"]["mask_token_id"]
    (d / "config.json").write_text(json.dumps(cfg))
    _fails(targets["qwen3"], d, "mask_token_id")


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"num_experts": 8, "num_experts_per_tok": 2}, "num_experts"),
        ({"num_experts": 4, "num_experts_per_tok": 4}, "num_experts_per_tok"),
    ],
)
def test_routing_geometry_mismatch(targets, tmp_path, extra, field):
    d = _draft(tmp_path, tiny_qwen3_moe_config(), **extra)
    _fails(targets["qwen3_moe"], d, field)


def test_moe_draft_on_dense_target(targets, tmp_path):
    d = _draft(tmp_path, tiny_qwen3_config(), num_experts=4, num_experts_per_tok=2)
    _fails(targets["qwen3"], d, "num_experts")


def test_missing_expert_weights(targets, tmp_path):
    t = rewrite_target(targets["qwen3_moe"], tmp_path / "t", drop={"model.layers.2.mlp.experts.1.down_proj.weight"})
    msg = _fails(t, _draft(tmp_path, tiny_qwen3_moe_config()), "experts")
    assert "`model.layers.2.mlp.experts.1.down_proj.weight`" in msg
    with pytest.raises(FamilyError, match="lacks expert weights"):
        validate_target(t)
    t2 = rewrite_target(targets["qwen3_moe"], tmp_path / "t2", drop={"model.layers.0.mlp.gate.weight"})
    with pytest.raises(FamilyError, match=r"`model.layers.0.mlp.gate.weight`"):
        validate_target(t2)


def test_packed_expert_target_is_valid(targets, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(targets["qwen3_moe"]))
    sd = ref.state_dict()
    packed = {k: v for k, v in sd.items() if ".experts.gate_up_proj" in k or ".experts.down_proj" in k}
    drop = {k for k in __import__("dflash_worker").weights.list_tensors(targets["qwen3_moe"]) if ".experts." in k}
    t = rewrite_target(targets["qwen3_moe"], tmp_path / "packed", drop=drop, add={k: v.contiguous() for k, v in packed.items()})
    assert validate_target(t).expert_storage == "packed"


def test_target_size_is_the_text_tower_the_loader_reads(targets, tmp_path):
    """A Qwen3.5 wrapper's vision tower and MTP heads are no part of the target's size (what preflight
    reports as the teacher): `validate_target` counts the bytes `load_model` reads, the skipped ones apart."""
    from dflash_worker.testing import save_tiny_target
    from dflash_worker.weights import list_tensors, load_model

    wrapper = tmp_path / "qwen3_5_moe"
    save_tiny_target(wrapper, family="qwen3_5_moe", dtype="bfloat16", expert_layout="packed")
    for path in (wrapper, targets["qwen3"]):
        entries = list_tensors(path)
        outside = {n: e.nbytes for n, e in entries.items() if n.startswith(("model.visual.", "mtp."))}
        inside = {n: e.nbytes for n, e in entries.items() if n not in outside}
        rep, load = validate_target(path), load_model(path).load_report
        assert (rep.tensors, rep.bytes) == (len(inside), sum(inside.values())), path
        assert rep.bytes == load.bytes_read, path
        assert (rep.skipped_tensors, rep.skipped_bytes) == (len(outside), sum(outside.values())), path
        assert sorted(load.skipped) == sorted(outside) and load.bytes_skipped == rep.skipped_bytes, path
    # the premise: the wrapper carries both a vision tower and MTP heads; a Qwen3 target skips nothing
    names = list(list_tensors(wrapper))
    assert any(n.startswith("mtp.") for n in names) and any(n.startswith("model.visual.") for n in names)
    assert validate_target(targets["qwen3"]).skipped_tensors == 0
    rep = validate_target(wrapper)
    assert rep.skipped_bytes > 0
    assert (rep.family, rep.num_hidden_layers, rep.num_experts, rep.expert_storage) == ("qwen3_5_moe", 4, 4, "packed")


@pytest.mark.parametrize(
    "how,field",
    [
        ("config", "quantization_config"),
        ("scales", "model.layers.0.mlp.down_proj.scales"),
        ("packed", "model.layers.0.mlp.down_proj.weight"),
    ],
)
def test_quantized_targets_rejected(targets, tmp_path, how, field):
    src = targets["qwen3"]
    kw: dict = {}
    if how == "config":
        kw["config"] = {"quantization_config": {"quant_method": "mlx", "bits": 4, "group_size": 64}}
    elif how == "scales":
        kw["add"] = {"model.layers.0.mlp.down_proj.scales": torch.ones(64, 2, dtype=torch.bfloat16)}
    else:
        kw["drop"] = {"model.layers.0.mlp.down_proj.weight"}
        kw["add"] = {"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 16, dtype=torch.uint32)}
    t = rewrite_target(src, tmp_path / "q", **kw)
    _fails(t, _draft(tmp_path, tiny_qwen3_config()), field)


def test_quantized_draft_rejected(targets, tmp_path):
    d = _draft(tmp_path, tiny_qwen3_config())
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "affine"}
    (d / "config.json").write_text(json.dumps(cfg))
    msg = _fails(targets["qwen3"], d, "quantization_config")
    assert "draft" in msg


def test_all_problems_listed(targets, tmp_path):
    d = _draft(tmp_path, tiny_qwen3_config(hidden_size=32, head_dim=8), mask_token_id=999, target_layer_ids=[0, 9])
    msg = _fails(targets["qwen3"], d, "hidden_size")
    for f in ("hidden_size", "target_layer_ids", "mask_token_id"):
        assert f"field `{f}`" in msg


# --------------------------------------------------------------------------- CLI


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dflash_worker.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )


def test_validate_pair_cli(targets, tmp_path):
    good = _draft(tmp_path, tiny_qwen3_moe_config(), name="good")
    ok = _cli("validate-pair", "--target", str(targets["qwen3_moe"]), "--draft", str(good), "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["ok"] and doc["family"] == "qwen3_moe" and doc["problems"] == []

    bad = _draft(tmp_path, tiny_qwen3_moe_config(), name="bad", num_experts=8)
    proc = _cli("validate-pair", "--target", str(targets["qwen3_moe"]), "--draft", str(bad))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and "field `num_experts`" in proc.stderr
    proc = _cli("validate-pair", "--target", str(targets["qwen3_moe"]), "--draft", str(bad), "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["problems"][0]["field"] == "num_experts"

    # a corrupt draft file: one clean error naming the file
    (bad / "model.safetensors").write_bytes(b"\x05\x00")
    proc = _cli("validate-pair", "--target", str(targets["qwen3_moe"]), "--draft", str(bad))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "model.safetensors" in proc.stderr
    # missing directory
    proc = _cli("validate-pair", "--target", str(tmp_path / "nope"), "--draft", str(good))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "nope" in proc.stderr


def test_validate_pair_help():
    proc = _cli("validate-pair", "--help")
    assert proc.returncode == 0
    for flag in ("--target", "--draft", "--json"):
        assert flag in proc.stdout


def test_inspect_draft(targets, tmp_path):
    d = _draft(tmp_path, tiny_qwen3_config())
    proc = _cli("inspect-checkpoint", str(d), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["kind"] == "draft" and doc["verdict"] == "ok"
    names = {t["name"] for t in doc["tensors"]}
    assert {"fc.weight", "candidate_selector.predecessor_codebook", "layers.0.mlp_conv.base_kernel"} <= names


def test_recipe_family_must_match_the_target(tmp_path):
    """capture / preflight / train refuse a recipe whose `[model].family` is not the target's."""
    from dflash_worker.families import check_recipe_pair
    from dflash_worker.testing.tiny import save_tiny_dflash2_draft, save_tiny_target

    target = tmp_path / "moe"
    model = save_tiny_target(target, family="qwen3_moe")
    draft = tmp_path / "draft"
    save_tiny_dflash2_draft(draft, model.config)
    assert check_recipe_pair(target, draft, "qwen3_moe").family == "qwen3_moe"
    with pytest.raises(FamilyError, match=r"recipe says `\[model\].family = \"qwen3\"`.*qwen3_moe"):
        check_recipe_pair(target, draft, "qwen3")


# --------------------------------------------------------------------------- DFlash (v1) drafts


def _v1_draft(tmp_path, target_dir, name="v1"):
    from dflash_worker.model import DraftConfig, build_draft, save_draft
    from dflash_worker.testing.tiny_draft import tiny_dflash_config
    from dflash_worker.testing.world import target_config

    path = tmp_path / name
    save_draft(build_draft(DraftConfig.from_dict(tiny_dflash_config(target_config(target_dir))), seed=0), path,
               dtype=torch.bfloat16)
    return path


@pytest.mark.parametrize("fam", ["qwen3", "qwen3_moe"])
def test_dflash_v1_draft_fits_without_a_selector(targets, tmp_path, fam):
    from dflash_worker.families import draft_kind, read_checkpoint_info

    d = _v1_draft(tmp_path, targets[fam])
    assert draft_kind(read_checkpoint_info(d)) == "dflash"
    rep = validate_pair(targets[fam], d)
    assert rep.family == fam and rep.draft.selector_rank is None
    proc = _cli("validate-pair", "--target", str(targets[fam]), "--draft", str(d))
    assert proc.returncode == 0 and proc.stdout.startswith("ok: draft fits target"), proc.stderr


def test_dflash_v1_config_over_dflash2_tensors_is_refused(targets, tmp_path):
    # a DFlash2 checkpoint whose config says v1: the model would drop the selector and convolutions silently
    d = _draft(tmp_path, tiny_qwen3_config())
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    msg = _fails(targets["qwen3"], d, "candidate_selector.hidden_projection.weight")
    assert "is a DFlash (v1) draft but the checkpoint holds DFlash2 tensors" in msg


def test_dflash2_config_without_its_selector_is_still_refused(targets, tmp_path):
    d = _v1_draft(tmp_path, targets["qwen3"], name="says-v2")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["DFlash2DraftModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    _fails(targets["qwen3"], d, "candidate_selector.predecessor_codebook")
