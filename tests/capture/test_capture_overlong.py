"""capture through the CLI: `--on-overlong skip|truncate|fail`, stop ids in the manifest, summary on stdout."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from prewarmed import worker_cli

from dflash_worker.capture import open_capture
from dflash_worker.data import PreparedData, render_example, render_prompt
from dflash_worker.recipe import load_recipe

from .conftest import one_thread_env, write_recipe

MAX_LENGTH = 160


@pytest.fixture(scope="module")
def long_data(tmp_path_factory, cap_tokenizer) -> tuple[Path, dict[str, int], str]:
    """Prepared data, all in `train`: short rows, two with responses over `MAX_LENGTH`, one whose
    prompt alone is over it. Returns (dir, {id of each overlong example: its length}, the long prompt's id)."""
    from dflash_worker.data import prepare_data
    from dflash_worker.testing.tokenizer import corpus_lines

    d = tmp_path_factory.mktemp("long")
    lines = corpus_lines(40, seed=11)
    rows = [{"prompt": lines[i], "response": lines[i + 1]} for i in range(0, 16, 2)]
    rows += [{"prompt": lines[20], "response": " ".join(lines[21:33])}, {"prompt": lines[22], "response": " ".join(lines[23:35])}]
    rows += [{"prompt": " ".join(lines[:14]), "response": lines[39]}]
    src = d / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_data([src], d / "prepared", seed=1, val_fraction=0.0, test_fraction=0.0)
    prepared = PreparedData(d / "prepared")
    lengths, long_prompt = {}, None
    for ex in prepared.examples(("train",)):
        n = len(render_example(cap_tokenizer, ex.messages, thinking="off").input_ids)
        if n > MAX_LENGTH:
            lengths[ex.id] = n
        if len(render_prompt(cap_tokenizer, ex.prompt_messages, thinking="off")) >= MAX_LENGTH:
            long_prompt = ex.id
    assert len(lengths) == 3 and long_prompt in lengths, "the fixture must hold three overlong examples, one by its prompt"
    return d / "prepared", lengths, long_prompt


def _cli(recipe: Path, *flags: str) -> subprocess.CompletedProcess:
    return worker_cli("capture", "--recipe", recipe, *flags, timeout=300, env=one_thread_env())


def _recipe(tmp_path, targets, draft_dir, data, name="r", **capture) -> Path:
    return write_recipe(tmp_path / f"{name}.toml", target=targets["qwen3"], draft=draft_dir, data=data,
                        output=tmp_path / name, thinking="off", max_length=MAX_LENGTH, splits=["train"], **capture)


def test_skip_is_the_default_counted_listed_and_warned(tmp_path, targets, draft_dir, long_data):
    data, lengths, _ = long_data
    res = _cli(_recipe(tmp_path, targets, draft_dir, data), "--json")
    assert res.returncode == 0, res.stderr
    m = json.loads(res.stdout)  # stdout is exactly one JSON object
    ov = m["overlong"]
    assert ov["policy"] == "skip" and ov["count"] == 3
    assert sorted(ov["ids"]) == sorted(lengths) and sorted(ov["skipped"]) == sorted(lengths) and ov["truncated"] == []
    assert {e["id"]: e["tokens"] for e in ov["examples"]} == lengths
    warnings = [ln for ln in res.stderr.splitlines() if "over max_length" in ln]
    assert len(warnings) == 1 and "warning" in warnings[0] and "`3` skipped" in warnings[0]
    n_all = sum(1 for _ in PreparedData(data).examples(("train",)))
    assert m["totals"]["examples"] == n_all - 3
    assert m["key_inputs"]["on_overlong"] == "skip"


def test_truncate_cuts_to_max_length_and_skips_what_keeps_no_response(tmp_path, targets, draft_dir, long_data, cap_tokenizer):
    data, lengths, long_prompt = long_data
    res = _cli(_recipe(tmp_path, targets, draft_dir, data), "--on-overlong", "truncate", "--json")
    assert res.returncode == 0, res.stderr
    m = json.loads(res.stdout)
    ov = m["overlong"]
    assert ov["policy"] == "truncate" and ov["count"] == 3
    assert ov["skipped"] == [long_prompt] and sorted(ov["truncated"]) == sorted(set(lengths) - {long_prompt})
    assert m["recipe"]["capture"]["on_overlong"] == "truncate"  # the CLI flag over the recipe
    n_all = sum(1 for _ in PreparedData(data).examples(("train",)))
    assert m["totals"]["examples"] == n_all - 1

    prepared = {ex.id: ex for ex in PreparedData(data).examples(("train",))}
    cap = open_capture(tmp_path / "r")
    order = [ex.id for ex in PreparedData(data).examples(("train",)) if ex.id != long_prompt]
    captured = list(cap)
    assert len(captured) == len(order)
    seen = 0
    for ex, eid in zip(captured, order, strict=True):
        full = render_example(cap_tokenizer, prepared[eid].messages, thinking="off")
        if eid in ov["truncated"]:
            seen += 1
            assert len(ex.input_ids) == MAX_LENGTH and ex.features.shape[0] == MAX_LENGTH
            assert ex.input_ids.tolist() == full.input_ids[:MAX_LENGTH]
            assert ex.loss_mask.tolist() == full.loss_mask[:MAX_LENGTH] and int(ex.loss_mask.sum()) > 0
        else:
            assert ex.input_ids.tolist() == full.input_ids
    assert seen == 2


def test_fail_names_the_first_overlong_example(tmp_path, targets, draft_dir, long_data):
    data, lengths, _ = long_data
    r = _recipe(tmp_path, targets, draft_dir, data, on_overlong="fail")
    res = _cli(r)
    assert res.returncode == 1 and res.stdout == ""
    first = next(ex.id for ex in PreparedData(data).examples(("train",)) if ex.id in lengths)
    assert f"example `{first}`" in res.stderr and f"`{lengths[first]}` tokens, over max_length `{MAX_LENGTH}`" in res.stderr
    assert "`3` of" in res.stderr and "hint:" in res.stderr
    assert not (tmp_path / "r" / "manifest.json").exists()


def test_unknown_policy_is_refused_by_name(tmp_path, targets, draft_dir, long_data):
    from dflash_worker.errors import ConfigError

    r = _recipe(tmp_path, targets, draft_dir, long_data[0], on_overlong="clip")
    with pytest.raises(ConfigError, match=r"`\[capture\].on_overlong` is `clip`"):
        load_recipe(r)
    res = _cli(_recipe(tmp_path, targets, draft_dir, long_data[0], name="r2"), "--on-overlong", "clip")
    assert res.returncode != 0 and "invalid choice: 'clip'" in res.stderr


def test_stop_ids_in_manifest_follow_the_shared_rule_and_summary_is_on_stdout(tmp_path, targets, draft_dir, prepared_dir, cap_tokenizer):
    from dflash_worker.evaluate.report import STOP_RULE
    from dflash_worker.stop_tokens import stop_token_ids

    r = write_recipe(tmp_path / "s.toml", target=targets["qwen3"], draft=draft_dir, data=prepared_dir, output=tmp_path / "s")
    res = _cli(r)
    assert res.returncode == 0, res.stderr
    out = res.stdout.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("capture: ") and " examples, " in out[0] and "tokens" in out[0]
    assert "teacher loaded" in res.stderr and "teacher loaded" not in res.stdout
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert m["stop_token_ids"] == stop_token_ids(targets["qwen3"], cap_tokenizer) and m["stop_token_ids"]
    assert m["stop_token_rule"] == STOP_RULE
    flat = [i for ids in m["stop_token_sources"].values() for i in ids]
    assert list(dict.fromkeys(flat)) == m["stop_token_ids"] and "tokenizer" in m["stop_token_sources"]
    assert m["overlong"] == {"policy": "skip", "max_length": 256, "count": 0, "ids": [], "skipped": [], "truncated": [], "examples": []}
    assert "on_overlong" not in m["key_inputs"]  # no example over the limit: the capture key is what it was
    again = _cli(r, "--json")  # already complete: still one JSON object on stdout
    assert again.returncode == 0 and json.loads(again.stdout)["capture_key"] == m["capture_key"]
