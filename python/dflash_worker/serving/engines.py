"""`export --for ENGINE`: check an export and its target against what a serving engine runs, and say how.

`plan(engine, export_dir, target_dir, device=...)` returns a `Plan`: accepted or not, the reasons for a
refusal (each naming the engine's own limit, quoting its message where it has one), notes on what this
project has not run, and the exact command or code that serves the draft. `write_plans` writes
`<export>/serving/<engine>.json` (`{"engine", "accepted", "reasons", "notes", "device", "checked", ...}`;
vLLM's has `speculative_config`, the dict to pass to vLLM as it is) and `<export>/serving/README.md`.

The facts behind each check were read in the engines' sources, versions in `CHECKED` (and
docs/serving.md); `device` is where the engine runs (`cpu`, or `cuda` for a GPU): vLLM's CPU build runs
its V1 model runner, which refuses DFlash2 and mixed sliding/full drafts that its GPU runner (V2) takes,
and SGLang runs DFlash only on GPUs. The serving files are not in the export's manifest: the manifest
hashes the files it lists, so verifying the export is unaffected by them, and they can be rewritten for
another engine or device without touching the export.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..model.config import DFLASH, DFLASH2, FULL_ATTENTION, SLIDING_ATTENTION, DraftConfig
from .fields import ENGINES, engine_reads, find_mismatches

DEVICES = ("cpu", "cuda")
SERVING_DIR = "serving"

# What each check was read against (sources of these versions; nothing here imports an engine).
CHECKED = {
    "vllm": "vllm-cpu 0.32.0 (config/vllm.py, config/speculative.py, model_executor/models/qwen3_dflash*.py, "
    "v1/attention/backends/cpu_attn.py)",
    "sglang": "sglang 0.5.23 (srt/arg_groups/speculative_hook.py, srt/speculative/dflash_utils.py, srt/models/dflash.py)",
    "mlx": "dflash 0.1.0 (model_mlx.py) and mlx-lm 0.32.2 (models/qwen3_5_moe.py), through "
    "dflash_worker.serving.mlx.load_draft",
    "llama.cpp": "llama.cpp 0c1e570 (the sources llama-cpp-python 0.3.36 vendors: convert_hf_to_gguf.py with its "
    "in-tree gguf-py, src/models/dflash.cpp), converted and run by `make interop-llamacpp`; PyPI gguf 0.19.0 has no "
    "DFLASH architecture",
}

# vLLM 0.32.0 CPU attention kernels (`CPUAttentionBackend.get_supported_head_sizes`).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Target architectures whose vLLM / SGLang / mlx-lm models hand DFlash the tapped hidden states.
TARGET_ARCHITECTURES = (
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
)


@dataclass(frozen=True)
class Target:
    """What the checks need of the target checkpoint (its text tower for the Qwen3.5 wrappers)."""

    path: Path
    architectures: tuple[str, ...]
    num_layers: int
    hidden_size: int
    head_dim: int
    vocab_size: int
    model_type: str  # the text tower's
    weight_files: tuple[str, ...]
    individual_experts: bool  # MoE experts stored one tensor per expert (`mlp.experts.0.gate_proj.weight`)

    @classmethod
    def from_dir(cls, path: str | Path) -> Target:
        path = Path(path)
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"target `{path}` has no readable `config.json`: {exc}") from None
        text = raw.get("text_config") or raw
        heads = text.get("num_attention_heads") or 1
        return cls(
            path=path.resolve(),
            architectures=tuple(raw.get("architectures") or ()),
            num_layers=int(text.get("num_hidden_layers", 0)),
            hidden_size=int(text.get("hidden_size", 0)),
            head_dim=int(text.get("head_dim") or text.get("hidden_size", 0) // heads),
            vocab_size=int(text.get("vocab_size", 0)),
            model_type=str(text.get("model_type", "")),
            weight_files=tuple(sorted(p.name for p in path.glob("*.safetensors"))),
            individual_experts=_individual_experts(path),
        )


def _individual_experts(path: Path) -> bool:
    """Whether any tensor name of the checkpoint is one expert's (headers only; no weights are read)."""
    import re

    from ..weights.checkpoint import list_tensors

    one = re.compile(r"\.experts\.\d+\.")
    return any(one.search(name) for name in list_tensors(path))


@dataclass(frozen=True)
class Export:
    """The export being served: its directory, format, raw `config.json` and parsed draft."""

    path: Path
    fmt: str  # `bf16` | `af4g64`
    raw: dict[str, Any]
    draft: DraftConfig

    @classmethod
    def from_dir(cls, path: str | Path) -> Export:
        path = Path(path).resolve()
        draft = DraftConfig.from_file(path / "config.json")
        fmt = "af4g64" if "quantization" in draft.raw else "bf16"
        return cls(path, fmt, draft.raw, draft)


@dataclass(frozen=True)
class Plan:
    """One engine's answer for one export: accepted or refused (`reasons`), and how to serve it."""

    engine: str
    device: str
    accepted: bool
    reasons: tuple[str, ...]
    notes: tuple[str, ...]
    fields: dict[str, Any] = field(default_factory=dict)  # engine-specific: speculative_config, flags, code, ...
    how: str = ""  # the command or code, as the README shows it

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine, "accepted": self.accepted, "reasons": list(self.reasons),
            "notes": list(self.notes), "device": self.device, "checked": CHECKED[self.engine], **self.fields,
        }


def _common(engine: str, ex: Export, target: Target) -> list[str]:
    """Reasons every engine shares: the target's family and width, taps in range, fields where it reads them."""
    d, out = ex.draft, []
    if not set(target.architectures) & set(TARGET_ARCHITECTURES):
        out.append(f"target architecture `{list(target.architectures)}` is not one whose hidden states the engines tap "
                   f"for DFlash (this project checked `{', '.join(TARGET_ARCHITECTURES[:4])}`)")
    if d.hidden_size != target.hidden_size:
        out.append(f"draft `hidden_size` `{d.hidden_size}` differs from the target's `{target.hidden_size}`")
    if d.vocab_size != target.vocab_size:
        out.append(f"draft `vocab_size` `{d.vocab_size}` differs from the target's `{target.vocab_size}` "
                   "(the draft shares the target's embedding and head)")
    bad = [i for i in d.target_layer_ids if i >= target.num_layers]
    if bad:
        out.append(f"`target_layer_ids` `{bad}` are beyond the target's `{target.num_layers}` layers")
    out += [f"{m} where {engine} reads it" for m in find_mismatches(ex.raw, engine_reads(d)[engine])]
    return out


def _vllm(ex: Export, target: Target, device: str) -> Plan:
    d, reasons, notes = ex.draft, _common("vllm", ex, target), []
    if ex.fmt == "af4g64":
        reasons.append("AF4G64 is MLX's packed 4-bit layout, which vLLM does not load; serve the BF16 export")
    mixed = 0 < d.layer_types.count(SLIDING_ATTENTION) < d.num_layers
    if device == "cpu":
        if d.kind == DFLASH2:
            reasons.append("DFlash2 (candidate-selector) drafts are not run by vLLM's CPU runner: "
                           "`Model Runner V1 does not support: DFlash candidate-head drafts`")
        if mixed:
            reasons.append("drafts mixing sliding and full attention layers are not run by vLLM's CPU runner: "
                           "`Model Runner V1 does not support: mixed sliding/full dflash drafts`")
        for who, hd in (("draft", d.head_dim), ("target", target.head_dim)):
            if hd not in VLLM_CPU_HEAD_DIMS:
                reasons.append(f"{who} `head_dim` `{hd}` has no vLLM CPU attention kernel (supported: {list(VLLM_CPU_HEAD_DIMS)})")
    else:
        notes.append("vLLM's GPU model runner (V2) runs DFlash2 and mixed sliding/full drafts; this project has run "
                     "only the CPU build (vllm-cpu 0.32.0)")
    if FULL_ATTENTION not in d.layer_types:
        notes.append("an all-sliding-window draft is not refused by vLLM's checks; this project ran only full-attention drafts")
    if target.model_type != "qwen3":
        notes.append(f"this project ran vLLM with a Qwen3 target only; `{target.model_type}` was not run")
    if d.kind == DFLASH:
        for name, value, default in (("input_embedding_scale", d.input_embedding_scale, 1.0),
                                     ("output_multiplier", d.output_multiplier, 1.0),
                                     ("final_logit_softcapping", d.final_logit_softcapping, None)):
            if value != default:
                reasons.append(f"vLLM's DFlash v1 model (`DFlashQwen3ForCausalLM`) ignores `{name}` `{value}`, "
                               "so it would draft from other logits")
    if d.kind == DFLASH2:
        notes.append("num_speculative_tokens must stay block_size - 1: vLLM sizes DFlash2's convolutions from it and "
                     "never reads `block_size`")
    spec = {"method": "dflash", "model": str(ex.path), "num_speculative_tokens": d.block_size - 1}
    cmd = ["vllm", "serve", str(target.path), "--speculative-config", json.dumps(spec)]
    python = (f"from vllm import LLM, SamplingParams\n\nllm = LLM(model={str(target.path)!r}, "
              f"speculative_config={spec!r})\nout = llm.generate([\"Hello\"], SamplingParams(temperature=0.0, max_tokens=64))\n")
    how = f"```sh\n{shlex.join(cmd)}\n```\n\nor in Python:\n\n```python\n{python}```\n"
    return Plan("vllm", device, not reasons, tuple(reasons), tuple(notes),
                {"speculative_config": spec, "command": cmd, "python": python}, how)


def _sglang(ex: Export, target: Target, device: str) -> Plan:
    d, reasons = ex.draft, _common("sglang", ex, target)
    notes = ["SGLang's own install was not run on this machine; the flags and fields follow sglang 0.5.23's sources"]
    if device == "cpu":
        reasons.append("SGLang runs DFLASH speculative decoding only on CUDA, NPU or XPU devices: `DFLASH speculative "
                       "decoding is not supported by ... on device 'cpu'`")
    if ex.fmt == "af4g64":
        reasons.append("AF4G64 is MLX's packed 4-bit layout, which SGLang does not load; serve the BF16 export")
    if d.input_embedding_scale != 1.0:
        reasons.append(f"SGLang takes the noise-embedding scale from the target model, never from the draft's "
                       f"`input_embedding_scale` `{d.input_embedding_scale}`")
    flags = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(ex.path),
             "--speculative-num-draft-tokens", str(d.block_size)]
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", str(target.path), *flags]
    notes.append("for DFLASH, `--speculative-num-draft-tokens` is the block size (the verify window), not block_size - 1")
    return Plan("sglang", device, not reasons, tuple(reasons), tuple(notes), {"flags": flags, "command": cmd},
                f"```sh\n{shlex.join(cmd)}\n```\n")


MLX_CODE = '''\
from dflash.model_mlx import stream_generate
from mlx_lm import load

from dflash_worker.serving.mlx import load_draft

model, tokenizer = load({target!r})
draft = load_draft({export!r})
messages = [{{"role": "user", "content": "Hello"}}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
for response in stream_generate(model, draft, tokenizer, prompt, block_size={block_size}, max_tokens=256, temperature=0.0):
    print(response.text, end="", flush=True)
print()
'''


def _mlx(ex: Export, target: Target, device: str) -> Plan:
    d, reasons = ex.draft, _common("mlx", ex, target)
    notes = ["MLX runs on Apple silicon, or on Linux with `mlx[cpu]`; `--serving-device` does not apply"]
    if d.num_target_layers is None:
        reasons.append("`num_target_layers` is missing at the top level, where z-lab's MLX `load_draft` requires it\n"
                       f"hint: set it to the target's `{target.num_layers}` layers in the released draft's config.json")
    others = [n for n in target.weight_files if not n.startswith("model")]
    if others:
        reasons.append(f"mlx-lm loads only `model*.safetensors`, and the target also stores `{others}`")
    if target.model_type.startswith("qwen3_5_moe") and target.individual_experts:
        reasons.append("mlx-lm's `qwen3_5_moe` reads packed experts (`experts.gate_up_proj`, `experts.down_proj`) only, "
                       "and the target stores one tensor per expert")
    if target.model_type.startswith("qwen3_5"):
        notes.append("Qwen3.5 targets: the mlx-lm and dflash versions matter for acceptance (Gated DeltaNet q/k norm, "
                     "the sliding-window cache); see docs/native-silicon.md for the versions that reproduce the project's")
    code = MLX_CODE.format(target=str(target.path), export=str(ex.path), block_size=d.block_size)
    return Plan("mlx", device, not reasons, tuple(reasons), tuple(notes), {"code": code, "format": ex.fmt},
                f"```python\n{code}```\n")


def _llamacpp(ex: Export, target: Target, device: str) -> Plan:
    d, reasons = ex.draft, _common("llama.cpp", ex, target)
    notes = ["run the converter from a llama.cpp checkout (0c1e570 or later): its in-tree gguf-py has the DFLASH "
             "architecture, PyPI gguf 0.19.0 has none; older converters (03173d5e) take DFlash v1 only and read "
             "`block_size` only at the top level, which the export also writes"]
    if ex.fmt == "af4g64":
        reasons.append("AF4G64 is MLX's packed 4-bit layout; llama.cpp's converter reads unquantized safetensors "
                       "(convert the BF16 export and quantize with llama.cpp's own tools)")
    if d.kind == DFLASH2:
        # 0c1e570's converter registers DFlash2DraftModel and writes the convolution and selector keys
        # (tests/interop_llamacpp: every tensor bit for bit); its loader still bounds the selector.
        if d.hidden_size < (d.selector_top_k or 0) * ((d.selector_top_k or 0) + 1):
            reasons.append(f"llama.cpp's DFlash2 loader needs hidden size >= top_k * (top_k + 1): `DFlash2 hidden size is "
                           f"too small for the selector lattice` (hidden `{d.hidden_size}`, top_k `{d.selector_top_k}`)")
    if FULL_ATTENTION not in d.layer_types:
        notes.append("an all-sliding draft converts with `sliding_window`; not checked against llama.cpp here")
    gguf_draft, gguf_target = ex.path.parent / f"{ex.path.name}.gguf", target.path.parent / f"{target.path.name}.gguf"
    convert_target = ["python", "convert_hf_to_gguf.py", str(target.path), "--outfile", str(gguf_target)]
    convert_draft = ["python", "convert_hf_to_gguf.py", str(ex.path), "--target-model-dir", str(target.path),
                     "--outfile", str(gguf_draft)]
    server = ["llama-server", "-m", str(gguf_target), "-md", str(gguf_draft), "--spec-type", "draft-dflash",
              "--spec-draft-n-max", str(d.block_size - 1)]
    how = "```sh\n" + "\n".join(shlex.join(c) for c in (convert_target, convert_draft, server)) + "\n```\n"
    return Plan("llama.cpp", device, not reasons, tuple(reasons), tuple(notes),
                {"convert": [convert_target, convert_draft], "command": server}, how)


_CHECKS = {"vllm": _vllm, "sglang": _sglang, "mlx": _mlx, "llama.cpp": _llamacpp}


def plan(engine: str, export_dir: str | Path, target_dir: str | Path, *, device: str = "cpu") -> Plan:
    """Check the export at `export_dir` and target at `target_dir` for `engine` running on `device`."""
    if engine not in _CHECKS:
        raise ConfigError(f"unknown serving engine `{engine}`\nhint: use one of {', '.join(ENGINES)}")
    if device not in DEVICES:
        raise ConfigError(f"unknown serving device `{device}`\nhint: use one of {', '.join(DEVICES)}")
    return _CHECKS[engine](Export.from_dir(export_dir), Target.from_dir(target_dir), device)


def readme(plans: list[Plan]) -> str:
    """The human `serving/README.md`: per engine, accepted or refused and why, then how to serve."""
    lines = ["# Serving this export", "",
             "Written by `dflash-worker export --for`; the `<engine>.json` files beside this one hold the same answers "
             "as data. See docs/serving.md for each engine's whole path.", ""]
    for p in plans:
        lines += [f"## {p.engine}: {'accepted' if p.accepted else 'refused'} ({p.device})", ""]
        lines += [f"- refused: {r}" for r in p.reasons] + [f"- note: {n}" for n in p.notes]
        lines += ["", f"Checked against {CHECKED[p.engine]}.", ""]
        if p.accepted:
            lines += [p.how]
    return "\n".join(lines).rstrip() + "\n"


def write_plans(export_dir: str | Path, plans: list[Plan]) -> list[Path]:
    """Write `<export>/serving/<engine>.json` per plan and `README.md`; returns the paths written."""
    from ..export.commit import write_file
    from ..manifest import pretty_json

    out = Path(export_dir) / SERVING_DIR
    out.mkdir(exist_ok=True)
    for engine in set(ENGINES) - {p.engine for p in plans}:  # an earlier `--for`'s answer would contradict the README
        (out / f"{engine}.json").unlink(missing_ok=True)
    paths = []
    for p in plans:
        paths.append(out / f"{p.engine}.json")
        write_file(paths[-1], pretty_json(p.to_json()))
    paths.append(out / "README.md")
    write_file(paths[-1], readme(plans).encode())
    return paths
