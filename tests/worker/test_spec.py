"""`spec.json` read through the one typed `JobSpec`, and `Placement` applying its device policy.

A file the real run-manager wrote is round-tripped in tests/e2e/test_e2e_policy.py; here the
same layout is checked field by field, with hostile values, without starting Rust.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_worker.errors import ConfigError
from dflash_worker.worker.placement import Placement
from dflash_worker.worker.spec import JobSpec


def rust_doc(job_dir: Path, **over) -> dict:
    """What `JobSpecFile::write` (run-manager/src/worker/jobdir.rs) writes, field for field."""
    doc = {
        "schema_version": 1,
        "spec": {"stages": ["noop"], "noop": {"steps": 3, "step_seconds": 0.0, "checkpoint_every": 1}},
        "lease": {
            "lease_id": "l-1", "run_id": "r-1", "job_id": "j-1", "attempt": 2, "checkpoint_policy": "durable",
            "required_features": ["cpu", "torch_compile"], "required_client_version": "0.1.0",
        },
        "resume_checkpoint": None,
        "resume_step": 0,
        "restart": 0,
        "job_dir": str(job_dir),
        "device": {"backend": "cpu", "device_count": 1, "memory_bytes": 1 << 34, "supports_bf16": True,
                   "features": ["cpu"], "platform": "linux-x86_64"},
        "local_ranks": 1,
        "downgrades": [{"feature": "torch_compile", "replacement": "eager", "reason": "torch_compile is CUDA-only"}],
        "client_version": "0.1.0",
    }  # fmt: skip
    doc.update(over)
    return doc


def load(tmp_path: Path, doc: dict) -> JobSpec:
    job = tmp_path / "job"
    job.mkdir(exist_ok=True)
    (job / "spec.json").write_text(json.dumps(doc))
    return JobSpec.load(job)


def test_every_field_is_read_and_written_back_unchanged(tmp_path):
    doc = rust_doc((tmp_path / "job").resolve(), resume_checkpoint="/x/checkpoints/step-00000004/manifest.json", resume_step=4)
    spec = load(tmp_path, doc)
    assert spec.to_json() == doc
    assert spec.lease.attempt == 2 and spec.lease.required_features == ("cpu", "torch_compile")
    assert spec.device.backend == "cpu" and spec.resume_checkpoint == Path("/x/checkpoints/step-00000004/manifest.json")
    assert spec.downgrades[0].feature == "torch_compile" and spec.job.noop.steps == 3


def test_a_hand_written_spec_needs_only_the_job(tmp_path):
    doc = {"schema_version": 1, "spec": {"stages": ["noop"]}}
    spec = load(tmp_path, doc)
    assert spec.to_json() == doc
    assert spec.device is None and spec.local_ranks == 1 and spec.downgrades == ()
    assert Placement.from_spec(spec).backend is None


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"schema_version": 2}, "schema_version"),
        ({"schema_version": True}, "schema_version"),
        ({"surprise": 1}, "unknown key(s) `surprise`"),
        ({"local_ranks": 0}, "`local_ranks` must be at least 1"),
        ({"local_ranks": -3}, "`local_ranks` must be an integer"),
        ({"local_ranks": "2"}, "`local_ranks` must be a non-negative integer"),
        ({"restart": 1.5}, "`restart`"),
        ({"resume_checkpoint": ""}, "empty string"),
        ({"resume_checkpoint": 7}, "`resume_checkpoint` must be a path or null"),
        ({"job_dir": "/somewhere/else"}, "but the worker was started in"),
        ({"device": {"backend": "tpu"}}, "`backend` is `tpu`"),
        ({"device": {"gpu_model": "x"}}, "`device`: unknown key(s) `gpu_model`"),
        ({"device": "cpu"}, "`device` must be a JSON object"),
        ({"lease": {"lease_id": "l"}}, "`lease`: `run_id` is missing"),
        ({"downgrades": {"feature": "x"}}, "`downgrades` must be a list"),
        ({"downgrades": [{"feature": "x", "replacement": "y"}]}, "`downgrades[0]`: `reason` is missing"),
        ({"spec": {"stages": ["noop"], "typo": 1}}, "`spec`: unknown key(s) `typo`"),
        ({"spec": {"stages": ["noop"], "noop": {"steps": 1e9}}}, "spec.noop.steps"),
        ({"spec": {"stages": ["prepare"]}}, "`spec.inputs` must be a non-empty list"),
        ({"spec": {"stages": ["export"], "export_formats": ["gguf"]}}, "`spec.export_formats`"),
        ({"spec": {"stages": ["check"]}}, "`spec.recipe` must be an object"),
        ({"spec": {"stages": ["evaluate"], "evaluate": {"max_prompts": 0}}}, "`max_prompts` must be a positive integer"),
    ],
)
def test_malformed_fields_are_refused_naming_file_and_field(tmp_path, over, needle):
    doc = rust_doc((tmp_path / "job").resolve())
    if "device" in over and isinstance(over["device"], dict):
        over = {"device": {**doc["device"], **over["device"]}}
    doc.update(over)
    with pytest.raises(ConfigError) as e:
        load(tmp_path, doc)
    assert needle in str(e.value) and "spec.json" in str(e.value), str(e.value)


def test_the_recipe_is_built_once_with_the_runner_s_outputs(tmp_path):
    recipe = {"model": {"target": "/t", "draft": "/d", "family": "qwen3"}, "data": {"thinking": "off"}, "capture": {}, "train": {"scope": "full"}}
    spec = load(tmp_path, {"schema_version": 1, "spec": {"stages": ["train"], "recipe": recipe}})
    job = (tmp_path / "job").resolve()
    r = spec.job.recipe
    assert (r.data.dir, r.capture.output, r.train.output) == (job / "data", job / "capture", job / "run")
    assert spec.job.raw["recipe"] == recipe  # the spec as read is left alone
    owned = {**recipe, "train": {"scope": "full", "output": "/elsewhere"}}
    with pytest.raises(ConfigError, match="set by the job runner"):
        load(tmp_path, {"schema_version": 1, "spec": {"stages": ["train"], "recipe": owned}})


def test_placement_pins_auto_to_the_provider_and_records_downgrades(tmp_path):
    placement = Placement.from_spec(load(tmp_path, rust_doc((tmp_path / "job").resolve())))
    choice = placement.device_for("train", "auto")
    assert choice.device == "cpu" and choice.requested == "auto"
    assert choice.notes[0] == "`auto` pinned to the provider's backend `cpu`"
    assert any(n.startswith("downgrade `torch_compile` -> `eager`") and "torch_compile is CUDA-only" in n for n in choice.notes)
    assert placement.draft_attention == "sdpa"  # no compiled flex attention once torch_compile is downgraded
    from dflash_worker.device import provenance

    assert provenance(choice)["notes"] == list(choice.notes)


def test_placement_refuses_what_the_provider_cannot_run(tmp_path, monkeypatch):
    job = (tmp_path / "job").resolve()
    placement = Placement.from_spec(load(tmp_path, rust_doc(job)))
    with pytest.raises(ConfigError, match=r"`\[capture\].device` is `cuda` but this provider runs `cpu`"):
        placement.device_for("capture", "cuda")
    # A lease of 2 ranks runs as 2 processes the run-manager starts (`WORLD_SIZE=2`), not as one.
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"grants 2 local rank\(s\), but this process was started as one of 1 \(`WORLD_SIZE`\)"):
        Placement.from_spec(load(tmp_path, rust_doc(job, local_ranks=2)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert Placement.from_spec(load(tmp_path, rust_doc(job, local_ranks=2))).local_ranks == 2
    with pytest.raises(ConfigError, match=r"grants 1 local rank\(s\), but this process was started as one of 2"):
        Placement.from_spec(load(tmp_path, rust_doc(job)))
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="`WORLD_SIZE` is `two`, not an integer"):
        Placement.from_spec(load(tmp_path, rust_doc(job)))
    monkeypatch.delenv("WORLD_SIZE")
    unknown = [{"feature": "xformers", "replacement": "sdpa", "reason": "r"}]
    with pytest.raises(ConfigError, match="downgrades `xformers`, which this worker does not know"):
        Placement.from_spec(load(tmp_path, rust_doc(job, downgrades=unknown)))
    wrong = [{"feature": "liger", "replacement": "triton", "reason": "r"}]
    with pytest.raises(ConfigError, match="replaces it with `torch`"):
        Placement.from_spec(load(tmp_path, rust_doc(job, downgrades=wrong)))


def test_without_downgrades_the_draft_keeps_its_attention_choice(tmp_path):
    placement = Placement.from_spec(load(tmp_path, rust_doc((tmp_path / "job").resolve(), downgrades=[])))
    assert placement.draft_attention == "auto" and placement.notes() == ()


def test_the_worker_knows_exactly_the_downgrades_the_run_manager_hands_out():
    import re

    from dflash_worker.worker.placement import DOWNGRADES

    src = (Path(__file__).resolve().parents[2] / "run-manager/src/policy.rs").read_text()
    table = re.search(r"pub const DOWNGRADES: \[\(&str, &str\); \d+\] = \[(.*?)\];", src, re.S)
    assert table, "DOWNGRADES not found in run-manager/src/policy.rs"
    pairs = dict(re.findall(r'\("([a-z_0-9]+)",\s*"([a-z_0-9]+)"\)', table.group(1)))
    assert pairs == DOWNGRADES


def test_reading_a_spec_does_not_import_torch(tmp_path):
    import subprocess
    import sys

    job = tmp_path / "job"
    job.mkdir()
    (job / "spec.json").write_text(json.dumps(rust_doc(job.resolve())))
    code = "import sys; from dflash_worker.worker import JobSpec, Placement; Placement.from_spec(JobSpec.load(sys.argv[1])); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code, str(job)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
