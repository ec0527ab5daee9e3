"""`dflash-worker evaluate`: released vs trained draft with real speculative generation on held-out prompts."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # `--run-dir` is the spelling under torchrun, whose own `--run-path` makes `--run` ambiguous to its parser
    parser.add_argument("--run", "--run-dir", dest="run", required=True, metavar="DIR",
                        help="run directory of a completed `dflash-worker train` (`--run-dir` is the same)")
    parser.add_argument("--data", metavar="DIR", default=None,
                        help="prepared data directory whose prompts are scored (default: the run's own `[data].dir`)")
    parser.add_argument("--split", choices=("train", "val", "test"), default=None,
                        help="prepared split whose prompts are evaluated (default: `[evaluate].split`, else `test`)")
    parser.add_argument("--max-prompts", type=int, default=None, metavar="N",
                        help="evaluate at most N prompts (default: `[evaluate].max_prompts`, else 32)")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="report directory for report.json, report.md, acceptance.png (default: `RUN/evaluate-SPLIT`)")
    parser.add_argument("--min-context", type=int, default=None, metavar="TOKENS",
                        help="score only the prompts of at least TOKENS tokens (as rendered for the target)")
    parser.add_argument("--max-context", type=int, default=None, metavar="TOKENS",
                        help="score only the prompts of at most TOKENS tokens (as rendered for the target)")
    parser.add_argument("--json", action="store_true", help="print report.json on stdout")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..evaluate.report import evaluate_run
    from ..worker.events import Progress

    bar = None

    def on_event(e: Progress) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=e.total_steps, unit="prompt", disable=not sys.stderr.isatty())
        bar.update(e.step - bar.n)  # (several ranks: rank 0's count of prompts done over all ranks)

    try:
        report = evaluate_run(args.run, split=args.split, out_dir=args.output, max_prompts=args.max_prompts, on_event=on_event,
                              data_dir=args.data, min_context=args.min_context, max_context=args.max_context)
    finally:
        if bar is not None:
            bar.close()
    from ..evaluate.breakdown import summary_lines

    b, t = report["baseline"], report["trained"]
    lossless = {True: "lossless", False: "NOT lossless: " + ", ".join(m["id"] for m in report["lossless_mismatches"]),
                None: "lossless not checked (temperature > 0)"}[report["lossless"]]
    print(f"evaluate: {report['prompts']} prompts, acceptance length (pooled) baseline {b['tau_pooled']:.3f} -> trained "
          f"{t['tau_pooled']:.3f}: {report['verdict']} (per-prompt mean {b['tau_mean']:.3f} -> {t['tau_mean']:.3f}); {lossless}",
          file=sys.stderr if args.json else sys.stdout)  # with `--json` stdout holds only the report
    for line in summary_lines(report):
        print(line, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    return 0
