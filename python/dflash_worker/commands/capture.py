"""`dflash-worker capture`: cache the teacher's features for the draft, as the recipe says (resumable).

The data summary goes to stdout (one JSON object, the capture manifest, with `--json`);
logs, warnings and the progress bar go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from ..recipe import ON_OVERLONG


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, metavar="RECIPE.toml",
                        help="recipe with `[model]`, `[data]` and `[capture]`; rerun the same command to resume")
    parser.add_argument("--on-overlong", choices=ON_OVERLONG, default=None,
                        help="examples over `[data].max_length`: skip them (listed in the manifest), truncate them "
                             "to it, or fail (default: `[capture].on_overlong`, else skip)")
    parser.add_argument("--json", action="store_true", help="print the capture manifest as one JSON object on stdout")


def summary(manifest: dict[str, Any]) -> str:
    """The human summary of a capture manifest (stdout without `--json`)."""
    t = manifest["totals"]
    peak = manifest["run"]["peak_memory"]
    out = manifest["recipe"]["capture"]["output"]
    line = (
        f"capture: {t['examples']} examples, {t['tokens']} tokens, {manifest['shards_total']} shards, "
        f"{t['payload_bytes']} bytes in `{out}`; peak RSS {peak.get('process_max_rss_bytes')} bytes"
    )
    ov = manifest.get("overlong") or {}
    if ov.get("count"):
        line += (f"\ncapture: {ov['count']} examples over max_length {ov['max_length']} ({ov['policy']}): "
                 f"{len(ov['skipped'])} skipped, {len(ov['truncated'])} truncated")
    return line


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..capture import run_capture
    from ..recipe import load_recipe
    from ..worker.events import Event, Log, Progress

    recipe = load_recipe(args.recipe)
    if args.on_overlong is not None:  # CLI over recipe
        recipe = dataclasses.replace(recipe, capture=dataclasses.replace(recipe.require("capture"), on_overlong=args.on_overlong))
    bar = None
    tty = sys.stderr.isatty()

    def on_event(e: Event) -> None:
        nonlocal bar
        if isinstance(e, Log) and e.level != "debug":
            level = "" if e.level == "info" else f"{e.level}: "
            print(f"capture: {level}{e.message}", file=sys.stderr)
        elif isinstance(e, Progress):
            if bar is None:  # the first progress says where a resumed capture starts
                bar = tqdm(total=e.total_steps, initial=e.step, unit="ex", disable=not tty)
            elif e.step > bar.n:
                bar.update(e.step - bar.n)

    manifest = run_capture(recipe, on_event=on_event)
    if bar is not None:
        bar.close()
    from ..dist import ranks_from_env

    if not ranks_from_env().main:  # under torchrun, rank 0 prints the summary
        return 0
    if args.json:
        print(json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False))
    else:
        print(summary(manifest))
    return 0
