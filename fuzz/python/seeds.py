"""Write the seed corpus and libFuzzer dictionary of every fuzz target: `seeds.py OUT_DIR`.

Seeds are small valid inputs made at fuzz time from the real writers where there
is one (a safetensors file saved by `safetensors`, the example recipe, the
`spec.json` layout the run-manager writes), so they follow the formats as they
change and nothing binary is committed. Dictionaries are built from the parsers'
own constants (dtype names, recipe keys, spec keys, event names), for the same
reason. Layout: `OUT_DIR/<target>/seed-NN` and `OUT_DIR/<target>.dict`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from dflash_worker.recipe import SECTIONS
from dflash_worker.weights.header import DTYPE_SIZES
from dflash_worker.worker import spec as spec_mod

ROOT = Path(__file__).resolve().parents[2]


def header_seeds() -> list[bytes]:
    tensors = {
        "model.embed_tokens.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "model.norm.weight": np.ones(4, dtype=np.float16),
        "lm_head.ids": np.array([1, 2], dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.uint8),
    }
    one = save(tensors, metadata={"format": "pt"})
    return [one, save({"w": np.zeros(2, dtype=np.int8)}), save({}), b"\x02\x00\x00\x00\x00\x00\x00\x00{}"]


def jsonl_seeds() -> list[bytes]:
    rows = [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello", "reasoning_content": "greet"}]},
        {"prompt": "2+2?", "response": "4", "source": "math"},
        {"prompt": "name a colour", "completion": "red", "extra": 1},
        {"prompt": "prompt only"},
    ]  # fmt: skip
    lines = [json.dumps(r).encode() for r in rows]
    return [
        b"\n".join(lines) + b"\n",
        b"\xef\xbb\xbf" + lines[1] + b"\r\n\r\n  \n" + lines[0],
        lines[2] + b"\n{\"prompt\": \"\\ud800\"}\n[1, {\"a\": 1, \"a\": 2}]\n",
    ]


def recipe_seeds() -> list[bytes]:
    minimal = b'[model]\ntarget = "t"\ndraft = "d"\nfamily = "qwen3"\n[data]\ndir = "data"\nthinking = "off"\n'
    return [(ROOT / "docs" / "examples" / "recipe.toml").read_bytes(), minimal, minimal + b'[train]\nscope = "selector"\nbetas = [0.9, 0.99]\n']


def spec_seeds() -> list[bytes]:
    # The layout `JobSpecFile::write` (run-manager/src/worker/jobdir.rs) produces; job_dir is
    # left out (the fuzz target's directory differs per process).
    noop = {"stages": ["noop"], "noop": {"steps": 3, "step_seconds": 0.0, "checkpoint_every": 1}}
    full = {
        "schema_version": 1,
        "spec": noop,
        "lease": {"lease_id": "l-1", "run_id": "r-1", "job_id": "j-1", "attempt": 2, "checkpoint_policy": "durable",
                  "required_features": ["cpu"], "required_client_version": "0.1.0"},
        "resume_checkpoint": "/x/checkpoints/step-00000004/manifest.json",
        "resume_step": 4,
        "restart": 0,
        "device": {"backend": "cpu", "device_count": 1, "memory_bytes": 1 << 34, "supports_bf16": True,
                   "features": ["cpu"], "platform": "linux-x86_64"},
        "local_ranks": 1,
        "downgrades": [{"feature": "torch_compile", "replacement": "eager", "reason": "CUDA-only"}],
        "client_version": "0.1.0",
    }  # fmt: skip
    pipeline = {
        "schema_version": 1,
        "spec": {
            "stages": ["prepare", "capture", "train", "export", "evaluate"],
            "inputs": ["rows.jsonl"],
            "prepare": {"seed": 1, "val_fraction": 0.1, "test_fraction": 0.1, "skip_invalid": True},
            "recipe": {"model": {"target": "t", "draft": "d", "family": "qwen3"}, "data": {"thinking": "on"},
                       "capture": {"shard_tokens": 64}, "train": {"scope": "full", "steps": 2}},
            "export_formats": ["bf16", "af4g64"],
            "evaluate": {"split": "test", "max_prompts": 2},
        },
    }  # fmt: skip
    return [json.dumps(d, indent=2).encode() for d in (full, pipeline, {"schema_version": 1, "spec": {"stages": ["noop"]}})]


def event_seeds() -> list[bytes]:
    sha = "ab" * 32
    events = [
        {"event": "progress", "phase": "train", "step": 3, "total_steps": 10, "metrics": {"loss": 2.5}, "committed_step": 2},
        {"event": "artifact", "name": "checkpoints/step-00000002", "kind": "checkpoint",
         "path": "run/checkpoints/step-00000002/manifest.json", "sha256": sha, "size_bytes": 1234, "step": 2},
        {"event": "done"},
        {"event": "error", "message": "bad recipe", "retryable": False},
        {"event": "stopped", "committed_step": 4},
    ]  # fmt: skip
    return [json.dumps(e).encode() for e in events]


def run_spec_seeds() -> list[bytes]:
    noop = {"stages": ["noop"], "noop": {"steps": 6, "step_seconds": 0.05, "checkpoint_every": 2}}
    files = [
        {"name": "local-1", "spec": noop, "required_features": ["cpu"], "num_jobs": 2, "max_local_ranks": 1},
        {"spec_json": json.dumps(noop), "checkpoint_policy": "durable", "image": "dflash-worker:0.1.0",
         "approve_native_versions": ["0.1.0"], "required_client_version": "0.1.0"},
    ]  # fmt: skip
    return [json.dumps(f).encode() for f in files] + [json.dumps(noop).encode()]


def _keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def dictionaries() -> dict[str, list[str]]:
    json_tokens = ["{", "}", "[", "]", ":", ",", '"', "null", "true", "false", "-0", "1e999", "\\u0000", "\\ud800"]
    recipe_keys = list(SECTIONS) + [k for cls in SECTIONS.values() for k in _keys(cls)]
    spec_keys = list(spec_mod._FILE_KEYS) + list(spec_mod._JOB_KEYS) + list(spec_mod.STAGE_NAMES) + list(spec_mod.LeaseInfo._KEYS)
    spec_keys += _keys(spec_mod.DeviceInfo) + _keys(spec_mod.PrepareOptions) + _keys(spec_mod.NoopOptions) + list(spec_mod.BACKENDS)
    event_keys = ["event", "progress", "artifact", "done", "error", "stopped", "phase", "step", "total_steps", "metrics",
                  "committed_step", "name", "kind", "path", "sha256", "size_bytes", "message", "retryable", "train", "checkpoint"]  # fmt: skip
    run_spec_keys = ["name", "spec", "spec_json", "required_client_version", "checkpoint_policy", "max_local_ranks",
                     "required_features", "image", "num_jobs", "approve_native_versions", "stages", "noop"]  # fmt: skip
    return {
        "py_header": json_tokens + ["__metadata__", "dtype", "shape", "data_offsets", *DTYPE_SIZES],
        "py_jsonl": json_tokens + ["messages", "role", "content", "reasoning_content", "system", "user", "assistant",
                                   "prompt", "response", "completion", "source", "\r\n", "\ufeff"],  # fmt: skip
        "py_recipe": ["[", "]", "[[", "]]", "=", '"', "'''", '"""', "true", "inf", "nan", "0x", "1979-05-27T07:32:00Z", "~", "\\u0000", "\\ud800", "\\U0010ffff"]
        + recipe_keys + ["qwen3", "qwen3_moe", "bfloat16", "cuda:0", "selector_context", "af4g64"],
        "py_spec": json_tokens + spec_keys + ["/", "..", "~", "bf16", "af4g64"],
        "rs_worker_event": json_tokens + event_keys,
        "rs_job_spec": json_tokens + run_spec_keys,
        "py_canary": ["FU"],
    }


def _dict_line(token: str) -> str:
    # libFuzzer's dictionary syntax: a quoted string with \\, \" and \xNN escapes.
    out = "".join(c if 32 <= ord(c) < 127 and c not in '\\"' else "".join(f"\\x{b:02x}" for b in c.encode("utf-8", "surrogatepass")) for c in token)
    return f'"{out}"'


def write_all(out: Path) -> None:
    seeds = {
        "py_header": header_seeds(),
        "py_jsonl": jsonl_seeds(),
        "py_recipe": recipe_seeds(),
        "py_spec": spec_seeds(),
        "rs_worker_event": event_seeds(),
        "rs_job_spec": run_spec_seeds() + spec_seeds()[2:],
        "py_canary": [b"FUZZ"],
    }
    for target, items in seeds.items():
        d = out / target
        d.mkdir(parents=True, exist_ok=True)
        for i, data in enumerate(items):
            (d / f"seed-{i:02d}").write_bytes(data)
    for target, tokens in dictionaries().items():
        (out / f"{target}.dict").write_text("".join(_dict_line(t) + "\n" for t in dict.fromkeys(tokens)))


if __name__ == "__main__":
    write_all(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="dflash-fuzz-seeds-")))
