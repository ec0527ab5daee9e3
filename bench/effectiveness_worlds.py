"""Effectiveness in the chat-log and long-context worlds: `bench/effectiveness.py --world tool|thinking|long`.

These worlds come from `dflash_worker.testing.world` (`build_world(kind=...)`): a tiny Qwen3 target whose
tokenizer carries the world's chat template, the world's DFlash2 draft, and rows from the world's generator.
Every capture regenerates the responses with the teacher (greedy, `regenerate = true`), each row in its own
thinking mode (`[data].thinking = "per_row"`) with every assistant turn trained (`train_turns = "all"`), so
acceptance is measured against what the target itself writes. Per seed the rows are drawn anew (the world's
generators are seeded), prepared with a held-out test split, and scored by greedy speculative generation
(`effectiveness.measure`) per thinking mode or on the long prompts.

- `thinking`: the "released" draft is the world's draft trained `released_steps` on thinking-on rows only;
  adapted on mixed rows (both modes), it is scored per mode against the released one (issue 53: the weaker
  mode should rise by >= +25% while the other stays within -3%).
- `tool`: the world's draft adapted on multi-turn tool conversations, scored per mode.
- `long`: the same draft adapted on the long rows and on the same rows cut to `cut_tokens` tokens
  (`worlds_long.cut_row`), both scored on long held-out prompts (the long-context goal: >= +25% pooled tau
  for the long-trained draft).

The target has random weights (no pretraining here), so its greedy text is its own: the figures show
whether adaptation moves acceptance in each mode and length, not what a pretrained target would reach.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import effectiveness as eff

CHAT_WORLDS = ("tool", "thinking", "long")
# Rows per seed and the long world's prompt lengths, by preset name.
SIZES: dict[str, dict[str, Any]] = {
    "full": {"rows": 240, "long_rows": 48, "long_tokens": (4096, 16384), "cut_tokens": 256},
    "quick": {"rows": 80, "long_rows": 16, "long_tokens": (4096, 8192), "cut_tokens": 256},
    "smoke": {"rows": 24, "long_rows": 12, "long_tokens": (300, 600), "cut_tokens": 128},
}


def _template(kind: str) -> str | None:
    if kind != "tool":
        return None
    return (eff.ROOT / "tests" / "data" / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")


def _rows(kind: str, world, n: int, seed: int, *, long_tokens: tuple[int, int] = (0, 0),
          one_mode: bool | None = None) -> list[dict[str, Any]]:
    from dflash_worker.data import load_tokenizer
    from dflash_worker.testing.worlds_chat import thinking_rows, tool_rows
    from dflash_worker.testing.worlds_long import long_rows

    if kind == "tool":
        return tool_rows(n, seed=seed)
    if kind == "thinking":
        return thinking_rows(n, seed=seed, one_mode=one_mode)
    lo, hi = long_tokens
    return long_rows(n, load_tokenizer(world.target), seed=seed, min_tokens=lo, max_tokens=hi)


def _recipe(world, work: Path, draft: Path, s) -> dict[str, Any]:
    return {
        "model": {"target": str(world.target), "draft": str(draft), "family": world.family},
        "data": {"dir": str(work / "data"), "thinking": world.thinking, "max_length": world.max_length, "train_turns": "all"},
        "capture": {"output": str(work / "capture"), "dtype": "float32", "splits": ["train", "val"], "device": "cpu",
                    "regenerate": True, "sampling": "greedy", "max_new_tokens": s.capture_new_tokens},
    }


def prepare_capture(rows: list[dict[str, Any]], work: Path, world, draft: Path, s, *, seed: int, test_fraction: float) -> dict:
    """prepare-data (strict) -> check-data -> capture of `rows` under `work`; the recipe dict."""
    from dflash_worker.capture import run_capture
    from dflash_worker.data import check_data, prepare_data
    from dflash_worker.recipe import recipe_from_dict

    src = eff.write_jsonl(work / "rows.jsonl", rows)
    prepare_data([src], work / "data", seed=seed, val_fraction=0.15, test_fraction=test_fraction)
    check_data(work / "data", world.target, thinking=world.thinking, train_turns="all", max_length=world.max_length,
               regenerate=True, splits=("train", "val")).raise_if_failed()
    raw = _recipe(world, work, draft, s)
    run_capture(recipe_from_dict(raw, base=work), on_event=eff.progress(f"capture {work.name}"))
    return raw


def held_out(data_dir: Path, world, tokenizer, n: int) -> dict[str, list[tuple[str, list[int]]]]:
    """Up to `n` test prompts per thinking mode, rendered as the target serves them (own mode, tools)."""
    from types import SimpleNamespace

    from dflash_worker.data import PreparedData, render_row_prompt, resolve_thinking

    cfg = SimpleNamespace(thinking=world.thinking, train_turns="all")
    out: dict[str, list[tuple[str, list[int]]]] = {"on": [], "off": []}
    for ex in PreparedData(data_dir).iter_split("test"):
        mode = "on" if resolve_thinking(world.thinking, ex) else "off"
        if len(out[mode]) < n:
            out[mode].append((ex.id, render_row_prompt(tokenizer, ex, cfg)))
    return {m: p for m, p in out.items() if p}


def _train(raw: dict, run: Path, s, *, steps: int, lr: float, seed: int) -> Path:
    table = eff._train_table(s, steps=steps, lr=lr, seed=seed, out=run, scope="full")
    eff.train_and_export(raw, run, table, "bf16")
    return run / "export"


def _released(kind: str, world, s, root: Path, n: int) -> Path:
    """The draft every seed starts from: for `thinking`, the world's draft trained on thinking-on rows only."""
    if kind != "thinking":
        return world.draft
    work = root / "released"
    shutil.rmtree(work, ignore_errors=True)
    raw = prepare_capture(_rows(kind, world, 2 * n, 10_000, one_mode=True), work, world, world.draft, s, seed=0,
                          test_fraction=0.0)
    return _train(raw, work / "run", s, steps=s.released_steps, lr=s.released_lr, seed=0)


def run_world(kind: str, s, *, seeds: int, out: Path, threads: int = 1) -> dict[str, Any]:
    """Build the `kind` world, adapt per seed, score released vs adapted; writes `out/report.json`."""
    import torch

    from dflash_worker.data import PreparedData, load_tokenizer
    from dflash_worker.model import load_draft
    from dflash_worker.testing.world import build_world
    from dflash_worker.testing.worlds_long import cut_row
    from dflash_worker.weights import load_model

    torch.set_num_threads(threads)
    size = SIZES[s.name]
    out = Path(out).resolve()
    shutil.rmtree(out / "world", ignore_errors=True)
    t0 = time.perf_counter()
    world = build_world(out / "world", kind=kind, examples=4, block_size=s.block_size, chat_template=_template(kind),
                        long_tokens=size["long_tokens"])
    n = size["long_rows"] if kind == "long" else size["rows"]
    released = _released(kind, world, s, out, n)
    tokenizer = load_tokenizer(world.target)
    teacher = load_model(world.target, device=torch.device("cpu"), dtype=torch.float32)
    cpu = torch.device("cpu")
    rows_out: list[dict[str, Any]] = []
    for seed in range(seeds):
        sd = out / "seeds" / f"seed{seed}"
        shutil.rmtree(sd, ignore_errors=True)
        rows = _rows(kind, world, n, seed, long_tokens=size["long_tokens"])
        raw = prepare_capture(rows, sd / "own", world, released, s, seed=seed, test_fraction=0.25)
        if kind == "long":  # the same train rows at short context: the control the long-trained draft must beat
            test = {ex.prompt_messages[-1]["content"] for ex in PreparedData(sd / "own" / "data").iter_split("test")}
            cut = [cut_row(r, tokenizer, size["cut_tokens"]) for r in rows if r["prompt"] not in test]
            craw = prepare_capture(cut, sd / "cut", world, released, s, seed=seed, test_fraction=0.0)
        prompts = held_out(sd / "own" / "data", world, tokenizer, s.eval_prompts)
        if not prompts:
            from dflash_worker.errors import DataError

            raise DataError(f"seed {seed}: the `{kind}` world's test split is empty\nhint: draw more rows (`SIZES`)")
        drafts = {"released": load_draft(released, device=cpu, dtype=torch.float32)}
        for steps in s.recipe_steps:
            drafts[f"adapted@{steps}"] = load_draft(_train(raw, sd / f"run-{steps}", s, steps=steps, lr=s.recipe_lr, seed=seed),
                                                    device=cpu, dtype=torch.float32)
            if kind == "long":
                drafts[f"adapted_cut{size['cut_tokens']}@{steps}"] = load_draft(
                    _train(craw, sd / f"run-cut-{steps}", s, steps=steps, lr=s.recipe_lr, seed=seed), device=cpu, dtype=torch.float32)
        for mode, ps in prompts.items():
            m = eff.measure(drafts, teacher, ps, s, [tokenizer.eos_token_id])
            for name in drafts:
                rows_out.append({"seed": seed, "mode": mode, "draft": name, "prompts": len(ps),
                                 "pooled_tau": eff.pooled(m["drafts"][name]), "lossless": m["drafts"][name]["lossless"]})
    report = {"world": kind, "preset": s.name, "seeds": seeds, "sizes": {**size, "long_tokens": list(size["long_tokens"])},
              "released_steps": s.released_steps if kind == "thinking" else 0, "recipe_steps": list(s.recipe_steps),
              "rows": rows_out, "seconds": time.perf_counter() - t0}
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def render(report: dict[str, Any]) -> str:
    """A markdown table: pooled tau of each draft per mode, and its change over the released draft."""
    lines = [f"World `{report['world']}`, preset `{report['preset']}`, {report['seeds']} seed(s); "
             f"released steps {report['released_steps']}, adaptation steps {report['recipe_steps']}.", "",
             "| seed | mode | draft | prompts | pooled tau | vs released | lossless |", "|---|---|---|---|---|---|---|"]
    base = {(r["seed"], r["mode"]): r["pooled_tau"] for r in report["rows"] if r["draft"] == "released"}
    for r in report["rows"]:
        b = base[(r["seed"], r["mode"])]
        change = f"{r['pooled_tau'] / b - 1:+.1%}" if b else "n/a"
        lines.append(f"| {r['seed']} | {r['mode']} | {r['draft']} | {r['prompts']} | {r['pooled_tau']:.3f} | {change} | "
                     f"{'yes' if r['lossless'] else 'NO'} |")
    return "\n".join(lines)
