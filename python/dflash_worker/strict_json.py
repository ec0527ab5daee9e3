"""The duplicate-key check shared by every parser of untrusted JSON.

`json.loads` silently keeps the last value of a repeated key; safetensors
headers, checkpoint indexes, JSONL data lines and coordinator job specs refuse
such a document instead. Each parser reports it through its own error type and
message, so the hook raises one `DuplicateKeyError` (a `ValueError`, so a
parser that reports every bad document alike may simply catch `ValueError`)
and the caller words it.
"""

from __future__ import annotations

from typing import Any


class DuplicateKeyError(ValueError):
    """A JSON object names `key` twice."""

    def __init__(self, key: str):
        super().__init__(f"duplicate key `{key}`")
        self.key = key


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook` for `json.loads`: the object as a dict, or `DuplicateKeyError` on a repeated key."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out
