"""Rendering a conversation with the target's chat template into token ids and a loss mask.

The sequence is exactly what a server feeds the model: the whole conversation
rendered once by the tokenizer's own ``apply_chat_template(messages, tools=...,
enable_thinking=..., tokenize=False)`` and tokenized once (no special tokens
added: the template wrote every control token it wants). Nothing is rendered
piecewise, so the text is byte-identical to the template's and the ids to the
tokenizer's own ids of that text.

The loss mask is built from character spans of that text, one per assistant
turn (`assistant_spans`): a token is trained when its first character lies in
a span. A turn's span starts where generation starts (after the generation
prompt, e.g. ``<|im_start|>assistant\\n`` or, thinking off, the empty think block
after it) and runs through the end-of-turn text (``<|im_end|>``): reasoning
where the template renders it, content and tool calls. System, user and tool
turns, and the whitespace after an end-of-turn, are never trained.
``train_turns = "all"`` trains every assistant turn, ``"last"`` only the final
one. `RenderedExample.prompt_length` is the number of tokens before the first
trained token.

Finding the spans. Templates render a turn differently depending on what comes
after it (Qwen3 drops the reasoning of turns before the last user query and
gives the final turn an empty think block), so a turn is not found by
rendering prefixes of the conversation. Instead each assistant turn is
rendered twice inside the whole conversation, once as logged and once with
marker characters added to its fields; the two texts differ only inside that
turn, which locates its fields. The span then opens after the longest
whole-line prefix of the generation prompt (at least its first line, the role
header) found just before the fields, and closes after the first end-of-turn
text after them. So where a turn renders as generation starts (the final
turn; with Qwen3.5 any turn with a think block) what the generation prompt
holds (thinking off: the empty think block) stays context, as when served; an
earlier turn rendered without it trains from after the role header. A
template for which this fails (renders the turn nowhere, or no end-of-turn
after it) is refused with the turn named.

Thinking mode is always explicit: ``enable_thinking`` goes to the template.
With thinking off, ``reasoning_content`` is removed before rendering (a
thinking-off model answers after an empty think block, so training on the
reasoning would teach the wrong format). `resolve_thinking` is the one place
that turns the ``[data].thinking`` setting and an example into that flag.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DataError

THINKING_SETTINGS = ("on", "off", "per_row")
TRAIN_TURNS = ("last", "all")
# Private-use characters: never stripped or rewritten by a template, so they mark where a field renders.
_OPEN, _CLOSE, _PROBE = "\ue000", "\ue001", "\ue002"


@dataclass(frozen=True)
class RenderedExample:
    """Token ids and a 0/1 loss mask of equal length; the first `prompt_length` tokens are untrained."""

    input_ids: list[int]
    loss_mask: list[int]
    prompt_length: int

    @property
    def response_tokens(self) -> int:
        return sum(self.loss_mask)


def row_thinking(messages: Sequence[dict[str, Any]], explicit: bool | None = None) -> bool:
    """A row's own thinking mode: its explicit `"thinking"`, else whether an assistant turn has reasoning."""
    if explicit is not None:
        return bool(explicit)
    return any(m.get("role") == "assistant" and m.get("reasoning_content") for m in messages)


def resolve_thinking(setting: str, example: Any) -> bool:
    """`enable_thinking` for `example` under `[data].thinking = setting` (``on``, ``off`` or ``per_row``).

    With ``per_row`` the example's own mode: its `thinking` attribute (prepared rows store it),
    else `row_thinking` of its messages. Every consumer (capture, training, evaluation) calls this.
    """
    if setting == "on":
        return True
    if setting == "off":
        return False
    if setting == "per_row":
        own = getattr(example, "thinking", None)
        if isinstance(own, bool):
            return own
        return row_thinking(getattr(example, "messages", ()) or ())
    raise DataError(f"thinking mode is `{setting}`\nhint: use `on`, `off` or `per_row`")


def _thinking_flag(thinking: str | bool) -> bool:
    if isinstance(thinking, bool):
        return thinking
    if thinking in ("on", "off"):
        return thinking == "on"
    raise DataError(f"thinking mode is `{thinking}`\nhint: use `on` or `off` (resolve `per_row` with `resolve_thinking`)")


def _clean(messages: Sequence[dict[str, Any]], enable: bool) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m = dict(m)
        if not enable:
            m.pop("reasoning_content", None)
        out.append(m)
    return out


def _template(
    tokenizer: Any, messages: list[dict[str, Any]], *, generation: bool, enable: bool, tools: Sequence[dict[str, Any]] | None = None
) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the target's tokenizer has no chat template\nhint: the target dir needs `chat_template.jinja` or a `chat_template` in `tokenizer_config.json`")  # noqa: E501
    kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation, enable_thinking=enable, **kwargs
        )
    except Exception as exc:  # jinja errors of a user-supplied template, any class
        raise DataError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise DataError(f"chat template returned `{type(text).__name__}`, expected text")
    return text


def _encode(tokenizer: Any, text: str) -> list[int]:
    # add_special_tokens=False: the template already wrote every control token it wants.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """Token ids of `text` and the character offset where each token starts."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise DataError(
            "the target's tokenizer gives no character offsets (a slow tokenizer)\n"
            "hint: the target dir needs a `tokenizer.json` (a fast tokenizer)"
        ) from None
    return list(enc["input_ids"]), [int(a) for a, _ in enc["offset_mapping"]]


def render_prompt(
    tokenizer: Any, messages: Sequence[dict[str, Any]], *, thinking: str | bool, tools: Sequence[dict[str, Any]] | None = None
) -> list[int]:
    """Token ids of `messages` followed by the generation prompt (what generation starts from)."""
    enable = _thinking_flag(thinking)
    return _encode(tokenizer, _template(tokenizer, _clean(messages, enable), generation=True, enable=enable, tools=tools))


@dataclass(frozen=True)
class _Markers:
    """What a template writes around an assistant turn, learned from a one-turn probe."""

    generation: str  # the generation prompt (e.g. `<|im_start|>assistant\n`, + `<think>\n\n</think>\n\n` thinking off)
    header_min: int  # the shortest prefix of `generation` that still opens a turn (its first line)
    end_of_turn: str  # what follows a turn's last field (e.g. `<|im_end|>`), trailing whitespace excluded


def _markers(tokenizer: Any, enable: bool, tools: Sequence[dict[str, Any]] | None) -> _Markers:
    user = [{"role": "user", "content": "x"}]
    bare = _template(tokenizer, user, generation=False, enable=enable, tools=tools)
    with_gen = _template(tokenizer, user, generation=True, enable=enable, tools=tools)
    if not with_gen.startswith(bare) or len(with_gen) == len(bare):
        raise DataError("chat template renders no generation prompt after the conversation\n"
                        "hint: the template must support `add_generation_prompt`")
    generation = with_gen[len(bare):]
    first_line = generation.find("\n")
    header_min = len(generation) if first_line < 0 else first_line + 1
    probe = _template(tokenizer, [*user, {"role": "assistant", "content": _PROBE}], generation=False, enable=enable, tools=tools)
    at = probe.rfind(_PROBE)
    end_of_turn = probe[at + 1:].rstrip() if at >= 0 else ""
    if not end_of_turn:
        raise DataError("chat template writes no end-of-turn text after an assistant turn\n"
                        "hint: the loss needs the end-of-turn token; the template is not usable for training as is")
    return _Markers(generation=generation, header_min=header_min, end_of_turn=end_of_turn)


def _marked(m: dict[str, Any]) -> dict[str, Any]:
    """`m` with a marker character opening each rendered field and one closing its last field.

    Every field is opened (not only the first) because a template may drop one of them
    (Qwen3 drops the reasoning of turns before the last user query)."""
    m = dict(m)
    calls = [dict(c) for c in m.get("tool_calls") or []]
    for key in ("reasoning_content", "content"):
        if m.get(key):
            m[key] = _OPEN + m[key]
    if calls:
        calls[0] = _rename(calls[0], _OPEN, "")
        calls[-1] = _rename(calls[-1], "", _CLOSE)
        m["tool_calls"] = calls
    else:
        m["content"] = (m.get("content") or "") + _CLOSE
    return m


def _rename(call: dict[str, Any], before: str, after: str) -> dict[str, Any]:
    fn = dict(call.get("function") or call)
    fn["name"] = before + str(fn.get("name", "")) + after
    return {**call, "function": fn} if "function" in call else fn


def _changed_region(a: str, b: str) -> tuple[int, int]:
    """`(start, end)` in `a` of the part where `a` and `b` differ (common prefix and suffix removed).

    Binary searches over slice comparisons (C speed): a long conversation is compared once per turn."""
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    p = lo
    lo, hi = 0, n - p
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return p, len(a) - lo


def assistant_spans(
    tokenizer: Any, messages: list[dict[str, Any]], full: str, *, enable: bool,
    tools: Sequence[dict[str, Any]] | None = None, turns: Sequence[int] | None = None, generation: bool = False,
) -> list[tuple[int, int]]:
    """Character spans in `full` (the rendered conversation) of the assistant turns at indices `turns`.

    `turns` defaults to every assistant turn; spans come in conversation order (module docstring).
    `generation`: whether `full` was rendered with the generation prompt.
    """
    idx = [i for i, m in enumerate(messages) if m.get("role") == "assistant"] if turns is None else list(turns)
    mk = _markers(tokenizer, enable, tools)
    regions = []
    for i in idx:
        marked = _template(tokenizer, [*messages[:i], _marked(messages[i]), *messages[i + 1:]],
                           generation=generation, enable=enable, tools=tools)
        start, end = _changed_region(full, marked)
        if start >= len(full) or marked == full:
            raise DataError(f"chat template does not render assistant turn `messages[{i}]`\n"
                            "hint: the template drops this turn, so it cannot be trained")
        regions.append((i, start, end))
    spans: list[tuple[int, int]] = []
    floor = 0
    for k, (i, start, end) in enumerate(regions):
        opened = _turn_start(full, mk, floor, start)
        if opened is None:
            raise DataError(
                f"chat template renders assistant turn `messages[{i}]` without a header matching its generation prompt "
                f"`{mk.generation!r}`\nhint: the template renders turns differently from what generation starts from"
            )
        close = full.find(mk.end_of_turn, end)
        limit = regions[k + 1][1] if k + 1 < len(regions) else len(full)
        if close < 0 or close + len(mk.end_of_turn) > limit:
            raise DataError(f"chat template writes no end-of-turn `{mk.end_of_turn}` after assistant turn `messages[{i}]`")
        spans.append((opened, close + len(mk.end_of_turn)))
        floor = close + len(mk.end_of_turn)
    return spans


def _turn_start(full: str, mk: _Markers, floor: int, fields_at: int) -> int | None:
    """Where generation starts for a turn whose fields begin at `fields_at`: after the longest prefix of
    the generation prompt (whole lines, at least the first) closest before the fields."""
    best: tuple[int, int] | None = None  # (end of the header, its length)
    # whole lines only: a partial line could match the start of something else (`<t` of `<think>` in `<tool_call>`)
    cuts = [k + 1 for k, ch in enumerate(mk.generation) if ch == "\n" and k + 1 >= mk.header_min]
    for k in sorted({*cuts, len(mk.generation)}, reverse=True):
        pos = full.rfind(mk.generation[:k], floor, fields_at)
        if pos >= 0 and (best is None or pos + k > best[0]):
            best = (pos + k, k)
    return None if best is None else best[0]


@dataclass(frozen=True)
class RenderedTurns:
    """A rendered conversation's token ids and, per trained assistant turn, `(message index, first token, end token)`."""

    input_ids: list[int]
    turns: list[tuple[int, int, int]]


def render_turns(
    tokenizer: Any, messages: Sequence[dict[str, Any]], *, thinking: str | bool,
    tools: Sequence[dict[str, Any]] | None = None, turns: Sequence[int] | None = None, generation: bool = False,
) -> RenderedTurns:
    """The whole conversation rendered and tokenized once, and the token range of each assistant turn in `turns`
    (message indices; default every assistant turn). `generation` appends the generation prompt."""
    enable = _thinking_flag(thinking)
    msgs = _clean(messages, enable)
    full = _template(tokenizer, msgs, generation=generation, enable=enable, tools=tools)
    idx = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"] if turns is None else list(turns)
    spans = assistant_spans(tokenizer, msgs, full, enable=enable, tools=tools, turns=idx, generation=generation) if idx else []
    ids, starts = _encode_with_offsets(tokenizer, full)
    out = []
    for i, (s, e) in zip(idx, spans, strict=True):
        a, b = bisect_left(starts, s), bisect_left(starts, e)  # a token trains when its first character does
        if b > a:
            out.append((i, a, b))
    return RenderedTurns(input_ids=ids, turns=out)


def render_example(
    tokenizer: Any, messages: Sequence[dict[str, Any]], *, thinking: str | bool,
    tools: Sequence[dict[str, Any]] | None = None, train_turns: str = "last",
) -> RenderedExample:
    """Render a conversation; see the module docstring for how the mask is built.

    A conversation that does not end with an assistant turn renders as its prompt
    (with the generation prompt) and an all-zero mask.
    """
    if train_turns not in TRAIN_TURNS:
        raise DataError(f"train_turns is `{train_turns}`\nhint: use `last` or `all`")
    if not messages:
        raise DataError("conversation has no messages")
    if messages[-1].get("role") != "assistant":
        ids = render_prompt(tokenizer, messages, thinking=thinking, tools=tools)
        return RenderedExample(input_ids=ids, loss_mask=[0] * len(ids), prompt_length=len(ids))
    r = render_turns(tokenizer, messages, thinking=thinking, tools=tools,
                     turns=[len(messages) - 1] if train_turns == "last" else None)
    mask = [0] * len(r.input_ids)
    for _, a, b in r.turns:
        mask[a:b] = [1] * (b - a)
    prompt_length = r.turns[0][1] if r.turns else len(mask)
    return RenderedExample(input_ids=r.input_ids, loss_mask=mask, prompt_length=prompt_length)


def render_row(tokenizer: Any, example: Any, data: Any) -> RenderedExample:
    """`example` (a prepared `Example`) rendered as `[data]` (`data.thinking`, `data.train_turns`) says."""
    return render_example(tokenizer, example.messages, thinking=resolve_thinking(data.thinking, example),
                          tools=getattr(example, "tools", None), train_turns=data.train_turns)


def render_row_prompt(tokenizer: Any, example: Any, data: Any) -> list[int]:
    """The prompt of `example` (every turn before its response) with the generation prompt, in its thinking mode."""
    return render_prompt(tokenizer, example.prompt_messages, thinking=resolve_thinking(data.thinking, example),
                         tools=getattr(example, "tools", None))


def control_tokens(tokenizer: Any) -> list[str]:
    """Every special or added token string of `tokenizer` (longest first)."""
    found: set[str] = set(getattr(tokenizer, "all_special_tokens", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for tok in decoder.values():
        content = getattr(tok, "content", tok)
        if isinstance(content, str) and content:
            found.add(content)
    return sorted(found, key=lambda s: (-len(s), s))


def _texts(m: dict[str, Any]) -> list[tuple[str, str]]:
    """`(field, text)` of every text a message renders: content, reasoning, tool names and arguments."""
    out = [(key, m[key]) for key in ("content", "reasoning_content") if isinstance(m.get(key), str)]
    for j, call in enumerate(m.get("tool_calls") or []):
        fn = call.get("function", call) if isinstance(call, dict) else {}
        out.append((f"tool_calls[{j}]", f"{fn.get('name', '')} {json.dumps(fn.get('arguments'), ensure_ascii=False)}"))
    return out


def special_tokens_in_text(messages: Sequence[dict[str, Any]], tokens: Sequence[str]) -> list[tuple[int, str, str]]:
    """`(message_index, field, token)` for each control token string found inside message text."""
    hits = []
    for i, m in enumerate(messages):
        for key, text in _texts(m):
            for tok in tokens:
                if tok in text:
                    hits.append((i, key, tok))
                    break
    return hits
