"""`export.commit.commit_dir`, the commit step both export formats share: the old export survives
a failure at any point (while writing, at the final rename), nothing partial or temporary stays."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dflash_worker.errors import ExportError
from dflash_worker.export import commit as commit_mod
from dflash_worker.export.af4g64 import write_af4g64
from dflash_worker.export.bf16 import write_bf16
from dflash_worker.export.commit import commit_dir, write_file
from dflash_worker.weights import write as write_mod


def _tree(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _fill(files: dict[str, bytes], fail_after: int | None = None):
    def fill(tmp: Path) -> str:
        for i, (name, data) in enumerate(files.items()):
            if i == fail_after:
                raise OSError("injected disk failure")
            write_file(tmp / name, data)
        return "done"

    return fill


def test_commit_writes_a_new_directory_and_returns_what_fill_returned(tmp_path):
    out = tmp_path / "sub" / "e"
    assert commit_dir(out, _fill({"a": b"1", "b": b"2"}), overwrite=False) == "done"
    assert _tree(out) == {"a": b"1", "b": b"2"} and _hidden(out.parent) == []


def test_commit_replaces_an_existing_directory_only_with_overwrite(tmp_path):
    out = tmp_path / "e"
    commit_dir(out, _fill({"a": b"old"}), overwrite=False)
    with pytest.raises(ExportError, match="appeared while exporting"):
        commit_dir(out, _fill({"a": b"new"}), overwrite=False)
    assert _tree(out) == {"a": b"old"} and _hidden(tmp_path) == []
    commit_dir(out, _fill({"b": b"new"}), overwrite=True)
    assert _tree(out) == {"b": b"new"} and _hidden(tmp_path) == []


@pytest.mark.parametrize("existing", [True, False])
def test_a_failing_fill_leaves_the_old_directory_or_none(tmp_path, existing):
    out = tmp_path / "e"
    if existing:
        commit_dir(out, _fill({"a": b"old"}), overwrite=False)
    with pytest.raises(OSError, match="injected"):
        commit_dir(out, _fill({"a": b"new", "b": b"new"}, fail_after=1), overwrite=True)
    assert (_tree(out) == {"a": b"old"}) if existing else not out.exists()
    assert _hidden(tmp_path) == []


def test_a_failing_final_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    out = tmp_path / "e"
    commit_dir(out, _fill({"a": b"old"}), overwrite=False)
    real = os.replace

    def flaky(src, dst):
        if Path(src).name.startswith(".e.tmp-"):
            raise OSError("rename failed")
        return real(src, dst)

    monkeypatch.setattr(commit_mod.os, "replace", flaky)
    with pytest.raises(OSError, match="rename failed"):
        commit_dir(out, _fill({"a": b"new"}), overwrite=True)
    monkeypatch.undo()
    assert _tree(out) == {"a": b"old"} and _hidden(tmp_path) == []


# Both formats commit through `commit_dir`: the same failures leave the same guarantees.


def _write_bf16(pipeline):
    from dflash_worker.model import load_draft

    model = load_draft(pipeline.draft, dtype=torch.float32)

    def write(out: Path, seed: int, **kw):
        values = {n: (p.detach() + seed * 0.01).to(torch.bfloat16) for n, p in model.named_parameters()}
        write_bf16(pipeline.draft, values, out, **kw)

    return write


def _write_af4g64(_pipeline):
    def write(out: Path, seed: int, **kw):
        named = {"fc.weight": torch.full((4, 64), float(seed)), "norm.weight": torch.ones(64), "b.weight": torch.ones(3, 2)}
        write_af4g64(named, {"model_type": "test"}, out, ["fc.weight"], **kw)

    return write


def _fail_midway_through_the_weights(monkeypatch):
    """`write_safetensors` fails after part of the file is on disk (the exports import it on each call)."""
    real = write_mod.write_safetensors

    def failing(path, tensors, metadata=None):
        def parts():
            yield b"\x00" * 8
            raise OSError("injected disk failure")

        items = list(tensors.items())
        half = dict(items[: len(items) // 2]) | {"zz.boom": write_mod.RawTensor("U8", (16,), parts())}
        real(path, half, metadata)

    monkeypatch.setattr(write_mod, "write_safetensors", failing)


def _fail_at_the_final_rename(monkeypatch, out: Path):
    real = os.replace

    def flaky(src, dst):
        if Path(src).name.startswith(f".{out.name}.tmp-"):
            raise OSError("rename failed")
        return real(src, dst)

    monkeypatch.setattr(commit_mod.os, "replace", flaky)


@pytest.mark.parametrize("fmt", [_write_bf16, _write_af4g64], ids=["bf16", "af4g64"])
@pytest.mark.parametrize("when", ["midway", "rename"])
def test_the_old_export_survives_a_failed_overwrite_in_both_formats(pipeline, tmp_path, monkeypatch, fmt, when):
    write = fmt(pipeline)
    out = tmp_path / "export"
    write(out, 1)
    before = _tree(out)
    if when == "midway":
        _fail_midway_through_the_weights(monkeypatch)
    else:
        _fail_at_the_final_rename(monkeypatch, out)
    with pytest.raises(OSError, match="injected|rename failed"):
        write(out, 2, overwrite=True)
    monkeypatch.undo()
    assert _tree(out) == before and _hidden(tmp_path) == []
    write(out, 2, overwrite=True)  # and a later export still replaces it
    assert _tree(out) != before and _hidden(tmp_path) == []
