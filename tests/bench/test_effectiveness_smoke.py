"""Smoke run of `bench/effectiveness.py` with miniature settings, so its machinery cannot rot.

The numbers of a smoke run mean nothing; what is checked is that every phase runs end to end on
real components (teacher, released draft, prepare/check/capture, train, export, speculative
evaluation), that the report is complete and self-consistent, and that the corpus and module
split are deterministic and keep the own domain's test modules out of everything it trains on.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "effectiveness.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_effectiveness", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_corpus_is_deterministic_and_split_by_module():
    eff = _module()
    s = eff.PRESETS["smoke"]
    a, b = eff.collect_corpus(s), eff.collect_corpus(s)
    assert a.files == b.files and a.files, "corpus file list must be deterministic and non-empty"
    assert all(len(f["sha256"]) == 64 for f in a.files)
    assert not set(eff.GENERAL_CODE) & set(eff.OWN_CODE), "own domain must be distinct from general code"
    full = eff.collect_corpus(eff.PRESETS["full"])
    for seed in range(3):
        sp = eff.own_split(full, seed)
        assert sp == eff.own_split(full, seed)
        parts = [set(sp[k]) for k in ("train", "val", "test")]
        assert all(parts) and not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
        assert set().union(*parts) == {rel for rel, _ in full.own_code}
    rows = eff.function_rows("x.py", 'def f(a):\n    """Doc."""\n    b = a + 1\n    return b * 2 + a\n')
    assert rows == [{"prompt": '# x.py\ndef f(a):\n    """Doc."""', "response": "b = a + 1\nreturn b * 2 + a", "source": "x.py"}]


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path):
    out = tmp_path / "eff"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| recipe |" in proc.stdout
    for phase in ("teacher", "released_draft", "own_prepare_check_capture", "evaluate"):
        assert f"] {phase}:" in proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.md").read_text().startswith("# DFlash2 adaptation effectiveness")
    assert (out / "tau.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    block = report["settings"]["block_size"]
    assert [r["recipe"] for r in report["rows"]] == [*report["settings"]["recipes"], "control_full_general"]
    for row in report["rows"]:
        for dom in ("own", "general"):
            d = row[dom]
            assert 1.0 <= d["before"][0] <= block and 1.0 <= d["after"][0] <= block
            assert sum(d["counts"].values()) == report["settings"]["eval_prompts"] * report["seeds"]
            # greedy speculative decoding must reproduce the teacher's own greedy output exactly
            assert d["lossless"] is True
            assert d["speedup"] > 0
            # the loop's cost: every phase timed, the goal's bound computed from the measured costs
            c = d["cost"]
            assert all(c[f"{k}_ms"] > 0 for k in ("draft", "verify", "accept", "crop", "target")), c
            assert 1.0 <= c["tau_pooled"] <= block
            assert c["bound"] == pytest.approx(0.8 * c["tau_pooled"] / (1 + c["draft_ms"] / c["target_ms"]))
    assert "| recipe | domain | draft | verify | rest | teacher | pooled tau | goal speedup | speedup |" in (out / "report.md").read_text()
    seed0 = report["per_seed"][0]
    test_mods = {m.replace("/", ".") for m in seed0["split"]["test"]}
    assert set(seed0["own_prompts"]) <= test_mods
    fit = [json.loads(line)["source"] for line in (out / "seeds" / "seed0" / "own.jsonl").read_text().splitlines()]
    assert fit and not set(fit) & test_mods, "a test module leaked into the adaptation data"
    # the QAT recipe's export is a real AF4G64 export
    manifest = out / "seeds" / "seed0" / "runs" / "full_qat_af4g64" / "export-af4g64" / "manifest.json"
    assert "af4g64" in json.loads(manifest.read_text())["format"]
    assert "the control (same training on general data)" in report["goal"] or "not evaluated" in report["goal"]
    assert seed0["own"]["sample_text"] is not None
    teacher_dirs = list((out / "cache").glob("teacher-*"))
    assert len(teacher_dirs) == 1 and (teacher_dirs[0] / "teacher.json").is_file()
