"""Own-data pipeline: prepare JSONL inputs into splits, render them with the chat template, check them.

`prepare_data` writes a prepared directory; `PreparedData` reads it back with
hashes verified; `render_example` turns a conversation into token ids and a
response loss mask (capture and training reuse it); `check_data` checks every
example against a target's tokenizer before any weights load.
"""

from .check import CheckReport, Failure, check_data, load_tokenizer
from .dataset import Example, PreparedData
from .prepare import SPLIT_NAMES, prepare_data, split_of
from .render import (
    RenderedExample,
    control_tokens,
    render_example,
    render_prompt,
    render_row,
    render_row_prompt,
    resolve_thinking,
    row_thinking,
)
from .schema import fold_text

__all__ = [
    "SPLIT_NAMES",
    "CheckReport",
    "Example",
    "Failure",
    "PreparedData",
    "RenderedExample",
    "check_data",
    "control_tokens",
    "fold_text",
    "load_tokenizer",
    "prepare_data",
    "render_example",
    "render_prompt",
    "render_row",
    "render_row_prompt",
    "resolve_thinking",
    "row_thinking",
    "split_of",
]
