"""`dflash-worker capture`: cache the teacher's features for the draft, as the recipe says (resumable)."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, metavar="RECIPE.toml",
                        help="recipe with `[model]`, `[data]` and `[capture]`; rerun the same command to resume")
    parser.add_argument("--json", action="store_true", help="print the capture manifest as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..capture import run_capture
    from ..recipe import load_recipe

    recipe = load_recipe(args.recipe)
    bar = None
    tty = sys.stderr.isatty()

    def on_event(e: dict) -> None:
        nonlocal bar
        kind = e["event"]
        if kind == "start":
            print(f"capture: {e['examples']} examples, resuming at {e['resume_from']} ({e['shards_reused']} shards reused)", file=sys.stderr)
            bar = tqdm(total=e["examples"], initial=e["resume_from"], unit="ex", disable=not tty)
        elif kind == "example" and bar is not None:
            bar.update(1)
        elif kind == "teacher_loaded":
            print(f"capture: teacher loaded in {e['seconds']:.1f}s", file=sys.stderr)
        elif kind == "already_complete":
            print(f"capture: already complete ({e['shards']} shards verified)", file=sys.stderr)

    manifest = run_capture(recipe, on_event=on_event)
    if bar is not None:
        bar.close()
    t = manifest["totals"]
    peak = manifest["run"]["peak_memory"]
    print(
        f"capture: {t['examples']} examples, {t['tokens']} tokens, {manifest['shards_total']} shards, "
        f"{t['payload_bytes']} bytes in `{recipe.capture.output}`; peak RSS {peak.get('process_max_rss_bytes')} bytes",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False))
    return 0
