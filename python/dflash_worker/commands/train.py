"""`dflash-worker train`: train the released draft on captured features, validate, select, export."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, metavar="RECIPE.toml",
                        help="recipe with `[model]`, `[data]`, `[capture]` (already run) and `[train]`")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest committed checkpoint in the run directory (refused when the recipe, "
                        "captured data or released draft differ from the checkpoint's; the error names each difference); "
                        "on a completed run, verify its selection and export instead of retraining")
    parser.add_argument("--run-dir", metavar="DIR", default=None,
                        help="run directory for checkpoints, metrics.jsonl, selection.json and the export "
                        "(default: `[train].output`)")
    parser.add_argument("--json", action="store_true", help="print the result (status, steps, selection, export) as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..dist import ranks_from_env
    from ..recipe import load_recipe
    from ..train import train
    from ..worker.events import Event, Log, Progress

    recipe = load_recipe(args.recipe)
    tty = sys.stderr.isatty()
    bar = None
    logged: set[str] = set()

    def on_event(e: Event) -> None:
        nonlocal bar
        if isinstance(e, Progress):
            if bar is None:
                bar = tqdm(total=e.total_steps, initial=e.step - 1, unit="step", disable=not tty)
            bar.update(1)
            bar.set_postfix(loss=f"{e.metrics.get('loss', float('nan')):.4f}", lr=f"{e.metrics.get('lr', float('nan')):.2e}")
        elif isinstance(e, Log):
            logged.add(e.message)
            print(f"train: {e.message}", file=sys.stderr)

    try:
        result = train(recipe, run_dir=args.run_dir, resume=args.resume, on_event=on_event)
    finally:
        if bar is not None:
            bar.close()
    if not ranks_from_env().main:  # under torchrun, rank 0 speaks for the run; the others log that they are done
        print(f"train: {result.message}", file=sys.stderr)
        return 0
    # The result on stdout; with `--json` stdout holds only the JSON and the result is a log
    # line (once: a stop is already logged by the trainer).
    if not args.json:
        print(f"train: {result.message}")
    elif result.message not in logged:
        print(f"train: {result.message}", file=sys.stderr)
    if args.json:
        out = {
            "status": result.status,
            "run_dir": str(result.run_dir),
            "step": result.step,
            "total_steps": result.total_steps,
            "selection": result.selection,
            "export_dir": str(result.export_dir) if result.export_dir else None,
            "checkpoint": str(result.checkpoint) if result.checkpoint else None,
        }
        print(json.dumps(out, indent=2, sort_keys=True))
    return 0
