"""`dflash-worker check-data`: render prepared data with the target's tokenizer (no weights) and report failures."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, metavar="DIR", help="dir written by `prepare-data`")
    parser.add_argument("--target", required=True, metavar="TARGET_DIR",
                        help="target checkpoint dir; only its tokenizer and chat template are read, never weights")
    parser.add_argument("--thinking", choices=("on", "off", "per_row"), required=True,
                        help="render with the chat template's thinking mode on or off (`enable_thinking`), "
                             "or each row in its own mode (`per_row`); use the recipe's `[data].thinking`")
    parser.add_argument("--train-turns", choices=("all", "last"), default="all",
                        help="train every assistant turn or only the final one; use the recipe's `[data].train_turns` (default all)")
    parser.add_argument("--max-length", type=int, default=4096, metavar="N",
                        help="longest allowed example in tokens; use the recipe's `[data].max_length` (default 4096)")
    parser.add_argument("--regenerate", action="store_true",
                        help="responses will be regenerated at capture: check prompts only, and accept prompt-only rows")
    parser.add_argument("--split", action="append", choices=("train", "val", "test"),
                        help="check only this split (repeatable; default all)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..data import check_data

    bar = tqdm(desc="check-data", unit="ex", disable=not sys.stderr.isatty())
    report = check_data(
        args.data, args.target, thinking=args.thinking, max_length=args.max_length,
        regenerate=args.regenerate, splits=tuple(args.split or ("train", "val", "test")),
        on_progress=lambda n: bar.update(1), train_turns=args.train_turns,
    )
    bar.close()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True, ensure_ascii=False))
    # The summary on stdout (with `--json`, a log line: stdout holds only the report); failures on stderr.
    summary = sys.stderr if args.json else sys.stdout
    by_split = ", ".join(f"{k} {v}" for k, v in report.examples_by_split.items())
    print(
        f"checked {report.examples} examples ({by_split}) thinking {report.thinking}, max_length {report.max_length}: "
        f"{report.tokens} tokens, {report.loss_tokens} response tokens, longest {report.longest}",
        file=summary,
    )
    print("by thinking mode: " + "; ".join(
        f"{mode} {c['examples']} examples, {c['tokens']} tokens, {c['loss_tokens']} response tokens"
        for mode, c in report.by_mode.items()), file=summary)
    if report.notes:
        print("notes: " + ", ".join(f"{k} {v}" for k, v in report.notes.items()), file=summary)
    if report.ok:
        print("ok", file=summary)
        return 0
    if report.examples == 0:
        print("error: no examples to check", file=sys.stderr)
        return 1
    print(f"error: {report.failed} failures: " + ", ".join(f"{k} {v}" for k, v in report.failure_counts.items()), file=sys.stderr)
    for f in report.failures:
        print("  " + f.describe().replace("\n", "\n    "), file=sys.stderr)
    if report.failed > len(report.failures):
        print(f"  ... and {report.failed - len(report.failures)} more", file=sys.stderr)
    return 1
