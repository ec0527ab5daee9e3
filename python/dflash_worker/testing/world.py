"""A whole tiny world on disk: target + tokenizer, a "released" DFlash2 draft, own data.

Used by the demo (`make demo`), the job end-to-end tests and the training tests.
Everything is real: a real Qwen3 checkpoint (random weights) with a trained BPE
tokenizer and a Qwen3-style chat template, a DFlash2 draft saved in the
released upstream layout (BF16), and JSONL rows in the `prompt`/`response`
schema. `family` builds the target of another family instead (`qwen3_moe`,
`qwen3_5`, `qwen3_5_moe`: the Qwen3.5 ones as released, a multimodal wrapper
with a vision tower and MTP tensors, and a Qwen3.5-style chat template).

`kind` picks the world's rows (`KINDS`): `plain` (the default, above); `tool`
(multi-turn chat logs with tool calls and results, both thinking modes:
`worlds_chat.tool_rows`; its target's tokenizer holds the tool markers and the
chat template it is given, one that renders tools); `thinking` (rows with and
without reasoning: `worlds_chat.thinking_rows`); `long` (documents of
`long_tokens` tokens whose answer recalls their opening: `worlds_long.long_rows`).
Each kind carries the `[data]` settings its rows need (`World.thinking`,
`World.max_length`), which `job_spec` writes into the job's recipe.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORDS = (
    "the draft model learns to predict the teacher tokens in each block after the anchor and "
    "the target verifies the block then accepts the longest matching prefix plus one bonus token"
).split()


@dataclass(frozen=True)
class World:
    root: Path
    target: Path
    draft: Path
    rows: Path
    family: str = "qwen3"
    kind: str = "plain"
    thinking: str = "off"  # `[data].thinking` for its rows
    max_length: int = 256  # `[data].max_length` that fits its rows


KINDS = ("plain", "tool", "thinking", "long")


def target_config(target: Path):
    """The saved target's text-tower config (a transformers config: `Qwen3Config`, `Qwen3_5TextConfig`, ...)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(target), local_files_only=True)
    return getattr(config, "text_config", None) or config


def write_rows(path: Path, *, examples: int, seed: int, words: Sequence[str] = WORDS, tag: str = "q") -> Path:
    """Own-data rows: short prompts of random `WORDS`, repetitive responses a draft can learn quickly (`words`
    in order from a random start); row `i`'s prompt starts with `{tag}{i}`."""
    rng = random.Random(seed)
    rows = []
    for i in range(examples):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 6)))
        start = rng.randrange(len(words))
        response = " ".join(words[(start + j) % len(words)] for j in range(rng.randint(10, 16)))
        rows.append({"prompt": f"{tag}{i} {prompt}", "response": response})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_world(
    root: str | Path, *, examples: int = 24, seed: int = 0, block_size: int = 4, family: str = "qwen3",
    kind: str = "plain", chat_template: str | None = None, long_tokens: tuple[int, int] = (4096, 16384),
    **target_kwargs: Any,
) -> World:
    """Write target (of `family`), released draft and rows of `kind` (`KINDS`) under `root`.

    `chat_template`: the target tokenizer's template (the `tool` world needs one that renders tools,
    e.g. a released Qwen3 template); `long_tokens`: the `long` world's prompt lengths (min, max).
    `target_kwargs` go to `save_tiny_target` (e.g. `expert_layout="packed"`)."""
    import torch

    from ..errors import ConfigError
    from ..model import DraftConfig, build_draft, save_draft
    from .tiny_draft import tiny_dflash2_config
    from .tokenizer import build_tiny_tokenizer, chat_template_for, save_tiny_target_with_tokenizer

    if kind not in KINDS:
        raise ConfigError(f"unknown world kind `{kind}`\nhint: use one of {', '.join(KINDS)}")
    if kind == "tool" and chat_template is None:
        raise ConfigError("the `tool` world needs a chat template that renders tools\n"
                          "hint: pass `chat_template=` (the tests use tests/data/chat_templates/qwen3.jinja)")
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    target = root / "target"
    if kind != "plain":
        tok = build_tiny_tokenizer(tool_tokens=kind == "tool")
        tok.chat_template = chat_template or chat_template_for(family)
        target_kwargs.setdefault("tokenizer", tok)
        # positions for the longest rows (the tiny configs default to 512)
        target_kwargs.setdefault("max_position_embeddings", 2 * long_tokens[1] if kind == "long" else 4096)
    _, tokenizer = save_tiny_target_with_tokenizer(target, seed=seed, family=family, **target_kwargs)
    cfg = tiny_dflash2_config(target_config(target), block_size=block_size, selector_top_k=64)
    draft = root / "draft"
    save_draft(build_draft(DraftConfig.from_dict(cfg), seed=seed), draft, dtype=torch.bfloat16)
    rows, thinking, max_length = _kind_rows(kind, root, tokenizer, examples=examples, seed=seed, long_tokens=long_tokens)
    return World(root, target, draft, rows, family, kind, thinking, max_length)


def _kind_rows(kind: str, root: Path, tokenizer: Any, *, examples: int, seed: int, long_tokens: tuple[int, int]):
    """The rows file of a world of `kind`, the `[data].thinking` and the `max_length` they need."""
    from .worlds_chat import thinking_rows, tool_rows, write_jsonl

    if kind == "plain":
        return write_rows(root / "rows.jsonl", examples=examples, seed=seed), "off", 256
    if kind == "tool":
        return write_jsonl(root / "rows.jsonl", tool_rows(examples, seed=seed)), "per_row", 2048
    if kind == "thinking":
        return write_jsonl(root / "rows.jsonl", thinking_rows(examples, seed=seed)), "per_row", 256
    from .worlds_long import long_rows

    rows = long_rows(examples, tokenizer, seed=seed, min_tokens=long_tokens[0], max_tokens=long_tokens[1])
    return write_jsonl(root / "rows.jsonl", rows), "off", long_tokens[1]


def job_spec(
    world: World, *, steps: int = 6, checkpoint_every: int = 2, stages: list[str] | None = None, regenerate: bool = False
) -> dict:
    """A job spec (see `dflash_worker.job`) that adapts the world's draft to its rows.

    `regenerate`: the teacher writes the responses (greedy), so the draft learns the
    teacher's own continuations, which is what speculative decoding accepts.
    """
    capture = {"dtype": "float32", "splits": ["train", "val"], "device": "cpu"}
    if regenerate:
        capture.update(regenerate=True, sampling="greedy", max_new_tokens=24)
    return {
        "stages": stages or ["prepare", "check", "capture", "train", "evaluate"],
        "inputs": [str(world.rows)],
        "prepare": {"seed": 0, "val_fraction": 0.2, "test_fraction": 0.2},
        "recipe": {
            "model": {"target": str(world.target), "draft": str(world.draft), "family": world.family},
            "data": {"thinking": world.thinking, "max_length": world.max_length,
                     **({"train_turns": "all"} if world.kind == "tool" else {})},
            "capture": capture,
            "train": {
                "scope": "full", "steps": steps, "lr": 3e-3, "blocks_per_sequence": 4, "val_every": 3,
                "checkpoint_every": checkpoint_every, "val_examples": 4, "device": "cpu", "warmup_steps": 1,
            },
            "evaluate": {"max_new_tokens": 24},
        },
        "evaluate": {"split": "test", "max_prompts": 4},
    }
