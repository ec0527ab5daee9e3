"""`dflash-worker validate-pair`: check that a DFlash2 draft fits a target, reading headers and config.json only."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..errors import FamilyError
from ..families import draft_geometry, pair_problems, read_checkpoint_info


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        required=True,
        metavar="T",
        help="target checkpoint directory (config.json + safetensors shards) of a supported family (qwen3, qwen3_moe, qwen3_5, qwen3_5_moe; a Qwen3.5 multimodal checkpoint loads its text tower)",
    )
    parser.add_argument(
        "--draft",
        required=True,
        metavar="D",
        help="DFlash2 draft checkpoint directory (config.json with dflash_config + safetensors)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (ok, family, problems) on stdout")


def run(args: argparse.Namespace) -> int:
    from ..weights.checkpoint import text_config

    target = read_checkpoint_info(args.target)
    draft = read_checkpoint_info(args.draft)
    fam, problems, storage = pair_problems(target, draft)
    geometry = dataclasses.asdict(draft_geometry(draft))
    tc = text_config(target.config)  # a multimodal wrapper's text tower
    if args.json:
        doc = {
            "ok": not problems,
            "target": str(args.target),
            "draft": str(args.draft),
            "family": fam.name if fam else None,
            "target_hidden_size": tc.get("hidden_size"),
            "target_num_hidden_layers": tc.get("num_hidden_layers"),
            "target_vocab_size": tc.get("vocab_size"),
            "expert_storage": storage,
            "draft_geometry": geometry,
            "problems": [{"field": p.field, "message": p.message} for p in problems],
        }
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    if problems:
        lines = "".join(f"\n  {p}" for p in problems[1:])
        raise FamilyError(
            f"draft `{args.draft}` does not fit target `{args.target}`: {problems[0]}"
            + (f"\nalso:{lines}" if lines else "")
        )
    if not args.json:
        ids = geometry["target_layer_ids"]
        sys.stdout.write(
            f"ok: draft fits target (family {fam.name if fam else '?'}; hidden {tc.get('hidden_size')}, "
            f"vocab {tc.get('vocab_size')}, target layers {tc.get('num_hidden_layers')}, "
            f"target_layer_ids {ids}, block_size {geometry['block_size']}"
            + (f", experts {storage}" if storage else "")
            + ")\n"
        )
    return 0
