"""Issue 33's must-show: a Qwen3.5-MoE target, saved as released (the multimodal wrapper with a vision
tower, an `mtp.*` shard and packed experts), trained against through the real coordinator, run-manager
and native client on loopback. The run admin fetches the export from the coordinator's artifact store:
the bytes the coordinator recorded, a BF16 draft that loads and pairs with the target; the capture the
job uploaded records the Qwen3.5-MoE teacher's text tower, and its evaluation report shows real speculative
verify steps (the world's seed is one where the tiny teacher generates). The demo's world stays a Qwen3 target."""

from __future__ import annotations

import json

import pytest
from e2e_helpers import export_model, pipeline_spec, run_one_job, sha256_file
from launchers import REPO

pytestmark = pytest.mark.slow


@pytest.mark.real_process("native_client")  # the one Qwen3.5 job end to end: in the native client's embedded interpreter
def test_a_qwen3_5_moe_job_exports_a_draft_that_loads_and_pairs_with_its_target(tmp_path, procs, qwen3_5_moe_world):
    from dflash_worker.families import validate_pair
    from dflash_worker.model import load_draft
    from dflash_worker.weights import list_tensors
    from dflash_worker.weights.checkpoint import read_config_json, read_text_config

    world = qwen3_5_moe_world
    spec = pipeline_spec(world)
    assert spec["recipe"]["model"]["family"] == "qwen3_5_moe"
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=30, warm=True)
    run_id, job, rm = run_one_job(procs, coord, tmp_path / "work", "qwen3_5_moe", spec)
    assert job["attempts"] == 1, json.dumps(job, indent=1)
    # The worker loaded the text tower alone (its log line, re-emitted by the run-manager).
    loaded = [v["message"] for v in rm.messages(lambda v: str(v.get("message", "")).startswith("teacher loaded"))]
    assert loaded and all("outside the text tower" in m for m in loaded), loaded
    # Its Gated DeltaNet kernels, logged by the worker (JSON) and re-emitted: the references here.
    reference = dict.fromkeys(("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
                               "causal_conv1d_update"), "torch reference")
    line = "linear-attention kernels (qwen3_5_moe): " + ", ".join(f"{k}={v}" for k, v in reference.items())
    kernels = list(rm.messages(lambda v: "linear-attention kernels" in str(v.get("message", ""))))
    assert kernels and {v["message"] for v in kernels} == {line} and {v.get("logger") for v in kernels} == {"dflash_worker.kernels"}, kernels

    pub = job["publication"]
    print(f"qwen3_5_moe: {pub['verdict']} {pub['reason']}")
    if not pub["published"]:
        coord.cli("runs", "publish", run_id, "--override", "--note", "e2e: the tiny qwen3_5_moe world's draft regressed")
    model = export_model(job)
    assert job["export"]["sha256"] == model["sha256"], json.dumps(job, indent=1)
    out = tmp_path / "admin" / "export"
    coord.cli("artifacts", "get", run_id, "--export", "-o", str(out))
    got = out / "model.safetensors"
    assert sha256_file(got) == model["sha256"] and got.stat().st_size == int(model["size_bytes"])
    blob = coord.blob_path(model["sha256"])  # the bytes live in the store, not on the provider's disk
    assert blob.is_file() and sha256_file(blob) == model["sha256"]

    # A BF16 draft: every floating tensor stored as BF16; it loads and fits the Qwen3.5-MoE target.
    dtypes = {e.dtype for e in list_tensors(got).values()}
    assert dtypes == {"BF16"}, dtypes
    draft = load_draft(out)
    pair = validate_pair(world.target, out)
    assert pair.family == "qwen3_5_moe" and pair.target.expert_storage == "packed", pair
    tc = read_text_config(world.target)
    assert draft.config.hidden_size == pair.draft.hidden_size == tc["hidden_size"]
    assert pair.draft.target_layer_ids == validate_pair(world.target, world.draft).draft.target_layer_ids

    # The capture's manifest, as uploaded: the teacher is the Qwen3.5-MoE text tower.
    manifest = json.loads(coord.fetch(run_id, "capture/manifest.json", tmp_path / "admin" / "capture-manifest.json").read_text())
    teacher = manifest["teacher"]
    assert teacher["family"] == manifest["recipe"]["model"]["family"] == "qwen3_5_moe", teacher
    assert (teacher["num_hidden_layers"], teacher["hidden_size"], teacher["vocab_size"]) == (
        tc["num_hidden_layers"], tc["hidden_size"], tc["vocab_size"]
    )
    assert read_config_json(world.target)["model_type"] == "qwen3_5_moe" and tc["model_type"] == "qwen3_5_moe_text"
    assert teacher["files"]["config.json"] == sha256_file(world.target / "config.json"), teacher["files"]
    assert manifest["hidden_size"] == tc["hidden_size"] and all(0 <= i < tc["num_hidden_layers"] for i in manifest["target_layer_ids"])
    assert manifest["device"]["linear_attention_kernels"] == {"qwen3_5_moe": reference}

    # The job's evaluation, as uploaded: real speculative decoding, every prompt past the teacher's first token.
    report = json.loads(coord.fetch(run_id, "eval/report.json", tmp_path / "admin" / "report.json").read_text())
    assert report["prompts"] == spec["evaluate"]["max_prompts"] == 2, report
    assert all(row["teacher_output_tokens"] > 1 for row in report["per_prompt"]), report["per_prompt"]
    assert report["baseline"]["verify_steps"] > 0 and report["trained"]["verify_steps"] > 0, report
    assert report["lossless"] is True, report["lossless_mismatches"]
    assert report["device"]["linear_attention_kernels"] == {"qwen3_5_moe": reference}


def test_the_demo_world_stays_a_qwen3_target(world):
    """`scripts/demo.sh` builds `build_world`'s default world, which the e2e tests share: a plain Qwen3 target."""
    from dflash_worker.testing.world import job_spec
    from dflash_worker.weights.checkpoint import is_wrapper_config, read_config_json

    demo = (REPO / "scripts" / "demo.sh").read_text()
    assert "build_world(work / \"world\", examples=48)" in demo and "family" not in demo
    config = read_config_json(world.target)
    assert world.family == "qwen3" and config["model_type"] == "qwen3" and not is_wrapper_config(config)
    assert job_spec(world)["recipe"]["model"]["family"] == "qwen3"
