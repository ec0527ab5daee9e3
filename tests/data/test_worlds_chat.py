"""The chat-log worlds (`dflash_worker.testing.worlds_chat`): deterministic rows that `prepare-data` takes
strictly, both thinking modes under `per_row`, answers that follow from the tool results, and every assistant
turn trained under the released Qwen3 and Qwen3.5 templates."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest
from loss_masks import mask_runs

from dflash_worker.data import PreparedData, check_data, prepare_data, render_row
from dflash_worker.testing.worlds_chat import THINKING_SHAPES, thinking_rows, tool_row, tool_rows, weather, write_jsonl

from .test_chat_logs import TEMPLATES

N = 24


def digest(rows) -> str:
    return hashlib.sha256("".join(json.dumps(r, sort_keys=True) for r in rows).encode()).hexdigest()


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def tool_tokenizer(request):
    from dflash_worker.testing.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tool_tokens=True)
    tok.chat_template = (TEMPLATES / f"{request.param}.jinja").read_text(encoding="utf-8")
    return tok


def test_tool_rows_are_deterministic_by_seed_and_row():
    assert digest(tool_rows(N, seed=3)) == digest(tool_rows(N, seed=3))
    assert digest(tool_rows(N, seed=3)) != digest(tool_rows(N, seed=4))
    assert tool_rows(5, seed=3) == tool_rows(N, seed=3)[:5] and tool_row(7, seed=3) == tool_rows(N, seed=3)[7]


def test_tool_rows_answer_from_their_tool_results():
    seen = {"parallel": 0, "string_arguments": 0, "object_arguments": 0, "two_rounds": 0}
    for row in tool_rows(N, seed=0):
        msgs = row["messages"]
        names = {t["function"]["name"] for t in row["tools"]}
        rounds = 0
        for k, m in enumerate(msgs):
            if not m.get("tool_calls"):
                continue
            rounds += 1
            calls = m["tool_calls"]
            seen["parallel"] += len(calls) > 1
            results = msgs[k + 1 : k + 1 + len(calls)]
            answer = msgs[k + 1 + len(calls)]
            assert [r["role"] for r in results] == ["tool"] * len(calls) and answer["role"] == "assistant"
            for c, r in zip(calls, results, strict=True):
                assert r["tool_call_id"] == c["id"] and c["function"]["name"] in names
                args = c["function"]["arguments"]
                seen["string_arguments" if isinstance(args, str) else "object_arguments"] += 1
                args = json.loads(args) if isinstance(args, str) else args
                name = c["function"]["name"]
                if name == "add":
                    assert r["content"] == str(args["a"] + args["b"]) and f"is {r['content']}." in answer["content"]
                elif name == "get_weather":
                    w = weather(args["city"])
                    assert json.loads(r["content"]) == w
                    assert f"in {w['city']} it is {w['temp_c']} degrees and {w['sky']}" in answer["content"]
                else:
                    assert answer["content"] == f"The capital of {args['country']} is {r['content']}."
        seen["two_rounds"] += rounds == 2
        assert rounds >= 1
    assert all(seen.values()), seen


def test_tool_rows_prepare_strictly_and_train_every_assistant_turn_in_both_modes(tmp_path, tool_tokenizer):
    rows = tool_rows(N, seed=0)
    src = write_jsonl(tmp_path / "tool.jsonl", rows)
    man = prepare_data([src], tmp_path / "data", seed=0, val_fraction=0.2, test_fraction=0.2)  # no --skip-invalid
    assert man["counts"]["rows"] == N
    report = check_data(tmp_path / "data", tool_tokenizer, thinking="per_row", train_turns="all", max_length=4096)
    assert report.ok and report.failed == 0, report.to_dict()
    # both modes, each given explicitly and inferred from reasoning (THINKING_SHAPES cycles over the rows)
    want_on = sum(1 for i in range(N) if THINKING_SHAPES[i % 4][0] is True or THINKING_SHAPES[i % 4] == (None, True))
    assert report.by_mode["on"]["examples"] == want_on and report.by_mode["off"]["examples"] == N - want_on
    assert all(report.by_mode[m]["loss_tokens"] > 0 for m in ("on", "off")), report.by_mode
    data = SimpleNamespace(thinking="per_row", train_turns="all")
    last = SimpleNamespace(thinking="per_row", train_turns="last")
    for ex in PreparedData(tmp_path / "data").examples(("train", "val", "test")):
        assistants = [m for m in ex.messages if m["role"] == "assistant"]
        r = render_row(tool_tokenizer, ex, data)
        trained = mask_runs(r.loss_mask)
        assert len(trained) == len(assistants), (ex.id, trained)
        for (a, b), m in zip(trained, assistants, strict=True):
            text = tool_tokenizer.decode(r.input_ids[a:b], skip_special_tokens=False)
            assert text.endswith("<|im_end|>") and "<tool_response>" not in text and "user\n" not in text, text
            for c in m.get("tool_calls") or ():
                assert c["function"]["name"] in text
            assert m["content"] in text
        untrained = tool_tokenizer.decode([t for t, k in zip(r.input_ids, r.loss_mask, strict=True) if not k])
        assert all(m["content"] in untrained for m in ex.messages if m["role"] in ("user", "tool"))
        only_last = render_row(tool_tokenizer, ex, last)
        assert mask_runs(only_last.loss_mask) == trained[-1:] and only_last.input_ids == r.input_ids


def test_thinking_rows_mix_and_one_mode():
    rows = thinking_rows(40, seed=1, on_fraction=0.5)
    on = [r for r in rows if r["thinking"]]
    assert 0 < len(on) < 40 and all("reasoning_content" in r["messages"][-1] for r in on)
    assert all("reasoning_content" not in r["messages"][-1] for r in rows if not r["thinking"])
    assert thinking_rows(40, seed=1, one_mode=True) == on
    assert thinking_rows(40, seed=1, one_mode=False) == [r for r in rows if not r["thinking"]]
    assert digest(thinking_rows(40, seed=1)) != digest(thinking_rows(40, seed=2))
    assert all(r["thinking"] for r in thinking_rows(10, on_fraction=1.0))
    with pytest.raises(ValueError, match="on_fraction"):
        thinking_rows(3, on_fraction=1.5)


def test_thinking_rows_prepare_and_check_per_mode(tmp_path, tiny_tokenizer):
    rows = thinking_rows(30, seed=0)
    prepare_data([write_jsonl(tmp_path / "t.jsonl", rows)], tmp_path / "data", seed=0, val_fraction=0.0, test_fraction=0.0)
    report = check_data(tmp_path / "data", tiny_tokenizer, thinking="per_row", max_length=256, splits=("train",))
    assert report.ok, report.to_dict()
    n_on = sum(r["thinking"] for r in rows)
    assert (report.by_mode["on"]["examples"], report.by_mode["off"]["examples"]) == (n_on, 30 - n_on)
    # a thinking-on row trains its reasoning too: more response tokens per row than the off rows
    per_on = report.by_mode["on"]["loss_tokens"] / n_on
    per_off = report.by_mode["off"]["loss_tokens"] / (30 - n_on)
    assert per_on > per_off + 10, report.by_mode


def test_build_world_refuses_an_unknown_kind_and_a_tool_world_without_a_template(tmp_path):
    from dflash_worker.errors import ConfigError
    from dflash_worker.testing.world import build_world

    with pytest.raises(ConfigError, match="unknown world kind `chat`"):
        build_world(tmp_path / "a", kind="chat")
    with pytest.raises(ConfigError, match="chat template that renders tools"):
        build_world(tmp_path / "b", kind="tool")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
