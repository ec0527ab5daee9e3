"""`dflash-worker` command line.

Each subcommand lives in ``dflash_worker.commands.<name>`` and exposes
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only
when their subcommand runs, so ``--help`` stays fast and torch loads lazily.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator

from . import __version__
from .errors import DflashError

# name -> (module under dflash_worker.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect-checkpoint": ("inspect_checkpoint", "list tensors, dtypes and family of a checkpoint (headers only)"),
    "validate-pair": ("validate_pair", "check that a draft fits a target (headers only)"),
    "init-draft": ("init_draft", "a fresh DFlash2 or DFlash (v1) draft for a target, to train from scratch"),
    "prepare-data": ("prepare_data", "normalise, deduplicate and split JSONL data into train/val/test"),
    "check-data": ("check_data", "render prepared data with the target's chat template (no weights) and report failures"),
    "capture": ("capture", "run the frozen teacher over prepared data and cache the draft's features (resumable)"),
    "preflight": ("preflight", "one near-max-length training step: peak memory of capture and optimization, go/no-go"),
    "train": ("train", "train the released draft on captured features; checkpoint, validate, select, export (resumable)"),
    "export": ("export", "export a finished run's selected checkpoint as BF16 or AF4G64 with a provenance manifest; "
               "`--for ENGINE` says how vLLM, SGLang, MLX or llama.cpp serves it"),
    "evaluate": ("evaluate", "speculative generation on held-out prompts: released vs trained draft, report + plot"),
}


def _module(name: str):
    return importlib.import_module(f"dflash_worker.commands.{COMMANDS[name][0]}")


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    """Build the parser; only the subcommand `load` (if any) imports its module."""
    parser = argparse.ArgumentParser(
        prog="dflash-worker",
        description="Adapt a released DFlash2 draft to your own data: prepare, capture, train, export, evaluate.",
    )
    parser.add_argument("--version", action="version", version=f"dflash-worker {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == load:
            _module(name).add_arguments(sp)
        else:
            sp.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 1
    with _log_to_stderr():
        return run_guarded(lambda: _one_rank_unless_ranked(args.command) or _module(args.command).run(args))


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever `sys.stderr` is when the record comes (tests swap it per call)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


@contextlib.contextmanager
def _log_to_stderr() -> Iterator[None]:
    """While a command runs, library logs of the `dflash_worker` loggers at INFO and above (the kernel
    selection of a hybrid target, `weights.linear_kernels`) go to stderr as ``dflash-worker: <message>``,
    unless the process already set up its own handler (the job runner's JSON lines, `dflash_worker.job`).
    Removed afterwards, so a process that calls `main` (tests) keeps its logging as it was."""
    root = logging.getLogger("dflash_worker")
    if root.handlers:
        yield
        return
    handler, level = _StderrHandler(), root.level
    handler.setFormatter(logging.Formatter("dflash-worker: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


# Commands that run as several `torch.distributed` ranks (`dflash_worker.dist`); the others would
# each do the whole work and write the same files at once.
RANKED = ("capture", "train", "evaluate")


def _one_rank_unless_ranked(command: str) -> None:
    world = os.environ.get("WORLD_SIZE", "1").strip()
    if command not in RANKED and world not in ("", "0", "1"):
        from .errors import ConfigError

        raise ConfigError(
            f"`{command}` runs on one rank, but `WORLD_SIZE` is `{world}` (started by torchrun?)\n"
            f"hint: run `{command}` as one process; {', '.join(f'`{c}`' for c in RANKED)} run as several ranks"
        )


def run_guarded(command: Callable[[], int | None]) -> int:
    """Run a command body and map the outcomes users see to exit codes, never a traceback
    for a user error: `DflashError` -> its message and code (1), Ctrl-C -> 130, a closed
    stdout pipe (`| head`) -> a quiet 1. Shared by `dflash-worker` and `dflash-coordinator`."""
    try:
        return int(command() or 0)
    except DflashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # point stdout at /dev/null so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
