"""Issue 53's must-show: a job on the multi-turn tool world (chat logs with tool calls and results, rows in
both thinking modes) through the real coordinator, run-manager and worker on loopback, with
`[data].thinking = "per_row"` and `[data].train_turns = "all"`.

The job must complete; both modes must be present in what it prepared and in what it evaluated; and what it
captured must train exactly the assistant turns of every conversation: one run of trained tokens per
assistant turn (its tool calls or answer, ending at its `<|im_end|>`), never a user or tool-result token.
The target is a tiny Qwen3 whose tokenizer holds the released Qwen3 chat template (it renders tools)."""

from __future__ import annotations

import json

import pytest
from e2e_helpers import run_one_job
from loss_masks import mask_runs

pytestmark = pytest.mark.slow

TEMPLATE = "qwen3.jinja"


@pytest.fixture(scope="module")
def tool_world(tmp_path_factory, binaries):
    from launchers import REPO

    from dflash_worker.testing.world import build_world

    template = (REPO / "tests" / "data" / "chat_templates" / TEMPLATE).read_text(encoding="utf-8")
    return build_world(tmp_path_factory.mktemp("world-tool"), kind="tool", examples=16, chat_template=template)


def tool_spec(world) -> dict:
    from dflash_worker.testing.world import job_spec

    spec = job_spec(world, steps=4, checkpoint_every=2)
    spec["recipe"]["train"].update(val_every=4, val_examples=2)
    spec["recipe"]["evaluate"] = {"max_new_tokens": 8}
    spec["evaluate"] = {"split": "test", "max_prompts": 4}
    return spec


def captured(capture_dir) -> dict[tuple[str, str], tuple[list[int], list[int]]]:
    """(split, example id) -> (input ids, loss mask) of every example of a finished capture (shards hash-verified)."""
    from dflash_worker.capture.reader import open_capture

    return {(e.split, e.id): (e.input_ids.tolist(), e.loss_mask.int().tolist()) for e in open_capture(capture_dir)}


def test_a_tool_world_job_trains_every_assistant_turn_in_both_thinking_modes(tmp_path, procs, tool_world):
    from dflash_worker.data import PreparedData, load_tokenizer

    spec = tool_spec(tool_world)
    data = spec["recipe"]["data"]
    assert (data["thinking"], data["train_turns"]) == ("per_row", "all"), data
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=30, warm=True)
    run_id, job, rm = run_one_job(procs, coord, tmp_path / "work", "tool-world", spec, warm=True)
    assert job["state"] == "succeeded" and job["attempts"] == 1, json.dumps(job, indent=1)

    # What the job prepared: every row kept (no --skip-invalid), both modes among them.
    job_dir = (tmp_path / "work" / "jobs" / job["job_id"]).resolve()
    manifest = json.loads(coord.fetch(run_id, "data/manifest.json", tmp_path / "admin" / "data-manifest.json").read_text())
    assert manifest["counts"]["rows"] == 16, manifest["counts"]
    prepared = PreparedData(job_dir / "data")
    examples = {(ex.split, ex.id): ex for ex in prepared.examples(("train", "val", "test"))}
    modes = {ex.thinking for ex in examples.values() if ex.split in ("train", "val")}
    assert modes == {True, False}, modes

    # What it captured (train and val): one trained run per assistant turn, exactly that turn's tokens.
    tok = load_tokenizer(tool_world.target)
    got = captured(job_dir / "capture")
    assert got and {k[0] for k in got} == {"train", "val"}
    assert set(got) == {k for k in examples if k[0] in ("train", "val")}
    turns = 0
    for key, (ids, mask) in got.items():
        ex = examples[key]
        assistants = [(i, m) for i, m in enumerate(ex.messages) if m["role"] == "assistant"]
        last_user = max(i for i, m in enumerate(ex.messages) if m["role"] == "user")
        trained = mask_runs(mask)
        assert len(trained) == len(assistants), (key, trained)
        for (a, b), (i, m) in zip(trained, assistants, strict=True):
            text = tok.decode(ids[a:b], skip_special_tokens=False)
            assert text.endswith("<|im_end|>") and m["content"] in text, text
            assert all(f'"name": "{c["function"]["name"]}"' in text for c in m.get("tool_calls") or ()), text
            assert "<tool_response>" not in text and "<|im_start|>user" not in text, text
            # reasoning trains where its row's mode keeps it and the Qwen3 template renders it (after the last user turn)
            if m.get("reasoning_content"):
                assert (m["reasoning_content"] in text) is (ex.thinking and i > last_user), (ex.thinking, i, text)
        untrained = tok.decode([t for t, k in zip(ids, mask, strict=True) if not k], skip_special_tokens=False)
        assert all(m["content"] in untrained for m in ex.messages if m["role"] in ("user", "tool")), key
        turns += len(assistants)
    cap = json.loads(coord.fetch(run_id, "capture/manifest.json", tmp_path / "admin" / "capture-manifest.json").read_text())
    assert cap["recipe"]["data"]["train_turns"] == "all" and cap["recipe"]["data"]["thinking"] == "per_row", cap["recipe"]["data"]
    assert cap["totals"]["loss_tokens"] == sum(sum(m) for _, m in got.values()), cap["totals"]
    assert turns > len(got)  # multi-turn rows: more trained turns than examples

    # What it evaluated: the held-out prompts in both modes, scored per mode beside the pooled figure.
    report = json.loads(coord.fetch(run_id, "eval/report.json", tmp_path / "admin" / "report.json").read_text())
    assert report["prompts"] == 4 and report["trained"]["verify_steps"] > 0, report
    by_mode = report["trained"]["modes"]
    assert {m for m, v in by_mode.items() if v.get("prompts")} == {"on", "off"}, by_mode
    (tmp_path / "rm.log").write_text(rm.text())
    print(f"tool world: {len(got)} captured examples, {turns} assistant turns trained; "
          f"pooled tau {report['baseline']['tau_pooled']:.3f} -> {report['trained']['tau_pooled']:.3f}; modes {by_mode}")
