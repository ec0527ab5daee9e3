"""`dflash-worker inspect-checkpoint`: real subprocesses for bad files (one clear error, exit 1,
no traceback), in-process runs for the rest."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from prewarmed import worker_cli
from safetensors.torch import save_file

from dflash_worker.cli import main

from .conftest import write_raw


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return worker_cli(*args, env=env, timeout=120)


def assert_clean_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: "), proc.stderr
    assert proc.stderr.count("error: ") == 1, proc.stderr
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)


def _good(tmp_path):
    p = tmp_path / "good.safetensors"
    save_file({"w": torch.ones(4, 4), "b": torch.zeros(4)}, str(p))
    return p


def test_truncated_file_subprocess(tmp_path):
    p = _good(tmp_path)
    p.write_bytes(p.read_bytes()[:-5])
    assert_clean_error(run_cli("inspect-checkpoint", str(p)), str(p), "tensor `w`", "past the end")


def test_header_length_past_eof_subprocess(tmp_path):
    p = write_raw(tmp_path / "len.safetensors", {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, length=1 << 40)
    assert_clean_error(run_cli("inspect-checkpoint", str(p)), str(p), "exceeds")
    p = write_raw(tmp_path / "len2.safetensors", {}, b"", length=500)
    assert_clean_error(run_cli("inspect-checkpoint", str(p)), str(p), "past the end of the file")


def test_invalid_utf8_and_overlap_subprocess(tmp_path):
    p = write_raw(tmp_path / "utf.safetensors", b'{"\xc3\x28": 1}')
    assert_clean_error(run_cli("inspect-checkpoint", str(p), "--json"), str(p), "UTF-8")
    e = lambda b, e_: {"dtype": "F32", "shape": [2], "data_offsets": [b, e_]}  # noqa: E731
    p = write_raw(tmp_path / "ov.safetensors", {"a": e(0, 8), "b": e(4, 12)}, b"\0" * 12)
    assert_clean_error(run_cli("inspect-checkpoint", str(p)), str(p), "tensor `b`", "overlap")


def test_index_missing_shard_subprocess(tiny_target, tmp_path):
    path, _ = tiny_target("qwen3", "float32", False)
    bad = tmp_path / "ck"
    shutil.copytree(path, bad)
    victim = sorted(bad.glob("*.safetensors"))[2]
    victim.unlink()
    assert_clean_error(run_cli("inspect-checkpoint", str(bad)), "model.safetensors.index.json", victim.name)


def test_shape_mismatch_against_model_subprocess(tiny_target, tmp_path):
    path, _ = tiny_target("qwen3", "float32", False)
    bad = tmp_path / "ck"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    proc = run_cli("inspect-checkpoint", str(bad))
    assert_clean_error(proc, "shape mismatch", ".safetensors`, tensor `model.layers.")
    # expected (from config.json) and found (from the header), in either orientation
    assert re.search(r"expects `\[(96, 64|64, 96)\]`", proc.stderr), proc.stderr
    assert re.search(r"has `\[(128, 64|64, 128)\]`", proc.stderr), proc.stderr


@pytest.mark.parametrize(
    "case,words",
    [
        ("unknown dtype", ["unknown dtype `Q4`", "tensor `w`"]),
        ("byte count", ["byte count", "tensor `w`"]),
        ("duplicate", ["duplicate key `w`"]),
        ("invalid json", ["not valid JSON"]),
        ("out of range", ["past the end", "tensor `w`"]),
    ],
)
def test_bad_headers_in_process(tmp_path, capsys, case, words):
    e = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    header = {
        "unknown dtype": {"w": {**e, "dtype": "Q4"}},
        "byte count": {"w": {**e, "shape": [3]}},
        "duplicate": f'{{"w": {json.dumps(e)}, "w": {json.dumps(e)}}}',
        "invalid json": '{"w": ',
        "out of range": {"w": {**e, "data_offsets": [0, 8]}},
    }[case]
    data = b"\0" * (4 if case == "out of range" else 8)
    p = write_raw(tmp_path / "x.safetensors", header, data)
    assert main(["inspect-checkpoint", str(p)]) == 1
    err = capsys.readouterr().err
    assert str(p) in err
    for w in words:
        assert w in err, (w, err)


def test_missing_and_unexpected_keys_in_process(tiny_target, tmp_path, capsys):
    path, _ = tiny_target("qwen3", "bfloat16", False)
    bad = tmp_path / "ck"
    bad.mkdir()
    shutil.copy(path / "config.json", bad / "config.json")
    from safetensors import safe_open

    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    tensors.pop("model.norm.weight")
    tensors["model.bogus.weight"] = torch.ones(2)
    save_file(tensors, str(bad / "model.safetensors"))
    assert main(["inspect-checkpoint", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "missing keys (1): `model.norm.weight`" in err
    assert "unexpected keys (1): `model.bogus.weight`" in err


def test_good_target_json(tiny_target, capsys):
    path, _ = tiny_target("qwen3_moe", "bfloat16", False)
    assert main(["inspect-checkpoint", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["family"] == "qwen3_moe" and doc["kind"] == "target" and doc["verdict"] == "ok"
    assert doc["num_tensors"] == len(doc["tensors"]) > 50
    assert doc["total_bytes"] == sum(t["bytes"] for t in doc["tensors"])
    assert len(doc["files"]) > 3


def test_good_text_and_headers_only_file(tmp_path, capsys):
    p = _good(tmp_path)
    assert main(["inspect-checkpoint", str(p)]) == 0
    out = capsys.readouterr().out
    assert "verdict: ok" in out and "no config.json" in out and "F32" in out


def test_inspect_does_not_import_torch_for_drafts_and_files(tmp_path):
    p = _good(tmp_path)
    code = (
        f"import sys; from dflash_worker.cli import main; rc = main(['inspect-checkpoint', {str(p)!r}]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_help_explains_flags():
    proc = run_cli("inspect-checkpoint", "--help")
    assert proc.returncode == 0
    for flag in ("--json", "--no-model-check", "PATH"):
        assert flag in proc.stdout


def test_single_shard_of_sharded_checkpoint(tiny_target, capsys):
    path, _ = tiny_target("qwen3", "float32", False)
    shard = sorted(path.glob("*.safetensors"))[1]
    assert main(["inspect-checkpoint", str(shard), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "shard" and doc["verdict"] == "ok" and doc["files"] == [str(shard)]


def test_qwen3_5_wrapper_target_reports_skipped_tensors(tmp_path, capsys):
    """A multimodal Qwen3.5 checkpoint checks against its text tower; the vision tower and MTP
    tensors are reported as skipped with their exact byte total (from the headers)."""
    from dflash_worker.testing.tiny import save_tiny_target
    from dflash_worker.weights import list_tensors

    target = tmp_path / "q35moe"
    save_tiny_target(target, family="qwen3_5_moe", dtype="bfloat16")
    entries = list_tensors(target)
    outside = {n: t.nbytes for n, t in entries.items() if n.startswith(("model.visual.", "mtp."))}
    assert any(n.startswith("mtp.") for n in outside) and any(n.startswith("model.visual.") for n in outside)
    assert main(["inspect-checkpoint", str(target), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["family"] == "qwen3_5_moe" and doc["verdict"] == "ok"
    assert sorted(doc["skipped"]) == sorted(outside) and doc["skipped_bytes"] == sum(outside.values())
    assert main(["inspect-checkpoint", str(target)]) == 0
    text = capsys.readouterr().out
    assert f"skips {len(outside)} tensors unread ({sum(outside.values())} bytes" in text
