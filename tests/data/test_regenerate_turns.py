"""Teacher regeneration of chat logs (`capture.generate.regenerate_example`): each row in its own
thinking mode, and with `train_turns = "all"` every assistant turn regenerated from its logged context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from loss_masks import mask_runs

from dflash_worker.capture.generate import regenerate_example
from dflash_worker.data import render_prompt
from dflash_worker.data.render import render_turns

from .test_chat_logs import TEMPLATES, VALID, call

MAX_NEW = 6


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from dflash_worker.testing.tokenizer import build_tiny_tokenizer, save_tiny_target_with_tokenizer

    tok = build_tiny_tokenizer(tool_tokens=True)
    tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
    d = tmp_path_factory.mktemp("t")
    model, tok = save_tiny_target_with_tokenizer(d, family="qwen3", tokenizer=tok)
    return d, model.float().eval(), tok


@pytest.fixture(scope="module")
def teacher(target_dir):
    return target_dir[1:]


def example(row, *, thinking, id="row"):
    msgs = tuple(row["messages"])
    has = msgs[-1]["role"] == "assistant"
    return SimpleNamespace(id=id, messages=msgs, tools=tuple(row["tools"]) if row.get("tools") else None,
                           thinking=thinking, prompt_messages=msgs[:-1] if has else msgs)


def regen(teacher, ex, *, thinking="per_row", train_turns="all", max_length=2048):
    model, tok = teacher
    data = SimpleNamespace(thinking=thinking, train_turns=train_turns, max_length=max_length)
    cap = SimpleNamespace(sampling="greedy", temperature=1.0, top_p=1.0, seed=0, max_new_tokens=MAX_NEW)
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    return regenerate_example(model, tok, ex, data=data, cap=cap, stop_ids=stop)


def argmax_continues(model, context, new):
    """True when every token of `new` is the teacher's greedy choice after `context` and the tokens before it."""
    ids = torch.tensor([context + new])
    with torch.no_grad():
        logits = model(ids).logits[0]
    return torch.equal(logits[len(context) - 1 : len(context) + len(new) - 1].argmax(-1), torch.tensor(new))


ROW = {"tools": VALID[2]["tools"], "messages": [
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 2, "b": 3}, id="x1")]},
    {"role": "tool", "tool_call_id": "x1", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."}]}


@pytest.mark.parametrize("own", [True, False])
def test_each_row_regenerates_in_its_own_mode(teacher, own):
    model, tok = teacher
    ex = example(VALID[0], thinking=own)
    g = regen(teacher, ex, thinking="per_row")
    first = g.mask.index(1)
    prompt = render_prompt(tok, ex.prompt_messages, thinking=own)
    assert g.ids[:first] == prompt
    text = tok.decode(prompt, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") is (not own)
    assert argmax_continues(model, prompt, g.ids[first:])


def test_every_turn_is_regenerated_from_its_logged_context(teacher):
    model, tok = teacher
    ex = example(ROW, thinking=False)
    g = regen(teacher, ex)
    logged = render_turns(tok, list(ex.prompt_messages), thinking=False, tools=ex.tools, generation=True)
    assert [i for i, _, _ in logged.turns] == [1, 3]
    trained = mask_runs(g.mask)
    assert len(trained) == 3  # the two earlier assistant turns and the response
    # each regenerated turn is the teacher's answer to the turns before it as logged (not as regenerated)
    for (i, _, _), (a, b) in zip(logged.turns, trained[:2], strict=True):
        context = render_prompt(tok, list(ex.prompt_messages[:i]), thinking=False, tools=ex.tools)
        assert argmax_continues(model, context, g.ids[a:b])
    assert argmax_continues(model, logged.input_ids, g.ids[trained[2][0]:])
    # everything untrained is the logged rendering outside the assistant turns: system, user and tool text as logged
    pieces, at = [], 0
    for _, a, b in logged.turns:
        pieces.append(logged.input_ids[at:a])
        at = b
    pieces.append(logged.input_ids[at:])
    untrained, at = [], 0
    for a, b in trained:
        untrained.append(g.ids[at:a])
        at = b
    assert untrained == pieces
    assert "<tool_response>\n5\n</tool_response>" in tok.decode(untrained[1], skip_special_tokens=False)


def test_last_regenerates_only_the_response_after_the_logged_prompt(teacher):
    model, tok = teacher
    ex = example(ROW, thinking=False)
    g = regen(teacher, ex, train_turns="last")
    prompt = render_prompt(tok, list(ex.prompt_messages), thinking=False, tools=ex.tools)
    assert g.ids[: len(prompt)] == prompt and g.mask == [0] * len(prompt) + [1] * (len(g.ids) - len(prompt))
    assert argmax_continues(model, prompt, g.ids[len(prompt):])


def test_a_sequence_over_max_length_is_cut_and_flagged(teacher):
    model, tok = teacher
    ex = example(ROW, thinking=False)
    full = regen(teacher, ex)
    context = render_prompt(tok, list(ex.prompt_messages[:1]), thinking=False, tools=ex.tools)
    for max_length in (len(full.ids) - 2, len(context) + 3):
        short = regen(teacher, ex, max_length=max_length)
        assert short.truncated and len(short.ids) <= max_length and len(short.mask) == len(short.ids)
        assert 0 < sum(short.mask) < sum(full.mask)
        # what is kept was still answered from the logged context, within the room left
        a, b = mask_runs(short.mask)[0]
        assert b - a <= max_length - len(context) and argmax_continues(model, context, short.ids[a:b])


def test_capture_key_names_train_turns_only_where_it_changes_a_byte(tmp_path, target_dir):
    from dflash_worker.capture.plan import capture_key
    from dflash_worker.data import PreparedData, prepare_data
    from dflash_worker.recipe import recipe_from_dict

    from .conftest import write_jsonl

    target, _, tok = target_dir
    for name, rows, differs in (("single", [VALID[0]], False), ("multi", [ROW], True)):
        data = tmp_path / name
        prepare_data([write_jsonl(tmp_path / f"{name}.jsonl", rows)], data, split="train")
        keys = {}
        for turns in ("all", "last"):
            recipe = recipe_from_dict({
                "model": {"target": str(target), "draft": str(target), "family": "qwen3"},
                "data": {"dir": str(data), "thinking": "per_row", "train_turns": turns},
                "capture": {"output": str(tmp_path / "cap"), "splits": ["train"]},
            }, base=tmp_path)
            keys[turns] = capture_key(recipe, PreparedData(data), tok, [0], "cpu")
        assert (keys["all"].key != keys["last"].key) is differs
        assert ("train_turns" in keys["all"].inputs) is differs
