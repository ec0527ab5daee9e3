"""strict_json: the one duplicate-key hook behind every strict JSON parser."""

from __future__ import annotations

import json

import pytest

from dflash_worker.coordinator.store import parse_spec_json
from dflash_worker.errors import ConfigError
from dflash_worker.strict_json import DuplicateKeyError, no_duplicate_keys


def test_hook_keeps_distinct_keys_in_order():
    assert list(json.loads('{"b": 1, "a": {"b": 2}}', object_pairs_hook=no_duplicate_keys)) == ["b", "a"]


@pytest.mark.parametrize("text", ['{"a": 1, "a": 1}', '{"x": {"a": 1, "a": 2}}', '[{"a": 1, "a": 2}]'])
def test_hook_refuses_a_repeated_key_at_any_depth(text):
    with pytest.raises(DuplicateKeyError) as info:
        json.loads(text, object_pairs_hook=no_duplicate_keys)
    assert info.value.key == "a"
    assert str(info.value) == "duplicate key `a`"
    assert isinstance(info.value, ValueError)


def test_coordinator_spec_names_the_duplicate_key():
    with pytest.raises(ConfigError, match=r"^`spec.spec_json` is not valid JSON: duplicate key `stages`\n"):
        parse_spec_json('{"stages": [], "stages": ["noop"]}')
