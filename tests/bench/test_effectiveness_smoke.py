"""Smoke run of `bench/effectiveness.py` with miniature settings, so its machinery cannot rot.

The numbers of a smoke run mean nothing; what is checked is that every phase runs end to end on
real components (teacher, released draft, prepare/check/capture, train, export, speculative
evaluation), that the report is complete and self-consistent, and that the corpus and module
split are deterministic and keep the own domain's test modules out of everything it trains on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _load import bench_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "effectiveness.py"


def _module():
    return bench_module("effectiveness")


def test_corpus_is_deterministic_and_split_by_module():
    eff = _module()
    s = eff.PRESETS["smoke"]
    a, b = eff.collect_corpus(s), eff.collect_corpus(s)
    assert a.files == b.files and a.files, "corpus file list must be deterministic and non-empty"
    assert all(len(f["sha256"]) == 64 for f in a.files)
    # the own domain (Perl) is disjoint from the teacher's Perl and never in the released draft's data
    own_mods = {rel for rel, _ in a.own_code}
    assert own_mods and a.teacher_perl and not own_mods & {rel for rel, _ in a.teacher_perl}
    assert all(eff.perl_pool(rel) == "own" for rel in own_mods)
    assert all(eff.perl_pool(rel) == "teacher" for rel, _ in a.teacher_perl)
    assert not any("sub " in r["prompt"] for r in eff.general_rows(a, s) if r["source"].endswith(".pm"))
    full = eff.collect_corpus(eff.PRESETS["full"])
    for seed in range(3):
        sp = eff.own_split(full, seed)
        assert sp == eff.own_split(full, seed)
        parts = [set(sp[k]) for k in ("train", "val", "test")]
        assert all(parts) and not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
        assert set().union(*parts) == {rel for rel, _ in full.own_code}
    perl = "# Add one.\n# Twice.\nsub add_one {\n    my ($x) = @_;\n    return $x + 1 + 0 * length('pad');\n}\nsub tiny {\n    1;\n}\n"
    assert eff.perl_rows("A/B.pm", perl) == [{"prompt": "# A/B.pm\n# Add one.\n# Twice.\nsub add_one {",
                                               "response": "my ($x) = @_;\nreturn $x + 1 + 0 * length('pad');",
                                               "source": "A::B.pm"}]
    rows = eff.function_rows("x.py", 'def f(a):\n    """Doc."""\n    b = a + 1\n    return b * 2 + a\n')
    assert rows == [{"prompt": '# x.py\ndef f(a):\n    """Doc."""', "response": "b = a + 1\nreturn b * 2 + a", "source": "x.py"}]


def _smoke(out: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *extra], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_recipe_names_parse_into_their_switches():
    eff = _module()
    s = eff.PRESETS["full"]
    sp = eff.recipe_spec("full_replay_l2sp", s)
    assert sp.replay == s.replay_fraction and sp.train["l2sp"] == s.l2sp and sp.train["scope"] == "full"
    sp = eff.recipe_spec("full_l2sp@3", s)
    assert sp.replay is None and sp.train["l2sp"] == 3.0
    sp = eff.recipe_spec("recall_replay@0.5", s)
    assert sp.replay == 0.5 and "l2sp" not in sp.train and sp.train["scope"] == "recall"
    assert eff.recipe_spec("full_qat_af4g64", s).fmt == "af4g64"
    for bad in ("fulll", "full_l2sp@x", "full_replay@", "selector@2", "full_bogus"):
        with pytest.raises(ValueError):
            eff.recipe_spec(bad, s)


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path):
    eff = _module()
    out = tmp_path / "eff"
    proc = _smoke(out)
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
            assert c["rollback_ms"] == 0.0  # the teacher is a plain Qwen3: no linear-attention layers to replay
            assert 1.0 <= c["tau_pooled"] <= block
            assert c["bound"] == pytest.approx(0.8 * c["tau_pooled"] / (1 + c["draft_ms"] / c["target_ms"]))
            step = sum(c[f"{k}_ms"] for k in ("draft", "verify", "accept", "rollback", "crop"))
            assert c["ceiling"] == pytest.approx((c["target_ms"] + c["draft_ms"]) / (0.8 * step))
            # the baseline is the teacher's greedy decoding at its faster thread count (here only 1)
            greedy, n = eff.greedy_baseline([ps[dom] for ps in report["per_seed"]])
            assert n == c["greedy_threads"] == report["torch_threads"] == 1
            assert d["speedup"] == pytest.approx(greedy / sum(ps[dom]["drafts"][row["recipe"]]["seconds"]
                                                              for ps in report["per_seed"]))
    assert ("| recipe | domain | draft | verify | rest | rollback | teacher | verify / teacher | ceiling | pooled tau | "
            "goal speedup | speedup | speedup / goal |") in (out / "report.md").read_text()
    seed0 = report["per_seed"][0]
    test_mods = {m.replace("/", "::") for m in seed0["split"]["test"]}
    assert set(seed0["own_prompts"]) <= test_mods
    fit = [json.loads(line)["source"] for line in (out / "seeds" / "seed0" / "own.jsonl").read_text().splitlines()]
    assert fit and not set(fit) & test_mods, "a test module leaked into the adaptation data"
    # the QAT recipe's export is a real AF4G64 export
    manifest = out / "seeds" / "seed0" / "runs" / "full_qat_af4g64" / "export-af4g64" / "manifest.json"
    assert "af4g64" in json.loads(manifest.read_text())["format"]
    assert "further general training (`control_full_general`)" in report["goal"]
    assert seed0["own"]["sample_text"] is not None
    teacher_dirs = list((out / "cache").glob("teacher-*"))
    assert len(teacher_dirs) == 1 and (teacher_dirs[0] / "teacher.json").is_file()
    # the world is printed by its hashes; the replay recipe trained on own rows plus recorded replay rows
    w = report["world"]
    assert f"teacher {w['teacher_steps']} steps" in proc.stderr and w["teacher_sha256"] in proc.stderr
    assert w["released_sha256"] in proc.stderr and w["released_val_history"]
    replay_row = next(r for r in report["rows"] if r["recipe"] == "full_replay_l2sp")
    assert replay_row["replay_rows"] > 0 and replay_row["capture_bytes_per_token"] > 0
    assert all(r["replay_rows"] == 0 for r in report["rows"] if "replay" not in r["recipe"])
    cap = json.loads((out / "seeds" / "seed0" / "replay0.25" / "capture" / "manifest.json").read_text())
    assert cap["data"]["replay"]["rows"] == replay_row["replay_rows"]
    metrics = (out / "seeds" / "seed0" / "runs" / "full_replay_l2sp" / "metrics.jsonl").read_text().splitlines()
    assert all("l2sp_penalty" in json.loads(line) for line in metrics)
    assert "the adopted default `" in report["goal"] or "goal NOT MET: no recipe" in report["goal"]


def _taus(report: dict) -> list:
    return [[r["recipe"], r["own"]["pooled_after"], r["general"]["pooled_after"], r["own"]["after"], r["general"]["after"]]
            for r in report["rows"]] + [[ps[d]["drafts"][n]["tau"] for d in ("own", "general") for n in ps[d]["drafts"]]
                                        for ps in report["per_seed"]]


@pytest.mark.slow
def test_world_and_table_do_not_depend_on_the_thread_count(tmp_path):
    """Issue 16: the world is defined by steps and seeds: two cold runs with 1 and 2 torch threads train
    the same teacher and released draft (same sha256) and give the same tau table."""
    reports = []
    for threads in (1, 2):
        out = tmp_path / f"t{threads}"
        _smoke(out, "--threads", str(threads), "--recipes", "full_replay_l2sp")
        reports.append(json.loads((out / "report.json").read_text()))
    a, b = reports
    assert a["torch_threads"] == 1 and b["torch_threads"] == 2
    assert a["world"]["teacher_sha256"] == b["world"]["teacher_sha256"]
    assert a["world"]["released_sha256"] == b["world"]["released_sha256"]
    assert _taus(a) == _taus(b)
    # with 2 threads, greedy decoding is also timed at 1 thread, with the same output
    for ps in b["per_seed"]:
        for dom in ("own", "general"):
            assert set(ps[dom]["greedy_seconds_by_threads"]) == {"1", "2"}
            assert ps[dom]["greedy_threads_agree"] is True
    assert {b["rows"][0][dom]["cost"]["greedy_threads"] for dom in ("own", "general")} <= {1, 2}


def test_progress_logs_real_worker_events(capsys):
    from dflash_worker.worker.events import Log, Progress

    eff = _module()
    cb = eff.progress("capture x", every_s=0.0)
    cb(Progress(phase="capture", step=3, total_steps=9, metrics={"tokens": 5}))
    cb(Log(level="info", message="not progress"))
    err = capsys.readouterr().err
    assert "capture x: capture 3/9" in err and "not progress" not in err


def test_the_adopted_default_is_the_largest_own_gain_that_keeps_the_general_domain():
    eff = _module()

    def row(name, own, gen):
        return {"recipe": name, "own": {"pooled_change": own}, "general": {"pooled_change": gen}}

    rows = [row("full", 3.0, -0.10), row("full_replay", 2.0, -0.01), row("full_l2sp", 1.0, 0.0),
            row(eff.CONTROL, 5.0, 0.0)]
    assert eff.adopted(rows)["recipe"] == "full_replay"  # full forgets; the control is never adopted
    assert eff.adopted([row("full", 3.0, -0.031)]) is None
    assert eff.adopted([row("full", 3.0, -0.03)])["recipe"] == "full"


def test_the_greedy_baseline_is_the_faster_thread_count_over_every_result():
    eff = _module()
    m = [{"greedy_seconds": 3.0, "greedy_seconds_by_threads": {"1": 2.0, "2": 3.0}},
         {"greedy_seconds": 1.0, "greedy_seconds_by_threads": {"1": 2.5, "2": 1.0}}]
    assert eff.greedy_baseline(m) == (4.0, 2)  # totals: 1 thread 4.5 s, 2 threads 4.0 s
    m[1]["greedy_seconds_by_threads"]["2"] = 2.0
    assert eff.greedy_baseline(m) == (4.5, 1)
    # reports written before greedy was timed per thread count
    assert eff.greedy_baseline([{"greedy_seconds": 1.5}, {"greedy_seconds": 2.0}]) == (3.5, None)


def test_loop_cost_counts_the_rollback_phase_and_reads_reports_without_it():
    eff = _module()

    def measured(phases):
        return [{"greedy_seconds": 1.0, "greedy_seconds_by_threads": {"1": 1.0}, "greedy_tokens": 100,
                 "drafts": {"d": {"steps": 10, "tokens": 40, "seconds": 0.5, "phase_seconds": phases}}}]

    base = {"draft": 0.02, "verify": 0.05, "accept": 0.002, "crop": 0.001}
    hybrid = eff.loop_cost(measured({**base, "rollback": 0.004}), "d")
    plain = eff.loop_cost(measured(base), "d")  # a non-hybrid teacher, or a report from before the phase
    assert hybrid["rollback_ms"] == pytest.approx(0.4) and plain["rollback_ms"] == 0.0
    # the replay is part of a step's cost: (teacher + draft) / (0.8 x (draft + verify + rest + rollback))
    assert hybrid["ceiling"] == pytest.approx((10 + 2) / (0.8 * (2 + 5 + 0.2 + 0.1 + 0.4)))
    assert plain["ceiling"] == pytest.approx((10 + 2) / (0.8 * (2 + 5 + 0.2 + 0.1)))
    rows = [{"recipe": "r", "own": {"cost": hybrid}, "general": {"cost": {k: v for k, v in plain.items() if k != "rollback_ms"}}}]
    table = [line for line in eff.cost_lines(rows) if line.startswith("| r |")]
    assert [line.split(" | ")[5] for line in table] == ["0.40", "0.00"]


@pytest.mark.slow
def test_smoke_run_on_a_hybrid_qwen3_5_teacher_reports_the_rollback(tmp_path):
    """`--family qwen3_5`: the teacher is a Gated DeltaNet text tower (saved text-only, `qwen3_5_text`);
    the speculative loop stays lossless and the cost table's rollback column is measured, not 0."""
    out = tmp_path / "eff"
    proc = _smoke(out, "--family", "qwen3_5", "--recipes", "selector")
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["family"] == "qwen3_5"
    teacher = next((out / "cache").glob("teacher-*"))
    tcfg = json.loads((teacher / "config.json").read_text())
    assert tcfg["model_type"] == "qwen3_5_text" and "linear_attention" in tcfg["layer_types"]
    for row in report["rows"]:
        for dom in ("own", "general"):
            assert row[dom]["lossless"] is True
            assert row[dom]["cost"]["rollback_ms"] > 0, row[dom]["cost"]
    assert "| rollback |" in proc.stdout
