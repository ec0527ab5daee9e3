"""The regression gate on real trainings and real evaluations (run-manager + native client + coordinator):

1. run `good`: the tiny world's draft adapted to the teacher's own greedy continuations (capture with
   `regenerate`), evaluated on the held-out `test` split against the released draft;
2. run `shuffled`: the same pipeline whose released draft is `good`'s export (fetched from the
   coordinator) and whose training rows have their responses shuffled across prompts (labels that
   belong to other prompts), at a high learning rate: a draft made worse on purpose.

The gate decides from each job's real `eval/report.json`: the shuffled draft regresses against its
released draft and is held back (job `succeeded`, `published: false`, the figures in the reason; the
export is refused), until `runs publish --override`, which is recorded.
"""

from __future__ import annotations

import json
import random

import pytest
from e2e_helpers import pipeline_spec, run_one_job, sha256_file

pytestmark = pytest.mark.slow


def _run(procs, coord, tmp_path, name: str, spec: dict) -> tuple[str, dict]:
    run_id, job, _ = run_one_job(procs, coord, tmp_path / f"work-{name}", name, spec, warm=True)
    return run_id, job


def test_a_draft_trained_on_shuffled_labels_is_held_back_and_an_override_is_recorded(tmp_path, procs, world, binaries):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=30, warm=True)
    good = pipeline_spec(world)
    good["recipe"]["capture"].update(regenerate=True, sampling="greedy", max_new_tokens=24)
    good["recipe"]["train"]["lr"] = 1e-2
    good_run, good_job = _run(procs, coord, tmp_path, "good", good)
    pub = good_job["publication"]
    print(f"good: {pub['verdict']} {pub['reason']}")
    assert pub["verdict"] in ("improved", "tied") and pub["published"] is True, pub
    export = tmp_path / "good-export"
    coord.cli("artifacts", "get", good_run, "--export", "-o", str(export))
    assert (export / "model.safetensors").is_file()

    rows = [json.loads(line) for line in world.rows.read_text().splitlines()]
    responses = [r["response"] for r in rows]
    random.Random(7).shuffle(responses)
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(json.dumps({**r, "response": resp}) + "\n" for r, resp in zip(rows, responses, strict=True)))
    bad = pipeline_spec(world)
    bad["inputs"] = [str(shuffled)]
    bad["recipe"]["model"]["draft"] = str(export)
    bad["recipe"]["train"]["lr"] = 5e-2
    bad_run, bad_job = _run(procs, coord, tmp_path, "shuffled", bad)
    pub = bad_job["publication"]
    print(f"shuffled: {pub['verdict']} {pub['reason']}")
    assert pub["published"] is False and pub["verdict"] == "regressed", pub
    assert pub["reason"].startswith("regressed: acceptance length") and pub["tau_trained"] < pub["tau_released"], pub
    refused = coord.cli("artifacts", "get", bad_run, "--export", "-o", str(tmp_path / "bad-export"), check=False)
    assert refused.returncode == 1 and "is not published: regressed" in refused.stderr, refused.stderr

    out = json.loads(coord.cli("runs", "publish", bad_run, "--override", "--note", "e2e: shipping the worse draft on purpose", "--json").stdout)
    assert out["publication"]["published"] is True and int(out["publication"]["override_unix"]) > 0
    coord.cli("artifacts", "get", bad_run, "--export", "-o", str(tmp_path / "bad-export"))
    model = next(a for a in bad_job["artifacts"] if a["name"].endswith("export/model.safetensors"))
    assert sha256_file(tmp_path / "bad-export" / "model.safetensors") == model["sha256"]
    (job,) = coord.show(bad_run)["jobs"]
    assert job["publication"]["override_note"] == "e2e: shipping the worse draft on purpose", job
