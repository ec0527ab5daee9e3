"""Header contract of the full-size Qwen3.5 targets (issue 33, item 7), without their weights.

Qwen3.6-35B-A3B and the dense Qwen3.6-27B are built from their public config values as
transformers' multimodal wrappers on the meta device. Their state dicts (experts written per
expert, as `save_pretrained` does, or packed) plus the `mtp.*` heads a release carries are
written as real safetensors files whose headers describe every tensor at its offset and whose
data regions are sparse holes (header written, file truncated to its full size: no disk used).
`check_model_checkpoint` (the real header parser and planner) and `families.validate_target`
then run on them, reading no tensor data: nothing is missing or mismatched, and exactly the
vision tower and the MTP heads are skipped.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dflash_worker.errors import CheckpointError, FamilyError  # noqa: E402
from dflash_worker.families import validate_target  # noqa: E402
from dflash_worker.testing.full_size import QWEN3_6_27B, QWEN3_6_35B_A3B  # noqa: E402
from dflash_worker.weights import check_model_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow  # ~30 s for the module on a 2-core CPU, most of it the 35B-A3B headers

TARGETS = {
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", QWEN3_6_35B_A3B),
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", QWEN3_6_27B),
}
SHARD_BYTES = 5 * 2**30  # about what released shards hold
TEXT = "model.language_model."
SKIPPED = ("model.visual.", "mtp.")
_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def wrapper_config(family: str):
    config_cls, model_cls, text = TARGETS[family]
    config = getattr(transformers, config_cls)(text_config=dict(text, dtype="bfloat16"), tie_word_embeddings=False)
    config.architectures = [model_cls]
    config.dtype = "bfloat16"
    return config


def _per_expert(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Packed experts (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) as `save_pretrained` writes them."""
    if name.endswith(".experts.gate_up_proj"):
        base, (n, two_i, h) = name[: -len(".gate_up_proj")], shape
        return {f"{base}.{e}.{p}.weight": (two_i // 2, h) for e in range(n) for p in ("gate_proj", "up_proj")}
    if name.endswith(".experts.down_proj"):
        base, (n, h, i) = name[: -len(".down_proj")], shape
        return {f"{base}.{e}.down_proj.weight": (h, i) for e in range(n)}
    return {name: shape}


@functools.cache
def release_layout(family: str, experts: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the checkpoint a release holds: the wrapper's state dict on the meta
    device (experts `individual` or `packed`), then the MTP heads (one full-attention layer's worth)."""
    config = wrapper_config(family)
    with torch.device("meta"):
        model = getattr(transformers, TARGETS[family][1])._from_config(config, dtype=torch.bfloat16)
    sd = model.state_dict()
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    layout: dict[str, tuple[int, ...]] = {}
    for name, t in sd.items():
        layout.update(_per_expert(name, tuple(t.shape)) if experts == "individual" else {name: tuple(t.shape)})
    text = config.text_config
    h = text.hidden_size
    full = f"{TEXT}layers.{text.layer_types.index('full_attention')}."
    layout.update(
        {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
        }
    )
    layout.update({"mtp.layers.0." + k[len(full) :]: s for k, s in list(layout.items()) if k.startswith(full)})
    return layout


@functools.cache
def text_model_shapes(family: str) -> dict[str, tuple[int, ...]]:
    """What the loader fills: the text-only model transformers gives for the wrapper, on meta."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(wrapper_config(family).text_config, dtype=torch.bfloat16)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _nbytes(shape: tuple[int, ...]) -> int:
    return 2 * int(torch.Size(shape).numel())


def write_sparse_checkpoint(path: Path, family: str, layout: dict[str, tuple[int, ...]]) -> list[Path]:
    """config.json, index and BF16 safetensors shards whose headers describe `layout` and whose data
    regions are holes (the file is truncated to its full size, nothing written). Returns the shards."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in layout.items():
        if groups[-1] and size + _nbytes(shape) > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += _nbytes(shape)
    path.mkdir(parents=True)
    shards, weight_map = [], {}
    for i, names in enumerate(groups):
        shard = path / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            n = _nbytes(layout[name])
            header[name] = {"dtype": "BF16", "shape": list(layout[name]), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = shard.name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(shard, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
        os.truncate(shard, 8 + len(raw) + offset)
        shards.append(shard)
    total = sum(_nbytes(s) for s in layout.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    wrapper_config(family).save_pretrained(str(path))
    return shards


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    """A directory whose file system keeps truncated files sparse (else these tests would write ~120 GB)."""
    root = tmp_path_factory.mktemp("full-size")
    probe = root / "probe"
    probe.write_bytes(b"x")
    os.truncate(probe, 2**30)
    allocated = os.stat(probe).st_blocks * 512
    probe.unlink()
    if allocated > 2**20:
        pytest.skip(f"`{root}` does not keep files sparse (a 1 GiB hole took `{allocated}` bytes)")
    return root


def _checkpoint(sparse_dir: Path, family: str, experts: str, layout=None) -> Path:
    layout = release_layout(family, experts) if layout is None else layout
    path = sparse_dir / f"{family}-{experts}-{len(os.listdir(sparse_dir))}"
    shards = write_sparse_checkpoint(path, family, layout)
    size = sum(s.stat().st_size for s in shards)
    allocated = sum(os.stat(s).st_blocks * 512 for s in shards)
    assert size > sum(_nbytes(s) for s in layout.values()) > 50 * 10**9  # full size on paper ...
    assert allocated < 64 * 2**20, allocated  # ... headers on disk only
    return path


def _expected_shape(name: str, text: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape the text model expects for checkpoint tensor `name` (a per-expert tensor: its slice)."""
    mapped = "model." + name[len(TEXT) :] if name.startswith(TEXT) else name
    if mapped in text:
        return text[mapped]
    m = _EXPERT.match(mapped)
    assert m, name
    if m["proj"] == "down_proj":
        return text[f"{m['base']}.down_proj"][1:]
    n, two_i, h = text[f"{m['base']}.gate_up_proj"]
    return (two_i // 2, h)


@pytest.mark.parametrize(
    "family, experts",
    [("qwen3_5_moe", "individual"), ("qwen3_5_moe", "packed"), ("qwen3_5", "individual")],
    ids=["35b-a3b-per-expert", "35b-a3b-packed", "27b-dense"],
)
def test_full_size_header_contract(sparse_dir, family, experts):
    layout = release_layout(family, experts)
    path = _checkpoint(sparse_dir, family, experts)
    text = text_model_shapes(family)

    report = check_model_checkpoint(path)

    assert report.missing == [] and report.unexpected == [] and report.tied == []
    assert report.bytes_read == 0  # headers only
    assert sorted(report.loaded) == sorted(text)  # every parameter of the text model is filled
    skipped = [n for n in layout if n.startswith(SKIPPED)]
    assert sorted(report.skipped) == sorted(skipped)
    assert any(n.startswith("model.visual.") for n in skipped) and any(n.startswith("mtp.layers.0.") for n in skipped)
    assert report.bytes_skipped == sum(_nbytes(layout[n]) for n in skipped)
    for name, shape in layout.items():
        if not name.startswith(SKIPPED):
            assert shape == _expected_shape(name, text), name

    target = validate_target(path)
    assert target.family == family
    assert (target.hidden_size, target.num_hidden_layers, target.vocab_size) == (
        TARGETS[family][2]["hidden_size"],
        TARGETS[family][2]["num_hidden_layers"],
        248320,
    )
    if family == "qwen3_5_moe":
        assert (target.num_experts, target.num_experts_per_tok) == (256, 8)
        assert target.expert_storage == {"individual": "per-expert", "packed": "packed"}[experts]
    else:
        assert target.num_experts is None and target.expert_storage is None
    assert (target.tensors, target.skipped_tensors) == (len(layout) - len(skipped), len(skipped))
    assert target.skipped_bytes == report.bytes_skipped
    assert target.bytes == sum(_nbytes(s) for n, s in layout.items() if not n.startswith(SKIPPED))


def test_full_size_missing_expert_is_named(sparse_dir):
    layout = dict(release_layout("qwen3_5_moe", "individual"))
    del layout[f"{TEXT}layers.17.mlp.experts.200.up_proj.weight"]
    path = _checkpoint(sparse_dir, "qwen3_5_moe", "individual", layout)

    with pytest.raises(CheckpointError, match=r"missing keys \(1\): `model\.layers\.17\.mlp\.experts\.200\.up_proj\.weight`"):
        check_model_checkpoint(path)
    with pytest.raises(FamilyError, match=r"lacks expert weights: `model\.language_model\.layers\.17\.mlp\.experts\.200\.up_proj\.weight`"):
        validate_target(path)


@pytest.mark.parametrize(
    "family, name",
    [
        ("qwen3_5_moe", f"{TEXT}layers.38.mlp.experts.255.down_proj.weight"),
        ("qwen3_5", f"{TEXT}layers.61.linear_attn.in_proj_qkv.weight"),
    ],
    ids=["35b-a3b-expert", "27b-linear-attention"],
)
def test_full_size_shape_mismatch_is_named(sparse_dir, family, name):
    layout = dict(release_layout(family, "individual"))
    good = layout[name]
    bad = (good[0] - 1, *good[1:])
    layout[name] = bad
    path = _checkpoint(sparse_dir, family, "individual", layout)

    with pytest.raises(CheckpointError) as exc:
        check_model_checkpoint(path)
    msg = str(exc.value)
    assert f"tensor `{name}`: shape mismatch" in msg
    assert f"expects `{list(good)}`" in msg and f"has `{list(bad)}`" in msg
