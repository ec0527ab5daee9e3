"""`dflash-worker prepare-data`: normalise, deduplicate and split JSONL inputs into a prepared dir."""

from __future__ import annotations

import argparse
import json
import sys

from ..data.jsonl import DEFAULT_MAX_LINE_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", action="append", required=True, metavar="FILE.jsonl",
        help="input JSONL file (repeatable). Rows: `messages` (role/content, optional reasoning_content), "
        "`prompt`+`response`, `prompt`+`completion`, or `prompt` alone; optional `source` tag "
        "(default: the file name). A UTF-8 BOM at the start and CRLF line endings are accepted",
    )
    parser.add_argument("--output", required=True, metavar="DIR",
                        help="output dir; train.jsonl, val.jsonl, test.jsonl and manifest.json are replaced atomically")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split hash (default 0)")
    parser.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                        help="fraction of prompt groups for validation (default 0.05)")
    parser.add_argument("--test-fraction", type=float, default=0.05, metavar="F",
                        help="fraction of prompt groups for test (default 0.05)")
    parser.add_argument("--skip-invalid", action="store_true",
                        help="drop unusable rows (counted by reason in the manifest and on stderr) instead of failing")
    parser.add_argument("--max-line-bytes", type=int, default=DEFAULT_MAX_LINE_BYTES, metavar="N",
                        help=f"longest accepted line in bytes (default {DEFAULT_MAX_LINE_BYTES})")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    from ..data import prepare_data

    def on_drop(file: str, line: int, reason: str, message: str) -> None:
        if reason != "duplicate":
            print(f"skipped `{file}` line {line}: {reason}: {message.splitlines()[0]}", file=sys.stderr)

    m = prepare_data(
        args.input, args.output, seed=args.seed, val_fraction=args.val_fraction,
        test_fraction=args.test_fraction, skip_invalid=args.skip_invalid,
        max_line_bytes=args.max_line_bytes, on_drop=on_drop,
    )
    c = m["counts"]
    split = ", ".join(f"{k} {v}" for k, v in c["split"].items())
    print(f"prepared {c['rows']} rows into `{args.output}` ({split})", file=sys.stderr)
    if m["dropped"]:
        print("dropped " + ", ".join(f"{k} {v}" for k, v in m["dropped"].items()), file=sys.stderr)
    if args.json:
        print(json.dumps(m, indent=2, sort_keys=True, ensure_ascii=False))
    return 0
