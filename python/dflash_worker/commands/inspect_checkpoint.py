"""`dflash-worker inspect-checkpoint`: list a checkpoint's tensors and check it, reading headers only."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import FamilyError
from ..families import (
    Problem,
    draft_problems,
    is_draft,
    read_checkpoint_info,
    target_problems,
)
from ..weights.checkpoint import INDEX_NAME


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        metavar="PATH",
        help="checkpoint directory (with model.safetensors.index.json or *.safetensors), an index json, "
        "or one .safetensors file; config.json next to it is read if present",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of a table")
    parser.add_argument(
        "--no-model-check",
        action="store_true",
        help="for targets, skip comparing tensor names and shapes with the model built from config.json "
        "(that check imports torch and transformers; it never reads tensor data)",
    )


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace) -> int:
    info = read_checkpoint_info(args.path, need_config=False)
    problems: list[Problem] = []
    skipped: list[str] = []
    skipped_bytes = 0
    kind: str | None = None
    family: str | None = None
    path = Path(args.path)
    is_shard = path.is_file() and path.suffix == ".safetensors" and (path.parent / INDEX_NAME).is_file()
    if is_shard:
        # One shard of a sharded checkpoint: list it; model checks need the whole checkpoint.
        kind = "shard"
    elif info.config:
        if is_draft(info):
            kind, family = "draft", "dflash2-draft"
            problems = draft_problems(info)
        else:
            kind = "target"
            fam, problems, _ = target_problems(info)
            family = fam.name if fam else None
            if fam is not None and not problems and not args.no_model_check:
                # Compare names and shapes with the model config.json describes
                # (built on the meta device: no weights are read or allocated).
                from ..weights.loader import check_model_checkpoint

                report = check_model_checkpoint(args.path)
                skipped, skipped_bytes = report.skipped, report.bytes_skipped
    files = sorted({str(t.file) for t in info.tensors.values()})
    total = sum(t.nbytes for t in info.tensors.values())
    verdict = "ok" if not problems else "invalid"
    if args.json:
        doc = {
            "path": str(Path(args.path)),
            "files": files,
            "tensors": [
                {"name": n, "file": str(t.file), "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes}
                for n, t in info.tensors.items()
            ],
            "num_tensors": len(info.tensors),
            "total_bytes": total,
            "kind": kind,
            "family": family,
            "config_found": bool(info.config),
            "verdict": verdict,
            "skipped": skipped,  # tensors a target load leaves unread (vision tower, MTP heads)
            "skipped_bytes": skipped_bytes,
            "problems": [{"field": p.field, "message": p.message} for p in problems],
        }
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        out = sys.stdout
        width = max((len(n) for n in info.tensors), default=4)
        out.write(f"{'tensor':<{width}}  {'dtype':<8} {'shape':<20} bytes\n")
        for n, t in info.tensors.items():
            out.write(f"{n:<{width}}  {t.dtype:<8} {str(list(t.shape)):<20} {t.nbytes}\n")
        out.write(f"\nfiles: {len(files)}  tensors: {len(info.tensors)}  bytes: {total} ({_fmt_bytes(total)})\n")
        if is_shard:
            out.write(f"kind: shard of a sharded checkpoint (pass `{path.parent}` to check the whole model)\n")
        elif info.config:
            out.write(f"kind: {kind}  family: {family or 'unsupported'}\n")
            if skipped:
                out.write(
                    f"loads the text tower; skips {len(skipped)} tensors unread ({skipped_bytes} bytes, "
                    f"{_fmt_bytes(skipped_bytes)}): vision tower and MTP heads\n"
                )
        else:
            out.write("kind: unknown (no config.json; headers checked only)\n")
        out.write(f"verdict: {verdict}\n")
        for p in problems:
            out.write(f"  {p}\n")
    if problems:
        raise FamilyError(f"`{args.path}` is not usable: {problems[0]}")
    return 0
