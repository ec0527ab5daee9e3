"""Draft config parsing: precedence, defaults, kind detection, validation, round trip."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_worker.errors import ConfigError
from dflash_worker.model import DraftConfig, default_target_layer_ids
from dflash_worker.testing.tiny import tiny_qwen3_config
from dflash_worker.testing.tiny_draft import tiny_dflash2_config, tiny_dflash_config

from .conftest import ref_model


@pytest.fixture(scope="module")
def raw2():
    return tiny_dflash2_config(tiny_qwen3_config())


def test_tiny_builder(raw2):
    cfg = DraftConfig.from_dict(raw2)
    assert cfg.kind == "dflash2" and cfg.num_layers == 2 and cfg.block_size == 4
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == 6
    assert cfg.layer_is_causal(0) and not cfg.layer_is_causal(1) and cfg.layer_window(1) is None
    assert cfg.target_layer_ids == (0, 2) and cfg.context_width == 128
    assert DraftConfig.from_dict(tiny_dflash_config(tiny_qwen3_config())).kind == "dflash"
    over = DraftConfig.from_dict(tiny_dflash2_config(tiny_qwen3_config(), block_size=8, num_hidden_layers=3, conv_kernel_size=2))
    assert over.block_size == 8 and over.num_layers == 3 and over.conv_kernel_size == 2 and len(over.layer_types) == 3


def test_dflash_config_wins_over_top_level(raw2):
    raw = copy.deepcopy(raw2)
    raw["block_size"] = 16
    raw["mask_token_id"] = 7
    assert DraftConfig.from_dict(raw).block_size == 4 and DraftConfig.from_dict(raw).mask_token_id == 255
    del raw["dflash_config"]["block_size"], raw["dflash_config"]["mask_token_id"]
    cfg = DraftConfig.from_dict(raw)
    assert cfg.block_size == 16 and cfg.mask_token_id == 7


def test_input_is_not_mutated(raw2):
    before = json.dumps(raw2, sort_keys=True)
    DraftConfig.from_dict(raw2).to_dict()
    assert json.dumps(raw2, sort_keys=True) == before


@settings(max_examples=60, deadline=None)
@given(n_target=st.integers(4, 80), n_draft=st.integers(1, 8))
def test_default_target_layer_ids_match_reference(n_target, n_draft):
    assert default_target_layer_ids(n_target, n_draft) == ref_model.build_target_layer_ids(n_target, n_draft)


def test_default_target_layer_ids_used_when_absent(raw2):
    raw = copy.deepcopy(raw2)
    del raw["dflash_config"]["target_layer_ids"]
    raw["num_target_layers"] = 36
    assert DraftConfig.from_dict(raw).target_layer_ids == (1, 33)
    del raw["num_target_layers"]
    with pytest.raises(ConfigError, match="num_target_layers"):
        DraftConfig.from_dict(raw)


def test_kind_detection(raw2):
    raw = copy.deepcopy(raw2)
    del raw["architectures"]
    assert DraftConfig.from_dict(raw).kind == "dflash2"  # selector + conv fields present
    raw["architectures"] = ["DFlashDraftModel"]
    assert DraftConfig.from_dict(raw).kind == "dflash"


def test_round_trip(raw2):
    cfg = DraftConfig.from_dict(raw2)
    again = DraftConfig.from_dict(cfg.to_dict())
    assert again == cfg
    hf = cfg.hf_config()
    assert hf.layer_types == list(cfg.layer_types) and hf.dflash_config["selector_rank"] == 8


def test_geometry_defaults_follow_transformers():
    # no head_dim in the file: Qwen3Config's default applies, exactly as for the reference
    from transformers import Qwen3Config

    raw = tiny_dflash_config(tiny_qwen3_config())
    del raw["head_dim"]
    assert DraftConfig.from_dict(raw).head_dim == Qwen3Config(**raw).head_dim


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda r: r["dflash_config"].update(mask_token_id=256), "outside the vocabulary"),
        (lambda r: r["dflash_config"].update(block_size=1), "block_size"),
        (lambda r: r["dflash_config"].update(block_size="4"), "block_size"),
        (lambda r: r["dflash_config"].update(target_layer_ids=[0, 9]), "out of range"),
        (lambda r: r["dflash_config"].update(target_layer_ids=[]), "empty"),
        (lambda r: r["dflash_config"].update(target_layer_ids="0,2"), "must be a list"),
        (lambda r: r["dflash_config"].update(conv_group_size=24), "multiple of `conv_group_size`"),
        (lambda r: r["dflash_config"].pop("selector_rank"), "selector_rank"),
        (lambda r: r["dflash_config"].update(selector_top_k=1000), "selector_top_k"),
        (lambda r: r.update(layer_types=["full_attention"]), "layer_types"),
        (lambda r: r.update(layer_types=["global", "full_attention"]), "layer_types"),
        (lambda r: r.update(num_attention_heads=3), "num_attention_heads"),
        (lambda r: r.update(dflash_config=[1, 2]), "must be an object"),
        (lambda r: r.update(hidden_size="big"), "invalid draft config|hidden_size"),
    ],
)
def test_invalid_configs_raise_config_error(raw2, edit, match):
    raw = copy.deepcopy(raw2)
    edit(raw)
    with pytest.raises(ConfigError, match=match):
        DraftConfig.from_dict(raw, source="draft/config.json")


def test_error_names_the_file(raw2, tmp_path):
    raw = copy.deepcopy(raw2)
    raw["dflash_config"]["block_size"] = 0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        DraftConfig.from_file(tmp_path)
    assert str(path) in str(err.value) and "`block_size`" in str(err.value)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        DraftConfig.from_file(path)
