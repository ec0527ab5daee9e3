"""`dflash-worker init-draft`: a fresh, randomly initialised DFlash2 or DFlash (v1) draft for a target.

The rules that pick each field are in `dflash_worker.model.geometry` and
docs/training/scratch.md ("Train a draft from scratch"). Train the result
with `[train] preset = "from_scratch"`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="T",
                        help="target checkpoint directory (config.json, tokenizer) of a supported family (qwen3, qwen3_moe, qwen3_5, qwen3_5_moe; a Qwen3.5 multimodal checkpoint loads its text tower)")
    parser.add_argument("--geometry", default="standard", metavar="G",
                        help="`standard` (5 layers, block 16; default), `tiny` (the 2-layer, block-4 test layout), "
                        "or FILE: a draft config.json (or its directory) whose layers, block size, taps and "
                        "selector fields are copied")
    parser.add_argument("--kind", choices=("dflash2", "dflash"), default=None,
                        help="draft kind: `dflash2` (default for built-in geometries) or `dflash` (v1: no selector, "
                        "no convolutions); with FILE, the file's kind unless given")
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write config.json and model.safetensors")
    parser.add_argument("--layers", type=int, default=None, metavar="N", help="number of draft decoder layers")
    parser.add_argument("--block-size", type=int, default=None, metavar="N", help="block size (anchor + N-1 mask tokens)")
    parser.add_argument("--target-layer-ids", default=None, metavar="IDS",
                        help="target layers whose outputs feed the draft, e.g. `1,9,17` (default: the geometry's rule)")
    parser.add_argument("--mask-token-id", type=int, default=None, metavar="ID",
                        help="mask token id (default: the tokenizer's mask token, else the first id it never produces)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation (default 0)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="weight dtype on disk (default bfloat16, as released drafts)")
    parser.add_argument("--overwrite", action="store_true", help="replace a draft already in DIR")
    parser.add_argument("--json", action="store_true", help="print the summary (config, files and their sha256) as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..families import validate_pair
    from ..model.geometry import parse_ids, plan_draft, write_fresh_draft

    out = Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise ConfigError(f"output `{out}` already exists and is not empty\nhint: pass `--overwrite` or another `--output`")
    plan = plan_draft(
        args.target,
        geometry=args.geometry,
        kind=args.kind,
        layers=args.layers,
        block_size=args.block_size,
        target_layer_ids=None if args.target_layer_ids is None else parse_ids(args.target_layer_ids),
        mask_token_id=args.mask_token_id,
    )
    for w in plan.warnings:
        print(f"warning: {w}", file=sys.stderr)
    summary = write_fresh_draft(plan, out, seed=args.seed, dtype=args.dtype)
    validate_pair(args.target, out)  # the file we wrote fits the target by the same rules capture and train use
    line = (
        f"initialised a {summary['kind']} draft in `{out}`: {summary['num_layers']} layers, block_size "
        f"{summary['block_size']}, target_layer_ids {summary['target_layer_ids']}, mask_token_id "
        f"{summary['mask_token_id']}, {summary['parameters']:,} parameters ({args.dtype}, seed {args.seed})"
    )
    print(line, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({**summary, "config": plan.config}, indent=2, sort_keys=True))
    return 0
