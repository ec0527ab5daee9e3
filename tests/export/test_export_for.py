"""`export --for ENGINE`: each engine's check accepts and refuses what that engine runs, the serving files say
how (vLLM's `speculative_config` with num_speculative_tokens = block_size - 1), the export's config carries
every field each engine reads where it reads it, and the serving files leave the export verifiable.

The exports are real: tiny targets saved by transformers, drafts saved by `save_draft`, exported by
`write_bf16` / `write_af4g64` and, for the CLI, by a trained run."""

from __future__ import annotations

import json

import pytest
import torch
from prewarmed import worker_cli

from dflash_worker.errors import ExportError
from dflash_worker.export.bf16 import export_config, verify_bf16, write_bf16
from dflash_worker.model import DraftConfig, build_draft, save_draft
from dflash_worker.serving.engines import ENGINES, plan, write_plans
from dflash_worker.testing.tiny import save_tiny_target
from dflash_worker.testing.tiny_draft import tiny_dflash2_config, tiny_dflash_config
from dflash_worker.testing.world import target_config

FULL = ["full_attention", "full_attention"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """Tiny Qwen3 targets: head_dim 16 (the tiny worlds') and 64 (one vLLM's CPU attention has a kernel for)."""
    root = tmp_path_factory.mktemp("targets")
    out = {}
    for hd in (16, 64):
        save_tiny_target(root / f"hd{hd}", head_dim=hd)
        out[hd] = root / f"hd{hd}"
    return out


def _export(tmp_path, name, cfg, *, config_edit=None):
    """A released draft saved from `cfg` (its config.json then edited by `config_edit`), exported to BF16."""
    draft = tmp_path / f"{name}-draft"
    save_draft(build_draft(DraftConfig.from_dict(cfg), seed=0), draft, dtype=torch.bfloat16)
    if config_edit is not None:
        raw = json.loads((draft / "config.json").read_text())
        config_edit(raw)
        (draft / "config.json").write_text(json.dumps(raw, indent=2))
    out = tmp_path / f"{name}-export"
    write_bf16(draft, {}, out)
    return out


def _v1(target, **over):
    return tiny_dflash_config(target_config(target), **{"layer_types": FULL, "use_sliding_window": False,
                                                        "sliding_window": None, **over})


def test_demo_like_dflash2_export_vllm_refused_on_cpu_mlx_accepted(tmp_path, targets):
    export = _export(tmp_path, "demo", tiny_dflash2_config(target_config(targets[16]), block_size=4, selector_top_k=64))
    written = json.loads((export / "config.json").read_text())
    # saved drafts keep block_size in dflash_config only; llama.cpp's converter reads it at the top level only
    assert written["block_size"] == written["dflash_config"]["block_size"] == 4
    assert verify_bf16(export)["config_added"] == ["block_size"]
    vllm = plan("vllm", export, targets[16])
    assert not vllm.accepted
    assert any("`Model Runner V1 does not support: DFlash candidate-head drafts`" in r for r in vllm.reasons), vllm.reasons
    assert any("mixed sliding/full dflash drafts" in r for r in vllm.reasons)
    mlx = plan("mlx", export, targets[16])
    assert mlx.accepted, mlx.reasons
    code = mlx.fields["code"]
    assert f"load_draft({str(export.resolve())!r})" in code and "from dflash_worker.serving.mlx import load_draft" in code
    assert "block_size=4" in code
    compile(code, "mlx.py", "exec")  # the emitted code is Python
    # on a GPU, vLLM's V2 runner takes DFlash2; SGLang takes it on a GPU only
    assert not any("candidate-head" in r for r in plan("vllm", export, targets[16], device="cuda").reasons)
    assert not plan("sglang", export, targets[16]).accepted
    sg = plan("sglang", export, targets[16], device="cuda")
    assert sg.accepted, sg.reasons
    assert sg.fields["flags"][sg.fields["flags"].index("--speculative-num-draft-tokens") + 1] == "4"
    lc = plan("llama.cpp", export, targets[16])
    assert not lc.accepted
    # llama.cpp 0c1e570 converts DFlash2; its loader bounds the selector: hidden 64 < 64 * 65
    assert [r for r in lc.reasons if "DFlash2" in r] == [r for r in lc.reasons if "selector lattice" in r] != []


def test_dflash2_within_llamacpps_selector_lattice_accepted(tmp_path, targets):
    # hidden size 64 >= top_k * (top_k + 1) = 56: llama.cpp's DFlash2 loader takes it (make interop-llamacpp)
    export = _export(tmp_path, "lattice", tiny_dflash2_config(target_config(targets[64]), block_size=4, selector_top_k=7,
                                                              layer_types=FULL, use_sliding_window=False,
                                                              sliding_window=None))
    lc = plan("llama.cpp", export, targets[64])
    assert lc.accepted, lc.reasons
    assert lc.fields["command"][-2:] == ["--spec-draft-n-max", "3"]


def test_v1_full_attention_export_vllm_accepted_with_its_speculative_config(tmp_path, targets):
    export = _export(tmp_path, "v1", _v1(targets[64], block_size=16))
    p = plan("vllm", export, targets[64])
    assert p.accepted, p.reasons
    # block_size 16 -> 15 speculative tokens: vLLM never reads block_size
    assert p.fields["speculative_config"] == {"method": "dflash", "model": str(export.resolve()), "num_speculative_tokens": 15}
    cmd = p.fields["command"]
    assert cmd[:3] == ["vllm", "serve", str(targets[64].resolve())]
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == p.fields["speculative_config"]
    lc = plan("llama.cpp", export, targets[64])
    assert lc.accepted, lc.reasons
    assert lc.fields["command"][-2:] == ["--spec-draft-n-max", "15"]
    write_plans(export, [p])
    assert json.loads((export / "serving" / "vllm.json").read_text())["speculative_config"] == p.fields["speculative_config"]
    verify_bf16(export)  # the serving files are not in the manifest: the export still verifies


@pytest.mark.parametrize(("name", "cfg", "target", "reason"), [
    ("sliding", dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=6), 64,
     "mixed sliding/full dflash drafts"),
    ("head16", {}, 16, "`head_dim` `16` has no vLLM CPU attention kernel"),
    ("embscale", dict(input_embedding_scale=2.0), 64, "ignores `input_embedding_scale`"),
    ("softcap", dict(final_logit_softcapping=30.0), 64, "ignores `final_logit_softcapping`"),
])
def test_vllm_cpu_refuses_what_its_runner_cannot_run(tmp_path, targets, name, cfg, target, reason):
    export = _export(tmp_path, name, _v1(targets[target], block_size=8, **cfg))
    p = plan("vllm", export, targets[target])
    assert not p.accepted and any(reason in r for r in p.reasons), p.reasons


def test_field_missing_where_an_engine_reads_it_is_refused_naming_it(tmp_path, targets):
    export = _export(tmp_path, "notl", _v1(targets[64]), config_edit=lambda raw: raw.pop("num_target_layers"))
    p = plan("mlx", export, targets[64])
    assert not p.accepted and any("`num_target_layers`" in r for r in p.reasons), p.reasons
    # a target of another width is refused by every engine
    other = tmp_path / "wide"
    save_tiny_target(other, hidden_size=128, head_dim=64)
    for engine in ENGINES:
        assert any("`hidden_size`" in r for r in plan(engine, export, other).reasons), engine


# Where each engine reads each field, as read in its sources (see serving/fields.py); written out here
# apart from the code so a wrong place there fails this test.
READS = {
    "vllm": ["dflash_config.final_logit_softcapping", "dflash_config.output_multiplier",
             "dflash_config.input_embedding_scale", "dflash_config.target_layer_ids", "dflash_config.mask_token_id",
             "dflash_config.conv_kernel_size", "dflash_config.conv_group_size", "dflash_config.selector_rank",
             "dflash_config.selector_top_k", "layer_types", "sliding_window", "head_dim"],
    "sglang": ["dflash_config.block_size", "dflash_config.final_logit_softcapping", "dflash_config.output_multiplier",
               "dflash_config.target_layer_ids", "dflash_config.mask_token_id", "dflash_config.selector_rank"],
    "mlx": ["dflash_config.target_layer_ids", "dflash_config.mask_token_id", "dflash_config.block_size",
            "dflash_config.final_logit_softcapping", "dflash_config.input_embedding_scale", "num_target_layers",
            "head_dim"],
    "llama.cpp": ["block_size", "dflash_config.target_layer_ids", "dflash_config.mask_token_id"],
}


def _at(raw, path):
    for part in path.split("."):
        raw = raw[part]
    return raw


def test_export_writes_each_field_where_each_engine_reads_it(tmp_path, targets):
    """A released config keeping softcapping, scales and block size at the top level only (an older layout):
    the export adds the copies each engine reads, with the same values, and changes nothing else."""
    cfg = tiny_dflash2_config(target_config(targets[16]), block_size=4, final_logit_softcapping=30.0,
                              output_multiplier=0.5, input_embedding_scale=2.0)

    def older_layout(raw):
        sub = raw["dflash_config"]
        for name in ("final_logit_softcapping", "output_multiplier", "input_embedding_scale", "block_size"):
            raw[name] = sub.pop(name)

    export = _export(tmp_path, "older", cfg, config_edit=older_layout)
    released = json.loads((tmp_path / "older-draft" / "config.json").read_text())
    assert "final_logit_softcapping" not in released["dflash_config"]  # the defect the export repairs
    written = json.loads((export / "config.json").read_text())
    want = {"final_logit_softcapping": 30.0, "output_multiplier": 0.5, "input_embedding_scale": 2.0, "block_size": 4}
    for engine, paths in READS.items():
        for path in paths:
            value = _at(written, path)
            if path.rsplit(".", 1)[-1] in want:
                assert value == want[path.rsplit(".", 1)[-1]], (engine, path, value)
    for key, value in released.items():  # only additions
        if key != "dflash_config":
            assert written[key] == value, key
    assert all(written["dflash_config"][k] == v for k, v in released["dflash_config"].items())
    manifest = verify_bf16(export)
    assert "dflash_config.final_logit_softcapping" in manifest["config_added"]
    assert DraftConfig.from_file(export) == DraftConfig.from_file(tmp_path / "older-draft")  # the same draft
    for engine in ENGINES:  # nothing an engine reads is missing any more
        assert not any("where" in r and "reads it" in r for r in plan(engine, export, targets[16]).reasons), engine


def test_complete_config_kept_byte_for_byte_and_conflicts_refused(tmp_path, targets):
    cfg = _v1(targets[64])
    draft = tmp_path / "complete"
    save_draft(build_draft(DraftConfig.from_dict(cfg), seed=0), draft, dtype=torch.bfloat16)
    raw = json.loads((draft / "config.json").read_text())
    raw["block_size"] = raw["dflash_config"]["block_size"]
    data = (json.dumps(raw, indent=1) + "\n").encode()
    (draft / "config.json").write_bytes(data)
    assert export_config(draft)[0] == data and export_config(draft)[2] == []
    raw["block_size"] = 16  # llama.cpp's converter would read 16, the others 4
    (draft / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ExportError, match="`block_size` is `16` at the top level and `4` in `dflash_config`"):
        write_bf16(draft, {}, tmp_path / "conflict-export")
    assert not (tmp_path / "conflict-export").exists()


def test_af4g64_export_mlx_accepted_vllm_and_llamacpp_refused(tmp_path, targets):
    from safetensors.torch import load_file

    from dflash_worker.export.af4g64 import read_manifest, write_af4g64

    export = _export(tmp_path, "q", _v1(targets[64]))
    tensors = {k: v.float() for k, v in load_file(str(export / "model.safetensors")).items()}
    out = tmp_path / "q-af4g64"
    write_af4g64(tensors, export_config(tmp_path / "q-draft")[1], out, ["fc.weight"])
    assert plan("mlx", out, targets[64]).accepted
    assert any("AF4G64" in r for r in plan("vllm", out, targets[64]).reasons)
    assert any("AF4G64" in r for r in plan("llama.cpp", out, targets[64]).reasons)
    write_plans(out, [plan(e, out, targets[64]) for e in ENGINES])
    read_manifest(out)  # the serving files are not in the manifest: the export still verifies


def test_cli_for_writes_serving_files_and_exits_3_when_an_engine_refuses(pipeline):
    from dflash_worker.commands.export import _ENGINES, REFUSED
    from dflash_worker.recipe import load_recipe
    from dflash_worker.train import train
    from dflash_worker.train.export_run import verify_export

    assert tuple(_ENGINES) == ENGINES  # `--help`'s list is the engines' list
    res = train(load_recipe(pipeline.recipe("for-run", steps=2, val_every=2, checkpoint_every=2)))
    assert res.status == "completed"
    out = res.run_dir / "export-af4g64"
    proc = worker_cli("export", "--run", res.run_dir, "--format", "af4g64", "--for", "vllm", "--for", "mlx", timeout=300)
    assert proc.returncode == REFUSED, proc.stderr
    assert f"error: vllm refuses `{out}` (cpu)" in proc.stderr and "DFlash candidate-head drafts" in proc.stderr
    assert "hint:" in proc.stderr and "serving: mlx accepts it (cpu)" in proc.stdout
    vllm = json.loads((out / "serving" / "vllm.json").read_text())
    mlx = json.loads((out / "serving" / "mlx.json").read_text())
    assert vllm["engine"] == "vllm" and vllm["accepted"] is False and vllm["reasons"]
    assert mlx["accepted"] is True and mlx["format"] == "af4g64" and "load_draft(" in mlx["code"]
    readme = (out / "serving" / "README.md").read_text()
    assert "## vllm: refused (cpu)" in readme and "## mlx: accepted" in readme
    manifest = verify_export(out)  # the manifest lists its own files; the serving files leave it valid
    assert not any(name.startswith("serving") for name in manifest["files"])
    # `--for` on the existing export: kept (it matches its manifest), only checked; an earlier answer is dropped
    again = worker_cli("export", "--run", res.run_dir, "--format", "af4g64", "--for", "mlx", timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"export: kept `{out}`" in again.stdout and not (out / "serving" / "vllm.json").exists()
    assert verify_export(out) == manifest
    # an export without its run (as `dflash-coordinator artifacts get` fetches it): the manifest names the target
    alone = worker_cli("export", "--export", out, "--for", "vllm", "--for", "mlx", timeout=300)
    assert alone.returncode == REFUSED and "DFlash candidate-head drafts" in alone.stderr, alone.stderr
    assert json.loads((out / "serving" / "mlx.json").read_text())["code"] == mlx["code"]
    given = worker_cli("export", "--export", out, "--target", pipeline.target, "--for", "mlx", timeout=300)
    assert given.returncode == 0, given.stderr
    nothing = worker_cli("export", "--export", out, timeout=300)
    assert nothing.returncode == 1 and "needs `--for ENGINE`" in nothing.stderr
    # a damaged existing export is not checked as if it were the run's
    (out / "config.json").write_text("{}")
    bad = worker_cli("export", "--run", res.run_dir, "--format", "af4g64", "--for", "mlx", timeout=300)
    assert bad.returncode == 1 and ("does not match" in bad.stderr or "sha256" in bad.stderr), bad.stderr
    helped = worker_cli("export", "--help", timeout=120)
    assert all(f"`{e}`:" in helped.stdout.replace("\n", " ") for e in ENGINES)


def test_mlx_refuses_a_qwen3_5_moe_target_with_one_tensor_per_expert(tmp_path):
    """mlx-lm's `qwen3_5_moe` stacks only packed experts; the same target packed is not refused for it."""
    reasons = {}
    for layout in ("individual", "packed"):
        target = tmp_path / layout
        save_tiny_target(target, family="qwen3_5_moe", expert_layout=layout, mtp=False)
        export = _export(tmp_path, layout, _v1(target))
        p = plan("mlx", export, target)
        reasons[layout] = [r for r in p.reasons if "one tensor per expert" in r]
        assert any("Qwen3.5 targets" in n for n in p.notes)
    assert reasons["individual"] and not reasons["packed"], reasons


def test_emitted_mlx_code_runs_on_the_export(tmp_path):
    """The `code` of `serving/mlx.json` runs as written: mlx-lm loads the target, the project's loader the
    export, z-lab dflash's MLX `stream_generate` drafts with it (greedy, as many tokens as it asks)."""
    import subprocess
    import sys

    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")
    pytest.importorskip("dflash.model_mlx", reason="z-lab dflash's MLX module is not importable")
    pytest.importorskip("dflash_worker.serving.mlx", reason="the project's MLX loader is not importable")
    from dflash_worker.testing.world import build_world

    world = build_world(tmp_path / "world")
    export = tmp_path / "export"
    write_bf16(world.draft, {}, export)
    p = plan("mlx", export, world.target)
    assert p.accepted, p.reasons
    code = p.fields["code"].replace("max_tokens=256", "max_tokens=12")
    script = tmp_path / "serve_mlx.py"
    script.write_text(code + "print('tokens', response.generation_tokens)\n")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "tokens 12" in res.stdout, res.stdout[-500:]
