"""Input row schemas and their normalisation to chat messages.

Accepted rows (one JSON object per line):

- ``{"messages": [{"role": ..., "content": ..., "reasoning_content"?: ...}, ...]}``
  roles ``system`` (first only), ``user``, ``assistant``; ``reasoning_content``
  only on assistant turns. A conversation ending with an assistant turn has a
  response (the final assistant turn); one ending with a user turn is a prompt.
- ``{"prompt": ..., "response": ...}`` and ``{"prompt": ..., "completion": ...}``
- ``{"prompt": ...}`` (prompt only: the response is generated at capture time)

Every row may carry ``source`` (a non-empty string, else the input file name
is used). Other top-level keys are ignored and counted in the manifest.
Every text must be a non-empty string (after stripping whitespace) that
encodes as UTF-8.

Prompt identity (`prompt_key`) is what keeps a prompt out of two splits: the
prompt turns (everything before the final assistant turn) with each content
Unicode NFKC-normalised and its whitespace runs folded to one space. The
source is deliberately not part of it, so a prompt found in two sources, or
twice with different spacing, is one group and lands in one split.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

from ..manifest import fingerprint
from .jsonl import LineError

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "reasoning_content")
SCHEMAS = ("messages", "prompt_response", "prompt_completion", "prompt_only")


class Conversation:
    """Chat `messages` (set by the subclass) whose last one may be the response to train on."""

    messages: tuple[dict[str, str], ...]

    @property
    def has_response(self) -> bool:
        return self.messages[-1]["role"] == "assistant"

    @property
    def prompt_messages(self) -> tuple[dict[str, str], ...]:
        return self.messages[:-1] if self.has_response else self.messages


@dataclass(frozen=True)
class Row(Conversation):
    """A normalised row: chat messages plus where it came from."""

    messages: tuple[dict[str, str], ...]
    schema: str
    source: str
    ignored: tuple[str, ...]


def fold_text(text: str) -> str:
    """NFKC-normalise and fold every whitespace run to a single space (trimmed)."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def prompt_key(row: Row) -> str:
    """Group key of a row's prompt (see module docstring)."""
    return fingerprint([[m["role"], fold_text(m["content"])] for m in row.prompt_messages])


def exact_key(row: Row) -> str:
    """Identity of the whole normalised conversation (exact text, any source)."""
    return fingerprint([sorted(m.items()) for m in row.messages])


def _text(value: Any, what: str, line: int) -> str | LineError:
    if not isinstance(value, str):
        return LineError(line, "wrong_type", f"{what} must be a string, found {type(value).__name__}")
    if not value.strip():
        return LineError(line, "empty_content", f"{what} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return LineError(line, "invalid_unicode", f"{what} contains a lone surrogate (not valid Unicode)")
    return value


def _messages(value: Any, line: int) -> list[dict[str, str]] | LineError:
    if not isinstance(value, list):
        return LineError(line, "wrong_type", f"`messages` must be a list, found {type(value).__name__}")
    if not value:
        return LineError(line, "empty_content", "`messages` is empty")
    out: list[dict[str, str]] = []
    for i, m in enumerate(value):
        where = f"`messages[{i}]`"
        if not isinstance(m, dict):
            return LineError(line, "wrong_type", f"{where} must be an object, found {type(m).__name__}")
        extra = sorted(set(m) - set(MESSAGE_KEYS))
        if extra:
            return LineError(
                line, "wrong_type", f"{where} has unsupported key `{extra[0]}` (allowed: role, content, reasoning_content)"
            )
        role = m.get("role")
        if role not in ROLES:
            return LineError(line, "bad_role", f"{where}.role is `{role}`; expected system, user or assistant")
        if role == "system" and i != 0:
            return LineError(line, "bad_role", f"{where} is a system turn after the start")
        content = _text(m.get("content"), f"{where}.content", line)
        if isinstance(content, LineError):
            return content
        msg = {"role": role, "content": content}
        if m.get("reasoning_content") is not None:
            if role != "assistant":
                return LineError(line, "wrong_type", f"{where} has `reasoning_content` on a `{role}` turn")
            reasoning = _text(m["reasoning_content"], f"{where}.reasoning_content", line)
            if isinstance(reasoning, LineError):
                return reasoning
            msg["reasoning_content"] = reasoning
        out.append(msg)
    if not any(m["role"] == "user" for m in out):
        return LineError(line, "bad_role", "`messages` has no user turn")
    first = 1 if out[0]["role"] == "system" else 0
    if out[first]["role"] != "user":
        return LineError(line, "bad_role", "the first non-system turn must be a user turn")
    return out


def normalize_row(obj: Any, *, line: int, default_source: str) -> Row | LineError:
    """Normalise one parsed JSON value to a `Row`, or say why it is unusable."""
    if not isinstance(obj, dict):
        return LineError(line, "wrong_type", f"row must be a JSON object, found {type(obj).__name__}")
    source = default_source
    if "source" in obj:
        s = _text(obj["source"], "`source`", line)
        if isinstance(s, LineError):
            return s
        source = s.strip()
    has = {k for k in ("messages", "prompt", "response", "completion") if k in obj}
    if "messages" in has:
        if has - {"messages"}:
            return LineError(
                line, "ambiguous_schema", "row has both `messages` and " + ", ".join(f"`{k}`" for k in sorted(has - {"messages"}))
            )
        msgs = _messages(obj["messages"], line)
        if isinstance(msgs, LineError):
            return msgs
        schema = "messages"
    elif "prompt" in has:
        if {"response", "completion"} <= has:
            return LineError(line, "ambiguous_schema", "row has both `response` and `completion`")
        prompt = _text(obj["prompt"], "`prompt`", line)
        if isinstance(prompt, LineError):
            return prompt
        msgs = [{"role": "user", "content": prompt}]
        schema = "prompt_only"
        for key in ("response", "completion"):
            if key in obj:
                resp = _text(obj[key], f"`{key}`", line)
                if isinstance(resp, LineError):
                    return resp
                msgs.append({"role": "assistant", "content": resp})
                schema = f"prompt_{key}"
    else:
        return LineError(
            line,
            "unknown_schema",
            "row has none of `messages`, `prompt`\nhint: rows need `messages`, or `prompt` with optional `response`/`completion`",
        )
    ignored = tuple(sorted(set(obj) - {"messages", "prompt", "response", "completion", "source"}))
    return Row(messages=tuple(msgs), schema=schema, source=source, ignored=ignored)
