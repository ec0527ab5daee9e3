"""Input row schemas and their normalisation to chat messages.

Accepted rows (one JSON object per line):

- ``{"messages": [...], "tools"?: [...], "thinking"?: true|false}``: the
  OpenAI / Hugging Face chat format, any number of turns. Roles ``system``
  (first only), ``user``, ``assistant``, ``tool``:

  - ``system`` / ``user``: ``content`` (text).
  - ``assistant``: ``content``; ``reasoning_content`` (optional);
    ``tool_calls`` (optional): ``[{"type": "function", "id"?: ...,
    "function": {"name": ..., "arguments": {...} or "<JSON object>"}}]``.
    Arguments given as a JSON string are parsed and stored as the object (the
    Qwen templates iterate them as a mapping). With tool calls the content may
    be empty or null (stored as ``""``).
  - ``tool``: ``content`` (the tool's output, may be empty), ``tool_call_id``
    and ``name`` (both optional). A tool turn answers the tool calls of the
    assistant turn before it (other tool turns between): its
    ``tool_call_id``, when given, must be one of their ids, else its
    ``name``, when given, one of their names.

  ``tools`` (function schemas ``{"type": "function", "function": {"name":
  ..., "parameters"?: {...}}}``) goes to the chat template as ``tools=``.
  ``thinking`` is the row's own thinking mode (``[data].thinking =
  "per_row"``); absent, the mode is whether an assistant turn carries
  ``reasoning_content``. A conversation ending with an assistant turn has a
  response (the final assistant turn); otherwise it is a prompt. A message
  key whose value is null is dropped; any other key not listed is refused.
- ``{"prompt": ..., "response": ...}`` and ``{"prompt": ..., "completion": ...}``
- ``{"prompt": ...}`` (prompt only: the response is generated at capture time)

Every row may carry ``source`` (a non-empty string, else the input file name
is used). Other top-level keys are ignored and counted in the manifest.
Every text must be a non-empty string (after stripping whitespace) that
encodes as UTF-8, except a tool's output and an assistant's content beside
tool calls.

Refusal reasons (stable counter keys) beyond the JSON reader's: ``wrong_type``,
``empty_content``, ``invalid_unicode``, ``bad_role`` (unknown role, system
not first, no user turn, not starting with a user turn), ``misplaced_tool_calls``
(``tool_calls`` on a non-assistant turn), ``bad_tool_call`` (a malformed call),
``bad_tool_arguments`` (arguments not JSON, or not an object),
``unmatched_tool_result`` (a tool turn answering no earlier call), ``bad_tools``
(a malformed ``tools`` entry), ``unknown_schema``, ``ambiguous_schema``.

Prompt identity (`prompt_key`) is what keeps a prompt out of two splits: the
prompt turns (everything before the final assistant turn) with each content
Unicode NFKC-normalised and its whitespace runs folded to one space. The
source is deliberately not part of it, so a prompt found in two sources, or
twice with different spacing, is one group and lands in one split.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Any

from ..manifest import fingerprint
from .jsonl import LineError

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = {
    "system": ("role", "content"),
    "user": ("role", "content"),
    "assistant": ("role", "content", "reasoning_content", "tool_calls"),
    "tool": ("role", "content", "tool_call_id", "name"),
}
SCHEMAS = ("messages", "prompt_response", "prompt_completion", "prompt_only")
ROW_KEYS = ("messages", "prompt", "response", "completion", "source", "tools", "thinking")


class Conversation:
    """Chat `messages` (set by the subclass) whose last one may be the response to train on."""

    messages: tuple[dict[str, Any], ...]

    @property
    def has_response(self) -> bool:
        return self.messages[-1]["role"] == "assistant"

    @property
    def prompt_messages(self) -> tuple[dict[str, Any], ...]:
        return self.messages[:-1] if self.has_response else self.messages


@dataclass(frozen=True)
class Row(Conversation):
    """A normalised row: chat messages, the template's tools, its own thinking mode and where it came from."""

    messages: tuple[dict[str, Any], ...]
    schema: str
    source: str
    ignored: tuple[str, ...]
    tools: tuple[dict[str, Any], ...] | None = None
    thinking: bool | None = None  # the row's explicit `"thinking"`; None: not given


def fold_text(text: str) -> str:
    """NFKC-normalise and fold every whitespace run to a single space (trimmed)."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


def prompt_key(row: Row) -> str:
    """Group key of a row's prompt (see module docstring)."""
    return fingerprint([[m["role"], fold_text(m["content"])] for m in row.prompt_messages])


def exact_key(row: Row) -> str:
    """Identity of the whole normalised conversation (exact text, any source).

    Tools and an explicit thinking mode are part of it only when the row has them, so a
    row without either keeps the key (and the row id) it had before they existed."""
    msgs = [sorted(m.items()) for m in row.messages]
    if row.tools is None and row.thinking is None:
        return fingerprint(msgs)
    return fingerprint({"messages": msgs, "tools": list(row.tools or ()), "thinking": row.thinking})


def _text(value: Any, what: str, line: int, *, empty_ok: bool = False) -> str | LineError:
    if not isinstance(value, str):
        return LineError(line, "wrong_type", f"{what} must be a string, found {type(value).__name__}")
    if not empty_ok and not value.strip():
        return LineError(line, "empty_content", f"{what} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return LineError(line, "invalid_unicode", f"{what} contains a lone surrogate (not valid Unicode)")
    return value


def _arguments(value: Any, where: str, line: int) -> dict[str, Any] | LineError:
    """Tool call arguments as an object: given as one, or as a JSON string holding one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            return LineError(line, "bad_tool_arguments", f"{where} is not valid JSON ({exc})")
    if not isinstance(value, dict):
        return LineError(
            line, "bad_tool_arguments", f"{where} must be a JSON object (or a string holding one), found {type(value).__name__}"
        )
    return value


def _tool_call(value: Any, where: str, line: int) -> dict[str, Any] | LineError:
    if not isinstance(value, dict):
        return LineError(line, "bad_tool_call", f"{where} must be an object, found {type(value).__name__}")
    extra = sorted(set(value) - {"type", "id", "function"})
    if extra:
        return LineError(line, "bad_tool_call", f"{where} has unsupported key `{extra[0]}` (allowed: type, id, function)")
    if value.get("type", "function") != "function":
        return LineError(line, "bad_tool_call", f"{where}.type is `{value.get('type')}`; only `function` calls exist")
    fn = value.get("function")
    if not isinstance(fn, dict):
        return LineError(line, "bad_tool_call", f"{where}.function must be an object with `name` and `arguments`")
    extra = sorted(set(fn) - {"name", "arguments"})
    if extra:
        return LineError(line, "bad_tool_call", f"{where}.function has unsupported key `{extra[0]}` (allowed: name, arguments)")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        return LineError(line, "bad_tool_call", f"{where}.function.name must be a non-empty string")
    if "arguments" not in fn:
        return LineError(line, "bad_tool_arguments", f"{where}.function has no `arguments`")
    args = _arguments(fn["arguments"], f"{where}.function.arguments", line)
    if isinstance(args, LineError):
        return args
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if value.get("id") is not None:
        if not isinstance(value["id"], str) or not value["id"]:
            return LineError(line, "bad_tool_call", f"{where}.id must be a non-empty string")
        call["id"] = value["id"]
    return call


def _assistant(m: dict[str, Any], where: str, line: int) -> dict[str, Any] | LineError:
    msg: dict[str, Any] = {"role": "assistant"}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            return LineError(line, "bad_tool_call", f"{where}.tool_calls must be a list, found {type(calls).__name__}")
        out = []
        for j, c in enumerate(calls):
            call = _tool_call(c, f"{where}.tool_calls[{j}]", line)
            if isinstance(call, LineError):
                return call
            out.append(call)
        calls = out or None
    content = m.get("content")
    if calls and content is None:
        content = ""
    content = _text(content, f"{where}.content", line, empty_ok=bool(calls))
    if isinstance(content, LineError):
        return content
    msg["content"] = content
    if m.get("reasoning_content") is not None:
        reasoning = _text(m["reasoning_content"], f"{where}.reasoning_content", line)
        if isinstance(reasoning, LineError):
            return reasoning
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def _message(m: Any, i: int, line: int) -> dict[str, Any] | LineError:
    where = f"`messages[{i}]`"
    if not isinstance(m, dict):
        return LineError(line, "wrong_type", f"{where} must be an object, found {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        return LineError(line, "bad_role", f"{where}.role is `{role}`; expected system, user, assistant or tool")
    if role != "assistant" and m.get("tool_calls") is not None:
        return LineError(line, "misplaced_tool_calls", f"{where} has `tool_calls` on a `{role}` turn (only assistant turns call tools)")
    if role != "assistant" and m.get("reasoning_content") is not None:
        return LineError(line, "wrong_type", f"{where} has `reasoning_content` on a `{role}` turn")
    # a null key says nothing (OpenAI-style logs write `"refusal": null`, `"tool_calls": null`): dropped
    m = {k: v for k, v in m.items() if v is not None or k in ("role", "content")}
    extra = sorted(set(m) - set(MESSAGE_KEYS[role]))
    if extra:
        return LineError(
            line, "wrong_type", f"{where} has unsupported key `{extra[0]}` (allowed on `{role}`: {', '.join(MESSAGE_KEYS[role])})"
        )
    if role == "assistant":
        return _assistant(m, where, line)
    content = _text(m.get("content"), f"{where}.content", line, empty_ok=role == "tool")
    if isinstance(content, LineError):
        return content
    msg = {"role": role, "content": content}
    for key in ("tool_call_id", "name"):
        if role == "tool" and m.get(key) is not None:
            v = _text(m[key], f"{where}.{key}", line)
            if isinstance(v, LineError):
                return v
            msg[key] = v
    return msg


def _match_tool_results(out: list[dict[str, Any]], line: int) -> LineError | None:
    """Each tool turn must answer a call of the assistant turn before it (module docstring)."""
    calls: list[dict[str, Any]] | None = None
    for i, m in enumerate(out):
        if m["role"] == "assistant":
            calls = m.get("tool_calls")
        elif m["role"] == "tool":
            where = f"`messages[{i}]`"
            if not calls:
                return LineError(line, "unmatched_tool_result", f"{where} is a tool result, but the turn before it made no tool call")
            if "tool_call_id" in m:
                ids = [c.get("id") for c in calls]
                if m["tool_call_id"] not in ids:
                    return LineError(line, "unmatched_tool_result",
                                     f"{where}.tool_call_id `{m['tool_call_id']}` matches no earlier tool call id")
            elif "name" in m and m["name"] not in [c["function"]["name"] for c in calls]:
                return LineError(line, "unmatched_tool_result", f"{where}.name `{m['name']}` matches no earlier tool call")
        else:
            calls = None
    return None


def _messages(value: Any, line: int) -> list[dict[str, Any]] | LineError:
    if not isinstance(value, list):
        return LineError(line, "wrong_type", f"`messages` must be a list, found {type(value).__name__}")
    if not value:
        return LineError(line, "empty_content", "`messages` is empty")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        msg = _message(m, i, line)
        if isinstance(msg, LineError):
            return msg
        if msg["role"] == "system" and i != 0:
            return LineError(line, "bad_role", f"`messages[{i}]` is a system turn after the start")
        out.append(msg)
    if not any(m["role"] == "user" for m in out):
        return LineError(line, "bad_role", "`messages` has no user turn")
    first = 1 if out[0]["role"] == "system" else 0
    if out[first]["role"] != "user":
        return LineError(line, "bad_role", "the first non-system turn must be a user turn")
    return _match_tool_results(out, line) or out


def _tools(value: Any, line: int) -> tuple[dict[str, Any], ...] | LineError:
    """The row's function schemas, kept as given (the template renders them) once their shape is checked."""
    if not isinstance(value, list):
        return LineError(line, "bad_tools", f"`tools` must be a list, found {type(value).__name__}")
    for j, tool in enumerate(value):
        where = f"`tools[{j}]`"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            return LineError(line, "bad_tools", f'{where} must be `{{"type": "function", "function": {{...}}}}`')
        name = tool["function"].get("name")
        if not isinstance(name, str) or not name.strip():
            return LineError(line, "bad_tools", f"{where}.function.name must be a non-empty string")
        params = tool["function"].get("parameters")
        if params is not None and not isinstance(params, dict):
            return LineError(line, "bad_tools", f"{where}.function.parameters must be an object (a JSON schema)")
    return tuple(value)


def _extras(obj: dict[str, Any], line: int) -> tuple[tuple[dict[str, Any], ...] | None, bool | None] | LineError:
    """The row's `tools` and explicit `thinking`, checked."""
    tools = None
    if obj.get("tools") is not None:
        tools = _tools(obj["tools"], line)
        if isinstance(tools, LineError):
            return tools
        tools = tools or None
    thinking = obj.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        return LineError(line, "wrong_type", f"`thinking` must be true or false, found `{thinking!r}`")
    return tools, thinking


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
    extras = _extras(obj, line)
    if isinstance(extras, LineError):
        return extras
    tools, thinking = extras
    ignored = tuple(sorted(set(obj) - set(ROW_KEYS)))
    return Row(messages=tuple(msgs), schema=schema, source=source, ignored=ignored, tools=tools, thinking=thinking)
