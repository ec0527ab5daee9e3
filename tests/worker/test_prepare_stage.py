"""The job's `prepare` stage with fixed splits (`spec.prepare.split` / `holdout_file`): the same
data directory, byte for byte, as `prepare-data --split` / `--holdout-file` on the same input."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from prewarmed import run_main

from dflash_worker.cli import main


def _write_rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"question number {i}", "response": f"answer {i}"}) + "\n" for i in range(n)))
    return path


# The prepare stage reads no model; the recipe only has to be well formed.
RECIPE = {"model": {"target": "/models/target", "draft": "/models/draft", "family": "qwen3"}, "data": {"thinking": "off", "max_length": 256}}


def _run_job(job: Path, spec: dict) -> subprocess.CompletedProcess:
    spec = {**spec, "recipe": RECIPE}
    job.mkdir()
    (job / "spec.json").write_text(json.dumps({"schema_version": 1, "spec": spec}))
    return run_main("dflash_worker.job", ["--job-dir", job], timeout=300)


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.name != "manifest.json"}


def _cli(capsys, *args: str) -> dict:
    code = main(["prepare-data", *args, "--json"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    return json.loads(cap.out)


def test_split_and_holdout_in_the_job_spec_prepare_what_the_cli_prepares(tmp_path, capsys):
    src = _write_rows(tmp_path / "in.jsonl", 50)

    # `split`: every row to `test` (a file that is all held-out data).
    p = _run_job(tmp_path / "job-split", {"stages": ["prepare"], "inputs": [str(src)], "prepare": {"split": "test"}})
    assert p.returncode == 0, p.stderr
    m = json.loads((tmp_path / "job-split" / "data" / "manifest.json").read_text())
    assert m["counts"]["split"] == {"train": 0, "val": 0, "test": 50} and m["params"]["split_mode"] == "all:test"
    cli = _cli(capsys, "--input", str(src), "--output", str(tmp_path / "cli-split"), "--split", "test")
    assert m["split_fingerprint"] == cli["split_fingerprint"]
    assert _digests(tmp_path / "job-split" / "data") == _digests(tmp_path / "cli-split")

    # `holdout_file`: the listed row goes to `test`, the rest keep their hashed split.
    base = _cli(capsys, "--input", str(src), "--output", str(tmp_path / "base"))
    train = [json.loads(line) for line in (tmp_path / "base" / "train.jsonl").read_text().splitlines()]
    hold = tmp_path / "holdout.txt"
    hold.write_text(f"# pinned\n{train[0]['id']}\n")
    p = _run_job(tmp_path / "job-hold", {"stages": ["prepare"], "inputs": [str(src)], "prepare": {"holdout_file": str(hold)}})
    assert p.returncode == 0, p.stderr
    m = json.loads((tmp_path / "job-hold" / "data" / "manifest.json").read_text())
    assert m["holdout"]["sha256"] == hashlib.sha256(hold.read_bytes()).hexdigest() and m["holdout"]["rows"] == 1
    assert m["counts"]["split"]["test"] == base["counts"]["split"]["test"] + 1
    test_ids = [json.loads(line)["id"] for line in (tmp_path / "job-hold" / "data" / "test.jsonl").read_text().splitlines()]
    assert train[0]["id"] in test_ids
    cli = _cli(capsys, "--input", str(src), "--output", str(tmp_path / "cli-hold"), "--holdout-file", str(hold))
    assert m["split_fingerprint"] == cli["split_fingerprint"] != base["split_fingerprint"]
    assert _digests(tmp_path / "job-hold" / "data") == _digests(tmp_path / "cli-hold")


@pytest.mark.parametrize(
    ("prepare", "needle"),
    [
        ({"split": "holdout"}, "`spec.prepare.split` must be one of `train`, `val`, `test`, found `holdout`"),
        ({"split": 3}, "`split` must be a split name"),
        ({"split": "test", "test_fraction": 0.1}, "cannot be combined with `spec.prepare.test_fraction`"),
        ({"split": "val", "holdout_file": "h.txt"}, "cannot be combined with `spec.prepare.holdout_file`"),
        ({"holdout_file": ""}, "`spec.prepare.holdout_file` is empty"),
        ({"holdout_file": "a\0b"}, "`spec.prepare.holdout_file` contains a NUL character"),
        ({"holdout_file": ["h.txt"]}, "`holdout_file` must be a path"),
    ],
)
def test_bad_fixed_split_options_are_refused_before_anything_is_written(tmp_path, prepare, needle):
    src = _write_rows(tmp_path / "in.jsonl", 5)
    p = _run_job(tmp_path / "job", {"stages": ["prepare"], "inputs": [str(src)], "prepare": prepare})
    last = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 1 and last["event"] == "error" and needle in last["message"], (p.stdout, p.stderr)
    assert not (tmp_path / "job" / "data").exists()


def test_a_missing_holdout_file_is_named(tmp_path):
    src = _write_rows(tmp_path / "in.jsonl", 5)
    p = _run_job(tmp_path / "job", {"stages": ["prepare"], "inputs": [str(src)], "prepare": {"holdout_file": str(tmp_path / "nope.txt")}})
    last = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 1 and last["event"] == "error" and f"cannot read holdout file `{tmp_path / 'nope.txt'}`" in last["message"], p.stdout
    assert not (tmp_path / "job" / "data" / "manifest.json").exists()


def test_replay_in_the_job_spec_prepares_what_the_cli_prepares(tmp_path, capsys):
    src = _write_rows(tmp_path / "in.jsonl", 40)
    gen = tmp_path / "general.jsonl"
    gen.write_text("".join(json.dumps({"prompt": f"general prompt {i}"}) + "\n" for i in range(30)))
    p = _run_job(tmp_path / "job", {"stages": ["prepare"], "inputs": [str(src)],
                                     "prepare": {"replay": [str(gen)], "replay_fraction": 0.2}})
    assert p.returncode == 0, p.stderr
    m = json.loads((tmp_path / "job" / "data" / "manifest.json").read_text())
    assert m["replay"]["rows"] > 0 and m["replay"]["fraction"] == 0.2
    cli = _cli(capsys, "--input", str(src), "--output", str(tmp_path / "cli"), "--replay", str(gen), "--replay-fraction", "0.2")
    assert m["split_fingerprint"] == cli["split_fingerprint"]
    assert _digests(tmp_path / "job" / "data") == _digests(tmp_path / "cli")


def test_replay_val_fraction_in_the_job_spec_prepares_what_the_cli_prepares(tmp_path, capsys):
    """General rows held out into val (the general-domain guard's rows), from a job as from the CLI."""
    src = _write_rows(tmp_path / "in.jsonl", 40)
    gen = tmp_path / "general.jsonl"
    gen.write_text("".join(json.dumps({"prompt": f"general prompt {i}"}) + "\n" for i in range(30)))
    p = _run_job(tmp_path / "job", {"stages": ["prepare"], "inputs": [str(src)],
                                     "prepare": {"replay": [str(gen)], "replay_fraction": 0.2, "replay_val_fraction": 0.1}})
    assert p.returncode == 0, p.stderr
    m = json.loads((tmp_path / "job" / "data" / "manifest.json").read_text())
    assert m["replay"]["val_ids"], m["replay"]
    val = [json.loads(line) for line in (tmp_path / "job" / "data" / "val.jsonl").read_text().splitlines()]
    assert sum(1 for row in val if row.get("domain") == "general") == len(m["replay"]["val_ids"])
    cli = _cli(capsys, "--input", str(src), "--output", str(tmp_path / "cli"), "--replay", str(gen), "--replay-fraction", "0.2",
               "--replay-val-fraction", "0.1")
    assert m["split_fingerprint"] == cli["split_fingerprint"]
    assert _digests(tmp_path / "job" / "data") == _digests(tmp_path / "cli")


@pytest.mark.parametrize(
    ("prepare", "needle"),
    [
        ({"replay": []}, "`spec.prepare.replay` must be a non-empty list of JSONL paths"),
        ({"replay": [""]}, "`spec.prepare.replay` must be a non-empty list of JSONL paths"),
        ({"replay": "g.jsonl"}, "`replay` must be a list of strings"),
        ({"replay": ["a\0b"]}, "`spec.prepare.replay[0]` contains a NUL character"),
        ({"replay_fraction": 0.3}, "`spec.prepare.replay_fraction` is set but `spec.prepare.replay` names no file"),
        ({"replay_val_fraction": 0.1}, "`spec.prepare.replay_val_fraction` is set but `spec.prepare.replay` names no file"),
        ({"replay": ["g.jsonl"], "replay_val_fraction": "a tenth"}, "`replay_val_fraction` must be a number"),
        ({"replay": ["g.jsonl"], "replay_val_fraction": 1.5}, "`--replay-val-fraction` must be in (0, 1)"),
        ({"replay": ["g.jsonl"], "replay_fraction": "half"}, "`replay_fraction` must be a number"),
        ({"replay": ["g.jsonl"], "replay_fraction": 1.5}, "`--replay-fraction` must be in (0, 1)"),
    ],
)
def test_bad_replay_options_are_refused_before_anything_is_written(tmp_path, prepare, needle):
    src = _write_rows(tmp_path / "in.jsonl", 5)
    (tmp_path / "g.jsonl").write_text(json.dumps({"prompt": "general"}) + "\n")
    p = _run_job(tmp_path / "job", {"stages": ["prepare"], "inputs": [str(src)], "prepare": prepare})
    last = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 1 and last["event"] == "error" and needle in last["message"], (p.stdout, p.stderr)
    assert not (tmp_path / "job" / "data" / "manifest.json").exists()
