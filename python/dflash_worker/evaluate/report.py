"""Held-out evaluation of a training run: released draft (baseline) vs trained draft.

Both drafts run real speculative generation against the teacher
(`dflash_worker.evaluate.speculate.speculative_generate`) on the same prompts
of a held-out split (default ``test``) of a prepared data directory (default:
the run's own ``[data].dir``; ``data_dir`` / ``--data`` scores any other),
rendered with the run's chat template and thinking mode (each row's own with
``[data].thinking = "per_row"``), stopping on the
shared stop-token rule (`dflash_worker.stop_tokens`). Per draft and prompt we
record the per-step acceptance lengths exactly as `speculative_generate`
returns them and derive:

- acceptance length ``tau``: the headline is the **pooled** figure, committed
  tokens / verify steps over all prompts (what upstream ``dflash_generate``
  and the papers report); the mean of per-prompt ``tau`` is reported beside
  it (short answers weigh more in that mean); a prompt that made no verify
  step has no ``tau`` and is counted apart (`breakdown`);
- pooled ``tau`` per thinking mode and per context bucket (the anchor's
  position: 0-1k, 1k-4k, 4k-16k, 16k+ tokens; `breakdown`); ``min_context`` /
  ``max_context`` keep only the prompts of that many tokens;
- matching proposals = ``tau - 1`` (mean accepted draft tokens per step);
- per-position acceptance: for block position k, the fraction of steps that
  accepted at least k draft tokens (steps cut short by `max_new_tokens` or a
  stop token count as produced).

Verdict per prompt (on its ``tau``) and overall (on the pooled ``tau``;
``verdict_per_prompt_mean`` keeps the old basis): ``tied`` when
``|tau_trained - tau_baseline| <= tie_tolerance * tau_baseline``
(`[evaluate].tie_tolerance`, relative, default 2%), else ``improved`` or
``regressed``. With greedy decoding (temperature 0) speculative decoding is
lossless: each prompt is also decoded by the teacher alone (argmax, same stop
tokens and ``max_new_tokens``) and both drafts' outputs must equal it; the
report says ``lossless`` and names every prompt (and draft) that differs.

The trained draft is the run's BF16 export (``RUN/export``), loaded from its
files; for a run exported only as AF4G64 it is rebuilt from the selected
checkpoint through the same conversion the export used.

Outputs in the report directory: ``report.json``, ``report.md`` and
``acceptance.png`` (matplotlib, Agg backend).

Several ranks (``WORLD_SIZE`` N > 1, started by ``torchrun`` or by the run-manager for a
job leased N local ranks; `dflash_worker.dist`): rank r generates the prompts whose index
i has ``i % N == r``, each rank holding the teacher and both drafts on its own device.
Every prompt's row depends only on the prompt, its index (the sampling seed) and the
models, so rank 0 gathers the rows, puts them back in prompt order and writes the
same report one rank writes (tested byte for byte). Rank 0 alone reports progress:
when it finishes prompt i, about ``i + N`` prompts are done over all ranks.

Several jobs (a run's job graph with M evaluate shards; `EvalPart`): shard j generates the
prompts with ``i % M == j`` (its ranks divide those in turn). Shards 1..M-1 write their rows
to ``part-J.json`` in the report directory; shard 0 runs after them (the coordinator's edges),
reads those files, checks that each covers exactly its prompts of the same split and selected
step, and writes the one report from every row, the same report one process writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..stop_tokens import RULE as STOP_TOKENS_RULE
from ..worker.events import EventSink, Progress
from . import breakdown

if TYPE_CHECKING:
    from ..device import DeviceChoice
    from ..recipe import Recipe

VERDICTS = ("improved", "tied", "regressed")
PART_FORMAT = "dflash-eval-part/1"


@dataclass(frozen=True)
class EvalPart:
    """One job's share of an evaluation divided over `count` jobs: the prompts with ``i % count == index``."""

    index: int
    count: int

    def file(self, out_dir: Path, index: int | None = None) -> Path:
        return Path(out_dir) / f"part-{self.index if index is None else index}.json"


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
    from ..train.interpolate import selected_trainable
    from ..train.params import export_values

    _, trainable = selected_trainable(run_dir, recipe.model.draft, selection)  # (an interpolated selection's theta(alpha))
    model = load_draft(recipe.model.draft, device=device, dtype=torch.float32)
    qnames = quant_names_for(recipe.model.draft, recipe.require("train").qat_scope)
    params = dict(model.named_parameters())
    merged = {n: (trainable[n] if n in trainable else params[n]) for n in params}
    names = [n for n in params if n in trainable or n in qnames]
    values = export_values(merged, names, qat_names=[n for n in names if n in qnames])
    with torch.no_grad():
        for n, v in values.items():
            params[n].copy_(v.to(params[n].dtype))
    alpha = (selection.get("interpolation") or {}).get("alpha")
    between = "" if alpha is None else f", interpolated from the released draft at alpha {alpha:g}"
    return model, f"{run_dir / ckpt.CHECKPOINTS / selection['checkpoint']} (af4g64 values{between})"


def selection_facts(selection: dict[str, Any]) -> dict[str, Any]:
    """What the report says of the run's `selection` (``selection.json``): the selected step, the
    ``interpolation_alpha`` when the export is ``theta(alpha)`` between the released draft and that
    checkpoint (`train.interpolate`; else None), and ``selection_note``, the one line `train` also
    prints when the export is an interpolated point or the released draft itself (else None)."""
    from ..train.selection import outcome

    return {"selection_step": selection["step"], "interpolation_alpha": (selection.get("interpolation") or {}).get("alpha"),
            "selection_note": outcome(selection)}


STOP_RULE = STOP_TOKENS_RULE
TAU_POOLED = "committed tokens / verify steps over all prompts"
LOSSLESS_REFERENCE = "the teacher's own greedy decoding (argmax, same stop tokens and max_new_tokens)"


def summarize(rows: list[dict[str, Any]], name: str, block_size: int) -> dict[str, Any]:
    """Overall figures of draft `name`: pooled tau (the headline), the mean of per-prompt tau over the
    prompts that made a verify step (`breakdown.made_steps`), and pooled tau per thinking mode and
    per context bucket (rows without ``prompt_tokens``: no buckets)."""
    taus = [r[name]["tau"] for r in rows if breakdown.made_steps(r)]
    pooled = step_stats([a for r in rows for a in r[name]["acceptance_lengths"]], block_size)
    mean = sum(taus) / len(taus) if taus else 0.0
    out = {"tau_pooled": pooled["tau"], "tau_mean": mean, "matching_proposals_mean": mean - 1.0,
           "committed_tokens": sum(sum(r[name]["acceptance_lengths"]) for r in rows), "verify_steps": pooled["steps"],
           "pooled": pooled, "modes": breakdown.by_mode(rows, name)}
    if all("prompt_tokens" in r for r in rows):
        out["buckets"] = breakdown.by_bucket(rows, name)
    return out


class _Prompt(NamedTuple):
    """One prompt to evaluate: its example id, its rendered token ids and its thinking mode (``on`` / ``off``)."""

    id: str
    ids: list[int]
    thinking: str


def context_bounds(min_context: int | None, max_context: int | None) -> tuple[int, int | None]:
    """`--min-context` / `--max-context` checked: (least, most or None) prompt tokens."""
    from ..errors import ConfigError

    for flag, v in (("--min-context", min_context), ("--max-context", max_context)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ConfigError(f"`{flag}` is `{v}`, it must be a token count >= 0\nhint: e.g. `{flag} 4096`")
    lo = min_context or 0
    if max_context is not None and lo > max_context:
        raise ConfigError(f"`--min-context` `{lo}` is above `--max-context` `{max_context}`: no prompt can be selected\n"
                          "hint: swap them, or drop one")
    return lo, max_context


def _prompts(data_dir: Path, split: str, limit: int, tokenizer, data, context: tuple[int, int | None]) -> list[_Prompt]:
    """The first `limit` prompts of `split` whose rendered length is within `context` (inclusive), each
    rendered in its thinking mode (`[data].thinking` `data`: one for all, or each row's own with `per_row`)."""
    from ..data import PreparedData, resolve_thinking
    from ..data.render import render_row_prompt
    from ..errors import DataError

    lo, hi = context
    prompts, seen = [], 0
    for ex in PreparedData(data_dir).iter_split(split):
        ids = render_row_prompt(tokenizer, ex, data)
        seen += 1
        if len(ids) < lo or (hi is not None and len(ids) > hi):
            continue
        prompts.append(_Prompt(ex.id, ids, "on" if resolve_thinking(data.thinking, ex) else "off"))
        if len(prompts) >= limit:
            break
    if not prompts:
        within = "" if (lo, hi) == (0, None) else f" of {lo} to {hi if hi is not None else 'any'} tokens ({seen} seen)"
        raise DataError(f"split `{split}` of `{data_dir}` has no prompts{within} to evaluate\n"
                        "hint: pick another `--split`, `--data DIR` with prompts in that split"
                        + (", or widen `--min-context` / `--max-context`" if within else ""))
    return prompts


@dataclass(frozen=True)
class _Models:
    """What every prompt is generated with: the target, both drafts, the settings and the stop ids."""

    target: Any
    drafts: dict[str, Any]  # "baseline", "trained"
    ecfg: Any  # EvaluateConfig
    stop: list[int]
    device: Any  # torch.device

    @property
    def block_size(self) -> int:
        return self.drafts["baseline"].block_size


def _evaluate_prompt(m: _Models, i: int, prompt: _Prompt) -> dict[str, Any]:
    """One prompt: both drafts' speculative generation and, at temperature 0, the teacher's greedy decoding."""
    import torch

    from . import speculate

    target, ecfg, stop, T = m.target, m.ecfg, m.stop, m.block_size

    ids = prompt.ids
    x = torch.tensor([ids], dtype=torch.long, device=m.device)
    row: dict[str, Any] = {"id": prompt.id, "prompt_tokens": len(ids), "thinking": prompt.thinking}
    outs = {}
    for name, draft in m.drafts.items():
        gen = torch.Generator(device="cpu").manual_seed(i) if ecfg.temperature > 0 else None
        res = speculate.speculative_generate(
            draft, target, x, max_new_tokens=ecfg.max_new_tokens, stop_token_ids=stop,
            temperature=ecfg.temperature, generator=gen,
        )
        row[name] = {"acceptance_lengths": list(res.acceptance_lengths), **step_stats(res.acceptance_lengths, T),
                     "output_tokens": res.num_output_tokens, "stopped_on": res.stopped_on}
        outs[name] = res.output_ids[0].tolist()
    row["same_output"] = outs["baseline"] == outs["trained"]
    if ecfg.temperature == 0:
        teacher = speculate.greedy_generate(target, x, max_new_tokens=ecfg.max_new_tokens, stop_token_ids=stop)[0].tolist()
        row["teacher_output_tokens"] = len(teacher) - len(ids)
        row["matches_teacher"] = {name: out == teacher for name, out in outs.items()}
        row["lossless"] = all(row["matches_teacher"].values())
    row["verdict"] = verdict(row["trained"]["tau"], row["baseline"]["tau"], ecfg.tie_tolerance)
    return row


def _lossless(rows: list[dict[str, Any]], temperature: float) -> dict[str, Any]:
    if temperature != 0:
        return {"lossless": None, "lossless_mismatches": [], "lossless_reference": None}
    bad = [{"id": r["id"], "drafts": [n for n, ok in r["matches_teacher"].items() if not ok]} for r in rows if not r["lossless"]]
    return {"lossless": not bad, "lossless_mismatches": bad, "lossless_reference": LOSSLESS_REFERENCE}


def evaluate_run(
    run_dir: str | Path,
    *,
    split: str | None = None,
    out_dir: str | Path | None = None,
    max_prompts: int | None = None,
    on_event: EventSink | None = None,
    device: DeviceChoice | None = None,
    data_dir: str | Path | None = None,
    recipe: Recipe | None = None,
    part: EvalPart | None = None,
    min_context: int | None = None,
    max_context: int | None = None,
) -> dict[str, Any]:
    """Evaluate a completed run; writes report.json / report.md / acceptance.png and returns the report.

    `data_dir` is any prepared data directory (default: the run's own `[data].dir`). `on_event`
    gets a `Progress` (phase `evaluate`) after each prompt; `device`, when given, is where to run
    (the job runner's placement), else `[evaluate].device` is resolved here. `recipe`: the run's
    recipe when the run directory holds its export and `selection.json` but not the selected
    checkpoint (a graph's evaluate job), else the checkpoint's own is read. `part`: this job's
    share of an evaluation divided over jobs (module docstring); a shard other than 0 writes and
    returns its part file instead of a report. `min_context` / `max_context`: only the prompts of
    at least / at most that many tokens (`ConfigError` for a negative bound or min above max).
    """
    from .. import dist
    from ..device import resolve_device
    from ..recipe import EvaluateConfig
    from ..train.export_run import read_selection, recipe_from_state

    context = context_bounds(min_context, max_context)  # (refused before anything loads)
    ranks = dist.ranks_from_env()
    emit = (on_event or (lambda e: None)) if ranks.main else (lambda e: None)
    run_dir = Path(run_dir)
    selection = read_selection(run_dir)
    if recipe is None:
        recipe = recipe_from_state(run_dir, selection)
    ecfg = recipe.evaluate or EvaluateConfig()
    split = split or ecfg.split
    choice = device or resolve_device(ecfg.device)
    dev = dist.place(ranks, choice.torch_device)
    dist.init(ranks, dev)  # (a no-op under a job, which holds the group: `dflash_worker.job`)
    try:
        return _evaluate(run_dir, recipe, selection, ecfg, split, choice, dev, ranks, emit, out_dir, max_prompts, data_dir,
                         part or EvalPart(0, 1), context)
    finally:
        dist.shutdown(ranks)


def _evaluate_share(models: _Models, prompts: list[_Prompt], share: list[int], ranks, emit) -> list[tuple[int, dict]]:
    """Evaluate the prompts `share` lists (this part's), split over the ranks; every rank's `(index, row)`
    pairs gathered, in prompt order."""
    from .. import dist

    mine = [i for j, i in enumerate(share) if j % ranks.world == ranks.rank]
    local = []
    for j, i in enumerate(mine):
        local.append((i, _evaluate_prompt(models, i, prompts[i])))
        emit(Progress(phase="evaluate", step=min((j + 1) * ranks.world, len(share)), total_steps=len(share)))
    pairs = sorted((pair for piece in dist.gather(ranks, local) for pair in piece), key=lambda p: p[0])
    if [i for i, _ in pairs] != share:  # (a rank that lost prompts is a bug, not a smaller report)
        raise RuntimeError(f"evaluation gathered {len(pairs)} rows for {len(share)} prompts over {ranks.world} ranks")
    return pairs


def _evaluate(run_dir, recipe, selection, ecfg, split, choice, dev, ranks, emit, out_dir, max_prompts, data_dir, part, context):
    """`evaluate_run` once the device is placed: this rank's prompts, then rank 0's report (module docstring)."""
    import torch

    from ..data import load_tokenizer
    from ..device import provenance
    from ..model import load_draft
    from ..stop_tokens import stop_token_ids
    from ..weights import load_model

    data = Path(data_dir) if data_dir is not None else Path(recipe.data.dir)

    tokenizer = load_tokenizer(recipe.model.target)
    prompts = _prompts(data, split, max_prompts or ecfg.max_prompts, tokenizer, recipe.data, context)
    target = load_model(recipe.model.target, device=dev, dtype=torch.float32)
    stop = stop_token_ids(recipe.model.target, tokenizer)
    trained, trained_from = _trained_draft(run_dir, recipe, dev, selection)
    models = _Models(target, {"baseline": load_draft(recipe.model.draft, device=dev, dtype=torch.float32), "trained": trained},
                     ecfg, stop, dev)
    T = models.block_size

    share = [i for i in range(len(prompts)) if i % part.count == part.index]
    pairs = _evaluate_share(models, prompts, share, ranks, emit)
    out = Path(out_dir) if out_dir is not None else run_dir / f"evaluate-{split}"
    facts = {"split": split, "prompts": len(prompts), "selection_step": selection["step"], "temperature": ecfg.temperature,
             "max_new_tokens": ecfg.max_new_tokens, "context_filter": _context_filter(context)}
    if part.count > 1 and part.index > 0:
        doc = {"format": PART_FORMAT, "part": part.index, "parts": part.count, **facts,
               "prompt_ids": [prompts[i][0] for i in share], "rows": [[i, row] for i, row in pairs]}
        if ranks.main:
            from ..manifest import pretty_json, write_bytes_atomic

            out.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(part.file(out), pretty_json(doc))
        return doc
    for k in range(1, part.count):
        pairs += read_part(part.file(out, k), k, part.count, facts, prompts)
    rows = [row for _, row in sorted(pairs, key=lambda p: p[0])]

    base_o, tr_o = summarize(rows, "baseline", T), summarize(rows, "trained", T)
    scored = [r for r in rows if breakdown.made_steps(r)]
    report = {
        "run": str(run_dir),
        "data": str(data),
        "data_source": "run" if data_dir is None else "--data",
        "split": split,
        "prompts": len(rows),
        "block_size": T,
        "temperature": ecfg.temperature,
        "max_new_tokens": ecfg.max_new_tokens,
        "stop_token_ids": stop,
        "stop_token_rule": STOP_RULE,
        "tau_pooled_rule": TAU_POOLED,
        "tie_tolerance": ecfg.tie_tolerance,
        "tie_rule": "tied when |tau_trained - tau_baseline| <= tie_tolerance * tau_baseline",
        "baseline_draft": str(recipe.model.draft),
        "trained_draft": trained_from,
        **selection_facts(selection),
        "baseline": base_o,
        "trained": tr_o,
        "verdict": verdict(tr_o["tau_pooled"], base_o["tau_pooled"], ecfg.tie_tolerance),
        "verdict_basis": "tau_pooled",
        "verdict_per_prompt_mean": verdict(tr_o["tau_mean"], base_o["tau_mean"], ecfg.tie_tolerance),
        "verdict_counts": {v: sum(1 for r in scored if r["verdict"] == v) for v in VERDICTS},
        "scored_prompts": len(scored),
        "no_verify": breakdown.no_verify(rows),
        "context_filter": facts["context_filter"],
        "bucket_rule": breakdown.BUCKET_RULE,
        # kept for compatibility: compares the two drafts with each other, not with the teacher
        "greedy_outputs_identical": all(r["same_output"] for r in rows) if ecfg.temperature == 0 else None,
        **_lossless(rows, ecfg.temperature),
        "per_prompt": rows,
        "device": provenance(choice),
    }
    if ranks.main:
        write_report(report, out)
    return report


def _context_filter(context: tuple[int, int | None]) -> dict[str, Any] | None:
    """The report's record of `--min-context` / `--max-context` (None: every prompt)."""
    return None if context == (0, None) else {"min_tokens": context[0], "max_tokens": context[1]}


def read_part(path: Path, k: int, count: int, facts: dict[str, Any], prompts: list[_Prompt]) -> list[tuple[int, dict]]:
    """The rows of evaluate shard `k`'s part file (another provider's: checked, never trusted): it must be
    shard `k` of `count` of this split, prompt set and selected step, with one well-formed row for each
    of its prompts (``i % count == k``) in order; `DataError` names the file and what is wrong."""
    from ..errors import DataError

    def bad(why: str) -> DataError:
        return DataError(f"evaluate part `{path}`: {why}\nhint: every evaluate shard of the run must succeed on the same train job first")

    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise bad("missing") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise bad(f"not readable JSON ({str(exc)[:120]})") from None
    if not isinstance(doc, dict) or doc.get("format") != PART_FORMAT:
        raise bad(f"not a `{PART_FORMAT}` document")
    want = {"part": k, "parts": count, **facts}
    for key, value in want.items():
        if doc.get(key) != value or isinstance(doc.get(key), bool):
            raise bad(f"`{key}` is `{str(doc.get(key))[:40]}`, this evaluation has `{value}`")
    share = [i for i in range(len(prompts)) if i % count == k]
    rows = doc.get("rows")
    if not isinstance(rows, list) or [r[0] if isinstance(r, list) and len(r) == 2 else None for r in rows] != share:
        raise bad(f"its rows are not exactly prompts {share[:4]}{'...' if len(share) > 4 else ''} in order")
    for i, row in rows:
        if not _row_ok(row, greedy=facts["temperature"] == 0) or row["id"] != prompts[i][0]:
            raise bad(f"the row of prompt {i} is malformed or names another prompt")
    return [(i, row) for i, row in rows]


def _row_ok(row: Any, *, greedy: bool) -> bool:
    """The fields the report reads from a row, with their types."""
    if not isinstance(row, dict) or not isinstance(row.get("id"), str) or row.get("verdict") not in VERDICTS:
        return False
    tokens = row.get("prompt_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0 or row.get("thinking") not in ("on", "off"):
        return False
    for name in ("baseline", "trained"):
        d = row.get(name)
        if not isinstance(d, dict) or isinstance(d.get("tau"), bool) or not isinstance(d.get("tau"), (int, float)):
            return False
        lengths = d.get("acceptance_lengths")
        if not isinstance(lengths, list) or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 1 for a in lengths):
            return False
    if greedy:
        matches = row.get("matches_teacher")
        if not isinstance(row.get("lossless"), bool) or not isinstance(matches, dict) or not all(isinstance(v, bool) for v in matches.values()):
            return False
    return isinstance(row.get("same_output"), bool)


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
    """report.md: pooled tau first (with the per-prompt mean beside it), verdict, lossless check, tables."""
    b, t = r["baseline"], r["trained"]
    lines = [
        f"# Evaluation of `{r['run']}` on split `{r['split']}`",
        "",
        f"**Acceptance length tau (pooled, {TAU_POOLED}): baseline {b['tau_pooled']:.3f} -> trained {t['tau_pooled']:.3f}**"
        f" (per-prompt mean: baseline {b['tau_mean']:.3f} -> trained {t['tau_mean']:.3f}).",
        "",
        f"Overall verdict (on pooled tau): **{r['verdict']}** ({r['tie_rule']}, tie_tolerance {r['tie_tolerance']}).",
        *([f"Selection: {r['selection_note']}."] if r.get("selection_note") else []),
        f"Prompts: {r['prompts']} (improved {r['verdict_counts']['improved']}, tied {r['verdict_counts']['tied']}, "
        f"regressed {r['verdict_counts']['regressed']}, no verify step {r['no_verify']['prompts']}); "
        f"temperature {r['temperature']}, max_new_tokens {r['max_new_tokens']}.",
        f"Data: `{r['data']}` (from {r['data_source']}); stop token ids {r['stop_token_ids']} ({r['stop_token_rule']}).",
        "",
    ]
    lines += _lossless_lines(r)
    lines += [
        "| draft | tau (pooled) | tau (per-prompt mean) | matching proposals (pooled) | verify steps | committed tokens |",
        "|---|---|---|---|---|---|",
    ]
    alpha = f", alpha {r['interpolation_alpha']:g}" if r.get("interpolation_alpha") is not None else ""
    for label, o in (("baseline (released)", b), (f"trained (step {r['selection_step']}{alpha})", t)):
        lines.append(f"| {label} | {o['tau_pooled']:.3f} | {o['tau_mean']:.3f} | {o['pooled']['matching_proposals']:.3f} | "
                     f"{o['verify_steps']} | {o['committed_tokens']} |")
    lines += ["", *breakdown.markdown(r)]
    lines += [
        "",
        "Per-position acceptance (fraction of steps accepting at least k draft tokens):",
        "",
        "| k | baseline | trained |",
        "|---|---|---|",
    ]
    for k, (x, y) in enumerate(zip(b["pooled"]["per_position"], t["pooled"]["per_position"]), start=1):
        lines.append(f"| {k} | {x:.3f} | {y:.3f} |")
    lines += ["", "| prompt | tokens | thinking | baseline tau | trained tau | verdict | matches teacher |",
              "|---|---|---|---|---|---|---|"]
    for row in r["per_prompt"]:
        same = "-" if "lossless" not in row else ("yes" if row["lossless"] else "**no**")
        taus = (f"{row['baseline']['tau']:.3f} | {row['trained']['tau']:.3f} | {row['verdict']}" if breakdown.made_steps(row)
                else "- | - | no verify step")
        lines.append(f"| `{row['id']}` | {row.get('prompt_tokens', '-')} | {row.get('thinking', '-')} | {taus} | {same} |")
    return "\n".join(lines) + "\n"


def _lossless_lines(r: dict[str, Any]) -> list[str]:
    if r.get("lossless") is None:
        return ["Lossless check: not applicable (temperature > 0).", ""]
    if r["lossless"]:
        return [f"Lossless check: **passed**: both drafts' outputs equal {r['lossless_reference']} on every prompt.", ""]
    named = ", ".join(f"`{m['id']}` ({', '.join(m['drafts'])})" for m in r["lossless_mismatches"])
    return [f"Lossless check: **FAILED**: outputs differ from {r['lossless_reference']} on {named}.", ""]


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
    scored = [row for row in r["per_prompt"] if breakdown.made_steps(row)]  # (no verify step: no tau to draw)
    idx = range(len(scored))
    ax2.bar([i - 0.2 for i in idx], [row["baseline"]["tau"] for row in scored], width=0.4, label="baseline")
    ax2.bar([i + 0.2 for i in idx], [row["trained"]["tau"] for row in scored], width=0.4, label="trained")
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
