"""`dflash-worker preflight`: one near-max-length step; capture and optimization memory peaks; go/no-go."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, metavar="RECIPE.toml",
                        help="recipe with `[model]`, `[data]` and `[train]` (`[capture].dtype`, if present, sets the "
                        "teacher's dtype; default bfloat16). Exit status 1 when the verdict is no-go")
    parser.add_argument("--length", type=int, default=None, metavar="TOKENS",
                        help="sequence length to test (default: `[data].max_length`)")
    parser.add_argument("--json", action="store_true", help="print the preflight report as JSON on stdout")


def _teacher_line(t: dict) -> str:
    """The measured teacher in one line: its text tower, and what the load skipped (never in a peak)."""
    mib = 2**20
    experts = f", {t['num_experts']} experts (top-{t['num_experts_per_tok']})" if t["num_experts"] else ""
    skipped = f"; {t['skipped_bytes'] / mib:.1f} MiB vision/MTP skipped unread" if t["skipped_tensors"] else ""
    return (
        f"{t['family']}, {t['num_hidden_layers']} layers x {t['hidden_size']}{experts}, "
        f"{t['bytes_read'] / mib:.1f} MiB of weights read{skipped}"
    )


def run(args: argparse.Namespace) -> int:
    from ..recipe import load_recipe
    from ..train.preflight import preflight

    report = preflight(load_recipe(args.recipe), length=args.length)
    gib = 2**30
    print(
        f"preflight: {report['sequence_length']} tokens, {report['blocks']} blocks on {report['device']['device']}\n"
        f"  teacher:           {_teacher_line(report['teacher'])}\n"
        f"  capture peak:      {report['capture_peak']['bytes'] / gib:.3f} GiB ({report['capture_peak']['what']})\n"
        f"  optimization peak: {report['optimization_peak']['bytes'] / gib:.3f} GiB ({report['optimization_peak']['what']})\n"
        f"  {report['verdict']}: {report['reason']}",
        file=sys.stderr if args.json else sys.stdout,  # with `--json` stdout holds only the report
    )
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    return 0 if report["verdict"] == "go" else 1
