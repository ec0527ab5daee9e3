"""SGLang's own DFlash config parser reads the project's exports to the values the project wrote.

Runs with `make interop-sglang` (scripts/interop-sglang.sh), which builds SGLang's environment and
passes its interpreter as `DFLASH_SGLANG_PYTHON`; the main suite leaves this folder out. The exports are
made here, in the project's environment, by `dflash-worker train` and `dflash-worker export`
(`exports.py`); `sglang_read.py` runs in SGLang's environment and reports what SGLang's
`get_config` + `parse_dflash_draft_config` make of the export. The project's side is its own parser,
`DraftConfig.from_dict`, on the same file. Each value must be equal: block size (SGLang's
`--speculative-num-draft-tokens` default), feature taps, mask token id, convolution and selector
settings, layer count and the target's, output multiplier, logit softcapping, layer types and the
sliding window; a field SGLang does not read at all (`input_embedding_scale`) must hold its neutral value.
The broken-export cases show the comparison failing when a field is renamed or dropped.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
from exports import build_export

from dflash_worker.model.config import DraftConfig

HERE = Path(__file__).resolve().parent
SGLANG_PYTHON_ENV = "DFLASH_SGLANG_PYTHON"


def sglang_python() -> str:
    path = os.environ.get(SGLANG_PYTHON_ENV)
    if not path or not Path(path).is_file():
        raise AssertionError(
            f"`{SGLANG_PYTHON_ENV}` is `{path}`, not SGLang's interpreter\n"
            "hint: run these tests with `make interop-sglang` (scripts/interop-sglang.sh builds SGLang's environment)"
        )
    return path


def sglang_reads(draft_dir: Path, target_num_layers: int) -> dict:
    """What SGLang's own functions read from `draft_dir/config.json` (sglang_read.py, in SGLang's environment)."""
    res = subprocess.run(
        [sglang_python(), str(HERE / "sglang_read.py"), str(draft_dir), str(target_num_layers)],
        capture_output=True, text=True, timeout=600,
    )
    if res.returncode != 0:
        raise AssertionError(f"SGLang could not read `{draft_dir}/config.json`:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def project_reads(draft_dir: Path) -> DraftConfig:
    path = draft_dir / "config.json"
    return DraftConfig.from_dict(json.loads(path.read_text()), source=str(path))


def expected_by_sglang(project: DraftConfig) -> dict:
    """The project's values, spelled as SGLang's parser returns them (0 where a DFlash2 field is absent,
    None for no softcapping, the window less the current token)."""
    sliding = "sliding_attention" in project.layer_types
    softcap = project.final_logit_softcapping
    return {
        "block_size": project.block_size,
        "target_layer_ids": list(project.target_layer_ids),
        "mask_token_id": project.mask_token_id,
        "selector_rank": project.selector_rank or 0,
        "selector_top_k": project.selector_top_k or 0,
        "conv_kernel_size": project.conv_kernel_size or 0,
        "conv_group_size": project.conv_group_size or 0,
        "num_hidden_layers": project.num_layers,
        "num_target_layers": project.num_target_layers,
        "output_multiplier": project.output_multiplier,
        "final_logit_softcapping": softcap if softcap else None,
        "layer_types": list(project.layer_types),
        "sliding_window_left": project.sliding_window - 1 if sliding and project.sliding_window else None,
    }


def got_from_sglang(read: dict) -> dict:
    parsed = read["parsed"]
    got = {k: read[k] for k in ("block_size", "target_layer_ids", "layer_types", "sliding_window_left")}
    for k in ("mask_token_id", "selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size",
              "num_hidden_layers", "num_target_layers", "output_multiplier", "final_logit_softcapping"):
        got[k] = parsed[k]
    return got


def mismatches(project: DraftConfig, read: dict) -> list[str]:
    """Each field where SGLang's reading differs from the project's (empty when they agree)."""
    want, got = expected_by_sglang(project), got_from_sglang(read)
    out = [f"`{k}`: project `{want[k]!r}`, SGLang `{got[k]!r}`" for k in want if want[k] != got[k]]
    if project.input_embedding_scale != 1.0:
        out.append(f"`input_embedding_scale`: project `{project.input_embedding_scale}`, SGLang does not read it (1.0)")
    return out


_BUILT: dict = {}


def export_of(kind: str, tmp_path_factory):
    """One export of each draft kind per session."""
    if kind not in _BUILT:
        _BUILT[kind] = build_export(tmp_path_factory.mktemp(f"sglang-{kind}"), kind)
    return _BUILT[kind]


def target_layers(exported) -> int:
    return json.loads((exported.target / "config.json").read_text())["num_hidden_layers"]


@pytest.fixture(params=["dflash2", "dflash"])
def exported(request, tmp_path_factory):
    return export_of(request.param, tmp_path_factory)


def test_sglang_parser_reads_the_exports_values(exported):
    project = project_reads(exported.export)
    read = sglang_reads(exported.export, target_layers(exported))
    print(f"SGLang {read['sglang_version']} ({read['sglang_file']}), config class {read['config_class']}, "
          f"architectures {read['architectures']}")
    print("SGLang parse_dflash_draft_config:", json.dumps(read["parsed"], sort_keys=True))
    want, got = expected_by_sglang(project), got_from_sglang(read)
    for k in want:
        print(f"  {k}: project {want[k]!r} | SGLang {got[k]!r}")
    assert read["sglang_version"] == "0.5.23"
    assert read["architectures"] == [{"dflash2": "DFlash2DraftModel", "dflash": "DFlashDraftModel"}[project.kind]]
    assert mismatches(project, read) == []
    # the values themselves, as the tiny world's draft config set them (a parser that agreed by defaulting
    # both sides would not pass)
    assert (got["block_size"], got["target_layer_ids"], got["mask_token_id"]) == (4, [0, 2], 383)
    if project.kind == "dflash2":
        assert (got["selector_rank"], got["selector_top_k"], got["conv_kernel_size"], got["conv_group_size"]) == (8, 64, 3, 16)
    else:
        assert (got["selector_rank"], got["selector_top_k"], got["conv_kernel_size"], got["conv_group_size"]) == (0, 0, 0, 0)


def _break(config: dict, how: str) -> dict:
    cfg = copy.deepcopy(config)
    sub = cfg["dflash_config"]
    cfg.pop("block_size", None)
    if how == "block_size renamed":
        sub["block_len"] = sub.pop("block_size")
    elif how == "taps renamed":
        sub["layer_ids"] = sub.pop("target_layer_ids")
    elif how == "mask id at the top level only, as a string":
        cfg["mask_token_id"] = str(sub.pop("mask_token_id"))
    elif how == "sliding window dropped":
        cfg.pop("sliding_window")
    return cfg


@pytest.mark.parametrize("how", ["block_size renamed", "taps renamed", "mask id at the top level only, as a string",
                                 "sliding window dropped"])
def test_a_broken_export_is_caught(tmp_path_factory, tmp_path, how):
    """Each break of the DFlash2 export makes SGLang read another value than the project wrote, or refuse the file."""
    exported = export_of("dflash2", tmp_path_factory)
    project = project_reads(exported.export)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(_break(exported.config(), how), indent=2))
    try:
        found = mismatches(project, sglang_reads(broken, target_layers(exported)))
    except AssertionError as exc:  # SGLang refused the file
        found = [str(exc).splitlines()[-1]]
    print(f"{how}: {found}")
    assert found, f"SGLang read the export broken by `{how}` to the project's values"
