"""`bench/effectiveness.py --world thinking|long` (bench/effectiveness_worlds.py): smoke runs and the goal rules.

The smoke runs check the machinery end to end on real components (the world's target pretrained on its
own rows, the released draft, prepare/check/capture, train, export, speculative evaluation, and for the
long world each run's real `evaluate` report with its context buckets); their numbers mean nothing.
The goal rules are pure functions of a report, checked on made-up reports that meet and miss them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _load import BENCH, bench_module
from prewarmed import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "effectiveness.py"


def _worlds():
    sys.path.insert(0, str(BENCH))  # the module imports its sibling `effectiveness`
    return bench_module("effectiveness_worlds")


def _smoke(out: Path, world: str):
    proc = run_script(SCRIPT, ["--smoke", "--world", world, "--out", str(out)], timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads((out / "report.json").read_text())


def test_thinking_world_smoke_pretrains_the_target_and_scores_each_mode(tmp_path):
    proc, r = _smoke(tmp_path / "eff", "thinking")
    t = r["teacher"]
    # the target was pretrained (the smoke preset's 3 steps) and its weights are not the random ones any more
    assert t["steps"] == 3 and len(t["sha256"]) == 64 and t["sha256"] != t["key"]["target"]
    assert {(x["mode"], x["draft"]) for x in r["rows"]} == {(m, d) for m in ("on", "off") for d in ("released", "adapted@2")}
    assert all(x["lossless"] and x["steps"] > 0 and x["tokens"] >= x["steps"] for x in r["rows"])
    assert "Pooled over seeds" in proc.stdout and "- 2 steps: weaker mode" in proc.stdout
    # cached by key (a later run reuses it): the cached target is the one the report names, hashed the same
    (cached,) = (tmp_path / "eff" / "cache").glob("teacher-thinking-*")
    assert json.loads((cached / "teacher.json").read_text())["sha256"] == t["sha256"]
    assert _worlds().eff.weights_sha256(cached) == t["sha256"]


def test_long_world_smoke_reads_each_runs_evaluate_buckets(tmp_path):
    proc, r = _smoke(tmp_path / "eff", "long")
    assert r["teacher"]["steps"] == 0  # the long world keeps the random target (module docstring)
    assert [b["draft"] for b in r["buckets"]] == ["adapted@2", "adapted_cut128@2"]
    for b in r["buckets"]:
        report = Path(b["report"])
        assert report.is_file() and "per context bucket" in report.read_text()
        assert b["lossless"] is True
        assert [x["bucket"] for x in b["trained"]] == ["0-1k", "1k-4k", "4k-16k", "16k+"]
        # the smoke documents are 300-600 tokens: every verify step is in the first bucket
        assert b["trained"][0]["steps"] > 0 and all(x["steps"] == 0 for x in b["trained"][1:])
    assert "| 4k-16k | empty | empty | empty |" in proc.stdout
    assert "long-trained tau empty vs cut-trained empty: n/a" in proc.stdout and "**not met**" in proc.stdout


def _row(seed, mode, draft, tau, steps=100):
    return {"seed": seed, "mode": mode, "draft": draft, "pooled_tau": tau, "tokens": round(tau * steps), "steps": steps,
            "prompts": 4, "lossless": True}


def test_thinking_goal_is_the_weaker_modes_gain_with_the_other_mode_kept():
    ew = _worlds()
    rows = []
    for seed in range(2):
        rows += [_row(seed, "on", "released", 3.0), _row(seed, "off", "released", 2.0),
                 _row(seed, "on", "adapted@200", 2.95), _row(seed, "off", "adapted@200", 2.6 if seed else 2.4),
                 _row(seed, "on", "adapted@2000", 2.8), _row(seed, "off", "adapted@2000", 3.0)]
    report = {"world": "thinking", "seeds": 2, "recipe_steps": [200, 2000], "rows": rows}
    g200, g2000 = ew.summary(report)["goals"]
    assert g200["weak_mode"] == "off" and g200["other_mode"] == "on"
    assert abs(g200["weak_gain"] - 0.25) < 1e-9 and abs(g200["worst_seed_weak_gain"] - 0.2) < 1e-9
    assert g200["met"] is True  # pooled +25.0% and -1.7%
    assert g2000["weak_gain"] > 0.25 and g2000["other_change"] < -0.03 and g2000["met"] is False
    text = ew.render({**report, "preset": "test", "released_steps": 1})
    assert "- 200 steps: weaker mode `off` +25.0%" in text and "**met**" in text and "**not met**" in text


def _bucket(tau_by_label, steps=10):
    out = []
    for label in ("0-1k", "1k-4k", "4k-16k", "16k+"):
        tau = tau_by_label.get(label)
        out.append({"bucket": label, "steps": steps if tau else 0, "committed_tokens": round(tau * steps) if tau else 0,
                    "tau": tau})
    return out


def test_long_goal_pools_the_4k_16k_bucket_over_seeds_against_the_cut_control():
    ew = _worlds()
    buckets = []
    for seed, (long_tau, cut_tau) in enumerate(((2.0, 1.5), (1.4, 1.3))):
        base = _bucket({"4k-16k": 1.0})
        buckets += [{"seed": seed, "draft": "adapted@200", "baseline": base, "trained": _bucket({"4k-16k": long_tau})},
                    {"seed": seed, "draft": "adapted_cut256@200", "baseline": base, "trained": _bucket({"4k-16k": cut_tau})}]
    report = {"world": "long", "seeds": 2, "recipe_steps": [200], "buckets": buckets,
              "rows": [_row(s, "off", d, 1.5) for s in range(2) for d in ("released", "adapted@200", "adapted_cut256@200")]}
    (g,) = ew.summary(report)["goals"]
    # pooled: (20 + 14) / 20 = 1.7 vs (15 + 13) / 20 = 1.4: +21.4%, under the +25% goal though seed 0 alone is +33%
    assert (g["long_tau"], g["cut_tau"], g["released_tau"]) == (1.7, 1.4, 1.0)
    assert abs(g["gain"] - (1.7 / 1.4 - 1)) < 1e-12 and g["met"] is False
    buckets[3]["trained"] = _bucket({"4k-16k": 1.0})
    (g,) = ew.summary(report)["goals"]
    assert g["met"] is True and abs(g["gain"] - (1.7 / 1.25 - 1)) < 1e-12
    text = ew.render({**report, "preset": "test", "released_steps": 0})
    assert "| 4k-16k | 1.000 (20) | 1.700 (20) | 1.250 (20) |" in text
