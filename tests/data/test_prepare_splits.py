"""prepare-data fixed splits through the CLI: `--split` (all rows to one split) and `--holdout-file`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from dflash_worker.cli import main
from dflash_worker.data import split_of
from dflash_worker.data.schema import normalize_row, prompt_key

from .conftest import write_jsonl

SPLITS = ("train", "val", "test")


def rows(n: int) -> list[dict]:
    return [{"prompt": f"question number {i}", "response": f"answer {i}"} for i in range(n)]


def prepare(capsys, *args: str) -> tuple[int, dict | None, str]:
    code = main(["prepare-data", *args, "--json"])
    cap = capsys.readouterr()
    return code, (json.loads(cap.out) if code == 0 else None), cap.err


def read_split(out: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]


def digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("split", SPLITS)
def test_split_sends_every_row_to_one_split_deterministically(tmp_path, capsys, split):
    f = write_jsonl(tmp_path / "in.jsonl", rows(40))
    code, m, err = prepare(capsys, "--input", str(f), "--output", str(tmp_path / "a"), "--split", split)
    assert code == 0, err
    assert m["counts"]["split"] == {s: (40 if s == split else 0) for s in SPLITS}
    assert m["params"]["split_mode"] == f"all:{split}"
    assert m["params"]["val_fraction"] is None and m["params"]["test_fraction"] is None
    assert len(read_split(tmp_path / "a", split)) == 40
    # Same input, same flags: the same bytes and fingerprint; a hashed prepare of the same rows differs.
    assert prepare(capsys, "--input", str(f), "--output", str(tmp_path / "b"), "--split", split)[0] == 0
    assert digests(tmp_path / "a") == digests(tmp_path / "b")
    _, hashed, _ = prepare(capsys, "--input", str(f), "--output", str(tmp_path / "c"),
                           "--val-fraction", "0", "--test-fraction", "0")
    assert "split_mode" not in hashed["params"] and "holdout" not in hashed
    if split == "train":
        assert hashed["files"] == m["files"]
    assert hashed["split_fingerprint"] != m["split_fingerprint"]


@pytest.mark.parametrize("other", [("--test-fraction", "0.1"), ("--val-fraction", "0"), ("--holdout-file", "h.txt")])
def test_split_is_exclusive_with_fractions_and_holdout(tmp_path, capsys, other):
    f = write_jsonl(tmp_path / "in.jsonl", rows(3))
    (tmp_path / "h.txt").write_text("")
    out = tmp_path / "out"
    args = ["--input", str(f), "--output", str(out), "--split", "test", other[0]]
    args.append(str(tmp_path / other[1]) if other[0] == "--holdout-file" else other[1])
    code, _, err = prepare(capsys, *args)
    assert code == 1
    assert "`--split test`" in err and f"`{other[0]}`" in err and "hint:" in err
    assert not out.exists()


def test_holdout_rows_land_in_test_even_when_hash_says_train(tmp_path, capsys):
    data = rows(60)
    f = write_jsonl(tmp_path / "in.jsonl", data)
    base = tmp_path / "base"
    _, m0, _ = prepare(capsys, "--input", str(f), "--output", str(base), "--val-fraction", "0.2", "--test-fraction", "0.2")
    train = read_split(base, "train")
    val = read_split(base, "val")
    by_id, by_group = train[0]["id"], train[1]
    group = prompt_key(normalize_row(data[by_group["origin"]["line"] - 1], line=1, default_source="in.jsonl"))
    assert split_of(group, seed=0, val_fraction=0.2, test_fraction=0.2) == "train"
    hold = tmp_path / "holdout.txt"
    hold.write_text(
        f"# fixed test set\n\n{by_id}\n  {group.upper()}  # group key, any case\n{val[0]['id']}\n{by_id}\n",
        encoding="utf-8",
    )
    out = tmp_path / "out"
    code, m, err = prepare(capsys, "--input", str(f), "--output", str(out),
                           "--val-fraction", "0.2", "--test-fraction", "0.2", "--holdout-file", str(hold))
    assert code == 0, err
    test_ids = {r["id"] for r in read_split(out, "test")}
    assert {by_id, by_group["id"], val[0]["id"]} <= test_ids
    assert test_ids == {r["id"] for r in read_split(base, "test")} | {by_id, by_group["id"], val[0]["id"]}
    # Every other row keeps its hashed split.
    for s in ("train", "val"):
        assert [r["id"] for r in read_split(out, s)] == [
            r["id"] for r in read_split(base, s) if r["id"] not in test_ids
        ]
    h = m["holdout"]
    assert h["file"] == "holdout.txt" and h["sha256"] == hashlib.sha256(hold.read_bytes()).hexdigest()
    assert (h["lines"], h["keys"], h["matched_keys"], h["unknown_keys"]) == (6, 3, 3, 0)
    assert (h["groups"], h["rows"], h["moved_from"]) == (3, 3, {"train": 2, "val": 1})
    assert m["params"]["split_mode"] == "hash+holdout" and m["params"]["holdout_sha256"] == h["sha256"]
    assert m["split_fingerprint"] != m0["split_fingerprint"]
    assert "held out 3 rows (3 groups)" in err and "warning" not in err


def test_holdout_id_pulls_its_whole_group_into_test(tmp_path, capsys):
    data = [{"prompt": "shared prompt", "response": "one"}, {"prompt": "shared  prompt", "response": "two",
                                                            "source": "web"}] + rows(10)
    f = write_jsonl(tmp_path / "in.jsonl", data)
    base = tmp_path / "base"
    assert prepare(capsys, "--input", str(f), "--output", str(base), "--split", "train")[0] == 0
    first = read_split(base, "train")[0]["id"]
    hold = tmp_path / "h.txt"
    hold.write_text(first + "\n")
    code, m, _ = prepare(capsys, "--input", str(f), "--output", str(tmp_path / "o"),
                         "--val-fraction", "0", "--test-fraction", "0", "--holdout-file", str(hold))
    assert code == 0
    assert [r["source"] for r in read_split(tmp_path / "o", "test")] == ["in.jsonl", "web"]
    assert (m["holdout"]["groups"], m["holdout"]["rows"]) == (1, 2)


def test_unknown_holdout_keys_are_counted_and_reported(tmp_path, capsys):
    f = write_jsonl(tmp_path / "in.jsonl", rows(10))
    base = tmp_path / "base"
    assert prepare(capsys, "--input", str(f), "--output", str(base), "--split", "train")[0] == 0
    known = read_split(base, "train")[0]["id"]
    unknown = [f"{i:016x}" for i in range(30)] + ["ab" * 32]
    hold = tmp_path / "h.txt"
    hold.write_text("\n".join([known, *unknown]) + "\n")
    code, m, err = prepare(capsys, "--input", str(f), "--output", str(tmp_path / "o"), "--holdout-file", str(hold))
    assert code == 0
    h = m["holdout"]
    assert (h["keys"], h["matched_keys"], h["unknown_keys"]) == (32, 1, 31)
    assert h["unknown_listed"] == unknown[:20]
    assert f"warning: 31 of 32 keys in `{hold}` match no kept row (first: `{unknown[0]}`" in err
    assert "hint:" in err


@pytest.mark.parametrize(
    ("content", "line", "what"),
    [
        (b"0123456789abcdef\n\xff\xfe\n", 2, "not valid UTF-8"),
        (b"# ok\n0123456789abcdef\x00\n", 2, "NUL byte"),
        (b"0123456789abcdef\nwhat is two plus two\n", 2, "neither a row id nor a group key"),
        (b"\n\n0123456789abcde\n", 3, "neither a row id nor a group key"),
    ],
)
def test_corrupt_holdout_file_is_an_error_naming_file_and_line(tmp_path, capsys, content, line, what):
    f = write_jsonl(tmp_path / "in.jsonl", rows(3))
    hold = tmp_path / "bad.txt"
    hold.write_bytes(content)
    out = tmp_path / "out"
    code, _, err = prepare(capsys, "--input", str(f), "--output", str(out), "--holdout-file", str(hold))
    assert code == 1
    assert f"`{hold}` line {line}" in err and what in err and "hint:" in err
    assert not out.exists()


def test_missing_holdout_file_and_bom_crlf_accepted(tmp_path, capsys):
    f = write_jsonl(tmp_path / "in.jsonl", rows(5))
    code, _, err = prepare(capsys, "--input", str(f), "--output", str(tmp_path / "o"),
                           "--holdout-file", str(tmp_path / "nope.txt"))
    assert code == 1 and "nope.txt" in err
    assert prepare(capsys, "--input", str(f), "--output", str(tmp_path / "b"), "--split", "train")[0] == 0
    ident = read_split(tmp_path / "b", "train")[2]["id"]
    hold = tmp_path / "h.txt"
    hold.write_bytes(b"\xef\xbb\xbf" + ident.encode() + b"\r\n")
    code, m, _ = prepare(capsys, "--input", str(f), "--output", str(tmp_path / "o"), "--holdout-file", str(hold))
    assert code == 0 and m["holdout"]["matched_keys"] == 1
    assert ident in {r["id"] for r in read_split(tmp_path / "o", "test")}
