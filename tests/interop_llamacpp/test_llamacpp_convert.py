"""llama.cpp's own converter turns the project's exports into GGUF with the project's values and tensors.

Runs with `make interop-llamacpp` (scripts/interop-llamacpp.sh), which unpacks llama.cpp from the
llama-cpp-python 0.3.36 sdist, builds its environment and passes it as `DFLASH_LLAMACPP_PYTHON` /
`DFLASH_LLAMACPP_DIR`; the main suite leaves this folder out. The exports are made here, in the project's
environment, by `dflash-worker train` and `dflash-worker export` (tests/interop_sglang/exports.py); the
converter (`convert.py`: llama.cpp's `convert_hf_to_gguf.py`, with the tiny tokenizer's pre-tokenizer named)
and the GGUF reader (`gguf_read.py`: llama.cpp's gguf-py) run in llama.cpp's environment.

Checked: the GGUF's DFlash keys hold the project's block size, taps (llama.cpp stores layer i's output as
i + 1), mask token id, convolution and selector settings, sliding window and its layer pattern and the
geometry; every exported tensor is in the GGUF under llama.cpp's own name for it, bit for bit. A renamed
tensor is refused by the converter; a changed tensor is caught by the comparison. Running the GGUF needs
llama.cpp built (`llama-speculative-simple`, by the script within its time limit; the run tests skip with
how far the build got until it is done): the v1 draft runs with `--spec-type draft-dflash` and writes the
target's own greedy continuation; the tiny DFlash2 draft is refused by llama.cpp's DFlash2 loader.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop_sglang"))

from exports import build_export  # noqa: E402

from dflash_worker.model.config import DraftConfig  # noqa: E402

HERE = Path(__file__).resolve().parent


def _env(name: str) -> Path:
    value = os.environ.get(name)
    if not value or not Path(value).exists():
        raise AssertionError(
            f"`{name}` is `{value}`, not a path of llama.cpp's environment\n"
            "hint: run these tests with `make interop-llamacpp` (scripts/interop-llamacpp.sh builds it)"
        )
    return Path(value)


def llamacpp(script: str, *args, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """`script` (convert.py, gguf_read.py or a `-c` snippet) run by llama.cpp's environment's interpreter."""
    cmd = [str(_env("DFLASH_LLAMACPP_PYTHON")), *([str(HERE / script)] if script != "-c" else ["-c"]), *map(str, args)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    if check and res.returncode != 0:
        raise AssertionError(f"`{' '.join(cmd[1:3])}` exited {res.returncode}:\n{res.stderr[-4000:]}")
    return res


def convert(export: Path, target: Path, out: Path, *, check: bool = True) -> subprocess.CompletedProcess:
    llama_cpp = _env("DFLASH_LLAMACPP_DIR")
    return llamacpp("convert.py", llama_cpp, export, "--target-model-dir", target, "--outfile", out, "--outtype", "bf16",
                    check=check)


def read_gguf(gguf: Path, export: Path) -> dict:
    res = llamacpp("gguf_read.py", _env("DFLASH_LLAMACPP_DIR"), gguf, export)
    return json.loads(res.stdout.strip().splitlines()[-1])


_BUILT: dict = {}


def converted(kind: str, tmp_path_factory):
    """The export of draft `kind` and its GGUF, once per session: `(Exported, gguf path, gguf_read result)`."""
    if kind not in _BUILT:
        exported = build_export(tmp_path_factory.mktemp(f"llamacpp-{kind}"), kind)
        gguf = exported.root / "draft.gguf"
        res = convert(exported.export, exported.target, gguf)
        print(res.stderr[-1500:])
        _BUILT[kind] = (exported, gguf, read_gguf(gguf, exported.export))
    return _BUILT[kind]


def expected_fields(project: DraftConfig) -> dict:
    """The GGUF keys llama.cpp's converter writes for a draft, with the project's values."""
    a = "dflash"
    want = {
        "general.architecture": a,
        f"{a}.block_count": project.num_layers,
        f"{a}.embedding_length": project.hidden_size,
        f"{a}.feed_forward_length": project.intermediate_size,
        f"{a}.attention.head_count": project.num_heads,
        f"{a}.attention.head_count_kv": project.num_kv_heads,
        f"{a}.attention.key_length": project.head_dim,
        f"{a}.block_size": project.block_size,
        # llama.cpp counts a tap as the output of layer i, i + 1 (conversion/qwen.py, DFlashModel)
        f"{a}.target_layers": [i + 1 for i in project.target_layer_ids],
        "tokenizer.ggml.mask_token_id": project.mask_token_id,
    }
    if project.kind == "dflash2":
        want.update({f"{a}.conv_kernel_size": project.conv_kernel_size, f"{a}.conv_group_size": project.conv_group_size,
                     f"{a}.selector_rank": project.selector_rank, f"{a}.selector_top_k": project.selector_top_k})
    if "sliding_attention" in project.layer_types and project.sliding_window:
        want[f"{a}.attention.sliding_window"] = project.sliding_window
        want[f"{a}.attention.sliding_window_pattern"] = [t == "sliding_attention" for t in project.layer_types]
    return want


@pytest.mark.parametrize("kind", ["dflash2", "dflash"])
def test_converter_writes_the_exports_values_and_tensors(kind, tmp_path_factory):
    exported, gguf, read = converted(kind, tmp_path_factory)
    cfg_path = exported.export / "config.json"
    project = DraftConfig.from_dict(json.loads(cfg_path.read_text()), source=str(cfg_path))
    fields = read["fields"]
    want = expected_fields(project)
    for k, v in want.items():
        print(f"  {k}: project {v!r} | GGUF {fields.get(k)!r}")
    assert {k: fields.get(k) for k in want} == want
    if kind == "dflash":
        assert not [k for k in fields if "conv_" in k or "selector" in k], "a DFlash v1 GGUF has no DFlash2 keys"
    # values the converter writes only when the draft sets them: neutral here, and so absent
    assert (project.output_multiplier, project.input_embedding_scale, project.final_logit_softcapping) in ((1.0, 1.0, None),)
    tensors = read["tensors"]
    for key, t in tensors.items():
        print(f"  {key} -> {t['gguf']} {t['type']} equal={t['equal']}")
    assert [k for k, t in tensors.items() if not t["equal"]] == []
    assert read["unmatched"] == [] and fields["GGUF.tensor_count"] == len(tensors)
    print(f"{kind}: {len(tensors)} tensors, every one bit for bit; {fields['GGUF.kv_count']} metadata keys")


def test_pypi_gguf_0_19_0_lacks_dflash(tmp_path_factory):
    """The converter needs the gguf-py llama.cpp ships with it: PyPI's gguf of the same version number has no
    DFLASH architecture, and the converter run on it (NO_LOCAL_GGUF) cannot even load its model classes."""
    llama_cpp = _env("DFLASH_LLAMACPP_DIR")
    snippet = (
        "import importlib.metadata as m, sys, gguf; a = hasattr(gguf.MODEL_ARCH, 'DFLASH'); "
        f"sys.path.insert(0, {str(llama_cpp / 'gguf-py')!r}); [sys.modules.pop(k) for k in list(sys.modules) if k.startswith('gguf')]; "
        "import gguf as g; print(m.version('gguf'), a, hasattr(g.MODEL_ARCH, 'DFLASH'), g.__file__)"
    )
    out = llamacpp("-c", snippet).stdout.split()
    print("PyPI gguf", out[0], "has MODEL_ARCH.DFLASH:", out[1], "| llama.cpp's gguf-py:", out[2], out[3])
    assert out[:3] == ["0.19.0", "False", "True"]
    exported, _, _ = converted("dflash2", tmp_path_factory)
    res = llamacpp("convert.py", llama_cpp, exported.export, "--target-model-dir", exported.target,
                   "--outfile", exported.root / "pypi.gguf", check=False, env={"NO_LOCAL_GGUF": "1"})
    print("converter with NO_LOCAL_GGUF (PyPI gguf):", *res.stderr.strip().splitlines()[-3:], sep="\n  ")
    assert res.returncode != 0 and "AttributeError: DFLASH" in res.stderr


def test_a_renamed_tensor_is_refused_and_a_changed_one_caught(tmp_path_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    exported, gguf, _ = converted("dflash2", tmp_path_factory)
    tensors = load_file(str(exported.export / "model.safetensors"))
    renamed = tmp_path / "renamed"
    shutil.copytree(exported.export, renamed)
    t = dict(tensors)
    t["fc_in.weight"] = t.pop("fc.weight")
    save_file(t, str(renamed / "model.safetensors"))
    res = convert(renamed, exported.target, tmp_path / "renamed.gguf", check=False)
    print("renamed `fc.weight` -> `fc_in.weight`:", res.stderr.strip().splitlines()[-1])
    assert res.returncode != 0 and "fc_in" in res.stderr

    changed = tmp_path / "changed"
    shutil.copytree(exported.export, changed)
    t = dict(tensors)
    t["layers.1.mlp_conv.base_kernel"] = t["layers.1.mlp_conv.base_kernel"].clone()
    t["layers.1.mlp_conv.base_kernel"].view(-1)[0] += 1
    save_file(t, str(changed / "model.safetensors"))
    unequal = [k for k, v in read_gguf(gguf, changed)["tensors"].items() if not v["equal"]]
    print("one value of `layers.1.mlp_conv.base_kernel` changed; unequal:", unequal)
    assert unequal == ["layers.1.mlp_conv.base_kernel"]


def _built_binary() -> Path:
    status = json.loads(_env("DFLASH_LLAMACPP_BUILD_STATUS").read_text())
    print("llama.cpp build status:", json.dumps(status))
    if not status.get("built"):
        pytest.skip(f"llama.cpp is not built, so the converted draft was not run: {json.dumps(status)}")
    return Path(_env("DFLASH_LLAMACPP_DIR")).parents[3] / "build" / "bin" / "llama-speculative-simple"


def _speculate(binary: Path, target: Path, draft: Path, prompt: str, n: int) -> subprocess.CompletedProcess:
    cmd = [str(binary), "-m", str(target), "-md", str(draft), "--spec-type", "draft-dflash", "-p", prompt,
           "-n", str(n), "--temp", "0", "-t", "2", "-c", "256"]
    return subprocess.run(cmd, capture_output=True, timeout=600)


PROMPT = "the draft model learns to predict"


def test_llamacpp_runs_the_v1_draft_losslessly(tmp_path_factory):
    """llama.cpp's DFlash speculative decoding with the converted v1 export writes the target's own greedy
    continuation (transformers' greedy decode of the same checkpoint), byte for byte after UTF-8 replacement."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    binary = _built_binary()
    exported, gguf, _ = converted("dflash", tmp_path_factory)
    target_gguf = exported.root / "target.gguf"
    if not target_gguf.exists():
        llamacpp("convert.py", _env("DFLASH_LLAMACPP_DIR"), exported.target, "--outfile", target_gguf, "--outtype", "f32")
    n = 17
    res = _speculate(binary, target_gguf, gguf, PROMPT, n)
    err = res.stderr.decode("utf-8", "replace")
    assert res.returncode == 0, err[-3000:]
    # the tokens llama.cpp wrote (its `n_predict` line: -n N writes N + 1, the first from the prompt's pass)
    written = int(next(line for line in err.splitlines() if "n_predict =" in line).rsplit("=", 1)[1])
    tok = AutoTokenizer.from_pretrained(str(exported.target))
    model = AutoModelForCausalLM.from_pretrained(str(exported.target), dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    greedy = model.generate(ids, max_new_tokens=written, do_sample=False)[0, ids.shape[1]:]
    want = tok.decode(greedy)
    got = res.stdout.decode("utf-8", "replace").strip()
    stats = [line.split(" I ", 1)[-1] for line in err.splitlines() if any(k in line for k in ("block_size=", "n_predict", "n_drafted", "n_accept", "accept "))]
    print("llama.cpp stdout:", repr(got), "| transformers greedy:", repr(want), *stats, sep="\n  ")
    assert got == PROMPT + want


def test_llamacpp_refuses_the_tiny_dflash2_draft(tmp_path_factory):
    """llama.cpp's DFlash2 loader (src/models/dflash.cpp) needs hidden size >= top_k * (top_k + 1); the tiny
    DFlash2 draft (hidden 64, top-k 64) is refused at load with that reason."""
    binary = _built_binary()
    exported, gguf, _ = converted("dflash2", tmp_path_factory)
    target_gguf = exported.root / "target.gguf"
    llamacpp("convert.py", _env("DFLASH_LLAMACPP_DIR"), exported.target, "--outfile", target_gguf, "--outtype", "f32")
    res = _speculate(binary, target_gguf, gguf, PROMPT, 4)
    err = res.stderr.decode("utf-8", "replace")
    print(*[line for line in err.splitlines() if "error loading model" in line][:1])
    assert res.returncode != 0 and "DFlash2 hidden size is too small for the selector lattice" in err
