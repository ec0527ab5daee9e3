"""docs/training-quickstart.md and docs/training/ cannot rot: their marked blocks run, in order, against a tiny world.

The guide is the quickstart followed by its topic pages, in the order of
``PAGES`` (the order of the quickstart's "Where to go next"); every page of
``docs/training/`` must be listed there, so a new page's blocks cannot be
silently skipped. Fenced blocks in the guide, by info string:

- ``sh test``: run with ``bash -euo pipefail`` in one temporary directory,
  in document order, with this environment's ``bin`` first on ``PATH``;
  must exit 0. ``dflash-worker`` there is the stand-in of
  ``tests/prewarmed.py`` (the same ``main`` in a fresh process forked from an
  interpreter that imported torch once; the console script itself is run by
  ``tests/test_packaging.py``).
- ``sh test fails``: same, but must exit non-zero (a documented refusal).
- ``<lang> file=NAME``: written to ``NAME`` in that directory when reached,
  so later ``sh test`` blocks use the file exactly as the guide shows it.

The guide's first ``sh test`` block builds the tiny world itself. Cheap
checks cover what does not run: every ``file=*.toml`` is a valid recipe, the
run spec the guide writes passes the job runner's spec rules, every
``dflash-worker SUBCOMMAND --flag`` in any ``sh`` block exists, and the
recipe reference names every key of every recipe section.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
from prewarmed import CommandServer

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
DOC = DOCS_DIR / "training-quickstart.md"
# The quickstart, then its topic pages in the order their blocks run (later pages use what earlier ones made).
PAGES = (
    DOC,
    *(
        DOCS_DIR / "training" / f"{name}.md"
        for name in (
            "data", "recipe", "capture", "preflight", "train", "resume", "export", "evaluate", "distributed",
            "families", "scratch", "coordinator-job",
        )
    ),
)
FENCE = re.compile(r"^```(?P<info>[^`\n]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)
BLOCK_TIMEOUT_S = 600

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Block:
    line: int
    info: tuple[str, ...]
    body: str
    page: str = DOC.name

    @property
    def lang(self) -> str:
        return self.info[0] if self.info else ""

    @property
    def file(self) -> str | None:
        return next((w.split("=", 1)[1] for w in self.info if w.startswith("file=")), None)


def blocks(text: str, page: str = DOC.name) -> list[Block]:
    """Every fenced block of `text` with its 1-based starting line and info words."""
    return [
        Block(text.count("\n", 0, m.start()) + 1, tuple(m.group("info").split()), m.group("body"), page)
        for m in FENCE.finditer(text)
    ]


def guide_blocks() -> list[Block]:
    """Every fenced block of every page of the guide, in the order they run."""
    return [b for p in PAGES for b in blocks(p.read_text(encoding="utf-8"), str(p.relative_to(DOCS_DIR)))]


def _env(first: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([*([str(first)] if first else []), str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("NO_COLOR", "1")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _run(block: Block, cwd: Path, first: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.body], cwd=cwd, env=_env(first), capture_output=True, text=True,
        timeout=BLOCK_TIMEOUT_S,
    )


def _describe(block: Block, res: subprocess.CompletedProcess) -> str:
    return (
        f"{block.page} line {block.line} (`{' '.join(block.info)}`) exited {res.returncode}\n"
        f"--- block ---\n{block.body}--- stdout ---\n{res.stdout[-4000:]}--- stderr ---\n{res.stderr[-4000:]}"
    )


def test_every_training_page_is_run():
    """Every page of docs/training/ is in `PAGES` (its blocks run), and every page in `PAGES` exists."""
    on_disk = {p.name for p in (DOCS_DIR / "training").glob("*.md")}
    listed = {p.name for p in PAGES[1:]}
    assert on_disk == listed, f"docs/training/ pages not in PAGES: {sorted(on_disk - listed)}; missing: {sorted(listed - on_disk)}"
    quickstart = DOC.read_text(encoding="utf-8")
    assert all(f"(training/{p.name})" in quickstart for p in PAGES[1:]), "the quickstart links every topic page"


def test_parser_sees_marked_blocks():
    """The guide has the marked blocks this test relies on (a renamed marker must not silently skip them)."""
    bs = guide_blocks()
    runnable = [b for b in bs if b.info[:2] == ("sh", "test")]
    assert len(runnable) >= 10
    assert any(b.info == ("sh", "test", "fails") for b in bs)
    assert {b.file for b in bs if b.file} >= {"recipe.toml", "recipe-moe.toml", "recipe-regen.toml", "recipe-scratch.toml"}
    # a block is never half-marked: `test` only after `sh`
    assert all(b.lang == "sh" for b in bs if "test" in b.info[1:])


def test_recipe_reference_names_every_key():
    """Every key of every recipe section appears, backticked, in the guide."""
    from dflash_worker.recipe import SECTIONS

    text = (DOCS_DIR / "training" / "recipe.md").read_text(encoding="utf-8")
    missing = [
        f"[{name}].{f.name}" for name, cls in SECTIONS.items() for f in fields(cls) if f.init and f"`{f.name}`" not in text
    ]
    assert not missing, f"keys missing from docs/training/recipe.md: {missing}"
    for name in SECTIONS:
        assert f"`[{name}]`" in text, name


def test_documented_flags_exist():
    """`dflash-worker SUB --flag` in any sh block (tested or not) names a real subcommand and flag."""
    from dflash_worker.cli import COMMANDS, build_parser

    seen = 0
    for b in guide_blocks():
        if b.lang != "sh":
            continue
        for raw in b.body.replace("\\\n", " ").splitlines():
            words = shlex.split(raw, comments=True)
            if "dflash-worker" not in words:
                continue
            args = words[words.index("dflash-worker") + 1 :]
            assert args and args[0] in COMMANDS, f"{b.page} line {b.line}: unknown subcommand in `{raw}`"
            sub = build_parser(args[0])._subparsers._group_actions[0].choices[args[0]]
            known = {s for a in sub._actions for s in a.option_strings}
            for w in args[1:]:
                if w.startswith("--"):
                    assert w.split("=", 1)[0] in known, f"{b.page} line {b.line}: `{args[0]}` has no flag `{w}`"
            seen += 1
    assert seen >= 15


def test_quickstart_blocks_run_in_order(tmp_path):
    with CommandServer(tmp_path.parent / f"{tmp_path.name}-bin", timeout=BLOCK_TIMEOUT_S) as server:
        _run_blocks(tmp_path, server)


def _run_blocks(tmp_path: Path, server: CommandServer) -> None:
    from dflash_worker.recipe import load_recipe

    ran = 0
    for b in guide_blocks():
        if b.file:
            (tmp_path / b.file).write_text(b.body, encoding="utf-8")
            if b.file.endswith(".toml"):
                load_recipe(tmp_path / b.file)  # every recipe in the guide parses, even those not run
            continue
        if b.info[:2] != ("sh", "test"):
            continue
        res = _run(b, tmp_path, server.bindir)
        if "fails" in b.info[2:]:
            assert res.returncode != 0, _describe(b, res)
            assert "error:" in res.stderr and "hint:" in res.stderr, _describe(b, res)
        else:
            assert res.returncode == 0, _describe(b, res)
        ran += 1
    assert ran >= 10
    assert len(server.calls) >= 30 and ["train", "--recipe", "recipe.toml", "--resume"] in server.calls  # the stand-in ran them

    # What the guide says the stages leave behind.
    run = tmp_path / "runs" / "my-draft"
    selection = json.loads((run / "selection.json").read_text())
    assert selection["step"] == 6 and selection["export"]["format"] == "bf16"
    for name in ("report.json", "report.md", "acceptance.png"):
        assert (run / "evaluate-test" / name).stat().st_size > 0
    report = json.loads((run / "evaluate-test" / "report.json").read_text())
    assert report["prompts"] == 2 and report["verdict"] in ("improved", "tied", "regressed")
    assert json.loads((run / "export-af4g64" / "manifest.json").read_text())
    moe = tmp_path / "runs" / "moe-draft"
    assert json.loads((moe / "selection.json").read_text())["export"]["format"] == "af4g64"
    assert json.loads((tmp_path / "runs" / "moe-capture" / "manifest.json").read_text())

    # "Train a draft from scratch": a fresh DFlash2 and a fresh DFlash (v1) draft both beat tau 1.5
    for kind, arch in (("dflash2", "DFlash2DraftModel"), ("dflash1", "DFlashDraftModel")):
        scratch = tmp_path / "runs" / f"scratch-{kind}"
        assert json.loads((scratch / "export" / "config.json").read_text())["architectures"] == [arch]
        report = json.loads((scratch / "evaluate-test" / "report.json").read_text())
        assert report["trained"]["tau_pooled"] > 1.5 and report["baseline"]["tau_pooled"] == 1.0, kind
        assert report["lossless"] is True

    # The run spec the guide writes (its `run-manager --local` block is not run here: tests/e2e runs jobs).
    from dflash_worker.worker.spec import JobSpec
    from dflash_worker.worker.stages import STAGES

    job_dir = tmp_path / "job"
    job_dir.mkdir()
    spec_file = json.loads((tmp_path / "run.json").read_text())
    (job_dir / "spec.json").write_text(json.dumps({"schema_version": 1, "spec": spec_file["spec"]}))
    spec = JobSpec.load(job_dir)
    assert all(s in STAGES for s in spec.job.stages)
    recipe = spec.job.recipe
    assert recipe.model.target == (tmp_path / "tiny" / "target").resolve()
    assert recipe.train.output == (job_dir / "run").resolve()
    for p in spec.job.inputs:
        assert Path(p).is_file(), p
