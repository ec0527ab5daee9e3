"""Rendering a conversation with the target's chat template into token ids and a loss mask.

The response is the final assistant turn; everything before it is the prompt.
The sequence is built exactly as serving sees it: the prompt rendered with the
generation prompt (``add_generation_prompt=True``) and tokenized on its own,
followed by the tokens of the response text the template appends after that
prefix. The loss mask is 1 on the response tokens up to and including the
end-of-turn token; trailing whitespace the template puts after the turn is in
the sequence but not in the mask (the model never generates it).

Thinking mode is always explicit: ``enable_thinking`` goes to the template.
With thinking off, ``reasoning_content`` is removed before rendering (a
thinking-off model answers after an empty think block, so training on the
reasoning would teach the wrong format).

Earlier assistant turns are context (mask 0): Qwen3-style templates render
them differently once a later user turn exists, so only the final turn is
rendered the way the model produces it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DataError


@dataclass(frozen=True)
class RenderedExample:
    """Token ids and a 0/1 loss mask of equal length; `prompt_length` tokens of prompt first."""

    input_ids: list[int]
    loss_mask: list[int]
    prompt_length: int

    @property
    def response_tokens(self) -> int:
        return sum(self.loss_mask)


def _thinking_flag(thinking: str | bool) -> bool:
    if isinstance(thinking, bool):
        return thinking
    if thinking in ("on", "off"):
        return thinking == "on"
    raise DataError(f"thinking mode is `{thinking}`\nhint: use `on` or `off`")


def _clean(messages: Sequence[dict[str, Any]], enable: bool) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        m = dict(m)
        if not enable:
            m.pop("reasoning_content", None)
        out.append(m)
    return out


def _template(tokenizer: Any, messages: list[dict[str, Any]], *, generation: bool, enable: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the target's tokenizer has no chat template\nhint: the target dir needs `chat_template.jinja` or a `chat_template` in `tokenizer_config.json`")  # noqa: E501
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation, enable_thinking=enable
        )
    except Exception as exc:  # jinja errors of a user-supplied template, any class
        raise DataError(f"chat template failed to render: {type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise DataError(f"chat template returned `{type(text).__name__}`, expected text")
    return text


def _encode(tokenizer: Any, text: str) -> list[int]:
    # add_special_tokens=False: the template already wrote every control token it wants.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]], *, thinking: str | bool) -> list[int]:
    """Token ids of `messages` followed by the generation prompt (what generation starts from)."""
    enable = _thinking_flag(thinking)
    return _encode(tokenizer, _template(tokenizer, _clean(messages, enable), generation=True, enable=enable))


def render_example(
    tokenizer: Any, messages: Sequence[dict[str, Any]], *, thinking: str | bool
) -> RenderedExample:
    """Render a conversation; see the module docstring for how the mask is built.

    A conversation that does not end with an assistant turn renders as its prompt
    (with the generation prompt) and an all-zero mask.
    """
    enable = _thinking_flag(thinking)
    msgs = _clean(messages, enable)
    if not msgs:
        raise DataError("conversation has no messages")
    if msgs[-1].get("role") != "assistant":
        ids = _encode(tokenizer, _template(tokenizer, msgs, generation=True, enable=enable))
        return RenderedExample(input_ids=ids, loss_mask=[0] * len(ids), prompt_length=len(ids))
    prompt_text = _template(tokenizer, msgs[:-1], generation=True, enable=enable)
    full_text = _template(tokenizer, msgs, generation=False, enable=enable)
    if not full_text.startswith(prompt_text):
        raise DataError(
            "chat template does not render the prompt (with generation prompt) as a prefix of the full conversation\n"
            "hint: the template is not usable for response-only training as is"
        )
    response_text = full_text[len(prompt_text):]
    body = response_text.rstrip()
    tail = response_text[len(body):]
    prompt_ids = _encode(tokenizer, prompt_text)
    body_ids = _encode(tokenizer, body) if body else []
    tail_ids = _encode(tokenizer, tail) if tail else []
    ids = prompt_ids + body_ids + tail_ids
    mask = [0] * len(prompt_ids) + [1] * len(body_ids) + [0] * len(tail_ids)
    return RenderedExample(input_ids=ids, loss_mask=mask, prompt_length=len(prompt_ids))


def control_tokens(tokenizer: Any) -> list[str]:
    """Every special or added token string of `tokenizer` (longest first)."""
    found: set[str] = set(getattr(tokenizer, "all_special_tokens", []) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for tok in decoder.values():
        content = getattr(tok, "content", tok)
        if isinstance(content, str) and content:
            found.add(content)
    return sorted(found, key=lambda s: (-len(s), s))


def special_tokens_in_text(messages: Sequence[dict[str, Any]], tokens: Sequence[str]) -> list[tuple[int, str, str]]:
    """`(message_index, field, token)` for each control token string found inside message text."""
    hits = []
    for i, m in enumerate(messages):
        for key in ("content", "reasoning_content"):
            text = m.get(key)
            if isinstance(text, str):
                for tok in tokens:
                    if tok in text:
                        hits.append((i, key, tok))
                        break
    return hits
