"""`dflash-worker preflight`: one near-max-length step; capture, optimization and online memory peaks;
both `[train].features` plans (cache disk vs online forward time and memory) with the one to pick; go/no-go."""

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


def _plan_lines(p: dict) -> str:
    """The cache and online plans, two lines each, and the recommendation."""
    from ..train.preflight import human_bytes as h

    gib, c, o = 2**30, p["cache"], p["online"]
    if p["tokens"] is None:
        return (
            f"  plans: {p['tokens_basis']}; cache {c['bytes_per_token']} B/token, online {o['bytes_per_token']} B/token, "
            f"+{o['target_forward_seconds_per_sequence']:.3f}s target forward per sequence, peak {o['peak_memory_bytes'] / gib:.3f} GiB"
        )
    return (
        f"  plans for {p['tokens']} tokens ({p['tokens_basis']}), `[train].features = \"{p['recipe_features']}\"` now:\n"
        f"    cache:  {c['bytes_per_token']} B/token ({c['taps']} taps x {c['hidden_size']} x {c['dtype']}), "
        f"{h(c['disk_bytes'])} on disk of {h(p['free_disk_bytes'])} free\n"
        f"    online: {o['bytes_per_token']} B/token, {h(o['disk_bytes'])} on disk; +{o['target_forward_seconds_per_sequence']:.3f}s "
        f"target forward per sequence ({o['extra_forward_seconds']:.1f}s over {o['sequences']} sequences); "
        f"peak {o['peak_memory_bytes'] / gib:.3f} GiB (target + draft + optimizer)\n"
        f"  recommended: {p['recommended']} ({p['reason']})"
    )


def run(args: argparse.Namespace) -> int:
    from ..recipe import load_recipe
    from ..train.preflight import preflight

    report = preflight(load_recipe(args.recipe), length=args.length)
    gib = 2**30
    print(
        f"preflight: {report['sequence_length']} tokens, {report['blocks']} blocks on {report['device']['device']} "
        f"(the teacher in chunks of {report['chunk_tokens']} tokens, as capture runs it)\n"
        f"  teacher:           {_teacher_line(report['teacher'])}\n"
        f"  capture peak:      {report['capture_peak']['bytes'] / gib:.3f} GiB ({report['capture_peak']['what']})\n"
        f"  optimization peak: {report['optimization_peak']['bytes'] / gib:.3f} GiB ({report['optimization_peak']['what']})\n"
        f"  online peak:       {report['online_peak']['bytes'] / gib:.3f} GiB ({report['online_peak']['what']})\n"
        f"{_plan_lines(report['plans'])}\n"
        f"  {report['verdict']}: {report['reason']}",
        file=sys.stderr if args.json else sys.stdout,  # with `--json` stdout holds only the report
    )
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    return 0 if report["verdict"] == "go" else 1
