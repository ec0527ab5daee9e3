"""`dflash-worker export`: write the selected checkpoint of a finished run as BF16 or AF4G64, and with
`--for ENGINE` check it against serving engines and write how each serves it (`serving.engines`).

Exit status: 0 when the export is written and every `--for` engine accepts it; 3 when the export and
the serving files are written but an engine refused it (the reasons are in `serving/<engine>.json`,
`serving/README.md` and on stderr); 1 for a user error, nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# `--for` engines and their help; kept here (not imported from `serving.engines`) so `--help` imports nothing.
_ENGINES = {
    "vllm": "a `speculative_config` (method `dflash`, num_speculative_tokens = block_size - 1) and the `vllm serve` "
    "line; on `--serving-device cpu` DFlash2 and mixed sliding/full drafts are refused (vLLM's CPU runner)",
    "sglang": "`--speculative-algorithm DFLASH` flags (`--speculative-num-draft-tokens` = block_size); refused on "
    "`cpu` (SGLang runs DFlash on CUDA, NPU or XPU only)",
    "mlx": "Python code loading the export (BF16 or AF4G64) with `dflash_worker.serving.mlx.load_draft` and "
    "generating with z-lab dflash's MLX `stream_generate` (Apple silicon, or `mlx[cpu]`)",
    "llama.cpp": "the GGUF conversion and `llama-server --spec-type draft-dflash` lines for DFlash v1 BF16 exports; "
    "DFlash2 and AF4G64 refused with the reason",
}
REFUSED = 3  # exit status: export written, an engine refused it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="DIR", help="run directory written by `dflash-worker train`")
    source.add_argument("--export", metavar="DIR", dest="export_dir",
                        help="an existing export directory (e.g. fetched by `dflash-coordinator artifacts get`), with "
                        "`--for`: checked against its manifest and for each engine, never rewritten")
    parser.add_argument("--target", metavar="DIR", default=None,
                        help="the target checkpoint, for `--export` (default: the target named in the export "
                        "manifest's provenance)")
    parser.add_argument("--format", choices=("bf16", "af4g64"), default="bf16",
                        help="`bf16`: safetensors in the released upstream layout (default); "
                        "`af4g64`: MLX affine 4-bit, group 64")
    parser.add_argument("--output", metavar="DIR", default=None,
                        help="export directory (default: `RUN/export` for bf16, `RUN/export-af4g64` for af4g64)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export directory (only once the new one is complete)")
    parser.add_argument("--json", action="store_true", help="print the export manifest as JSON on stdout")
    parser.add_argument(
        "--for", dest="engines", action="append", choices=tuple(_ENGINES), metavar="ENGINE", default=[],
        help="check the export against a serving engine and write `EXPORT/serving/ENGINE.json` and `serving/README.md` "
        "(repeatable; an existing export that matches its manifest is kept and only checked). "
        + "; ".join(f"`{k}`: {v}" for k, v in _ENGINES.items())
        + f". Exit status {REFUSED} when an engine refuses (the export and the other engines' files are still written)",
    )
    parser.add_argument("--serving-device", choices=("cpu", "cuda"), default="cpu",
                        help="where the engine will run, for `--for` (default `cpu`: vLLM's CPU build, the one this "
                        "project runs in its interop test; `cuda`: a GPU)")


def run(args: argparse.Namespace) -> int:
    from ..errors import ExportError
    from ..train.export_run import export_dir_name, export_run, read_selection, recipe_from_state, verify_export

    if args.export_dir is not None:
        return _serve_export(args)
    if args.target is not None:
        raise ExportError("`--target` goes with `--export`; with `--run` the target is the run's recipe's\n"
                          "hint: drop `--target`")
    run_dir = Path(args.run)
    selection = read_selection(run_dir)
    recipe = recipe_from_state(run_dir, selection)
    out = Path(args.output) if args.output else run_dir / export_dir_name(args.format)
    log = sys.stderr if args.json else sys.stdout  # with `--json`, stdout holds only the manifest
    if out.exists() and not args.overwrite:
        if not args.engines:
            raise ExportError(f"export directory `{out}` already exists\nhint: pass `--overwrite` or `--output DIR`")
        manifest = verify_export(out)  # `--for` on an existing export: check it, never rewrite it
        print(f"export: kept `{out}` (matches its manifest)", file=log)
    else:
        res = export_run(run_dir, fmt=args.format, recipe=recipe, selection=selection, out_dir=out, overwrite=args.overwrite)
        manifest = res.manifest
        print(f"export: wrote `{res.out_dir}` ({args.format}, step {selection['step']})", file=log)
    if args.json:
        print(json.dumps(manifest, indent=2, sort_keys=True))
    if not args.engines:
        return 0
    return _serve(out, recipe.model.target, list(dict.fromkeys(args.engines)), args.serving_device, log)


def _serve_export(args: argparse.Namespace) -> int:
    """`--export DIR --for ENGINE`: an export without its run (fetched from a coordinator, copied over)."""
    from ..errors import ConfigError
    from ..train.export_run import verify_export

    out = Path(args.export_dir)
    if not args.engines:
        raise ConfigError("`--export` checks an existing export for serving engines and needs `--for ENGINE`\n"
                          "hint: add `--for vllm` (or sglang, mlx, llama.cpp); to write an export, use `--run`")
    manifest = verify_export(out)
    target = args.target
    if target is None:
        try:
            target = manifest["provenance"]["recipe"]["resolved"]["model"]["target"]
        except (KeyError, TypeError):
            raise ConfigError(f"export `{out}` names no target in its manifest's provenance\n"
                              "hint: pass `--target DIR`, the target checkpoint the draft was trained for") from None
    log = sys.stderr if args.json else sys.stdout
    print(f"export: kept `{out}` (matches its manifest)", file=log)
    if args.json:
        print(json.dumps(manifest, indent=2, sort_keys=True))
    return _serve(out, Path(target), list(dict.fromkeys(args.engines)), args.serving_device, log)


def _serve(out: Path, target: Path, engines: list[str], device: str, log) -> int:
    """Check `out` for each engine, write the serving files, report each answer; the exit status."""
    from ..serving.engines import plan, write_plans

    plans = [plan(engine, out, target, device=device) for engine in engines]
    write_plans(out, plans)
    for p in plans:
        if p.accepted:
            print(f"serving: {p.engine} accepts it ({device}): `{out / 'serving' / f'{p.engine}.json'}`", file=log)
    refused = [p for p in plans if not p.accepted]
    for p in refused:  # a refusal reads like any error: the reasons, then what to do
        print(f"error: {p.engine} refuses `{out}` ({device}): " + "; ".join(p.reasons), file=sys.stderr)
    if refused:
        other = " or `--serving-device cuda` for a GPU" if device == "cpu" else ""
        print(f"hint: every engine's answer is in `{out / 'serving' / 'README.md'}`; serve it with an engine that "
              f"accepts it{other}", file=sys.stderr)
    return REFUSED if refused else 0
