"""Held-out evaluation of a training run: released draft (baseline) vs trained draft.

Both drafts run real speculative generation against the teacher
(`dflash_worker.evaluate.speculate.speculative_generate`) on the same prompts
of a held-out split (default ``test``), rendered with the run's chat template
and thinking mode. Per draft and prompt we record the per-step acceptance
lengths exactly as `speculative_generate` returns them and derive:

- acceptance length ``tau`` = mean tokens per verify step (accepted draft
  tokens + the bonus token);
- matching proposals = ``tau - 1`` (mean accepted draft tokens per step);
- per-position acceptance: for block position k, the fraction of steps that
  accepted at least k draft tokens (steps cut short by `max_new_tokens` or a
  stop token count as produced).

Verdict per prompt and overall (overall compares the mean of the per-prompt
``tau``): ``tied`` when ``|tau_trained - tau_baseline| <= tie_tolerance *
tau_baseline`` (`[evaluate].tie_tolerance`, relative, default 2%), else
``improved`` or ``regressed``. With greedy decoding (temperature 0) both
drafts must reproduce the teacher's own greedy output; the report records
whether they did.

The trained draft is the run's BF16 export (``RUN/export``), loaded from its
files; for a run exported only as AF4G64 it is rebuilt from the selected
checkpoint through the same conversion the export used.

Outputs in the report directory: ``report.json``, ``report.md`` and
``acceptance.png`` (matplotlib, Agg backend).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..worker.events import EventSink, Progress

if TYPE_CHECKING:
    from ..device import DeviceChoice

VERDICTS = ("improved", "tied", "regressed")


def verdict(trained: float, baseline: float, tolerance: float) -> str:
    """improved / tied / regressed of `trained` vs `baseline` acceptance length (relative tolerance)."""
    if abs(trained - baseline) <= tolerance * baseline:
        return "tied"
    return "improved" if trained > baseline else "regressed"


def step_stats(lengths: list[int], block_size: int) -> dict[str, Any]:
    """tau, matching proposals and per-position acceptance of one generation's acceptance lengths."""
    steps = len(lengths)
    tau = sum(lengths) / steps if steps else 0.0
    per_pos = [(sum(1 for a in lengths if a - 1 >= k) / steps) if steps else 0.0 for k in range(1, block_size)]
    return {"steps": steps, "tau": tau, "matching_proposals": tau - 1.0 if steps else 0.0, "per_position": per_pos}


def _trained_draft(run_dir: Path, recipe, device, selection: dict[str, Any]):
    import torch

    from ..model import load_draft

    bf16 = run_dir / "export"
    if (bf16 / "manifest.json").is_file():
        from ..train.export_run import verify_export

        verify_export(bf16)
        return load_draft(bf16, device=device, dtype=torch.float32), str(bf16)
    from ..train import checkpoint as ckpt
    from ..train.export_run import quant_names_for
    from ..train.params import export_values

    loaded = ckpt.load(run_dir / ckpt.CHECKPOINTS / selection["checkpoint"])
    model = load_draft(recipe.model.draft, device=device, dtype=torch.float32)
    qnames = quant_names_for(recipe.model.draft, recipe.require("train").qat_scope)
    params = dict(model.named_parameters())
    merged = {n: (loaded.trainable[n] if n in loaded.trainable else params[n]) for n in params}
    names = [n for n in params if n in loaded.trainable or n in qnames]
    values = export_values(merged, names, qat_names=[n for n in names if n in qnames])
    with torch.no_grad():
        for n, v in values.items():
            params[n].copy_(v.to(params[n].dtype))
    return model, f"{run_dir / ckpt.CHECKPOINTS / selection['checkpoint']} (af4g64 values)"


def evaluate_run(
    run_dir: str | Path,
    *,
    split: str | None = None,
    out_dir: str | Path | None = None,
    max_prompts: int | None = None,
    on_event: EventSink | None = None,
    device: DeviceChoice | None = None,
) -> dict[str, Any]:
    """Evaluate a completed run; writes report.json / report.md / acceptance.png and returns the report.

    `on_event` gets a `Progress` (phase `evaluate`) after each prompt; `device`, when given,
    is where to run (the job runner's placement), else `[evaluate].device` is resolved here.
    """
    import torch

    from ..data import PreparedData, load_tokenizer, render_prompt
    from ..device import provenance, resolve_device
    from ..errors import DataError
    from ..model import load_draft
    from ..recipe import EvaluateConfig
    from ..train.export_run import read_selection, recipe_from_state
    from ..weights import load_model
    from .speculate import speculative_generate

    emit = on_event or (lambda e: None)
    run_dir = Path(run_dir)
    selection = read_selection(run_dir)
    recipe = recipe_from_state(run_dir, selection)
    ecfg = recipe.evaluate or EvaluateConfig()
    split = split or ecfg.split
    limit = max_prompts or ecfg.max_prompts
    choice = device or resolve_device(ecfg.device)
    dev = choice.torch_device

    tokenizer = load_tokenizer(recipe.model.target)
    prompts = []
    for ex in PreparedData(recipe.data.dir).iter_split(split):
        prompts.append((ex.id, render_prompt(tokenizer, ex.prompt_messages, thinking=recipe.data.thinking)))
        if len(prompts) >= limit:
            break
    if not prompts:
        raise DataError(f"split `{split}` of `{recipe.data.dir}` has no prompts to evaluate\nhint: use `--split val` or prepare data with a test fraction")
    target = load_model(recipe.model.target, device=dev, dtype=torch.float32)
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    baseline = load_draft(recipe.model.draft, device=dev, dtype=torch.float32)
    trained, trained_from = _trained_draft(run_dir, recipe, dev, selection)
    T = baseline.block_size

    rows = []
    for i, (pid, ids) in enumerate(prompts):
        x = torch.tensor([ids], dtype=torch.long, device=dev)
        row: dict[str, Any] = {"id": pid, "prompt_tokens": len(ids)}
        outs = {}
        for name, draft in (("baseline", baseline), ("trained", trained)):
            gen = torch.Generator(device="cpu").manual_seed(i) if ecfg.temperature > 0 else None
            res = speculative_generate(
                draft, target, x, max_new_tokens=ecfg.max_new_tokens, stop_token_ids=stop,
                temperature=ecfg.temperature, generator=gen,
            )
            row[name] = {"acceptance_lengths": list(res.acceptance_lengths), **step_stats(res.acceptance_lengths, T),
                         "output_tokens": res.num_output_tokens}
            outs[name] = res.output_ids[0].tolist()
        row["same_output"] = outs["baseline"] == outs["trained"]
        row["verdict"] = verdict(row["trained"]["tau"], row["baseline"]["tau"], ecfg.tie_tolerance)
        rows.append(row)
        emit(Progress(phase="evaluate", step=i + 1, total_steps=len(prompts)))

    def overall(name: str) -> dict[str, Any]:
        taus = [r[name]["tau"] for r in rows]
        all_lengths = [a for r in rows for a in r[name]["acceptance_lengths"]]
        pooled = step_stats(all_lengths, T)
        return {"tau_mean": sum(taus) / len(taus), "matching_proposals_mean": sum(taus) / len(taus) - 1.0,
                "pooled": pooled}

    base_o, tr_o = overall("baseline"), overall("trained")
    report = {
        "run": str(run_dir),
        "split": split,
        "prompts": len(rows),
        "block_size": T,
        "temperature": ecfg.temperature,
        "max_new_tokens": ecfg.max_new_tokens,
        "tie_tolerance": ecfg.tie_tolerance,
        "tie_rule": "tied when |tau_trained - tau_baseline| <= tie_tolerance * tau_baseline",
        "baseline_draft": str(recipe.model.draft),
        "trained_draft": trained_from,
        "selection_step": selection["step"],
        "baseline": base_o,
        "trained": tr_o,
        "verdict": verdict(tr_o["tau_mean"], base_o["tau_mean"], ecfg.tie_tolerance),
        "verdict_counts": {v: sum(1 for r in rows if r["verdict"] == v) for v in VERDICTS},
        "greedy_outputs_identical": all(r["same_output"] for r in rows) if ecfg.temperature == 0 else None,
        "per_prompt": rows,
        "device": provenance(choice),
    }
    out = Path(out_dir) if out_dir is not None else run_dir / f"evaluate-{split}"
    write_report(report, out)
    return report


def write_report(report: dict[str, Any], out_dir: str | Path) -> Path:
    """report.json, report.md and acceptance.png into `out_dir` (each written atomically)."""
    from ..manifest import pretty_json, write_bytes_atomic

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out / "report.json", pretty_json(report))
    write_bytes_atomic(out / "report.md", render_markdown(report).encode())
    plot(report, out / "acceptance.png")
    return out


def render_markdown(r: dict[str, Any]) -> str:
    b, t = r["baseline"], r["trained"]
    lines = [
        f"# Evaluation of `{r['run']}` on split `{r['split']}`",
        "",
        f"Overall verdict: **{r['verdict']}** ({r['tie_rule']}, tie_tolerance {r['tie_tolerance']}).",
        f"Prompts: {r['prompts']} (improved {r['verdict_counts']['improved']}, tied {r['verdict_counts']['tied']}, "
        f"regressed {r['verdict_counts']['regressed']}); temperature {r['temperature']}, max_new_tokens {r['max_new_tokens']}.",
        "",
        "| draft | acceptance length (mean tau) | matching proposals | steps |",
        "|---|---|---|---|",
        f"| baseline (released) | {b['tau_mean']:.3f} | {b['matching_proposals_mean']:.3f} | {b['pooled']['steps']} |",
        f"| trained (step {r['selection_step']}) | {t['tau_mean']:.3f} | {t['matching_proposals_mean']:.3f} | {t['pooled']['steps']} |",
        "",
        "Per-position acceptance (fraction of steps accepting at least k draft tokens):",
        "",
        "| k | baseline | trained |",
        "|---|---|---|",
    ]
    for k, (x, y) in enumerate(zip(b["pooled"]["per_position"], t["pooled"]["per_position"]), start=1):
        lines.append(f"| {k} | {x:.3f} | {y:.3f} |")
    lines += ["", "| prompt | baseline tau | trained tau | verdict |", "|---|---|---|---|"]
    for row in r["per_prompt"]:
        lines.append(f"| `{row['id']}` | {row['baseline']['tau']:.3f} | {row['trained']['tau']:.3f} | {row['verdict']} |")
    if r.get("greedy_outputs_identical") is not None:
        lines += ["", f"Greedy outputs identical for both drafts (lossless check): {r['greedy_outputs_identical']}."]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ks = list(range(1, r["block_size"]))
    ax1.plot(ks, r["baseline"]["pooled"]["per_position"], marker="o", label="baseline (released)")
    ax1.plot(ks, r["trained"]["pooled"]["per_position"], marker="o", label=f"trained (step {r['selection_step']})")
    ax1.set_xlabel("block position k")
    ax1.set_ylabel("P(accepted >= k)")
    ax1.set_title("per-position acceptance")
    ax1.legend()
    idx = range(len(r["per_prompt"]))
    ax2.bar([i - 0.2 for i in idx], [row["baseline"]["tau"] for row in r["per_prompt"]], width=0.4, label="baseline")
    ax2.bar([i + 0.2 for i in idx], [row["trained"]["tau"] for row in r["per_prompt"]], width=0.4, label="trained")
    ax2.set_xlabel("prompt")
    ax2.set_ylabel("acceptance length tau")
    ax2.set_title(f"verdict: {r['verdict']}")
    ax2.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=80)
    plt.close(fig)
    import os

    os.replace(tmp, path)
