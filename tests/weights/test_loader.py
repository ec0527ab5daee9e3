"""Streamed loading equals `from_pretrained` exactly: every parameter and buffer, bf16 and fp32,
tied and untied, sharded / single-file / in-memory sources, per-expert and packed MoE experts."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM

from dflash_worker.errors import CheckpointError
from dflash_worker.weights import list_tensors, load_model, stream_into
from dflash_worker.weights.loader import build_meta_model, check_model_checkpoint


def _reference(path, dtype=None):
    kw = {} if dtype is None else {"dtype": dtype}
    return AutoModelForCausalLM.from_pretrained(str(path), **kw).eval()


def assert_identical(ours: nn.Module, ref: nn.Module) -> None:
    ours_t = dict(ours.named_parameters(remove_duplicate=False)) | dict(ours.named_buffers(remove_duplicate=False))
    ref_t = dict(ref.named_parameters(remove_duplicate=False)) | dict(ref.named_buffers(remove_duplicate=False))
    assert ours_t.keys() == ref_t.keys()
    for name, t in ref_t.items():
        o = ours_t[name]
        assert o.device.type == "cpu" and not o.is_meta, name
        assert o.dtype == t.dtype, (name, o.dtype, t.dtype)
        assert o.shape == t.shape, name
        assert torch.equal(o, t), name
    assert not ours.training


def assert_tied(model: nn.Module) -> None:
    emb, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert head is emb
    assert head.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mmap", [None, False], ids=["mapped-default", "copied"])
def test_sharded_equals_from_pretrained(tiny_target, family, dtype, tied, mmap):
    path, saved = tiny_target(family, dtype, tied)
    assert len(list(path.glob("*.safetensors"))) > 3  # really sharded
    ours = load_model(path, mmap=mmap)
    assert_identical(ours, _reference(path))
    # and the bytes are those that were saved
    for name, p in saved.named_parameters():
        assert torch.equal(dict(ours.named_parameters())[name], p), name
    if tied:
        assert_tied(ours)
    else:
        assert ours.lm_head.weight.untyped_storage().data_ptr() != ours.model.embed_tokens.weight.untyped_storage().data_ptr()
    rep = ours.load_report
    assert not rep.missing and not rep.unexpected
    # the CPU default maps what is stored whole in the model's dtype (save_pretrained writes MoE
    # experts one by one: those fill slices of packed storage and are copied); mmap=False copies all
    if mmap is False:
        assert rep.bytes_mapped == 0 and rep.bytes_read > 0
    elif family == "qwen3":
        assert rep.bytes_mapped == rep.bytes_read > 0
    else:
        assert 0 < rep.bytes_mapped < rep.bytes_read


@pytest.mark.parametrize("want", [torch.bfloat16, torch.float32])
def test_explicit_dtype_converts_like_from_pretrained(tiny_target, want):
    path, _ = tiny_target("qwen3", "float32" if want == torch.bfloat16 else "bfloat16", True)
    ours = load_model(path, dtype=want)
    assert_identical(ours, _reference(path, want))
    assert_tied(ours)


def test_single_file(tiny_target, tmp_path):
    _, saved = tiny_target("qwen3", "bfloat16", True)
    d = tmp_path / "single"
    saved.save_pretrained(str(d), max_shard_size="1GB")
    assert (d / "model.safetensors").is_file() and not (d / "model.safetensors.index.json").exists()
    ref = _reference(d)
    assert_identical(load_model(d), ref)
    m = load_model(d / "model.safetensors")  # the file itself, config.json beside it
    assert_identical(m, ref)
    assert_tied(m)


def _digest(mapping):
    return {k: (id(v), v.data_ptr(), v.dtype, tuple(v.shape), hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()) for k, v in mapping.items()}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_in_memory_mapping_is_not_mutated(tiny_target, family):
    path, saved = tiny_target(family, "float32", False)
    ref = _reference(path)
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    before = _digest(sd)
    keys = list(sd)
    m = load_model(path, source=sd)
    assert list(sd) == keys and _digest(sd) == before
    assert_identical(m, ref)
    # the model owns its storage: writing to it leaves the caller's tensors alone
    with torch.no_grad():
        m.model.norm.weight.add_(1)
    assert _digest(sd) == before


def test_moe_packed_and_per_expert_checkpoints(tiny_target, tmp_path):
    path, _ = tiny_target("qwen3_moe", "bfloat16", False)
    assert any(".experts.0.gate_proj.weight" in n for n in list_tensors(path))  # save_pretrained writes per-expert
    ref = _reference(path)
    packed = tmp_path / "packed"
    packed.mkdir()
    shutil.copy(path / "config.json", packed / "config.json")
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    save_file(sd, str(packed / "model.safetensors"))
    m_packed = load_model(packed)
    m_individual = load_model(path)
    assert_identical(m_packed, ref)
    assert_identical(m_individual, ref)
    # per-expert slices landed in the right rows: gate first, then up
    I = ref.config.moe_intermediate_size
    t = list_tensors(path)
    from safetensors import safe_open

    entry = t["model.layers.1.mlp.experts.2.up_proj.weight"]
    with safe_open(str(entry.file), "pt") as f:
        up = f.get_tensor("model.layers.1.mlp.experts.2.up_proj.weight")
    assert torch.equal(m_individual.model.layers[1].mlp.experts.gate_up_proj[2, I:], up)


def test_moe_missing_expert_is_named(tiny_target, tmp_path):
    path, saved = tiny_target("qwen3_moe", "float32", False)
    ref = _reference(path)
    sd = {k: v for k, v in ref.state_dict().items()}
    # rebuild a per-expert dict and drop one expert slice
    per = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("gate_up_proj")]
            I = v.shape[1] // 2
            for e in range(v.shape[0]):
                per[f"{pre}{e}.gate_proj.weight"] = v[e, :I]
                per[f"{pre}{e}.up_proj.weight"] = v[e, I:]
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                per[f"{pre}{e}.down_proj.weight"] = v[e]
        else:
            per[k] = v
    assert_identical(load_model(path, source=per), ref)
    del per["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): `model.layers.2.mlp.experts.3.up_proj.weight`"):
        load_model(path, source=per)


def test_shape_mismatch_names_file_tensor_expected_found(tiny_target, tmp_path):
    path, _ = tiny_target("qwen3", "float32", False)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as info:
        load_model(bad)
    msg = str(info.value)
    assert "shape mismatch" in msg and ".safetensors" in msg and "mlp." in msg
    assert "`[96, 64]`" in msg or "`[64, 96]`" in msg  # expected
    assert "`[128, 64]`" in msg or "`[64, 128]`" in msg  # found
    with pytest.raises(CheckpointError, match="shape mismatch"):
        check_model_checkpoint(bad)


def test_missing_and_unexpected_keys_are_listed(tiny_target, tmp_path):
    path, _ = tiny_target("qwen3", "float32", False)
    sd = {k: v for k, v in _reference(path).state_dict().items()}
    sd.pop("model.norm.weight")
    sd.pop("model.layers.1.self_attn.q_norm.weight")
    sd["model.extra.weight"] = torch.ones(3)
    with pytest.raises(CheckpointError) as info:
        load_model(path, source=sd)
    msg = str(info.value)
    assert "missing keys (2)" in msg and "`model.norm.weight`" in msg and "`model.layers.1.self_attn.q_norm.weight`" in msg
    assert "unexpected keys (1)" in msg and "`model.extra.weight`" in msg


def test_dtype_kind_mismatch(tiny_target, tmp_path):
    path, _ = tiny_target("qwen3", "float32", False)
    sd = dict(_reference(path).state_dict())
    sd["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    with pytest.raises(CheckpointError, match=r"tensor `model.norm.weight`: dtype mismatch.*torch.float32.*torch.int32"):
        load_model(path, source=sd)


def test_tied_checkpoint_carrying_both_names(tiny_target, tmp_path):
    path, _ = tiny_target("qwen3", "float32", True)
    ref = _reference(path)
    sd = dict(ref.state_dict())
    assert "lm_head.weight" in sd  # state_dict lists the alias too
    m = load_model(path, source=sd)
    assert_identical(m, ref)
    assert_tied(m)
    assert m.load_report.tied == ["lm_head.weight"]


def test_truncated_shard_is_caught_before_loading(tiny_target, tmp_path):
    path, _ = tiny_target("qwen3", "float32", False)
    bad = tmp_path / "trunc"
    shutil.copytree(path, bad)
    shard = sorted(bad.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*tensor `.*`.*past the end"):
        load_model(bad)


# --------------------------------------------------------------------------- stream_into on arbitrary modules


class Selector(nn.Module):
    def __init__(self):
        super().__init__()
        self.predecessor_codebook = nn.Embedding(10, 4)
        self.hidden_projection = nn.Linear(8, 4, bias=False)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8, bias=False)
        self.candidate_selector = Selector()
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.full((8,), 2.0), persistent=False)


def test_stream_into_key_mapping_and_dtype(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "fc.weight": torch.randn(8, 16, generator=g),
        "candidate_selector.predecessor_codebook": torch.randn(10, 4, generator=g),
        "candidate_selector.hidden_projection.weight": torch.randn(4, 8, generator=g),
        "step": torch.tensor(7),
    }
    f = tmp_path / "draft.safetensors"
    save_file(tensors, str(f))
    with torch.device("meta"):
        m = Toy()
    m.scale = torch.full((8,), 2.0)  # built for real: kept as is
    mapping = {"candidate_selector.predecessor_codebook": "candidate_selector.predecessor_codebook.weight"}
    rep = stream_into(m, f, dtype=torch.bfloat16, key_mapping=mapping)
    assert sorted(rep.loaded) == sorted(
        ["fc.weight", "candidate_selector.predecessor_codebook.weight", "candidate_selector.hidden_projection.weight", "step"]
    )
    assert m.fc.weight.dtype == torch.bfloat16 and torch.equal(m.fc.weight, tensors["fc.weight"].to(torch.bfloat16))
    assert torch.equal(m.candidate_selector.predecessor_codebook.weight, tensors["candidate_selector.predecessor_codebook"].bfloat16())
    assert m.step.dtype == torch.int64 and int(m.step) == 7  # non-float keeps its dtype
    assert isinstance(m.fc.weight, nn.Parameter) and m.fc.weight.requires_grad
    assert torch.equal(m.scale, torch.full((8,), 2.0))
    # without the mapping: both sides are reported
    with torch.device("meta"):
        m2 = Toy()
    m2.scale = torch.full((8,), 2.0)
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): `candidate_selector.predecessor_codebook.weight`.*unexpected keys \(1\): `candidate_selector.predecessor_codebook`"):
        stream_into(m2, f)
    rep = stream_into(m2, f, strict=False)
    assert rep.missing == ["candidate_selector.predecessor_codebook.weight"]
    assert rep.unexpected == ["candidate_selector.predecessor_codebook"]
    assert torch.count_nonzero(m2.candidate_selector.predecessor_codebook.weight) == 0  # zero-filled, reported


def test_stream_into_meta_nonpersistent_buffer_without_recipe(tmp_path):
    f = tmp_path / "t.safetensors"
    save_file({"fc.weight": torch.ones(8, 16), "candidate_selector.predecessor_codebook.weight": torch.ones(10, 4),
               "candidate_selector.hidden_projection.weight": torch.ones(4, 8), "step": torch.tensor(1)}, str(f))
    with torch.device("meta"):
        m = Toy()
    with pytest.raises(CheckpointError, match=r"non-persistent buffer\(s\) `scale` were built on the meta device"):
        stream_into(m, f)


def test_stream_into_callable_mapping_and_duplicate_fill(tmp_path):
    f = tmp_path / "t.safetensors"
    save_file({"a.fc.weight": torch.ones(8, 16), "fc.weight": torch.ones(8, 16)}, str(f))
    lin = nn.Linear(16, 8, bias=False)
    with pytest.raises(CheckpointError, match="already fills"):
        stream_into(lin.to("meta"), f, key_mapping=lambda k: k.removeprefix("a.fc.").removeprefix("fc."))


def test_meta_model_is_cheap_and_rotary_matches(tiny_target):
    path, _ = tiny_target("qwen3", "bfloat16", False)
    meta = build_meta_model(path, torch.bfloat16)
    assert all(p.is_meta for p in meta.parameters())
    ours = load_model(path)
    ref = _reference(path)
    assert torch.equal(ours.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    # the loaded model computes the same logits
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


def test_packed_and_per_expert_for_same_tensor_is_refused(tiny_target):
    path, _ = tiny_target("qwen3_moe", "float32", False)
    ref = _reference(path)
    sd = dict(ref.state_dict())
    I = ref.config.moe_intermediate_size
    sd["model.layers.0.mlp.experts.1.gate_proj.weight"] = sd["model.layers.0.mlp.experts.gate_up_proj"][1, :I]
    with pytest.raises(CheckpointError, match="already fills"):
        load_model(path, source=sd)


def test_progress_and_bytes_read(tiny_target):
    path, _ = tiny_target("qwen3", "bfloat16", False)
    seen = []
    m = load_model(path, progress=lambda done, total: seen.append((done, total)))
    total = sum(e.nbytes for e in list_tensors(path).values())
    assert seen[-1] == (total, total) and m.load_report.bytes_read == total
    assert all(a <= b for (a, _), (b, _) in zip(seen, seen[1:]))


@pytest.mark.parametrize("want", [None, torch.bfloat16])
def test_chunked_threaded_reads(tiny_target, monkeypatch, want):
    """Force many odd-sized chunks over several threads; direct and converting paths stay exact."""
    from dflash_worker.weights import stream_read

    monkeypatch.setattr(stream_read, "CHUNK_BYTES", 1000)  # not a multiple of 4: chunks must stay element-aligned
    monkeypatch.setattr(stream_read, "_threads", lambda: 3)
    path, _ = tiny_target("qwen3_moe", "float32", True)
    ours = load_model(path, dtype=want, mmap=False)
    assert ours.load_report.bytes_mapped == 0
    assert_identical(ours, _reference(path, want))
    assert_tied(ours)


def test_prefaulted_direct_reads_are_byte_identical(tiny_target, monkeypatch):
    """With the prefault threshold at 0 every direct chunk is `madvise`d before its read."""
    from dflash_worker.weights import stream_read

    calls = []
    real = stream_read._prefault
    monkeypatch.setattr(stream_read, "_PREFAULT_MIN_BYTES", 0)
    monkeypatch.setattr(stream_read, "_prefault", lambda addr, n: (calls.append(n), real(addr, n)))
    path, _ = tiny_target("qwen3", "float32", False)
    ours = load_model(path, mmap=False)
    assert calls, "no direct chunk was prefaulted"
    assert_identical(ours, _reference(path))


def test_per_expert_reads_are_batched_and_prefaulted_as_merged_ranges(tiny_target, monkeypatch):
    """Thousands of small per-expert tensors: a pool task reads many of them, and the batch
    backs their adjacent destination rows (gate then up of one expert, and the next) in one range."""
    from dflash_worker.weights import stream_read

    calls: list[int] = []
    real = stream_read._prefault
    monkeypatch.setattr(stream_read, "_PREFAULT_MIN_BYTES", 0)
    monkeypatch.setattr(stream_read, "_prefault", lambda addr, n: (calls.append(n), real(addr, n)))
    monkeypatch.setattr(stream_read, "_threads", lambda: 2)
    monkeypatch.setattr(stream_read, "CHUNK_BYTES", 4096)  # several batches, over a pool of 2
    submitted: list[int] = []
    real_run = stream_read._run_batch
    monkeypatch.setattr(stream_read, "_run_batch", lambda batch, fd: (submitted.append(len(batch)), real_run(batch, fd)))
    path, _ = tiny_target("qwen3_moe", "bfloat16", False)
    piece = max(e.nbytes for n, e in list_tensors(path).items() if ".experts.0." in n)
    ours = load_model(path, mmap=False)
    assert_identical(ours, _reference(path))
    assert max(submitted) > 1, "every pool task read a single piece"
    assert len(submitted) < sum(submitted)
    assert max(calls) > piece, "no prefault covered more than one per-expert piece"


def test_batches_keep_order_and_limit():
    from dflash_worker.weights import stream_read

    units = [stream_read._Unit(item=None, nbytes=n, fn=lambda fd: None) for n in (3, 3, 3, 10, 1, 1, 4)]
    got = [[u.nbytes for u in b] for b in stream_read._batches(units, limit=6)]
    assert got == [[3, 3], [3], [10], [1, 1, 4]]
    assert [u for b in stream_read._batches(units, limit=6) for u in b] == units
    assert stream_read._batches([], limit=6) == []
