"""The hybrid targets' stage of the prepared checks: `bench/hybrid_check.py` end to end on CPU at the
tiny scale (the same phases `scripts/gpu-check.sh` runs on CUDA and `scripts/mac-check.sh` on MPS at
full width), its verdicts, and both scripts' refusal off their hardware (exit 3).

A CPU run's timings mean nothing; what is checked is that every figure the check's reader needs is
printed (the loop-cost table, losslessness, the kernels) and follows from what ran.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import pytest
from _load import bench_module
from prewarmed import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "hybrid_check.py"
KERNELS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update")
TABLE_HEAD = ("| target | draft | verify | rest | rollback | rollback share | teacher | verify / teacher | tau | "
              "ceiling | speedup | lossless |")


def _bash(script: str, path_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{path_dir}:{os.environ['PATH']}")
    return subprocess.run(["bash", str(ROOT / "scripts" / script)], capture_output=True, text=True, env=env, timeout=60)


def test_gpu_check_exits_3_where_nvidia_smi_lists_no_gpu(tmp_path):
    # a stand-in nvidia-smi that lists nothing, first on PATH: the check refuses before installing anything
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    fake.chmod(0o755)
    proc = _bash("gpu-check.sh", tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert "gpu-check: no NVIDIA GPU here" in proc.stderr
    assert "== install" not in proc.stdout


@pytest.mark.skipif(platform.system() == "Darwin" and platform.machine() == "arm64", reason="this is an Apple Silicon Mac")
def test_mac_check_exits_3_off_apple_silicon(tmp_path):
    proc = _bash("mac-check.sh", tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert f"this is `{platform.system()} {platform.machine()}`, not an Apple Silicon Mac" in proc.stderr
    assert "== install" not in proc.stdout


def test_the_scripts_run_the_hybrid_stage_at_full_width_on_their_device():
    gpu = (ROOT / "scripts" / "gpu-check.sh").read_text()
    mac = (ROOT / "scripts" / "mac-check.sh").read_text()
    assert "bench/hybrid_check.py --device cuda --scale full" in gpu
    # fla goes into its own directory on PYTHONPATH for that stage, never into .venv
    assert "pip install --quiet --no-deps --target \"$kernels\" -r requirements/cuda.txt" in gpu
    assert 'PYTHONPATH="$PWD/$kernels" .venv/bin/python bench/hybrid_check.py' in gpu
    assert "bench/hybrid_check.py --device mps --scale full" in mac
    assert "DFLASH_REQUIRE_MPS=1 PYTORCH_ENABLE_MPS_FALLBACK=0" in mac
    assert "scripts/build-native-silicon.sh" in mac


@pytest.mark.parametrize("argv, message", [
    (["--families", "qwen3"], "--families: `qwen3` is not among qwen3_5_moe, qwen3_5"),
    (["--families", ","], "is not among"),
    (["--layers", "3"], "--layers must be >= 4"),
    (["--new-tokens", "0"], "--new-tokens must be >= 1"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_bad_arguments_are_refused_with_the_flag_named(argv, message, capsys):
    hc = bench_module("hybrid_check")
    with pytest.raises(SystemExit) as e:
        hc.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_full_scale_configs_have_the_released_widths_and_the_3_to_1_pattern():
    from dflash_worker.testing.tokenizer import build_tiny_tokenizer

    hc = bench_module("hybrid_check")
    tok = build_tiny_tokenizer()
    moe = hc.target_config("qwen3_5_moe", "full", 4, tok).text_config
    assert (moe.hidden_size, moe.num_experts, moe.num_experts_per_tok, moe.shared_expert_intermediate_size) == (2048, 256, 8, 512)
    assert moe.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    dense = hc.target_config("qwen3_5", "full", 8, tok).text_config
    assert (dense.hidden_size, dense.intermediate_size, dense.num_hidden_layers) == (5120, 17408, 8)
    assert dense.layer_types.count("full_attention") == 2
    # the released tap count, spread over every layer of the reduced target
    assert hc.draft_taps("qwen3_5_moe", 4) == [0, 1, 2, 3] and hc.draft_taps("qwen3_5_moe", 8) == list(range(8))
    assert hc.draft_taps("qwen3_5", 8) == [0, 2, 4, 5, 7] and hc.draft_taps("qwen3_5", 4) == [0, 1, 2, 3]


def _result(lossless: bool, agree: bool = True) -> dict:
    cost = dict(draft_ms=2.0, verify_ms=6.0, accept_ms=0.5, crop_ms=0.5, rollback_ms=1.0, target_ms=4.0, tau_pooled=1.5,
                ceiling=0.5, speedup=0.4)
    return {"speculative": {"lossless": lossless, "cost": cost}, "kernels_agree": agree}


@pytest.mark.parametrize("lossless, agree", [(False, True), (True, False)])
def test_a_lossy_target_or_disagreeing_kernel_records_fail_the_check(lossless, agree, monkeypatch, capsys):
    hc = bench_module("hybrid_check")
    monkeypatch.setattr(hc, "run_target", lambda root, family, args, env: _result(lossless, agree))
    assert hc.main(["--device", "cpu", "--scale", "tiny", "--families", "qwen3_5"]) == 1
    captured = capsys.readouterr()
    assert "hybrid_check: FAILED for qwen3_5" in captured.err
    # the table: rest = accept + crop, rollback share of the 10 ms step, verify / teacher
    assert f"| qwen3_5 | 2.00 | 6.00 | 1.00 | 1.00 | 10.0% | 4.00 | 1.50 | 1.50 | 0.50 | 0.40 | {str(lossless).lower()} |" in captured.out
    monkeypatch.setattr(hc, "run_target", lambda root, family, args, env: _result(True))
    assert hc.main(["--device", "cpu", "--scale", "tiny", "--families", "qwen3_5"]) == 0


@pytest.mark.slow
def test_tiny_cpu_run_prints_every_figure_lossless_with_the_kernels_named(tmp_path):
    out = tmp_path / "hybrid.json"
    proc = run_script(SCRIPT, ["--device", "cpu", "--scale", "tiny", "--examples", "12", "--steps", "2", "--grad-accum",
                               "2", "--prompts", "2", "--prompt-length", "12", "--new-tokens", "12", "--json", str(out)],
                      timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["scale"] == "tiny"
    assert sorted(report["targets"]) == ["qwen3_5", "qwen3_5_moe"]
    lines = proc.stdout.splitlines()
    assert TABLE_HEAD in lines
    for family, r in report["targets"].items():
        g = r["geometry"]
        assert g["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        assert ("experts" in g) == (family == "qwen3_5_moe")
        assert r["capture"]["examples"] > 0 and r["capture"]["tokens_per_s"] > 0
        assert r["online_train"]["steps"] == 2 and r["online_train"]["tokens_per_s"] > 0
        spec = r["speculative"]
        assert spec["lossless"] is True and spec["first_mismatch"] is None
        c = spec["cost"]
        # the rollback runs on every verify step of a hybrid target: its time is measured, not zero
        assert c["rollback_ms"] > 0 and c["verify_ms"] > 0 and c["target_ms"] > 0
        # the oracle's plan rejects inside blocks: several tokens accepted per step on average
        assert 1.5 < c["tau_pooled"] < 8
        # the kernels are read off the target in this process and from the capture manifest, and agree
        assert r["kernels_agree"] is True
        assert r["kernels"] == {family: dict.fromkeys(KERNELS, "torch reference")} == r["capture"]["kernels"]
        row = next(x for x in lines if x.startswith(f"| {family} |"))
        assert row.endswith("| true |")
        assert f"[{family}] kernels ({family}): chunk_gated_delta_rule=torch reference" in proc.stdout
        assert f"[{family}] speculative (float32, 2 prompts x 12 tokens): lossless against greedy with the same kernels: true" in proc.stdout
        assert f"[{family}] capture manifest records the same kernels: true" in proc.stdout


def test_the_speculative_phase_sees_a_rollback_that_does_not_replay(tmp_path, monkeypatch):
    # the mutation the phase exists to catch: the recurrent state left as the verify forward wrote it
    from prewarmed import worker_cli

    from dflash_worker.evaluate import rollback

    hc = bench_module("hybrid_check")
    args = hc.parse_args(["--device", "cpu", "--scale", "tiny", "--prompts", "2", "--prompt-length", "12",
                          "--new-tokens", "24"])
    hc.build_target(tmp_path / "target", "qwen3_5", args)
    proc = worker_cli("init-draft", "--target", str(tmp_path / "target"), "--geometry", "tiny", "-o", str(tmp_path / "draft"))
    assert proc.returncode == 0, proc.stderr
    intact = hc.speculative_phase(tmp_path, args)
    assert intact["lossless"] is True and intact["cost"]["rollback_ms"] > 0
    monkeypatch.setattr(rollback.RecurrentRollback, "replay", lambda self, cache, produced: None)
    broken = hc.speculative_phase(tmp_path, args)
    assert broken["lossless"] is False
    m = broken["first_mismatch"]
    assert 0 <= m["position"] < 24 and m["speculative"] != m["greedy"]
    assert m["greedy_top2_margin"] > 1e-3  # a real fault, not a near-tie
