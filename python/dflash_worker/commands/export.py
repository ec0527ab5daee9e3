"""`dflash-worker export`: write the selected checkpoint of a finished run as BF16 or AF4G64."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="DIR", help="run directory written by `dflash-worker train`")
    parser.add_argument("--format", choices=("bf16", "af4g64"), default="bf16",
                        help="`bf16`: safetensors in the released upstream layout (default); "
                        "`af4g64`: MLX affine 4-bit, group 64")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="export directory (default: `RUN/export` for bf16, `RUN/export-af4g64` for af4g64)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export directory (only once the new one is complete)")
    parser.add_argument("--json", action="store_true", help="print the export manifest as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    from ..errors import ExportError
    from ..train.export_run import export_dir_name, export_run, read_selection, recipe_from_state

    run_dir = Path(args.run)
    selection = read_selection(run_dir)
    recipe = recipe_from_state(run_dir, selection)
    out = Path(args.output) if args.output else run_dir / export_dir_name(args.format)
    if out.exists() and not args.overwrite:
        raise ExportError(f"export directory `{out}` already exists\nhint: pass `--overwrite` or `--output DIR`")
    res = export_run(run_dir, fmt=args.format, recipe=recipe, selection=selection, out_dir=out, overwrite=args.overwrite)
    # The summary on stdout; with `--json` stdout holds only the manifest and the summary is a log line.
    print(f"export: wrote `{res.out_dir}` ({args.format}, step {selection['step']})", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(res.manifest, indent=2, sort_keys=True))
    return 0
