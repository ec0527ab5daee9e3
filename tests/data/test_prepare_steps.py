"""prepare-data's steps on their own: the reader (kept, dropped, refused rows), the split files and
their counts, the fingerprinted parameters, and groups shared by several sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_worker.data.prepare import (
    MAX_LISTED_DROPS,
    SplitPlan,
    _groups_in_several_sources,
    _params,
    _Reader,
    _split_files,
)
from dflash_worker.errors import DataError

from .conftest import write_jsonl


def reader(**kw) -> _Reader:
    return _Reader(**{"skip_invalid": False, "max_line_bytes": 1 << 20, "on_drop": None, **kw})


def test_the_reader_keeps_rows_in_order_and_drops_exact_duplicates_across_files(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "q1", "response": "r1"}, "", {"prompt": "q2", "extra": 1}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "q1", "response": "r1"}, {"prompt": "q3", "response": "r3", "source": "web"}])
    drops = []
    r = reader(on_drop=lambda *d: drops.append(d))
    r.read_all([a], [b])
    assert [(k.file, k.line, k.replay) for k in r.kept] == [("a.jsonl", 1, False), ("a.jsonl", 3, False), ("b.jsonl", 2, True)]
    assert drops == [("b.jsonl", 1, "duplicate", "exact duplicate of `a.jsonl` line 1")]
    assert r.dropped == {"duplicate": 1} and r.ignored == {"extra": 1}
    assert [m["file"] for m in r.inputs_meta] == ["a.jsonl"] and [m["file"] for m in r.replay_meta] == ["b.jsonl"]
    assert r.inputs_meta[0] | {"sha256": "-"} == {
        "file": "a.jsonl",
        "sha256": "-",
        "bytes": a.stat().st_size,
        "lines": 3,
        "rows_read": 2,
        "rows_kept": 2,
        "blank_lines": 1,
        "crlf_lines": 0,
        "bom": False,
    }
    assert r.replay_meta[0]["rows_read"] == 2 and r.replay_meta[0]["rows_kept"] == 1


def test_the_reader_refuses_a_bad_row_naming_it_unless_told_to_skip(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "q1"}, "not json"] + [f"bad {i}" for i in range(MAX_LISTED_DROPS + 5)])
    with pytest.raises(DataError, match=r"a\.jsonl` line 2: .*\nhint: fix the line, or pass `--skip-invalid`"):
        reader().read_all([a], [])
    r = reader(skip_invalid=True)
    r.read_all([a], [])
    assert len(r.kept) == 1 and sum(r.dropped.values()) == MAX_LISTED_DROPS + 6
    assert len(r.drops) == MAX_LISTED_DROPS and r.drops[0]["line"] == 2
    with pytest.raises(DataError, match=r"replay file `.*nope\.jsonl` does not exist"):
        reader(skip_invalid=True).read_all([a], [tmp_path / "nope.jsonl"])


def test_split_files_tag_only_replay_rows_held_out_into_val_as_general(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"q{i}", "response": "r", "source": "s" + str(i % 2)} for i in range(4)])
    r = reader()
    r.read_all([a], [])
    rows = r.kept
    blobs, counts = _split_files(rows, ["train", "val", "val", "test"], n_own=2)
    val = [json.loads(line) for line in blobs["val.jsonl"].splitlines()]
    assert [v.get("domain") for v in val] == [None, "general"]
    assert list(blobs) == ["train.jsonl", "val.jsonl", "test.jsonl"]
    assert counts == {
        "source": {"s0": 2, "s1": 2},
        "split": {"train": 1, "val": 2, "test": 1},
        "source_split": {"s0": {"train": 1, "val": 1, "test": 0}, "s1": {"train": 0, "val": 1, "test": 1}},
        "groups_split": {"train": 1, "val": 2, "test": 1},
        "prompt_only_split": {"train": 0, "val": 0, "test": 0},
    }
    with pytest.raises(ValueError):
        _split_files(rows, ["train"], n_own=4)


def test_params_add_replay_only_when_there_are_replay_files() -> None:
    plan = SplitPlan.resolve(seed=1, val_fraction=None, test_fraction=None, split=None, holdout=None)
    assert _params(plan, [], 0.3, 0.1) == plan.params() and "replay" not in plan.params()
    assert _params(plan, [{"sha256": "ab"}], 0.3, None)["replay"] == {"fraction": 0.3, "sha256": ["ab"]}
    assert _params(plan, [{"sha256": "ab"}], 0.3, 0.1)["replay"] == {"fraction": 0.3, "sha256": ["ab"], "val_fraction": 0.1}


def test_groups_in_several_sources_ignores_spacing_and_counts_each_group_once(tmp_path: Path) -> None:
    a = write_jsonl(
        tmp_path / "a.jsonl",
        [
            {"prompt": "same  prompt", "response": "1", "source": "x"},
            {"prompt": "same prompt", "response": "2", "source": "y"},
            {"prompt": "same prompt", "response": "3", "source": "z"},
            {"prompt": "alone", "response": "4", "source": "x"},
            {"prompt": "alone", "response": "5", "source": "x"},
        ],
    )
    r = reader()
    r.read_all([a], [])
    assert _groups_in_several_sources(r.kept) == 1
    assert _groups_in_several_sources(r.kept[3:]) == 0
