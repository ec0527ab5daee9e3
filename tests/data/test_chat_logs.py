"""Chat logs with tools: the schema, malformed rows, rendering against the real Qwen3 / Qwen3.5
templates (`apply_chat_template` is the oracle), every-turn loss masks, and per-row thinking."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from dflash_worker.data import PreparedData, check_data, prepare_data, render_example, resolve_thinking
from dflash_worker.data.render import assistant_spans
from dflash_worker.errors import DataError

from .conftest import write_jsonl

TEMPLATES = Path(__file__).parent / "chat_templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALC = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}


def call(name, args, id=None):
    c = {"type": "function", "function": {"name": name, "arguments": args}}
    if id is not None:
        c["id"] = id
    return c


# Valid rows, written for this test: one of each shape a serving log holds.
VALID = [
    # single turn with reasoning (thinking on by its own mode)
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "What is seven plus three?"},
                  {"role": "assistant", "content": "Ten.", "reasoning_content": "seven and three make ten"}]},
    # a tool call (arguments an object) with reasoning, its result, the answer
    {"tools": [WEATHER],
     "messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "reasoning_content": "I should call the tool",
                   "tool_calls": [call("get_weather", {"city": "Paris"}, id="c1")]},
                  {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny, 21 C"},
                  {"role": "assistant", "content": "Sunny and 21 C.", "reasoning_content": "the tool said sunny"}]},
    # two parallel calls, arguments as JSON strings, null content; then a second user turn
    {"tools": [WEATHER, CALC], "source": "agent",
     "messages": [{"role": "system", "content": "Use tools."},
                  {"role": "user", "content": "Add 2 and 3, and weather in Oslo."},
                  {"role": "assistant", "content": None,
                   "tool_calls": [call("add", '{"a": 2, "b": 3}', id="x1"), call("get_weather", '{"city":"Oslo"}', id="x2")]},
                  {"role": "tool", "tool_call_id": "x1", "content": "5"},
                  {"role": "tool", "tool_call_id": "x2", "content": "rain"},
                  {"role": "assistant", "content": "5, and rain in Oslo."},
                  {"role": "user", "content": "Thanks!"},
                  {"role": "assistant", "content": "You are welcome."}]},
    # multi-turn without tools, explicitly thinking off
    {"thinking": False,
     "messages": [{"role": "user", "content": "Name a river."},
                  {"role": "assistant", "content": "The Seine."},
                  {"role": "user", "content": "Another?"},
                  {"role": "assistant", "content": "The Rhine."}]},
    # reasoning on an earlier turn, a tool call named but without ids
    {"tools": [CALC],
     "messages": [{"role": "user", "content": "What is 4 plus 4?"},
                  {"role": "assistant", "content": "Let me add.", "reasoning_content": "use add",
                   "tool_calls": [call("add", {"a": 4, "b": 4})]},
                  {"role": "tool", "name": "add", "content": "8"},
                  {"role": "assistant", "content": "Eight.", "reasoning_content": "the tool said 8"}]},
]
# per_row mode of each valid row: its `thinking`, else whether it carries reasoning
VALID_MODES = [True, True, False, False, True]

BASE = [{"role": "user", "content": "hi"}]
# Malformed rows, one per refusal kind (reason key, a word the message must contain).
BAD = {
    "unmatched_id": ({"messages": [*BASE, {"role": "assistant", "content": "", "tool_calls": [call("add", {}, id="a")]},
                                   {"role": "tool", "tool_call_id": "zzz", "content": "1"}]},
                     "unmatched_tool_result", "zzz"),
    "result_without_call": ({"messages": [*BASE, {"role": "tool", "content": "1"}]}, "unmatched_tool_result", "made no tool call"),
    "args_not_json": ({"messages": [*BASE, {"role": "assistant", "content": "", "tool_calls": [call("add", "{a: 1")]}]},
                      "bad_tool_arguments", "not valid JSON"),
    "args_not_object": ({"messages": [*BASE, {"role": "assistant", "content": "", "tool_calls": [call("add", "[1, 2]")]}]},
                        "bad_tool_arguments", "JSON object"),
    "calls_on_user": ({"messages": [{"role": "user", "content": "x", "tool_calls": [call("add", {})]}]},
                      "misplaced_tool_calls", "`user` turn"),
    "bad_tools_entry": ({"tools": [{"name": "add"}], "messages": [*BASE, {"role": "assistant", "content": "ok"}]},
                        "bad_tools", "tools[0]"),
    "unknown_role": ({"messages": [*BASE, {"role": "developer", "content": "x"}]}, "bad_role", "developer"),
    "call_without_name": ({"messages": [*BASE, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"arguments": {}}}]}]},  # noqa: E501
                          "bad_tool_call", "name"),
    "empty_content_no_calls": ({"messages": [*BASE, {"role": "assistant", "content": ""}]}, "empty_content", "empty"),
}


def template_tokenizer(name: str):
    from dflash_worker.testing.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(tool_tokens=True)
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return tok


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def real(request):
    return request.param, template_tokenizer(request.param)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    f = write_jsonl(d / "chat.jsonl", VALID)
    prepare_data([f], d / "out", split="train")
    return PreparedData(d / "out")


def oracle(tok, messages, tools, enable):
    kw = {"tools": list(tools)} if tools else {}
    return tok.apply_chat_template(list(messages), tokenize=False, enable_thinking=enable, **kw)


def masked_runs(tok, r):
    """The decoded text of each run of trained tokens."""
    runs, cur = [], None
    for i, m in zip(r.input_ids, r.loss_mask):
        if m and cur is None:
            cur = []
        if m:
            cur.append(i)
        elif cur is not None:
            runs.append(tok.decode(cur, skip_special_tokens=False))
            cur = None
    if cur is not None:
        runs.append(tok.decode(cur, skip_special_tokens=False))
    return runs


def test_template_fixtures_are_the_recorded_bytes():
    import hashlib

    readme = (TEMPLATES / "README.md").read_text()
    for name in ("qwen3", "qwen3_5"):
        digest = hashlib.sha256((TEMPLATES / f"{name}.jinja").read_bytes()).hexdigest()
        assert digest in readme, name


def test_valid_rows_are_normalised(prepared):
    rows = list(prepared.examples())
    assert len(rows) == len(VALID)
    assert [r.thinking for r in rows] == VALID_MODES
    parallel = rows[2].messages[2]
    # arguments given as JSON strings are stored as objects; null content beside calls is ""
    assert parallel["content"] == ""
    assert [c["function"]["arguments"] for c in parallel["tool_calls"]] == [{"a": 2, "b": 3}, {"city": "Oslo"}]
    assert rows[1].tools == (WEATHER,) and rows[0].tools is None
    assert rows[2].source == "agent"
    raw = [json.loads(x) for x in prepared.split_path("train").read_text().splitlines()]
    assert [x["thinking"] for x in raw] == VALID_MODES


def test_null_message_keys_are_dropped_and_unknown_ones_refused(tmp_path):
    row = {"messages": [{"role": "user", "content": "hi", "name": None},
                        {"role": "assistant", "content": "yo", "refusal": None, "tool_calls": None, "reasoning_content": None}]}
    f = write_jsonl(tmp_path / "chat.jsonl", [row, {"messages": [{"role": "user", "content": "x", "refusal": "no"}]}])
    with pytest.raises(DataError, match=r"line 2: `messages\[0\]` has unsupported key `refusal`"):
        prepare_data([f], tmp_path / "out")
    prepare_data([f], tmp_path / "out", split="train", skip_invalid=True)
    (ex,) = PreparedData(tmp_path / "out").examples()
    assert list(ex.messages) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_row_refused_with_file_line_and_reason(tmp_path, case):
    row, reason, word = BAD[case]
    f = write_jsonl(tmp_path / "chat.jsonl", [VALID[0], VALID[1], row, VALID[2]])
    with pytest.raises(DataError) as exc:
        prepare_data([f], tmp_path / "out")
    msg = str(exc.value)
    assert "chat.jsonl" in msg and "line 3" in msg and word in msg, msg
    m = prepare_data([f], tmp_path / "out", skip_invalid=True, split="train")
    assert m["dropped"] == {reason: 1}, m["drops_listed"]
    assert m["drops_listed"][0]["line"] == 3


def test_skip_invalid_drops_every_bad_kind_counted_and_keeps_every_other_row(tmp_path):
    lines = []
    for i, v in enumerate(VALID):
        lines += [v, BAD[sorted(BAD)[i]][0]]
    lines += [BAD[k][0] for k in sorted(BAD)[len(VALID):]]
    f = write_jsonl(tmp_path / "chat.jsonl", lines)
    m = prepare_data([f], tmp_path / "out", skip_invalid=True, split="train")
    assert m["dropped"] == dict(Counter(reason for _, reason, _ in BAD.values()))
    assert m["dropped_total"] == len(BAD)
    kept = list(PreparedData(tmp_path / "out").examples())
    assert [e.origin["line"] for e in kept] == [1, 3, 5, 7, 9]


@pytest.mark.parametrize("setting", ["per_row", "on", "off"])
def test_rendering_is_byte_identical_to_apply_chat_template(prepared, real, setting):
    _, tok = real
    for ex in prepared.examples():
        enable = resolve_thinking(setting, ex)
        r = render_example(tok, ex.messages, thinking=enable, tools=ex.tools, train_turns="all")
        # thinking off removes reasoning before rendering (module docstring of render)
        msgs = [m if enable else {k: v for k, v in m.items() if k != "reasoning_content"} for m in ex.messages]
        want = oracle(tok, msgs, ex.tools, enable)
        assert tok.decode(r.input_ids, skip_special_tokens=False) == want
        assert r.input_ids == tok(want, add_special_tokens=False)["input_ids"]
        if setting == "per_row" and (ex.thinking or not any(m.get("reasoning_content") for m in ex.messages)):
            # rows whose own mode keeps every field: the oracle of the stored messages as they are
            assert want == oracle(tok, ex.messages, ex.tools, ex.thinking)


# What each template trains in VALID[2] (parallel calls, then a second user turn), thinking off:
# every assistant turn's tokens from where generation starts through `<|im_end|>`.
EXPECTED_RUNS = {
    "qwen3": [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
        "5, and rain in Oslo.<|im_end|>",
        "You are welcome.<|im_end|>",
    ],
    "qwen3_5": [
        "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>"
        "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call><|im_end|>",
        "5, and rain in Oslo.<|im_end|>",
        "You are welcome.<|im_end|>",
    ],
}


def test_loss_mask_is_exactly_every_assistant_turn(prepared, real):
    name, tok = real
    ex = list(prepared.examples())[2]
    r = render_example(tok, ex.messages, thinking="off", tools=ex.tools, train_turns="all")
    assert masked_runs(tok, r) == EXPECTED_RUNS[name]
    last = render_example(tok, ex.messages, thinking="off", tools=ex.tools, train_turns="last")
    assert masked_runs(tok, last) == EXPECTED_RUNS[name][-1:]
    assert last.input_ids == r.input_ids
    # prompt_length: the tokens before the first trained one
    assert r.loss_mask[: r.prompt_length] == [0] * r.prompt_length and r.loss_mask[r.prompt_length] == 1
    assert tok.decode(r.input_ids[: r.prompt_length], skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_loss_mask_with_reasoning_follows_each_template(prepared, real):
    name, tok = real
    ex = list(prepared.examples())[1]  # tool call with reasoning, then the answer with reasoning
    r = render_example(tok, ex.messages, thinking="on", tools=ex.tools, train_turns="all")
    call_text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' if name == "qwen3"
                 else "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
    if name == "qwen3":  # both turns follow the last user query: both keep their think blocks
        want = ["<think>\nI should call the tool\n</think>\n\n" + call_text + "<|im_end|>",
                "<think>\nthe tool said sunny\n</think>\n\nSunny and 21 C.<|im_end|>"]
    else:  # Qwen3.5's generation prompt opens the think block, so training starts inside it
        want = ["I should call the tool\n</think>\n\n" + call_text + "<|im_end|>",
                "the tool said sunny\n</think>\n\nSunny and 21 C.<|im_end|>"]
    assert masked_runs(tok, r) == want
    # never a system, user or tool-result token
    for run in masked_runs(tok, r):
        assert "sunny, 21 C" not in run and "Weather in Paris?" not in run


def test_earlier_turn_rendered_without_its_reasoning_is_found(prepared):
    tok = template_tokenizer("qwen3")
    ex = list(prepared.examples())[0]
    msgs = [*ex.messages, {"role": "user", "content": "And eight plus one?"},
            {"role": "assistant", "content": "Nine.", "reasoning_content": "eight and one"}]
    r = render_example(tok, msgs, thinking="on", train_turns="all")
    # Qwen3 drops the first answer's reasoning (it precedes the last user query): only its content trains
    assert masked_runs(tok, r) == ["Ten.<|im_end|>", "<think>\neight and one\n</think>\n\nNine.<|im_end|>"]


def test_template_that_drops_a_turn_is_refused(tiny_tokenizer):
    from dflash_worker.testing.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = ("{%- for m in messages %}{%- if m.role != 'assistant' or loop.last %}"
                         "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
                         "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(DataError, match=r"does not render assistant turn `messages\[1\]`"):
        render_example(tok, msgs, thinking="off", train_turns="all")
    assert render_example(tok, msgs, thinking="off", train_turns="last").response_tokens > 0
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert len(assistant_spans(tok, msgs, full, enable=False, turns=[3])) == 1


def test_resolve_thinking():
    class Ex:
        messages = ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"})

    assert resolve_thinking("per_row", Ex()) is True  # no `thinking` attribute: from the messages
    Ex.thinking = False
    assert resolve_thinking("per_row", Ex()) is False
    assert resolve_thinking("on", Ex()) is True and resolve_thinking("off", Ex()) is False
    with pytest.raises(DataError, match="per_row"):
        resolve_thinking("sometimes", Ex())


@pytest.fixture(scope="module")
def mixed_target(tmp_path_factory):
    """A tokenizer-only target with the real Qwen3 template and the tool tokens."""
    from dflash_worker.testing.tokenizer import save_tiny_tokenizer

    d = tmp_path_factory.mktemp("qwen3_target")
    tok = template_tokenizer("qwen3")
    save_tiny_tokenizer(d, tok)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": len(tok)}))
    return d, tok


def test_per_row_renders_each_row_in_its_mode_and_check_data_counts_per_mode(prepared, mixed_target, capsys):
    target, tok = mixed_target
    want = {"on": Counter(), "off": Counter()}
    for ex in prepared.examples():
        mode = "on" if ex.thinking else "off"
        msgs = ex.messages if ex.thinking else [{k: v for k, v in m.items() if k != "reasoning_content"} for m in ex.messages]
        ids = tok(oracle(tok, msgs, ex.tools, ex.thinking), add_special_tokens=False)["input_ids"]
        r = render_example(tok, ex.messages, thinking=resolve_thinking("per_row", ex), tools=ex.tools, train_turns="all")
        assert r.input_ids == ids
        want[mode].update(examples=1, tokens=len(ids), loss_tokens=r.response_tokens)
    rep = check_data(prepared, target, thinking="per_row", max_length=4096, splits=("train",))
    assert rep.ok, rep.failures
    assert rep.by_mode == {m: {k: want[m][k] for k in ("examples", "tokens", "loss_tokens")} for m in ("on", "off")}
    assert rep.by_mode["on"]["examples"] == 3 and rep.by_mode["off"]["examples"] == 2
    last = check_data(prepared, target, thinking="per_row", max_length=4096, splits=("train",), train_turns="last")
    assert last.by_mode["on"]["tokens"] == rep.by_mode["on"]["tokens"]
    assert last.loss_tokens < rep.loss_tokens  # earlier turns no longer train

    from dflash_worker.commands import check_data as cmd

    args = argparse.Namespace(data=str(prepared.path), target=str(target), thinking="per_row", max_length=4096,
                              regenerate=False, split=["train"], json=False, train_turns="all")
    assert cmd.run(args) == 0
    out = capsys.readouterr().out
    on, off = rep.by_mode["on"], rep.by_mode["off"]
    assert (f"by thinking mode: on 3 examples, {on['tokens']} tokens, {on['loss_tokens']} response tokens; "
            f"off 2 examples, {off['tokens']} tokens, {off['loss_tokens']} response tokens") in out


def _conversation(draw_turns, words):
    """A conversation from drawn turn kinds: `q` user question, `a` answer, `t` tool call + result."""
    msgs, n = [], 0
    for kind, w in zip(draw_turns, words, strict=True):
        if kind == "q" or not msgs:
            msgs.append({"role": "user", "content": f"question {w}?"})
        if kind == "t":
            n += 1
            msgs.append({"role": "assistant", "content": "" if n % 2 else f"calling {w}", "reasoning_content": f"need {w}",
                         "tool_calls": [call("add", {"a": n, "b": w}, id=f"c{n}")]})
            msgs.append({"role": "tool", "tool_call_id": f"c{n}", "content": f"result {w}"})
        msgs.append({"role": "assistant", "content": f"answer {w}.", **({"reasoning_content": f"think {w}"} if n % 2 else {})})
    return msgs


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_every_assistant_turn_is_one_trained_run_ending_at_end_of_turn(name):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tok = template_tokenizer(name)
    kinds = st.lists(st.sampled_from("qat"), min_size=1, max_size=5)

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(kinds=kinds, enable=st.booleans(), seed=st.integers(0, 99))
    def check(kinds, enable, seed):
        msgs = _conversation(kinds, [seed + i for i in range(len(kinds))])
        clean = [m if enable else {k: v for k, v in m.items() if k != "reasoning_content"} for m in msgs]
        r = render_example(tok, msgs, thinking=enable, tools=[CALC], train_turns="all")
        assert tok.decode(r.input_ids, skip_special_tokens=False) == oracle(tok, clean, [CALC], enable)
        got = masked_runs(tok, r)
        assert len(got) == sum(m["role"] == "assistant" for m in msgs)
        assert all(run.endswith("<|im_end|>") and run.count("<|im_end|>") == 1 for run in got)
        assert not any("question" in run or "result" in run or "<|im_start|>" in run for run in got)

    check()
