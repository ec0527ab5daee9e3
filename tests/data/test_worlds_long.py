"""The long-context world (`dflash_worker.testing.worlds_long`): prompts of the asked token lengths, whose
answer is written only at their start, deterministic by seed; `cut_row` keeps the facts within a short budget."""

from __future__ import annotations

import pytest

from dflash_worker.data import check_data, prepare_data
from dflash_worker.testing.worlds_chat import write_jsonl
from dflash_worker.testing.worlds_long import TEMPLATE_ROOM, cut_row, long_row, long_rows


def n_tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_long_rows_have_the_asked_lengths_and_recall_their_opening(tiny_tokenizer):
    rows = long_rows(3, tiny_tokenizer, seed=0)  # the world's default range: 4k-16k tokens
    for r in rows:
        n = n_tokens(tiny_tokenizer, r["prompt"])
        assert 4096 <= n <= 16384 - TEMPLATE_ROOM, n
        f = r["facts"]
        ids = tiny_tokenizer(r["prompt"], add_special_tokens=False, return_offsets_mapping=True)
        first_chars = ids["offset_mapping"][200][0]  # the facts are stated in the first 200 tokens and never again
        for fact in (f["keeper"], f["passphrase"], f["meaning"]):
            assert fact in r["response"] and r["prompt"].find(fact) < first_chars
            assert r["prompt"].count(fact) == 1, fact
        assert r["prompt"].rstrip().endswith("mean?") and f["term"] in r["prompt"][-200:]
    assert len({n_tokens(tiny_tokenizer, r["prompt"]) // 512 for r in rows}) > 1  # lengths drawn, not fixed


def test_long_rows_are_deterministic_by_seed(tiny_tokenizer):
    kw = dict(min_tokens=600, max_tokens=1200)
    a = long_rows(3, tiny_tokenizer, seed=5, **kw)
    assert a == long_rows(3, tiny_tokenizer, seed=5, **kw) and a[2] == long_row(2, tiny_tokenizer, seed=5, **kw)
    assert a != long_rows(3, tiny_tokenizer, seed=6, **kw)
    with pytest.raises(ValueError, match="min_tokens"):
        long_row(0, tiny_tokenizer, min_tokens=1000, max_tokens=1000)


def test_cut_rows_keep_the_facts_within_the_budget(tiny_tokenizer):
    row = long_row(1, tiny_tokenizer, seed=0, min_tokens=3000, max_tokens=5000)
    cut = cut_row(row, tiny_tokenizer, 256)
    assert n_tokens(tiny_tokenizer, cut["prompt"]) <= 256 < n_tokens(tiny_tokenizer, row["prompt"])
    assert cut["response"] == row["response"] and row["facts"]["keeper"] in cut["prompt"]
    assert cut["prompt"].split("\n\n")[0] == row["prompt"].split("\n\n")[0]
    assert cut["prompt"].split("\n\n")[-1] == row["prompt"].split("\n\n")[-1]


def test_long_rows_prepare_and_check(tmp_path, tiny_tokenizer):
    rows = long_rows(2, tiny_tokenizer, seed=0, min_tokens=2000, max_tokens=3000)
    prepare_data([write_jsonl(tmp_path / "long.jsonl", rows)], tmp_path / "data", seed=0, val_fraction=0.0, test_fraction=0.0)
    report = check_data(tmp_path / "data", tiny_tokenizer, thinking="off", max_length=3000, splits=("train",))
    assert report.ok and 2000 <= report.longest <= 3000, report.to_dict()
