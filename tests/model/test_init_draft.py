"""`dflash-worker init-draft`: fresh drafts by documented rules, checked against the target, refused cleanly."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from prewarmed import worker_cli

from dflash_worker.families import validate_pair
from dflash_worker.model import DraftConfig, default_target_layer_ids, load_draft
from dflash_worker.testing.tokenizer import save_tiny_target_with_tokenizer
from dflash_worker.testing.world import build_world


def _cli(*args, cwd=None):
    return worker_cli("init-draft", *args, timeout=300, cwd=cwd, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def _in_process(capsys, *args):
    """The same command in this process (no interpreter start): exit code and stderr."""
    from dflash_worker.cli import main

    code = main(["init-draft", *map(str, args)])
    return code, capsys.readouterr().err


def _ok(*args):
    proc = _cli(*args)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("world"))


@pytest.fixture(scope="module")
def roomy_target(tmp_path_factory):
    """A dense target of 10 layers whose vocabulary has 8 rows the tokenizer never produces."""
    path = tmp_path_factory.mktemp("roomy") / "target"
    _, tok = save_tiny_target_with_tokenizer(path, vocab_size=392, num_hidden_layers=10)
    assert len(tok) == 384
    return path


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    """The world's vocabulary and width, 10 layers."""
    path = tmp_path_factory.mktemp("deep") / "target"
    save_tiny_target_with_tokenizer(path, num_hidden_layers=10)
    return path


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_geometry_reproduces_the_test_worlds_draft_byte_for_byte(world, tmp_path):
    # The world's draft is built by `testing.tiny_draft` with seed 0: the CLI's `tiny` rules are the same rules.
    out = tmp_path / "v2"
    proc = _ok("--target", world.target, "--geometry", "tiny", "-o", out)
    assert proc.stdout.startswith(f"initialised a dflash2 draft in `{out}`: 2 layers, block_size 4, target_layer_ids [0, 2]")
    assert _sha(out / "model.safetensors") == _sha(world.draft / "model.safetensors")
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (out, world.draft))
    assert ours == theirs
    # the tokenizer fills the vocabulary, so the mask token shadows a real one: said on stderr
    assert "shadows the real token" in proc.stderr and "--mask-token-id" in proc.stderr


def test_dflash_v1_has_no_selector_and_fits_the_target(world, tmp_path):
    out = tmp_path / "v1"
    proc = _ok("--target", world.target, "--geometry", "tiny", "--kind", "dflash", "-o", out, "--json")
    doc = json.loads(proc.stdout)
    assert doc["kind"] == "dflash" and doc["config"]["architectures"] == ["DFlashDraftModel"]
    for name in ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size"):
        assert name not in doc["config"]["dflash_config"]
    assert doc["files"] == {p.name: _sha(p) for p in out.iterdir()}
    model = load_draft(out)
    assert model.kind == "dflash" and model.candidate_selector is None
    assert not any("_conv." in n for n, _ in model.named_parameters())
    assert doc["parameters"] == sum(p.numel() for p in model.parameters())
    validate_pair(world.target, out)


def test_standard_geometry_rules(roomy_target, tmp_path):
    out = tmp_path / "std"
    proc = _ok("--target", roomy_target, "-o", out, "--json")
    cfg = DraftConfig.from_file(out)
    target = json.loads((roomy_target / "config.json").read_text())
    assert cfg.kind == "dflash2" and cfg.num_layers == 5 and cfg.block_size == 16
    assert list(cfg.target_layer_ids) == default_target_layer_ids(10, 5) == [1, 2, 4, 6, 7]
    assert cfg.layer_types == ("full_attention",) * 5
    assert cfg.intermediate_size == target["intermediate_size"]
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads) == (
        target["hidden_size"], target["vocab_size"], target["num_attention_heads"], target["num_key_value_heads"])
    assert cfg.raw["rope_parameters"] == target["rope_parameters"]
    assert (cfg.selector_rank, cfg.selector_top_k, cfg.conv_kernel_size, cfg.conv_group_size) == (64, 16, 4, 64)
    # 392 vocabulary rows, 384 tokens: the first id the tokenizer never produces, and no warning
    assert cfg.mask_token_id == 384 and "warning" not in proc.stderr
    assert "mask_token_id 384: the first id the tokenizer never produces" in " ".join(json.loads(proc.stdout)["notes"])
    validate_pair(roomy_target, out)


def test_explicit_fields_win(roomy_target, tmp_path):
    out = tmp_path / "explicit"
    _ok("--target", roomy_target, "-o", out, "--layers", "3", "--block-size", "8", "--target-layer-ids", "2,5,8",
        "--mask-token-id", "7", "--seed", "3", "--dtype", "float32")
    cfg = DraftConfig.from_file(out)
    assert (cfg.num_layers, cfg.block_size, list(cfg.target_layer_ids), cfg.mask_token_id) == (3, 8, [2, 5, 8], 7)
    assert cfg.raw["dtype"] == "float32"
    other = tmp_path / "seed4"
    _ok("--target", roomy_target, "-o", other, "--layers", "3", "--block-size", "8", "--target-layer-ids", "2,5,8",
        "--mask-token-id", "7", "--seed", "4", "--dtype", "float32")
    assert _sha(out / "model.safetensors") != _sha(other / "model.safetensors")


def test_geometry_from_a_draft_config(world, deep_target, roomy_target, tmp_path):
    # the world's draft config as FILE: same layers and fields, re-targeted at a 10-layer target
    out = tmp_path / "like"
    _ok("--target", deep_target, "--geometry", world.draft / "config.json", "-o", out)
    src, got = DraftConfig.from_file(world.draft), DraftConfig.from_file(out)
    for name in ("kind", "num_layers", "layer_types", "sliding_window", "intermediate_size", "block_size",
                 "target_layer_ids", "selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size"):
        assert getattr(got, name) == getattr(src, name), name
    assert got.num_target_layers == 10
    # and as a v1 draft
    v1 = tmp_path / "like-v1"
    _ok("--target", deep_target, "--geometry", world.draft, "--kind", "dflash", "-o", v1)
    assert DraftConfig.from_file(v1).kind == "dflash"
    # a geometry of another vocabulary cannot attach: the selector's codebooks are vocabulary-wide
    proc = _cli("--target", roomy_target, "--geometry", world.draft, "-o", tmp_path / "other-vocab")
    assert proc.returncode == 1 and "`vocab_size` is `384` but the target's is `392`" in proc.stderr


def test_refusals_name_the_problem_and_write_nothing(world, roomy_target, tmp_path, capsys):
    cases = [
        (("--geometry", "huge"), "geometry `huge` is neither a built-in geometry nor an existing file"),
        (("--target-layer-ids", "0,9"), "`target_layer_ids` entry `9` is out of range"),
        (("--target-layer-ids", "one"), "`--target-layer-ids` is `one`"),
        (("--mask-token-id", "384"), "`mask_token_id` `384` is outside the vocabulary"),
        (("--block-size", "1"), "`block_size` must be an integer >= 2"),
        (("--layers", "0"), "`--layers` must be a positive integer"),
        (("--geometry", world.draft, "--layers", "3"), "contradicts geometry"),
    ]
    for extra, message in cases:
        out = tmp_path / "refused"
        code, err = _in_process(capsys, "--target", world.target, "-o", out, *extra)
        assert code == 1 and err.startswith("error: ") and message in err, (extra, err)
        assert not out.exists(), extra
    # a geometry of another width cannot attach to this target
    (tmp_path / "wide").mkdir()
    cfg = json.loads((world.draft / "config.json").read_text())
    cfg["hidden_size"] = 128
    (tmp_path / "wide" / "config.json").write_text(json.dumps(cfg))
    code, err = _in_process(capsys, "--target", world.target, "-o", tmp_path / "x", "--geometry", tmp_path / "wide")
    assert code == 1 and "`hidden_size` is `128` but the target's is `64`" in err
    # a v1 geometry cannot make a DFlash2 draft
    v1 = tmp_path / "v1"
    assert _in_process(capsys, "--target", world.target, "--geometry", "tiny", "--kind", "dflash", "-o", v1)[0] == 0
    code, err = _in_process(capsys, "--target", world.target, "-o", tmp_path / "y", "--geometry", v1, "--kind", "dflash2")
    assert code == 1 and "has no DFlash2 selector and convolution fields" in err
    # no target there: one clean error from a fresh interpreter, no traceback
    proc = _cli("--target", tmp_path / "nope", "-o", tmp_path / "z")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "config.json" in proc.stderr


def test_an_existing_draft_is_kept_unless_overwrite(world, tmp_path):
    out = tmp_path / "keep"
    _ok("--target", world.target, "--geometry", "tiny", "-o", out)
    before = {p.name: _sha(p) for p in out.iterdir()}
    proc = _cli("--target", world.target, "--geometry", "tiny", "--kind", "dflash", "-o", out)
    assert proc.returncode == 1 and "already exists and is not empty" in proc.stderr and "--overwrite" in proc.stderr
    assert {p.name: _sha(p) for p in out.iterdir()} == before
    _ok("--target", world.target, "--geometry", "tiny", "--kind", "dflash", "-o", out, "--overwrite")
    assert DraftConfig.from_file(out).kind == "dflash"


def test_help_explains_every_flag():
    proc = _cli("--help")
    assert proc.returncode == 0
    for flag in ("--target", "--geometry", "--kind", "--output", "--layers", "--block-size", "--target-layer-ids",
                 "--mask-token-id", "--seed", "--dtype", "--overwrite", "--json", "standard", "tiny"):
        assert flag in proc.stdout, flag
