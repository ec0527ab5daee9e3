"""Smoke run of `bench/effectiveness.py` with miniature settings, so its machinery cannot rot.

The numbers of a smoke run mean nothing; what is checked is that every phase runs end to end on
real components (teacher, released draft, prepare/check/capture, train, export, speculative
evaluation), that the report is complete and self-consistent, and that the corpus and module
split are deterministic and keep the own domain's test modules out of everything it trains on.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from _load import bench_module
from prewarmed import run_script

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


def test_rust_rows_cut_functions_and_methods_at_their_closing_brace():
    eff = _module()
    src = ("/// Add one.\n#[inline]\npub fn add_one(x: u32) -> u32 {\n    let y = x + 1;\n    y * 1 + 0\n}\n"
           "impl Foo {\n    /// The name.\n    pub(crate) fn name(&self) -> &str {\n        if self.long { &self.name } else { \"\" }\n    }\n"
           "    fn tiny() {\n        1\n    }\n}\n")
    assert eff.rust_rows("c-1.0/src/lib.rs", src) == [
        {"prompt": "// c-1.0/src/lib.rs\n/// Add one.\n#[inline]\npub fn add_one(x: u32) -> u32 {",
         "response": "let y = x + 1;\ny * 1 + 0", "source": "c-1.0::src::lib.rs"},
        {"prompt": "// c-1.0/src/lib.rs\n/// The name.\npub(crate) fn name(&self) -> &str {",
         "response": 'if self.long { &self.name } else { "" }', "source": "c-1.0::src::lib.rs"}]


def test_the_rust_world_takes_every_source_elsewhere():
    """The second world shares no file with the first, and its own pool is split like Perl's."""
    from dataclasses import replace

    eff = _module()
    s = eff.PRESETS["smoke"]
    perl, rust = eff.collect_corpus(s), eff.collect_corpus(replace(s, world="rust"))
    assert rust.files == eff.collect_corpus(replace(s, world="rust")).files
    assert not {f["path"] for f in perl.files} & {f["path"] for f in rust.files}
    assert all(eff.own_pool(rel) == "own" for rel, _ in rust.own_code)
    assert rust.teacher_perl and all(eff.own_pool(rel) == "teacher" for rel, _ in rust.teacher_perl)
    assert eff.world_settings(s, "rust").vocab == 2 * s.vocab and eff.world_settings(s, "perl") == replace(s, world="perl")


def test_man_rows_take_each_section_after_name_with_the_page_head_as_prompt():
    eff = _module()
    page = ('.\\" generated\n.TH LS 1 "2024" "coreutils"\n.SH NAME\nls \\- list directory contents\n'
            '.SH SYNOPSIS\n.B ls\n[\\fIOPTION\\fR]...\n[\\fIFILE\\fR]... (the files to list)\n'
            '.SH "DESCRIPTION"\n.PP\n\nList information about the FILEs (the current directory by default).\n'
            '.\\" a comment the rows leave out\nSort entries alphabetically.\n.SH BUGS\nnone\n')
    rows = eff.man_rows("man1/ls.1.gz", page)
    head = '.\\" man1/ls.1.gz\n.TH LS 1 "2024" "coreutils"\n.SH NAME\nls \\- list directory contents\n'
    assert rows == [
        {"prompt": head + ".SH SYNOPSIS", "response": ".B ls\n[\\fIOPTION\\fR]...\n[\\fIFILE\\fR]... (the files to list)",
         "source": "man1/ls.1.gz"},
        {"prompt": head + '.SH "DESCRIPTION"',
         "response": ".PP\nList information about the FILEs (the current directory by default).\nSort entries alphabetically.",
         "source": "man1/ls.1.gz"}]
    assert eff.man_rows("man1/x.1.gz", "no roff here\n.SH NAME\nx\n") == []  # no `.TH`: no rows


def test_the_man_world_keeps_the_rust_worlds_general_text_and_its_own_pages():
    from dataclasses import replace

    eff = _module()
    s = replace(eff.PRESETS["smoke"], world="man")
    man, perl, rust = (eff.collect_corpus(replace(s, world=w)) for w in ("man", "perl", "rust"))
    assert man.files == eff.collect_corpus(s).files
    general = lambda c: {f["path"] for f in c.files if f["role"] in ("prose", "general_code")}  # noqa: E731
    assert general(man) == general(rust) and not general(man) & general(perl)
    own = [f["path"] for f in man.files if f["role"] in ("own_code", "teacher_man")]
    assert own and all(re.search(r"/usr/share/man/man[158]/[^/]+\.gz$", p) and "/gcloud" not in p for p in own)
    pages = [f["sha256"] for f in man.files if f["role"] in ("own_code", "teacher_man")]
    assert len(pages) == len(set(pages))  # a page under two names is taken once (no leak across splits)
    assert all(eff.own_pool(rel) == "own" and rel.startswith(("man1/", "man5/", "man8/")) for rel, _ in man.own_code)
    assert man.teacher_perl and all(eff.own_pool(rel) == "teacher" for rel, _ in man.teacher_perl)
    assert eff.world_settings(eff.PRESETS["smoke"], "man").vocab == eff.PRESETS["smoke"].vocab * 3 // 2


def _smoke(out: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = run_script(SCRIPT, ["--smoke", "--out", str(out), *extra], timeout=300, cwd=ROOT)
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
    # the guard: general rows held out into val (no replay into train unless `_replay` says so)
    sp = eff.recipe_spec("recall_guard", s)
    assert sp.guard == s.general_tolerance == sp.train["general_tolerance"] and sp.replay is None
    assert sp.data_key == (0.0, True) and eff.recipe_spec("recall", s).data_key is None
    # guarded runs validate early at every step count and stop after `guard_patience` rejections
    assert sp.train["guard_patience"] == s.guard_patience > 0 and "guard_patience" not in eff.recipe_spec("full", s).train
    table = lambda steps, **over: eff._train_table(s, steps=steps, lr=1e-3, seed=0, out=Path("x"), **over)  # noqa: E731
    assert table(2000, **sp.train)["val_every"] == s.guard_val_every == 25 and table(2000)["val_every"] == 500
    assert table(80, **sp.train)["val_every"] == 10 and table(200, **sp.train)["val_every"] == 25
    sp = eff.recipe_spec("full_replay@0.1_guard@0.05", s)
    assert sp.data_key == (0.1, True) and sp.train["general_tolerance"] == 0.05
    assert eff.recipe_spec("full_replay", s).data_key == (s.replay_fraction, False)
    # replay distillation: on the replay rows, so only with `_replay`
    sp = eff.recipe_spec("full_replay_kd@2_guard", s)
    assert sp.train["replay_kd"] == 2.0 and sp.replay == s.replay_fraction and sp.data_key == (s.replay_fraction, True)
    assert eff.recipe_spec("full_replay_kd", s).train["replay_kd"] == s.kd and "replay_kd" not in eff.recipe_spec("full_replay", s).train
    for bad in ("fulll", "full_l2sp@x", "full_replay@", "selector@2", "full_bogus", "full_guard_guard",
                "full_guard@2", "full_replay@1", "guard", "full_guard_x", "full_kd", "full_kd_guard"):
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
    assert "further general training (`control_full_general`" in report["goal"]
    # the guarded recipe: general rows held out into val, none mixed into train, the guard's verdict recorded
    guard_row = next(r for r in report["rows"] if r["recipe"] == "recall_guard")
    assert guard_row["replay_rows"] == 0 and guard_row["general_val_rows"] > 0
    g = guard_row["guard"][0]
    assert set(g) == {"passed", "rejected_steps", "tolerance", "floor", "stopped_at"} and g["tolerance"] == 0.03
    sel = json.loads((out / "seeds" / "seed0" / "runs" / "recall_guard" / "selection.json").read_text())
    assert sel["guard"]["rejected_steps"] == g["rejected_steps"] and guard_row["selected_steps"] == [sel["step"]]
    assert sel["guard"]["stopped_at"] == g["stopped_at"]
    man = json.loads((out / "seeds" / "seed0" / "guard" / "data" / "manifest.json").read_text())
    assert man["replay"]["rows"] == 0 and man["replay"]["val_rows"] == guard_row["general_val_rows"]
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


def test_the_adopted_default_must_hold_at_every_step_count_and_on_every_world():
    """Issue 35: a recipe that forgets in any run (one step count, one world) is not adopted, and of the
    others the one whose smallest own gain is the largest wins."""
    eff = _module()

    def row(name, steps, own, gen):
        return {"recipe": name, "steps": steps, "own": {"pooled_change": own}, "general": {"pooled_change": gen},
                "selected_steps": [steps]}

    rows = [row("full", 200, 0.5, -0.01), row("full", 2000, 3.0, -0.20),  # forgets at 2,000 steps
            row("recall_guard", 200, 0.4, -0.01), row("recall_guard", 2000, 1.2, -0.02),
            row("full_guard", 200, 0.9, 0.0), row("full_guard", 2000, 0.3, -0.025)]
    a = eff.adopted(rows)
    assert a["recipe"] == "recall_guard" and a["own_min"] == 0.4 and a["general_min"] == -0.02
    line = eff.goal_line(rows)
    assert line.startswith("goal MET: the adopted default `recall_guard`") and "200 steps: own +40.0%" in line
    # over two worlds: the second world's forgetting rules recall_guard out
    other = [dict(r, general={"pooled_change": -0.05}) if r["recipe"] == "recall_guard" else r for r in rows]
    verdict = eff.combined_verdict([{"settings": {"world": "perl"}, "rows": rows},
                                    {"settings": {"world": "rust"}, "rows": other}])
    assert verdict.startswith("Over the worlds perl, rust: goal MET: the adopted default `full_guard`")
    assert "world rust, 2000 steps: own +30.0%" in verdict
    low = [dict(r, own={"pooled_change": 0.1}) for r in rows]
    assert eff.goal_line(low).startswith("goal NOT MET: the adopted default")  # within -3% but own below +25%


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
def test_smoke_run_on_a_hybrid_qwen3_5_teacher_in_the_rust_world_at_two_step_counts(tmp_path):
    """`--family qwen3_5`: the teacher is a Gated DeltaNet text tower (saved text-only, `qwen3_5_text`);
    the speculative loop stays lossless and the cost table's rollback column is measured, not 0.
    `--world rust`: the second world's corpora and tokenizer size; `--recipe-steps 2,3`: each recipe
    at both counts, the control at the larger."""
    out = tmp_path / "eff"
    proc = _smoke(out, "--family", "qwen3_5", "--recipes", "selector", "--world", "rust", "--recipe-steps", "2,3")
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["family"] == "qwen3_5" and report["settings"]["world"] == "rust"
    assert report["teacher"]["vocab"] > 2 * 400 - 50  # the smoke vocabulary doubled (BPE may stop short)
    assert [(r["recipe"], r["steps"]) for r in report["rows"]] == [("selector", 2), ("selector", 3),
                                                                  ("control_full_general", 3)]
    roles = {f["role"] for f in report["corpus_files"]}
    assert roles == {"prose", "general_code", "own_code", "teacher_rust"}
    assert all(f["path"].endswith(".rs") for f in report["corpus_files"] if f["role"] in ("own_code", "teacher_rust"))
    assert all("changelog.Debian" in f["path"] for f in report["corpus_files"] if f["role"] == "prose")
    assert (out / "seeds" / "seed0" / "runs" / "selector-3" / "export" / "manifest.json").is_file()
    teacher = next((out / "cache").glob("teacher-*"))
    tcfg = json.loads((teacher / "config.json").read_text())
    assert tcfg["model_type"] == "qwen3_5_text" and "linear_attention" in tcfg["layer_types"]
    for row in report["rows"]:
        for dom in ("own", "general"):
            assert row[dom]["lossless"] is True
            assert row[dom]["cost"]["rollback_ms"] > 0, row[dom]["cost"]
    assert "| rollback |" in proc.stdout


# the recipe `bench/effectiveness.py` adopted over the perl and man worlds (docs/effectiveness.md)
ADOPTED = "full_replay_kd_guard@0.02"


def test_the_keep_general_preset_is_the_recipe_the_benchmark_adopted(tmp_path):
    """`[train] preset = "keep_general"` trains exactly what the benchmark's adopted recipe trained
    (docs/effectiveness.md, issue 35's fourth run), at both measured step counts, and the guide's
    data flags are the benchmark's: a quarter of train replayed, a tenth of the pool held out."""
    from dflash_worker.recipe import TrainConfig

    eff = _module()
    s = eff.PRESETS["full"]
    sp = eff.recipe_spec(ADOPTED, s)
    assert (sp.replay, s.guard_val_fraction) == (0.25, 0.1)
    for steps in s.recipe_steps + (200, 2000):
        bench = eff._train_table(s, steps=steps, lr=s.recipe_lr, seed=0, out=tmp_path, **sp.train)
        preset = TrainConfig.apply_preset({"preset": "keep_general", "steps": steps})
        # `interpolate` trains nothing: it chooses the export after training (issue 58 added it to the preset,
        # after this benchmark's measurements)
        same = [k for k in preset if k not in ("preset", "interpolate")]
        assert {k: bench.get(k, getattr(TrainConfig(scope="full"), k)) for k in same} == {k: preset[k] for k in same}, steps
        assert preset["interpolate"] == "auto"
        assert bench["objective"] == TrainConfig(scope="full").objective

