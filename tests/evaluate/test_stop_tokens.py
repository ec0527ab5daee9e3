"""The one stop-token rule: generation-config eos ids, then the tokenizer's eos, repeats dropped, order kept."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflash_worker.errors import CheckpointError
from dflash_worker.stop_tokens import stop_token_ids


def _target(tmp_path, generation=None, config=None):
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_generation_config_list_then_tokenizer_eos(tmp_path):
    t = _target(tmp_path, {"eos_token_id": [7, 3]}, {"eos_token_id": 9})
    assert stop_token_ids(t, SimpleNamespace(eos_token_id=3)) == [7, 3]
    assert stop_token_ids(t, SimpleNamespace(eos_token_id=11)) == [7, 3, 11]


def test_int_and_fallback_to_config_json(tmp_path):
    assert stop_token_ids(_target(tmp_path, {"eos_token_id": 4}), SimpleNamespace(eos_token_id=None)) == [4]
    (tmp_path / "generation_config.json").unlink()
    _target(tmp_path, config={"eos_token_id": [9, 9, 2]})
    assert stop_token_ids(tmp_path, SimpleNamespace(eos_token_id=2)) == [9, 2]


def test_unreadable_generation_config_is_named(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json"):
        stop_token_ids(tmp_path, SimpleNamespace(eos_token_id=2))
