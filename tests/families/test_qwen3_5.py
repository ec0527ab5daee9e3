"""Qwen3.5-architecture targets (issue 33) on checkpoints transformers' own wrappers wrote.

The targets are `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`
saved with `save_pretrained` (vision tower present) plus an `mtp.*` shard, MoE experts
individual or packed (`conftest.QWEN3_5_TARGETS`). Shown here:

- load: `load_model` equals transformers' `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`
  `from_pretrained` (the loading oracle) tensor for tensor and in logits; every vision and
  MTP tensor is skipped with its exact byte total (from the safetensors headers, parsed here),
  and none of their bytes is read;
- validate: `validate_target`, `validate_pair` and the `validate-pair` CLI accept the pairs
  and name the field of each failure;
- `init-draft`: the standard geometry on tiny 12-layer targets and, from config.json
  values only, on the full-size Qwen3.6-35B-A3B and dense 27B;
- draft configs of both released schemas parse and build, and mean what the upstream
  reference makes of them.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from dflash_worker.errors import ConfigError, FamilyError
from dflash_worker.families import validate_pair, validate_target
from dflash_worker.model import DraftConfig, build_draft, default_target_layer_ids, load_draft
from dflash_worker.model.geometry import plan_draft
from dflash_worker.testing.full_size import QWEN3_6_27B, QWEN3_6_35B_A3B
from dflash_worker.testing.tiny import save_tiny_dflash2_draft, tiny_qwen3_5_config
from dflash_worker.weights import check_model_checkpoint, load_model

from .conftest import QWEN3_5_TARGETS, rewrite_target
from .test_families import _cli, _fails

SKIPPED_PREFIXES = ("model.visual.", "mtp.")
LAYERS = "model.language_model.layers"


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models; a second spinning thread only slows the shared machine
    yield
    torch.set_num_threads(before)


def _headers(directory: Path) -> dict[str, tuple[Path, int, int]]:
    """{tensor name: (file, absolute data offset, nbytes)} of every safetensors file in `directory`,
    parsed here from the format itself (8-byte little-endian header length, JSON header)."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            assert name not in out, f"`{name}` in two files"
            out[name] = (file, 8 + n + begin, end - begin)
    return out


def _oracle(key: str, path: Path):
    """transformers' own text-tower class, loaded with its own `from_pretrained`."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    cls = Qwen3_5MoeForCausalLM if QWEN3_5_TARGETS[key][0] == "qwen3_5_moe" else Qwen3_5ForCausalLM
    model, info = cls.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _assert_same_model(ours, oracle) -> None:
    assert type(ours) is type(oracle)
    a, b = ours.state_dict(), oracle.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ids = torch.randint(3, ours.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, oracle(ids).logits)


# --------------------------------------------------------------------------- load


@pytest.mark.parametrize("key", list(QWEN3_5_TARGETS))
def test_load_equals_transformers_text_tower_and_skips_vision_and_mtp_unread(qwen3_5_targets, key, tmp_path):
    path, _ = qwen3_5_targets[key]
    headers = _headers(path)
    skipped = {n: nb for n, (_, _, nb) in headers.items() if n.startswith(SKIPPED_PREFIXES)}
    text = {n: nb for n, (_, _, nb) in headers.items() if not n.startswith(SKIPPED_PREFIXES)}
    assert any(n.startswith("mtp.") for n in skipped) and any(n.startswith("model.visual.") for n in skipped)
    assert all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in text)

    oracle = _oracle(key, path)
    ours = load_model(path)
    _assert_same_model(ours, oracle)
    report = ours.load_report
    assert sorted(report.skipped) == sorted(skipped)
    assert report.bytes_skipped == sum(skipped.values())
    assert report.bytes_read == sum(text.values())  # the text tower's bytes and nothing else
    dry = check_model_checkpoint(path)  # the header-only dry run says the same
    assert sorted(dry.skipped) == sorted(skipped) and dry.bytes_skipped == report.bytes_skipped

    # Every skipped tensor's data overwritten with 0xFF (NaN in bf16): the load is still the oracle's.
    broken = shutil.copytree(path, tmp_path / "broken")
    for name in skipped:
        file, offset, nbytes = _headers(broken)[name]
        with open(file, "r+b") as f:
            f.seek(offset)
            f.write(b"\xff" * nbytes)
    from safetensors import safe_open

    name = next(n for n in skipped if n.startswith("mtp."))
    with safe_open(str(headers[name][0]).replace(str(path), str(broken)), "pt") as f:
        assert torch.isnan(f.get_tensor(name)).all()  # the corruption is really there
    again = load_model(broken)
    _assert_same_model(again, oracle)
    assert again.load_report.bytes_read == report.bytes_read


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_tied_embeddings_wrapper_loads_and_gives_training_its_head(family, tmp_path):
    """The small Qwen3.5 releases tie `lm_head` to the embedding: no `lm_head.weight` in the file."""
    from dflash_worker.testing import save_tiny_target
    from dflash_worker.train.params import load_target_head

    path = tmp_path / family
    save_tiny_target(path, family=family, dtype="bfloat16", tie_word_embeddings=True)
    assert "lm_head.weight" not in _headers(path)
    oracle = _oracle("qwen3_5" if family == "qwen3_5" else "qwen3_5_moe/individual", path)
    ours = load_model(path)
    _assert_same_model(ours, oracle)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    head = load_target_head(path)  # what training streams in: the wrapper's embedding, tied head
    assert torch.equal(head.embed, oracle.model.embed_tokens.weight.float())
    assert head.head is None or torch.equal(head.head, oracle.lm_head.weight.float())


def test_text_only_config_loads_the_same_tower(qwen3_5_targets, tmp_path):
    """A `qwen3_5_moe_text` checkpoint (weights at `model.*`) is the same family and the same model."""
    path, _ = qwen3_5_targets["qwen3_5_moe/packed"]
    oracle = _oracle("qwen3_5_moe/packed", path)
    wrapper = json.loads((path / "config.json").read_text())
    text_cfg = {**wrapper["text_config"], "architectures": ["Qwen3_5MoeForCausalLM"], "dtype": "bfloat16"}
    dst = tmp_path / "text-only"
    dst.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in oracle.state_dict().items()}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(text_cfg))
    assert validate_target(dst).family == "qwen3_5_moe"
    ours = load_model(dst)
    _assert_same_model(ours, oracle)
    assert ours.load_report.skipped == [] and ours.load_report.bytes_skipped == 0


# --------------------------------------------------------------------------- validate


def _draft(tmp_path: Path, config, name: str = "draft", **kw) -> Path:
    path = tmp_path / name
    save_tiny_dflash2_draft(path, config, **kw)
    return path


def _moe_kw(key: str) -> dict:
    return {"num_experts": 4, "num_experts_per_tok": 2} if "moe" in key else {}


@pytest.mark.parametrize("key", list(QWEN3_5_TARGETS))
def test_validate_target_pair_and_cli_accept_wrapper_targets(qwen3_5_targets, key, tmp_path):
    path, config = qwen3_5_targets[key]
    family, layout = QWEN3_5_TARGETS[key]
    rep = validate_target(path)
    assert (rep.family, rep.hidden_size, rep.num_hidden_layers, rep.vocab_size) == (family, 64, 4, 256)
    if family == "qwen3_5_moe":
        assert (rep.num_experts, rep.num_experts_per_tok) == (4, 2)
        assert rep.expert_storage == {"individual": "per-expert", "packed": "packed"}[layout]
    else:
        assert rep.num_experts is None and rep.expert_storage is None
    # taps 0 and 3: valid for the 4-layer text tower (the 1-block vision tower does not count)
    draft = _draft(tmp_path, config, target_layer_ids=[0, 3], **_moe_kw(key))
    pair = validate_pair(path, draft)
    assert pair.family == family and pair.draft.target_layer_ids == [0, 3]
    ok = _cli("validate-pair", "--target", str(path), "--draft", str(draft), "--json")
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["ok"] and doc["family"] == family and doc["problems"] == []
    text = _cli("validate-pair", "--target", str(path), "--draft", str(draft))
    assert text.returncode == 0 and text.stdout.startswith(f"ok: draft fits target (family {family}; hidden 64, vocab 256, target layers 4")


def test_recipe_family_must_be_the_wrappers_family(qwen3_5_targets, tmp_path):
    from dflash_worker.families import check_recipe_pair

    path, config = qwen3_5_targets["qwen3_5_moe/packed"]
    draft = _draft(tmp_path, config, num_experts=4, num_experts_per_tok=2)
    assert check_recipe_pair(path, draft, "qwen3_5_moe").family == "qwen3_5_moe"
    for wrong in ("qwen3_5", "qwen3_moe"):
        with pytest.raises(FamilyError, match=rf'recipe says `\[model\].family = "{wrong}"`.*qwen3_5_moe') as info:
            check_recipe_pair(path, draft, wrong)
        assert 'hint: set `family = "qwen3_5_moe"`' in str(info.value)


def test_taps_out_of_range_of_the_text_tower(qwen3_5_targets, tmp_path):
    path, config = qwen3_5_targets["qwen3_5"]
    draft = _draft(tmp_path, config, target_layer_ids=[1, 4])
    msg = _fails(path, draft, "target_layer_ids")
    assert "`[4]` out of range" in msg and "`4` layers" in msg
    proc = _cli("validate-pair", "--target", str(path), "--draft", str(draft), "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["problems"][0]["field"] == "target_layer_ids"
    proc = _cli("validate-pair", "--target", str(path), "--draft", str(draft))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "field `target_layer_ids`" in proc.stderr


@pytest.mark.parametrize("key", ["qwen3_5", "qwen3_5_moe/packed"])
def test_draft_geometry_mismatch_names_the_field(qwen3_5_targets, key, tmp_path):
    path, _ = qwen3_5_targets[key]
    moe = "moe" in key
    narrow = _draft(tmp_path, tiny_qwen3_5_config(moe=moe, hidden_size=32, head_dim=8), "narrow", **_moe_kw(key))
    msg = _fails(path, narrow, "hidden_size")
    assert "`32` != target hidden_size `64`" in msg
    wide_vocab = _draft(tmp_path, tiny_qwen3_5_config(moe=moe, vocab_size=300), "vocab", mask_token_id=100, **_moe_kw(key))
    msg = _fails(path, wide_vocab, "vocab_size")
    assert "`300` != target vocab_size `256`" in msg
    if moe:
        routed = _draft(tmp_path, tiny_qwen3_5_config(moe=True), "routing", num_experts=8, num_experts_per_tok=2)
        assert "target has `4`" in _fails(path, routed, "num_experts")


@pytest.mark.parametrize(
    "layout,drop",
    [
        ("individual", f"{LAYERS}.2.mlp.experts.1.down_proj.weight"),  # one routed expert
        ("packed", f"{LAYERS}.1.mlp.experts.gate_up_proj"),  # one layer's packed experts
        ("individual", f"{LAYERS}.1.mlp.shared_expert.up_proj.weight"),
        ("packed", f"{LAYERS}.3.mlp.shared_expert.down_proj.weight"),
        ("individual", f"{LAYERS}.0.mlp.shared_expert_gate.weight"),
        ("packed", f"{LAYERS}.2.mlp.shared_expert_gate.weight"),
        ("packed", f"{LAYERS}.0.mlp.gate.weight"),  # the router
    ],
)
def test_missing_moe_weights_are_named(qwen3_5_targets, tmp_path, layout, drop):
    path, config = qwen3_5_targets[f"qwen3_5_moe/{layout}"]
    assert drop in _headers(path)
    t = rewrite_target(path, tmp_path / "t", drop={drop})
    want = f"{LAYERS}.1.mlp.experts.0.gate_proj.weight" if drop.endswith("gate_up_proj") else drop
    msg = _fails(t, _draft(tmp_path, config, num_experts=4, num_experts_per_tok=2), "experts")
    assert f"`{want}`" in msg, msg
    with pytest.raises(FamilyError, match="lacks expert weights") as info:
        validate_target(t)
    assert f"`{want}`" in str(info.value)
    proc = _cli("validate-pair", "--target", str(t), "--draft", str(tmp_path / "draft"))
    assert proc.returncode == 1 and "field `experts`" in proc.stderr and want in proc.stderr


@pytest.mark.parametrize(
    "key,how,field",
    [
        ("qwen3_5", "config", "quantization_config"),
        ("qwen3_5_moe/packed", "config", "quantization_config"),
        ("qwen3_5", "int8", f"{LAYERS}.0.mlp.down_proj.weight"),
        ("qwen3_5_moe/individual", "int8", f"{LAYERS}.1.mlp.experts.2.up_proj.weight"),
        ("qwen3_5_moe/packed", "scales", f"{LAYERS}.3.self_attn.o_proj.scales"),
    ],
)
def test_quantized_wrapper_targets_are_refused(qwen3_5_targets, tmp_path, key, how, field):
    path, config = qwen3_5_targets[key]
    kw: dict = {}
    if how == "config":
        kw["config"] = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    elif how == "int8":
        shape = json.loads(_read_header_json(path, field))["shape"]
        kw["drop"] = {field}
        kw["add"] = {field: torch.zeros(shape, dtype=torch.int8)}
    else:
        kw["add"] = {field: torch.ones(64, 1, dtype=torch.bfloat16)}
    t = rewrite_target(path, tmp_path / "q", **kw)
    msg = _fails(t, _draft(tmp_path, config, **_moe_kw(key)), field)
    assert "target" in msg
    if how == "int8":
        assert "`I8`" in msg


def _read_header_json(path: Path, name: str) -> str:
    file, _, _ = _headers(path)[name]
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.dumps(json.loads(f.read(n))[name])


# --------------------------------------------------------------------------- init-draft


def _init(capsys, *args) -> dict:
    """`dflash-worker init-draft ARGS --json` in this process (the CLI's entry point, no interpreter start)."""
    from dflash_worker.cli import main

    code = main(["init-draft", *map(str, args), "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "warning" not in out.err  # the mask id is a padded row: it shadows no token
    return json.loads(out.out)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_init_draft_standard_on_tiny_targets(deep_qwen3_5_targets, family, tmp_path, capsys):
    target = deep_qwen3_5_targets[family]
    text = json.loads((target / "config.json").read_text())["text_config"]
    assert text["num_hidden_layers"] == 12 and text["layer_types"].count("full_attention") == 3
    out = tmp_path / "std"
    doc = _init(capsys, "--target", target, "--geometry", "standard", "-o", out)
    cfg = DraftConfig.from_file(out)
    assert cfg.kind == "dflash2" and cfg.block_size == 8
    if family == "qwen3_5":
        assert cfg.num_layers == 5 and cfg.layer_types == ("full_attention",) * 5 and cfg.sliding_window is None
        assert list(cfg.target_layer_ids) == default_target_layer_ids(12, 5) == [1, 3, 5, 7, 9]
    else:
        assert cfg.num_layers == 6 and cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
        assert cfg.sliding_window == 2048
        assert [cfg.layer_window(i) for i in range(6)] == [2048] * 5 + [None]
        assert list(cfg.target_layer_ids) == default_target_layer_ids(12, 8) == [1, 2, 3, 4, 6, 7, 8, 9]
    assert len(set(cfg.target_layer_ids)) == len(cfg.target_layer_ids)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 392, 4, 2, 16)
    assert cfg.num_target_layers == 12
    # the plain rotary embedding at the target's theta; its partial rotary factor stays the target's
    assert cfg.raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e6}
    assert cfg.hf_config().rope_parameters == {"rope_type": "default", "rope_theta": 5e6}
    assert cfg.mask_token_id == 384 and doc["mask_token_id"] == 384  # the first id past the tokenizer
    model = load_draft(out)
    assert model.rotary.inv_freq.shape == (16 // 2,)  # over the whole head
    assert torch.equal(model.rotary.inv_freq, 1.0 / 5e6 ** (torch.arange(0, 16, 2).float() / 16))
    validate_pair(target, out)

    tiny = tmp_path / "tiny"
    _init(capsys, "--target", target, "--geometry", "tiny", "-o", tiny)
    small = DraftConfig.from_file(tiny)
    assert (small.num_layers, small.block_size, list(small.target_layer_ids)) == (2, 4, [0, 6, 10])
    validate_pair(target, tiny)


@pytest.mark.parametrize("which", ["nested", "top_level"])
def test_init_draft_geometry_from_a_released_schema_file(deep_qwen3_5_targets, which, tmp_path, capsys):
    """A released draft's config.json as `--geometry FILE`: its layers, sliding window, block size and 8 taps
    are kept; width, vocabulary, depth and rotary come from the target."""
    target = deep_qwen3_5_targets["qwen3_5_moe"]
    raw = _released_schema(which, hidden=64, vocab=392, mask=384, n_target=12)
    geometry = tmp_path / "released.json"
    geometry.write_text(json.dumps(raw))
    out = tmp_path / "from-file"
    _init(capsys, "--target", target, "--geometry", geometry, "-o", out)
    cfg, src = DraftConfig.from_file(out), DraftConfig.from_dict(raw)
    for name in ("kind", "num_layers", "layer_types", "sliding_window", "block_size", "target_layer_ids", "intermediate_size"):
        assert getattr(cfg, name) == getattr(src, name), name
    assert cfg.block_size == 8 and len(cfg.target_layer_ids) == 8 and cfg.num_target_layers == 12
    assert cfg.hf_config().rope_parameters == {"rope_type": "default", "rope_theta": 5e6}
    validate_pair(target, out)


def _full_size_wrapper(model_type: str, text: dict) -> dict:
    """A released-style Qwen3.5 wrapper config.json: text tower under `text_config`, a vision tower."""
    arch = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}[model_type]
    n = text["num_hidden_layers"]
    return {
        "architectures": [arch],
        "model_type": model_type,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": model_type + "_text",
            "vocab_size": 248320,
            "num_hidden_layers": n,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
            "full_attention_interval": 4,
            "head_dim": 256,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "attn_output_gate": True,
            "eos_token_id": 248044,
            "dtype": "bfloat16",
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                "mrope_interleaved": True, "mrope_section": [11, 11, 10],
            },
            **text,
        },
        "vision_config": {"model_type": model_type + "_vision", "depth": 27, "hidden_size": 1152, "out_hidden_size": text["hidden_size"]},
    }


def _write_config(directory: Path, doc: dict) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(doc, indent=2))
    return directory


@pytest.mark.parametrize("text_only", [False, True])
def test_standard_geometry_of_the_full_size_targets_from_config_alone(tmp_path, text_only):
    """No weights and no tokenizer: `plan_draft` reads config.json only when the mask id is given."""
    # (with the MoE-layer fields `families` reads written out: every layer routed)
    moe_text = dict(QWEN3_6_35B_A3B, mlp_only_layers=[], decoder_sparse_step=1)
    docs = {"qwen3_5_moe": _full_size_wrapper("qwen3_5_moe", moe_text), "qwen3_5": _full_size_wrapper("qwen3_5", QWEN3_6_27B)}
    if text_only:  # the same towers as text-only configs
        docs = {k: d["text_config"] for k, d in docs.items()}
    moe = plan_draft(_write_config(tmp_path / "35b-a3b", docs["qwen3_5_moe"]), geometry="standard", mask_token_id=248077)
    dense = plan_draft(_write_config(tmp_path / "27b", docs["qwen3_5"]), geometry="standard", mask_token_id=248077)

    for plan, hidden, heads, kv in ((moe, 2048, 16, 2), (dense, 5120, 24, 4)):
        cfg = DraftConfig.from_dict(plan.config)
        assert cfg.kind == "dflash2" and cfg.block_size == 8 and cfg.mask_token_id == 248077
        assert (cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (hidden, 248320, heads, kv, 256)
        assert plan.config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000000}
        assert plan.config["max_position_embeddings"] == 262144
        assert plan.config["model_type"] == "qwen3" and plan.config["architectures"] == ["DFlash2DraftModel"]

    c27 = DraftConfig.from_dict(dense.config)
    assert c27.num_layers == 5 and c27.layer_types == ("full_attention",) * 5 and c27.sliding_window is None
    assert list(c27.target_layer_ids) == [1, 16, 31, 46, 61] and c27.num_target_layers == 64
    assert c27.intermediate_size == 17408

    c35 = DraftConfig.from_dict(moe.config)
    taps = list(c35.target_layer_ids)
    assert c35.num_layers == 6 and c35.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert c35.sliding_window == 2048 and c35.num_target_layers == 40
    assert len(taps) == 8 and taps == sorted(set(taps)) and all(0 <= t < 40 for t in taps)
    assert taps == default_target_layer_ids(40, 8) and taps[0] == 1 and taps[-1] == 37

    # DFlash (v1) on the same target keeps block 16
    v1 = plan_draft(tmp_path / "27b", geometry="standard", kind="dflash", mask_token_id=248077)
    assert DraftConfig.from_dict(v1.config).block_size == 16
    # Without a mask id a tokenizer is needed, and the error says what to pass. (transformers 5 builds an
    # empty 1-token tokenizer from config.json alone; `init-draft` used to take mask id 1 from it, a real token.)
    with pytest.raises(ConfigError, match=r"has no tokenizer .* to choose a mask token from\nhint: pass `--mask-token-id ID`"):
        plan_draft(tmp_path / "27b", geometry="standard")
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        plan_draft(tmp_path / "27b", geometry="standard", mask_token_id=248320)


# --------------------------------------------------------------------------- released draft schemas

_SELECTOR = {"selector_rank": 8, "selector_top_k": 4, "conv_kernel_size": 3, "conv_group_size": 16}


def _released_schema(which: str, *, hidden: int, vocab: int, mask: int, n_target: int, heads=4, kv=2, head_dim=16) -> dict:
    """The two released draft config layouts, at any size.

    `nested`: every draft field in `dflash_config` (block size too), `rope_parameters`,
    sliding layers with `use_sliding_window`. `top_level`: `block_size` and `mask_token_id`
    at the top level, `rope_theta` instead of `rope_parameters`, `sliding_window` only.
    """
    taps = default_target_layer_ids(n_target, 8)
    base = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": 6,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "sliding_window": 2048,
        "num_target_layers": n_target,
        "tie_word_embeddings": False,
    }
    if which == "nested":
        return {
            **base,
            "use_sliding_window": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
            "dflash_config": {"target_layer_ids": taps, "block_size": 8, "mask_token_id": mask, **_SELECTOR},
        }
    return {
        **base,
        "rope_theta": 10000000.0,
        "block_size": 8,
        "mask_token_id": mask,
        "dflash_config": {"target_layer_ids": taps, **_SELECTOR},
    }


@pytest.mark.parametrize("which", ["nested", "top_level"])
def test_released_draft_schemas_parse_at_full_size(which):
    raw = _released_schema(which, hidden=2048, vocab=248320, mask=248077, n_target=40, heads=32, kv=4, head_dim=128)
    cfg = DraftConfig.from_dict(raw, source=which)
    assert cfg.kind == "dflash2" and cfg.block_size == 8 and cfg.mask_token_id == 248077
    assert cfg.num_layers == 6 and len(cfg.target_layer_ids) == 8 and cfg.context_width == 8 * 2048
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert cfg.hf_config().rope_parameters == {"rope_type": "default", "rope_theta": 10000000.0}
    assert cfg.num_target_layers == 40
    # the mask id lies in the padded rows (248077 < 248320); one past the vocabulary is refused
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        DraftConfig.from_dict(_released_schema(which, hidden=2048, vocab=248320, mask=248320, n_target=40, heads=32, kv=4, head_dim=128))
    # a tap past the target is refused
    bad = _released_schema(which, hidden=2048, vocab=248320, mask=248077, n_target=40, heads=32, kv=4, head_dim=128)
    bad["dflash_config"]["target_layer_ids"] = [*bad["dflash_config"]["target_layer_ids"][:-1], 40]
    with pytest.raises(ConfigError, match="`target_layer_ids` entry `40` is out of range"):
        DraftConfig.from_dict(bad)


@pytest.mark.parametrize("which", ["nested", "top_level"])
def test_released_draft_schemas_build_and_mean_what_the_reference_reads(which, tmp_path):
    ref_model = pytest.importorskip("dflash.model", reason="upstream reference `dflash==0.1.0` is not installed")
    from transformers import Qwen3Config

    # tokenizer of 384 tokens, vocabulary padded to 392: the mask id is a padded row
    raw = _released_schema(which, hidden=64, vocab=392, mask=384, n_target=12)
    cfg = DraftConfig.from_dict(raw, source=which)
    model = build_draft(cfg, seed=0)
    assert model.fc.weight.shape == (64, 8 * 64)
    assert model.candidate_selector is not None

    ref = ref_model.DFlash2DraftModel(Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}))
    assert ref.block_size == model.block_size == 8
    assert ref.mask_token_id == model.mask_token_id == 384
    assert list(ref.target_layer_ids) == model.target_layer_ids == default_target_layer_ids(12, 8)
    for ours, theirs in zip(model.layers, ref.layers, strict=True):
        assert ours.self_attn.is_causal == theirs.self_attn.is_causal
        assert ours.self_attn.window == theirs.self_attn.sliding_window
    # the nested schema's window reaches the sliding layers; transformers' Qwen3Config drops a window
    # without `use_sliding_window`, for the reference as for us
    want = 2048 if which == "nested" else None
    assert [layer.self_attn.window for layer in model.layers] == [want] * 5 + [None]
    assert [layer.self_attn.is_causal for layer in model.layers] == [True] * 5 + [False]
    assert torch.equal(model.rotary.inv_freq, ref.rotary_emb.inv_freq.float())
    # saved and loaded back: the same geometry and every tensor
    from dflash_worker.model import save_draft

    out = save_draft(model, tmp_path / which)
    back = load_draft(out)
    assert back.config == cfg
    for (n, a), (m, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n
