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
    from ..worker.events import Event, Log, Progress

    recipe = load_recipe(args.recipe)
    bar = None
    tty = sys.stderr.isatty()

    def on_event(e: Event) -> None:
        nonlocal bar
        if isinstance(e, Log) and e.level != "debug":
            print(f"capture: {e.message}", file=sys.stderr)
        elif isinstance(e, Progress):
            if bar is None:  # the first progress says where a resumed capture starts
                bar = tqdm(total=e.total_steps, initial=e.step, unit="ex", disable=not tty)
            elif e.step > bar.n:
                bar.update(e.step - bar.n)

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
