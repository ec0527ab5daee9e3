"""Loading and saving drafts in the released layout, both directions against the upstream reference."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_worker.errors import CheckpointError, ConfigError
from dflash_worker.model import load_draft, save_draft

from .conftest import make_draft, ref_model, reference_twin, target_features

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a, b.view(torch.uint8) if b.dtype != torch.bool else b)


def _ours_vs_ref_state(ours, ref) -> None:
    rsd = ref.state_dict()
    osd = ours.state_dict()
    assert len(osd) == len([k for k in rsd if "rotary" not in k])
    for name, t in osd.items():
        other = rsd[name + ".weight" if name.endswith("_codebook") else name]
        assert _same_bytes(t.contiguous(), other.contiguous()), name


@pytest.fixture(scope="module")
def v2(target):
    return make_draft(target.config, v2=True, seed=31, std=0.2, final_logit_softcapping=3.0)


def _outputs(model, target, ids, feats, *, ref: bool):
    emb = target.get_input_embeddings().weight
    blk = torch.full((1, model.block_size), model.mask_token_id)
    blk[0, 0] = ids[0, 12]
    e = torch.nn.functional.embedding(blk, emb)
    with torch.no_grad():
        if ref:
            h = model(position_ids=torch.arange(16)[None], noise_embedding=e, target_hidden=feats[:, :12])
            path = model.propose(h[:, 1:], blk[:, 0], target.lm_head, 0.0)[0] if hasattr(model, "propose") else None
        else:
            h = model.step(feats[:, :12], e, model.new_cache())
            path = model.propose(h[:, 1:], blk[:, 0], target.lm_head)[0] if model.candidate_selector is not None else None
    return h, path


def test_reference_save_pretrained_loads_in_ours(v2, target, tmp_path):
    ours, raw = v2
    ref = reference_twin(ours, raw)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")  # sharded, codebooks spelled `.weight`
    assert (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_draft(tmp_path)
    assert loaded.kind == "dflash2" and loaded.config == ours.config
    _ours_vs_ref_state(loaded, ref)
    ids = torch.randint(3, 250, (1, 16), generator=torch.Generator().manual_seed(0))
    feats = target_features(target, ids, ours.target_layer_ids)
    h, path = _outputs(loaded, target, ids, feats, ref=False)
    rh, rpath = _outputs(ref, target, ids, feats, ref=True)
    assert (h - rh).abs().max() <= 1e-5 and torch.equal(path, rpath)


def test_our_export_is_released_layout_and_loads_in_reference(v2, target, tmp_path):
    ours, _ = v2
    save_draft(ours, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "candidate_selector.predecessor_codebook" in keys and "candidate_selector.successor_codebook" in keys
    assert not any(k.endswith("codebook.weight") for k in keys)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 8
    assert cfg["dflash_config"]["target_layer_ids"] == list(ours.target_layer_ids)

    ref = ref_model.DFlash2DraftModel.from_pretrained(str(tmp_path)).eval()
    _ours_vs_ref_state(ours, ref)
    ids = torch.randint(3, 250, (1, 16), generator=torch.Generator().manual_seed(1))
    feats = target_features(target, ids, ours.target_layer_ids)
    h, path = _outputs(ours, target, ids, feats, ref=False)
    rh, rpath = _outputs(ref, target, ids, feats, ref=True)
    assert (h - rh).abs().max() <= 1e-5 and torch.equal(path, rpath)
    assert ref.compute_logits(rh, target.lm_head).sub(ours.logits(h, target.lm_head)).abs().max() <= 1e-5


def test_dflash_v1_export_loads_in_reference(target, tmp_path):
    ours, _ = make_draft(target.config, v2=False, seed=2)
    save_draft(ours, tmp_path)
    ref = ref_model.DFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    _ours_vs_ref_state(ours, ref)
    assert load_draft(tmp_path).kind == "dflash"


def test_round_trip_is_byte_identical(v2, tmp_path):
    ours, _ = v2
    save_draft(ours, tmp_path / "a")
    back = load_draft(tmp_path / "a")
    assert back.config == ours.config
    for (n, a), (m, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert n == m and _same_bytes(a, b), n
    save_draft(back, tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()
    assert not list((tmp_path / "a").glob(".*"))  # no temporaries left behind


def test_dtypes(v2, tmp_path):
    ours, _ = v2
    save_draft(ours, tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(load_draft(tmp_path).parameters()).dtype == torch.bfloat16  # None keeps the checkpoint dtype
    up = load_draft(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in up.parameters())
    want = ours.fc.weight.to(torch.bfloat16).float()
    assert torch.equal(up.fc.weight, want)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_saved_weights_are_the_bytes_safetensors_save_file_writes(v2, tmp_path, dtype):
    """`save_draft` writes through `weights.write`; drafts saved before (by `save_file`) must hash the same."""
    ours, _ = v2
    save_draft(ours, tmp_path / "ours", dtype=dtype)
    tensors = {k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in ours.state_dict().items()}
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_a_failed_save_keeps_the_draft_already_there(v2, tmp_path, monkeypatch):
    ours, _ = v2
    save_draft(ours, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def refuse(tmp, path):
        raise OSError("disk full")

    monkeypatch.setattr("dflash_worker.manifest.commit_file", refuse)
    changed = copy.deepcopy(ours)
    changed.fc.weight.data.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_draft(changed, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # old files, no temporaries


def _write(tmp_path, tensors, cfg):
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))


def test_both_codebook_spellings_is_an_error(v2, tmp_path):
    ours, raw = v2
    sd = {k: v.contiguous() for k, v in ours.state_dict().items()}
    sd["candidate_selector.predecessor_codebook.weight"] = sd["candidate_selector.predecessor_codebook"].clone()
    _write(tmp_path, sd, ours.config.to_dict())
    with pytest.raises(CheckpointError, match="predecessor_codebook"):
        load_draft(tmp_path)


def test_missing_and_misshaped_tensors(v2, tmp_path):
    ours, raw = v2
    sd = {k: v.contiguous() for k, v in ours.state_dict().items()}
    del sd["layers.1.mlp_conv.base_kernel"]
    _write(tmp_path / "missing", sd, ours.config.to_dict())
    with pytest.raises(CheckpointError, match="layers.1.mlp_conv.base_kernel"):
        load_draft(tmp_path / "missing")
    sd = {k: v.contiguous() for k, v in ours.state_dict().items()}
    sd["fc.weight"] = torch.zeros(3, 3)
    _write(tmp_path / "shape", sd, ours.config.to_dict())
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_draft(tmp_path / "shape")
    # a v1 checkpoint whose config claims DFlash2: the conv and selector tensors are missing
    v1_sd = {k: v.contiguous() for k, v in ours.state_dict().items() if "conv" not in k and "selector" not in k}
    _write(tmp_path / "kind", v1_sd, ours.config.to_dict())
    with pytest.raises(CheckpointError, match="missing keys"):
        load_draft(tmp_path / "kind")


def test_corrupt_inputs(v2, tmp_path):
    ours, _ = v2
    save_draft(ours, tmp_path / "ok")
    bad = tmp_path / "badjson"
    bad.mkdir()
    (bad / "config.json").write_text('{\n  "hidden_size": 64,\n  oops\n}')
    with pytest.raises(ConfigError, match=r"config.json:3: invalid JSON"):
        load_draft(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_draft(tmp_path)  # no config.json here
    with pytest.raises(CheckpointError, match="not a directory"):
        load_draft(tmp_path / "ok" / "model.safetensors")
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    (trunc / "config.json").write_bytes((tmp_path / "ok" / "config.json").read_bytes())
    data = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        load_draft(trunc)
