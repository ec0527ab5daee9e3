"""BF16 export: loads in the upstream reference with the same logits as ours; refuses
non-finite tensors naming them; writes atomically; the CLI exports AF4G64 too."""

from __future__ import annotations

import json

import pytest
import torch
from prewarmed import worker_cli

from dflash_worker.errors import ExportError
from dflash_worker.export.bf16 import export_config, verify_bf16, write_bf16
from dflash_worker.recipe import load_recipe
from dflash_worker.train import train


@pytest.fixture(scope="module")
def trained_run(pipeline):
    res = train(load_recipe(pipeline.recipe("export-run", steps=4, val_every=2, checkpoint_every=2, lr=1e-2)))
    assert res.status == "completed"
    return res


def test_export_loads_in_upstream_reference_with_identical_logits(pipeline, trained_run):
    from dflash.model import DFlash2DraftModel

    from dflash_worker.capture import open_capture
    from dflash_worker.model import load_draft
    from dflash_worker.train.params import load_target_head

    out = trained_run.export_dir
    ref = DFlash2DraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load_draft(out, dtype=torch.float32).eval()
    head = load_target_head(pipeline.target)
    ex = next(iter(open_capture(pipeline.capture)))
    C = 12
    feats = ex.features[None, :C].float()
    block = torch.full((1, ours.block_size), ours.mask_token_id, dtype=torch.long)
    block[0, 0] = ex.input_ids[C]
    emb = ours.embed(block, head.embed)
    with torch.no_grad():
        h_ours = ours.step(feats, emb, ours.new_cache())[:, 1:]
        l_ours = ours.logits(h_ours, head.head)
        h_ref = ref(position_ids=torch.arange(C + ours.block_size)[None], noise_embedding=emb, target_hidden=feats)[:, 1:]
        l_ref = ref.compute_logits(h_ref, lambda x: x @ head.head.T)
        p_ours = ours.propose(h_ours, block[:, 0], head.head)[0]
        p_ref = ref.propose(h_ref, block[:, 0], lambda x: x @ head.head.T, 0.0)[0]
    assert (l_ours - l_ref).abs().max().item() <= 1e-5
    assert torch.equal(l_ours.argmax(-1), l_ref.argmax(-1))
    assert torch.equal(p_ours, p_ref)
    # every tensor of the reference equals the exported bytes (nothing renamed or dropped)
    ref_sd = ref.state_dict()
    for name, p in ours.named_parameters():
        key = name + ".weight" if name.endswith("_codebook") else name
        assert torch.equal(ref_sd[key], p.detach()), name


def test_planted_nan_is_refused_naming_the_tensor(pipeline, tmp_path):
    from dflash_worker.model import load_draft

    model = load_draft(pipeline.draft, dtype=torch.float32)
    values = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    name = "layers.1.mlp.down_proj.weight"
    values[name] = values[name].clone()
    values[name][3, 5] = float("nan")
    out = tmp_path / "nan-export"
    with pytest.raises(ExportError, match=f"`{name}`"):
        write_bf16(pipeline.draft, values, out)
    assert not out.exists() and not list(tmp_path.glob(".*"))  # no temporary or moved-aside export left
    values[name][3, 5] = float("inf")
    with pytest.raises(ExportError, match="non-finite"):
        write_bf16(pipeline.draft, values, out)


def test_export_cli_formats_and_manifest(pipeline, trained_run):
    run = trained_run.run_dir
    res = worker_cli("export", "--run", run, "--format", "af4g64", "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    manifest = json.loads(res.stdout)  # stdout holds only the manifest; the summary is a log line
    assert f"export: wrote `{run / 'export-af4g64'}` (af4g64, step {trained_run.selection['step']})" in res.stderr, res.stderr
    chain = manifest["provenance"]
    assert chain["chain"] == ["data", "split", "capture", "recipe", "checkpoint", "export"]
    assert set(chain) == set(chain["chain"]) | {"chain"}
    assert chain["checkpoint"]["step"] == trained_run.selection["step"]
    # an existing export is not replaced without --overwrite
    again = worker_cli("export", "--run", run, timeout=300)
    assert again.returncode == 1 and "--overwrite" in again.stderr
    m = verify_bf16(run / "export")
    assert m["provenance"]["recipe"]["fingerprint"]
    assert set(m["files"]) == {"model.safetensors", "config.json"}
    assert (run / "export" / "config.json").read_bytes() == export_config(pipeline.draft)[0]  # released + serving fields


def test_damaged_export_fails_verification(tmp_path, trained_run):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(trained_run.export_dir, copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ExportError, match="does not match"):
        verify_bf16(copy)
