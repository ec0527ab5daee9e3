"""`prepare-data --replay`: general rows mixed into train only, as a recorded share of it, chosen
as a pure function of the bytes, never overlapping an input's prompt, and hostile replay files
refused with the file and line named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prewarmed import worker_cli

from dflash_worker.data import prepare_data
from dflash_worker.errors import ConfigError, DataError


def _rows(path: Path, prefix: str, n: int, extra: list[dict] | None = None) -> Path:
    rows = [{"prompt": f"{prefix} question {i}", "response": f"{prefix} answer {i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + (extra or [])))
    return path


def _split(out: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture()
def files(tmp_path):
    own = _rows(tmp_path / "own.jsonl", "own", 60)
    # the last general row repeats an own prompt (a different answer): it must never be mixed in
    gen = _rows(tmp_path / "general.jsonl", "general", 80, [{"prompt": "own question 3", "response": "leak"}])
    return own, gen


def test_replay_rows_go_to_train_only_as_the_recorded_share(tmp_path, files):
    own, gen = files
    out = tmp_path / "out"
    m = prepare_data([own], out, seed=3, val_fraction=0.2, test_fraction=0.2, replay=[gen], replay_fraction=0.3)
    r = m["replay"]
    train, val, test = (_split(out, s) for s in ("train", "val", "test"))
    mixed = [row for row in train if row["source"] == "general.jsonl"]
    assert r["rows"] == len(mixed) == r["wanted_rows"] == round(0.3 / 0.7 * r["own_train_rows"])
    assert r["own_train_rows"] == len(train) - len(mixed) and not r["short"]
    assert r["overlap_dropped"] == 1 and r["pool_rows"] == 80
    assert all(row["source"] == "own.jsonl" for row in val + test)
    assert not any(row["messages"][-1]["content"] == "leak" for row in train + val + test)
    assert m["counts"]["split"]["train"] == len(train) and m["params"]["replay"]["fraction"] == 0.3
    assert r["inputs"][0]["file"] == "general.jsonl" and len(r["inputs"][0]["sha256"]) == 64
    # the own rows' split is the one prepare-data gives without replay
    plain = prepare_data([own], tmp_path / "plain", seed=3, val_fraction=0.2, test_fraction=0.2)
    assert [row for row in train if row["source"] == "own.jsonl"] == _split(tmp_path / "plain", "train")
    assert _split(tmp_path / "plain", "val") == val and "replay" not in plain
    assert plain["split_fingerprint"] != m["split_fingerprint"]


def test_replay_is_byte_reproducible_and_seeded(tmp_path, files):
    own, gen = files
    a = prepare_data([own], tmp_path / "a", seed=1, replay=[gen])
    b = prepare_data([own], tmp_path / "b", seed=1, replay=[gen])
    prepare_data([own], tmp_path / "c", seed=2, replay=[gen])
    assert a == b and (tmp_path / "a" / "train.jsonl").read_bytes() == (tmp_path / "b" / "train.jsonl").read_bytes()
    pick = lambda d: {r["id"] for r in _split(d, "train") if r["source"] == "general.jsonl"}  # noqa: E731
    assert pick(tmp_path / "a") != pick(tmp_path / "c")  # another seed draws other replay rows
    assert a["replay"]["fraction"] == 0.25  # the documented default


def test_a_small_replay_pool_is_used_whole_and_marked_short(tmp_path, files):
    own, _ = files
    few = _rows(tmp_path / "few.jsonl", "general", 3)
    m = prepare_data([own], tmp_path / "out", replay=[few], replay_fraction=0.5)
    assert m["replay"]["rows"] == 3 and m["replay"]["short"] and m["replay"]["wanted_rows"] > 3


def test_replay_refusals(tmp_path, files):
    own, gen = files
    with pytest.raises(ConfigError, match="--replay-fraction"):
        prepare_data([own], tmp_path / "x", replay=[gen], replay_fraction=1.0)
    with pytest.raises(ConfigError, match="--replay-fraction"):
        prepare_data([own], tmp_path / "x", replay=[gen], replay_fraction=0.0)
    with pytest.raises(ConfigError, match="one split"):
        prepare_data([own], tmp_path / "x", split="test", replay=[gen])
    with pytest.raises(ConfigError, match="share the file name"):
        prepare_data([own], tmp_path / "x", replay=[own])
    with pytest.raises(DataError, match="replay file .*missing.jsonl"):
        prepare_data([own], tmp_path / "x", replay=[tmp_path / "missing.jsonl"])
    assert not (tmp_path / "x").exists()  # nothing written on any refusal


def test_a_hostile_replay_file_names_its_line_and_writes_nothing(tmp_path, files):
    own, _ = files
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "fine", "response": "ok"}\n{"prompt": 7}\n\xff\xfe not json\n')
    out = tmp_path / "out"
    with pytest.raises(DataError, match="`.*bad.jsonl` line 2"):
        prepare_data([own], out, replay=[bad])
    assert not out.exists()
    m = prepare_data([own], out, replay=[bad], skip_invalid=True)
    assert m["replay"]["pool_rows"] == 1 and m["dropped_total"] == 2
    assert {d["file"] for d in m["drops_listed"]} == {"bad.jsonl"}


def test_cli_flags(tmp_path, files):
    own, gen = files
    out = tmp_path / "out"
    res = worker_cli("prepare-data", "--input", own, "--replay", gen, "--replay-fraction", "0.2", "--output", out, timeout=120)
    assert res.returncode == 0, res.stderr
    m = json.loads((out / "manifest.json").read_text())
    assert f"mixed {m['replay']['rows']} replay rows into train" in res.stdout and m["replay"]["fraction"] == 0.2
    res = worker_cli("prepare-data", "--help", timeout=120)
    assert "--replay" in res.stdout and "--replay-fraction" in res.stdout
