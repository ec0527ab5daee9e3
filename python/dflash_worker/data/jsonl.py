"""A strict, bounded JSONL reader that reports every bad line by file and line number.

Decisions (tested in tests/data):

- Lines end at ``\\n`` only (bytes are split, never universal newlines, so a
  lone ``\\r`` or U+2028 inside a string cannot split a record). A ``\\r``
  before the ``\\n`` (CRLF files) is accepted and counted.
- A UTF-8 byte order mark is accepted at the start of the file only (editors
  on Windows write one) and recorded; a BOM anywhere else is an error.
- Whitespace-only lines are skipped and counted.
- A line longer than ``max_line_bytes`` is an error; it is never read into
  memory whole (the reader skips to the next newline in 1 MiB chunks).
- Invalid UTF-8, invalid JSON, nesting deep enough to hit Python's recursion
  limit, an integer longer than Python's int-parsing limit (4300 digits),
  duplicate keys in an object, and lone surrogates (``"\\ud800"``) are errors.

The reader never raises for a bad line: it yields a `LineError` so the caller
decides between failing (the default) and a counted drop (``--skip-invalid``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..strict_json import DuplicateKeyError, no_duplicate_keys

BOM = b"\xef\xbb\xbf"
DEFAULT_MAX_LINE_BYTES = 4 << 20  # 4 MiB: ~1M tokens of text, far above any context we train
_SKIP_CHUNK = 1 << 20


@dataclass(frozen=True)
class LineError:
    """Why line `line` of a file could not be used; `reason` is a stable counter key."""

    line: int
    reason: str
    message: str


@dataclass
class FileStats:
    """Facts about one input file, recorded in the manifest."""

    lines: int = 0
    blank_lines: int = 0
    crlf_lines: int = 0
    bom: bool = False


def parse_json_line(text: str, line: int) -> Any | LineError:
    """Parse one decoded line; a LineError on invalid JSON, deep nesting or duplicate keys."""
    try:
        return json.loads(text, object_pairs_hook=no_duplicate_keys)
    except DuplicateKeyError as exc:
        return LineError(line, "duplicate_key", f"duplicate key `{exc.key}` in one object")
    except json.JSONDecodeError as exc:
        return LineError(line, "invalid_json", f"invalid JSON at column {exc.colno}: {exc.msg}")
    except RecursionError:
        return LineError(line, "invalid_json", "JSON nested too deeply")
    except ValueError as exc:  # int() refusing a number longer than sys.get_int_max_str_digits()
        if "integer string conversion" in str(exc):
            return LineError(line, "invalid_json", f"a number has more than `{sys.get_int_max_str_digits()}` digits")
        return LineError(line, "invalid_json", f"invalid JSON: {exc}")


def iter_jsonl(
    path: str | Path, stats: FileStats, *, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
) -> Iterator[tuple[int, Any | LineError]]:
    """Yield `(line_number, parsed_value_or_LineError)` for each non-blank line (1-based)."""
    with open(path, "rb") as f:
        lineno = 0
        while True:
            raw = f.readline(max_line_bytes + 2)  # +2: room for "\r\n" on a line exactly at the limit
            if not raw:
                return
            lineno += 1
            stats.lines = lineno
            if not raw.endswith(b"\n") and len(raw) >= max_line_bytes + 2:
                size = len(raw)
                while True:  # skip the rest of the over-long line without holding it
                    more = f.readline(_SKIP_CHUNK)
                    size += len(more)
                    if not more or more.endswith(b"\n"):
                        break
                yield lineno, LineError(
                    lineno,
                    "line_too_long",
                    f"line is at least `{size}` bytes, over the `{max_line_bytes}`-byte limit\n"
                    "hint: raise `--max-line-bytes` if such long examples are intended",
                )
                continue
            if raw.endswith(b"\n"):
                raw = raw[:-1]
                if raw.endswith(b"\r"):
                    raw = raw[:-1]
                    stats.crlf_lines += 1
            if len(raw) > max_line_bytes:
                yield lineno, LineError(
                    lineno,
                    "line_too_long",
                    f"line is `{len(raw)}` bytes, over the `{max_line_bytes}`-byte limit\n"
                    "hint: raise `--max-line-bytes` if such long examples are intended",
                )
                continue
            if raw.startswith(BOM):
                if lineno == 1:
                    stats.bom = True
                    raw = raw[len(BOM):]
                else:
                    yield lineno, LineError(
                        lineno, "bom", "byte order mark in the middle of the file (files concatenated?)"
                    )
                    continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield lineno, LineError(lineno, "invalid_utf8", f"invalid UTF-8 at byte {exc.start} of the line")
                continue
            if not text.strip():
                stats.blank_lines += 1
                continue
            yield lineno, parse_json_line(text, lineno)
