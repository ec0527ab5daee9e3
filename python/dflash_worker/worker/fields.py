"""Readers of one field of a JSON object, for `spec.json` (`worker.spec`): each checks the type (a bool
is never an int here) and range, and raises `ConfigError` naming where the field sits and what it must be.

Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError


def read_field(obj: Mapping[str, Any], key: str, where: str, kinds: tuple[type, ...], what: str, default: Any = ...) -> Any:
    """`obj[key]` checked against `kinds` (bool is never an int here); `default` when absent."""
    if key not in obj:
        if default is ...:
            raise ConfigError(f"{where}: `{key}` is missing")
        return default
    v = obj[key]
    if isinstance(v, bool) and bool not in kinds:
        raise ConfigError(f"{where}: `{key}` must be {what}, got `{v!r}`")
    if not isinstance(v, kinds):
        raise ConfigError(f"{where}: `{key}` must be {what}, got `{short(v)}`")
    return v


def read_uint(obj: Mapping[str, Any], key: str, where: str, default: Any = ..., hi: int = 2**64 - 1) -> int:
    """`obj[key]` as an integer in [0, `hi`]; `default` when absent."""
    v = read_field(obj, key, where, (int,), "a non-negative integer", default)
    if not 0 <= v <= hi:
        raise ConfigError(f"{where}: `{key}` must be an integer in [0, {hi}], got `{v}`")
    return v


def read_str_list(obj: Mapping[str, Any], key: str, where: str, default: Any = ...) -> tuple[str, ...]:
    """`obj[key]` as a tuple of strings; `default` when absent."""
    v = read_field(obj, key, where, (list,), "a list of strings", default)
    if not all(isinstance(s, str) for s in v):
        raise ConfigError(f"{where}: `{key}` must be a list of strings")
    return tuple(v)


def check_path(text: str, what: str) -> str:
    """`text` if a filesystem could hold it: no NUL, no lone surrogate (os.fsencode refuses both)."""
    if "\0" in text:
        raise ConfigError(f"{what} contains a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{what} is not valid Unicode (a lone surrogate at character {exc.start})") from None
    return text


def refuse_unknown(obj: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    """Refuse a key of `obj` not in `known` (a misspelt field must not be ignored); the hint lists `known`."""
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(f'`{k}`' for k in unknown[:8])}\nhint: known keys: {', '.join(f'`{k}`' for k in known)}"
        )


def as_object(v: Any, where: str) -> Mapping[str, Any]:
    """`v` if it is a JSON object."""
    if not isinstance(v, dict):
        raise ConfigError(f"{where} must be a JSON object, got `{short(v)}`")
    return v


def short(v: Any) -> str:
    """`v` quoted for a message: its JSON (or its type's name), cut to 80 characters."""
    text = json.dumps(v) if isinstance(v, (dict, list, str, int, float, type(None))) else type(v).__name__
    return text if len(text) <= 80 else text[:77] + "..."
