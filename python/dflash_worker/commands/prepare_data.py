"""`dflash-worker prepare-data`: normalise, deduplicate and split JSONL inputs into a prepared dir."""

from __future__ import annotations

import argparse
import json
import sys

from ..data.jsonl import DEFAULT_MAX_LINE_BYTES
from ..data.prepare import DEFAULT_REPLAY_FRACTION, SPLIT_NAMES


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
    # The fractions default to None (0.05 in prepare_data) so `--split` can refuse them when given.
    parser.add_argument("--val-fraction", type=float, default=None, metavar="F",
                        help="fraction of prompt groups for validation (default 0.05)")
    parser.add_argument("--test-fraction", type=float, default=None, metavar="F",
                        help="fraction of prompt groups for test (default 0.05)")
    parser.add_argument("--split", choices=SPLIT_NAMES, default=None,
                        help="send every kept row to this one split, no hashing (e.g. a held-out set prepared on "
                        "its own); exclusive with the fractions and `--holdout-file`")
    parser.add_argument("--holdout-file", default=None, metavar="FILE",
                        help="text file of group keys or row ids (the `id` of a prepared row), one per line, "
                        "`#` comments allowed: their prompt groups land in test whatever the hash says")
    parser.add_argument("--replay", action="append", default=[], metavar="FILE.jsonl",
                        help="general-domain rows (same formats as `--input`, repeatable) mixed into train only, so "
                        "that adapting a draft to the inputs does not forget what it could do; the teacher answers "
                        "them during capture. Rows whose prompt is also in an input are left out")
    parser.add_argument("--replay-fraction", type=float, default=DEFAULT_REPLAY_FRACTION, metavar="F",
                        help=f"share of the train split made of replay rows, in (0, 1) (default {DEFAULT_REPLAY_FRACTION}; "
                        "fewer when the replay files hold fewer rows, recorded as `replay.short`); 0 with "
                        "`--replay-val-fraction` uses the replay rows for the general-domain guard only")
    parser.add_argument("--replay-val-fraction", type=float, default=None, metavar="F",
                        help="also hold this share of the replay rows, in (0, 1), at least one row, out into val as "
                        "general-domain validation rows (`\"domain\": \"general\"`): training then keeps the selected "
                        "checkpoint's general acceptance within `[train].general_tolerance` of the released draft's")
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
        max_line_bytes=args.max_line_bytes, on_drop=on_drop, split=args.split, holdout_file=args.holdout_file,
        replay=args.replay, replay_fraction=args.replay_fraction, replay_val_fraction=args.replay_val_fraction,
    )
    # The summary on stdout (with `--json`, log lines: stdout holds only the manifest); warnings on stderr.
    summary = sys.stderr if args.json else sys.stdout
    c = m["counts"]
    split = ", ".join(f"{k} {v}" for k, v in c["split"].items())
    print(f"prepared {c['rows']} rows into `{args.output}` ({split})", file=summary)
    h = m.get("holdout")
    if h is not None:
        print(f"held out {h['rows']} rows ({h['groups']} groups) in test, listed in `{args.holdout_file}`",
              file=summary)
        if h["unknown_keys"]:
            first = ", ".join(f"`{k}`" for k in h["unknown_listed"][:5])
            print(
                f"warning: {h['unknown_keys']} of {h['keys']} keys in `{args.holdout_file}` match no kept row "
                f"(first: {first})\nhint: list the `id` of a prepared row or a group key; all are in the manifest's "
                "`holdout.unknown_listed` (first 20)",
                file=sys.stderr,
            )
    r = m.get("replay")
    if r is not None:
        short = f" (wanted {r['wanted_rows']}: the replay files hold only {r['pool_rows']} usable rows)" if r["short"] else ""
        print(f"mixed {r['rows']} replay rows into train ({r['rows'] / max(1, r['rows'] + r['own_train_rows']):.0%} of it){short}", file=summary)
        if "val_rows" in r:
            print(f"held out {r['val_rows']} replay rows in val as general-domain validation rows", file=summary)
    if m["dropped"]:
        print("dropped " + ", ".join(f"{k} {v}" for k, v in m["dropped"].items()), file=summary)
    if args.json:
        print(json.dumps(m, indent=2, sort_keys=True, ensure_ascii=False))
    return 0
