"""The project's side of the vLLM interop test: a tiny world, a short training run, its BF16 export
and the project's own evaluation of it, each made by the project's own code and commands.

The target is a tiny Qwen3 with head_dim 64 (vLLM's CPU attention has no kernel for the tiny
worlds' head_dim 16); the draft is a DFlash v1 draft whose layers are all full attention (vLLM's
V1 runner, the one its CPU build uses, refuses mixed sliding/full DFlash drafts).

This runs in the project's own environment (`.venv`, requirements/lock.txt), not vLLM's: vLLM 0.32
pins transformers < 5.20 and the project needs 5.24. The test (in vLLM's environment) runs it as
`python world.py v1|dflash2 ROOT RESULT.json` and reads the JSON it writes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HEAD_DIM = 64
PROMPTS = 16
MAX_NEW_TOKENS = 24
BLOCK_SIZE = 4


@dataclass(frozen=True)
class V1World:
    root: Path
    target: Path
    draft: Path  # the "released" v1 draft the run starts from
    data: Path
    run: Path
    export: Path  # written by `dflash-worker export --format bf16 --for vllm`
    report: dict  # `dflash-worker evaluate --json` of the run (its export is the trained draft)
    recipe: dict  # the run's recipe, as a dict

    def as_json(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.__dict__.items()}


def worker_cli(*argv: str | Path, expect: int = 0, timeout: float = 900) -> subprocess.CompletedProcess:
    """`dflash-worker ARGV` as a user runs it (`python -m dflash_worker.cli`), which must exit `expect`."""
    cmd = [sys.executable, "-m", "dflash_worker.cli", *map(str, argv)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if res.returncode != expect:
        raise AssertionError(f"`{' '.join(cmd[2:])}` exited {res.returncode}, not {expect}:\n{res.stderr[-4000:]}")
    return res


def build_v1_world(root: Path, *, steps: int = 20, seed: int = 0) -> V1World:
    """Target, v1 draft, data (16 test prompts), a `steps`-step run, its CLI export and CLI evaluation."""
    import torch

    from dflash_worker.capture import run_capture
    from dflash_worker.data import prepare_data
    from dflash_worker.model import DraftConfig, build_draft, save_draft
    from dflash_worker.recipe import recipe_from_dict
    from dflash_worker.testing.tiny_draft import tiny_dflash_config
    from dflash_worker.testing.tokenizer import save_tiny_target_with_tokenizer
    from dflash_worker.testing.world import target_config, write_rows

    root = Path(root)
    target = root / "target"
    save_tiny_target_with_tokenizer(target, seed=seed, head_dim=HEAD_DIM)
    cfg = tiny_dflash_config(
        target_config(target), block_size=BLOCK_SIZE, layer_types=["full_attention", "full_attention"],
        use_sliding_window=False, sliding_window=None,
    )
    draft = root / "draft"
    save_draft(build_draft(DraftConfig.from_dict(cfg), seed=seed), draft, dtype=torch.bfloat16)
    # 8 rows a prompt: the 0.2 test fraction (split by hash) holds at least the 16 prompts served
    rows = write_rows(root / "rows.jsonl", examples=8 * PROMPTS, seed=seed)
    data = root / "data"
    prepare_data([rows], data, seed=seed, val_fraction=0.2, test_fraction=0.2)
    run = root / "run"
    raw = {
        "model": {"target": str(target), "draft": str(draft), "family": "qwen3"},
        "data": {"dir": str(data), "thinking": "off", "max_length": 256},
        # the teacher writes the responses (greedy), so the draft learns what verification accepts
        "capture": {"output": str(root / "capture"), "dtype": "float32", "splits": ["train", "val"], "device": "cpu",
                    "regenerate": True, "sampling": "greedy", "max_new_tokens": MAX_NEW_TOKENS},
        "train": {"scope": "full", "steps": steps, "lr": 1e-2, "blocks_per_sequence": 4, "val_every": 2,
                  "checkpoint_every": 2, "val_examples": 4, "device": "cpu", "warmup_steps": 1, "output": str(run)},
        "evaluate": {"split": "test", "max_prompts": PROMPTS, "max_new_tokens": MAX_NEW_TOKENS, "device": "cpu"},
    }
    run_capture(recipe_from_dict(raw, base=root))
    export = _train_and_export(raw, root, "export-bf16")
    report = json.loads(worker_cli("evaluate", "--run", run, "--json").stdout)
    return V1World(root, target, draft, data, run, export, report, raw)


def _train_and_export(raw: dict, root: Path, name: str, *, expect: int = 0) -> Path:
    """Train the recipe `raw` (its capture made already), then `dflash-worker export --format bf16 --for vllm`
    to `root/name` (exit `expect`: 3 when the project refuses it for vLLM's CPU runner), which writes
    `serving/vllm.json` beside the export."""
    from dflash_worker.recipe import recipe_from_dict
    from dflash_worker.train import train

    res = train(recipe_from_dict(raw, base=root))
    assert res.status == "completed", res.status
    export = root / name
    worker_cli("export", "--run", raw["train"]["output"], "--format", "bf16", "--output", export, "--for", "vllm", expect=expect)
    return export


def build_dflash2_export(world: V1World, *, steps: int = 2, seed: int = 0) -> Path:
    """A DFlash2 draft (convolutions, candidate selector; full-attention layers, the v1 draft's taps) for
    the same target, trained `steps` steps on the same capture and exported by `dflash-worker export`."""
    import copy

    import torch

    from dflash_worker.model import DraftConfig, build_draft, save_draft
    from dflash_worker.testing.tiny_draft import tiny_dflash2_config
    from dflash_worker.testing.world import target_config

    cfg = tiny_dflash2_config(
        target_config(world.target), block_size=BLOCK_SIZE, layer_types=["full_attention", "full_attention"],
        use_sliding_window=False, sliding_window=None,
    )
    draft = world.root / "draft-dflash2"
    save_draft(build_draft(DraftConfig.from_dict(cfg), seed=seed), draft, dtype=torch.bfloat16)
    raw = copy.deepcopy(world.recipe)
    raw["model"]["draft"] = str(draft)
    raw["train"].update(steps=steps, val_every=steps, checkpoint_every=steps, output=str(world.root / "run-dflash2"))
    return _train_and_export(raw, world.root, "export-dflash2-bf16", expect=3)


def prompt_ids(world: V1World) -> list[tuple[str, list[int]]]:
    """The evaluated prompts' ids and token ids, rendered by evaluate's own rendering (`render_row_prompt`
    with the run's `[data]`), in its split and order; checked against the report's ids and lengths."""
    from dflash_worker.data import PreparedData, load_tokenizer
    from dflash_worker.data.render import render_row_prompt
    from dflash_worker.recipe import recipe_from_dict

    data = recipe_from_dict(world.recipe, base=world.root).data
    tokenizer = load_tokenizer(world.target)
    rows = {r["id"]: r for r in world.report["per_prompt"]}
    out = [(ex.id, render_row_prompt(tokenizer, ex, data)) for ex in PreparedData(world.data).iter_split(world.report["split"])]
    out = [(pid, ids) for pid, ids in out if pid in rows]
    assert [pid for pid, _ in out] == list(rows), "the prompts rendered here are not the ones evaluate scored"
    for pid, ids in out:
        assert len(ids) == rows[pid]["prompt_tokens"], f"prompt `{pid}` renders to {len(ids)} tokens, evaluate scored {rows[pid]['prompt_tokens']}"
    return out


def transformers_greedy(world: V1World, prompts: list[tuple[str, list[int]]]) -> list[list[int]]:
    """The target's own greedy continuation of each prompt, by transformers' `generate` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(world.target), dtype=torch.float32).eval()
    stop = world.report["stop_token_ids"]
    outs = []
    with torch.inference_mode():
        for _, ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                               eos_token_id=stop, pad_token_id=stop[0])
            outs.append(y[0, len(ids):].tolist())
    return outs


def main(argv: list[str]) -> int:
    """`world.py v1 ROOT OUT.json`: the v1 world, its prompts and transformers' greedy tokens;
    `world.py dflash2 ROOT OUT.json`: the DFlash2 export for the v1 world already at ROOT."""
    what, root, out = argv[1], Path(argv[2]), Path(argv[3])
    if what == "v1":
        world = build_v1_world(root)
        prompts = prompt_ids(world)
        doc = {**world.as_json(), "prompts": prompts, "greedy": transformers_greedy(world, prompts)}
    else:
        raw = json.loads((root / "v1.json").read_text())
        world = V1World(**{**raw, **{k: Path(raw[k]) for k in ("root", "target", "draft", "data", "run", "export")}})
        doc = {"export": str(build_dflash2_export(world))}
    out.write_text(json.dumps(doc, indent=1))
    if what == "v1":
        (root / "v1.json").write_text(json.dumps(world.as_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
