"""Preflight measures both phases as peaks and turns them into go / no-go."""

from __future__ import annotations

import json
import subprocess
import sys

from dflash_worker.recipe import load_recipe


def test_preflight_reports_peaks_and_verdict(pipeline, monkeypatch):
    from dflash_worker.train import preflight as pf

    recipe = load_recipe(pipeline.recipe("preflight"))
    report = pf.preflight(recipe, length=128)
    for phase in ("capture_peak", "optimization_peak"):
        assert report[phase]["kind"] == "peak" and report[phase]["bytes"] > 0
    assert report["verdict"] == "go"
    monkeypatch.setattr(pf, "_device_memory", lambda dev: (1 << 20, "system memory"))
    small = pf.preflight(recipe, length=64)
    assert small["verdict"] == "no-go" and "exceeds" in small["reason"]


def test_preflight_cli_json(pipeline):
    res = subprocess.run([sys.executable, "-m", "dflash_worker.cli", "preflight", "--recipe", str(pipeline.recipe("preflight-cli")),
                          "--length", "64", "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["verdict"] == "go"
    assert "capture peak" in res.stderr and "optimization peak" in res.stderr  # a log line beside the JSON
    plain = subprocess.run([sys.executable, "-m", "dflash_worker.cli", "preflight", "--recipe", str(pipeline.recipe("preflight-cli")),
                            "--length", "64"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.startswith("preflight: 64 tokens") and "optimization peak" in plain.stdout and "go:" in plain.stdout, plain.stdout
    assert "capture peak" not in plain.stderr
