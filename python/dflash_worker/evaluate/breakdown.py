"""The evaluation report's breakdowns: pure functions of the per-prompt rows, no model.

A row (`report._evaluate_prompt`) holds, per draft, the acceptance length of each verify step,
plus the prompt's length in tokens (``prompt_tokens``) and its thinking mode (``thinking``:
``on`` or ``off``). From those alone:

- **no verify step**: a prompt whose generation ended at the first token (the teacher's first
  token is a stop token, or ``max_new_tokens`` is 1) has no step, so no ``tau``; it is left out of
  the per-prompt figures (mean of per-prompt ``tau``, verdict counts) and counted apart with its
  reason, instead of being averaged in as ``tau`` 0. The pooled figures are unaffected (it adds
  no step and no token).
- **context buckets**: each verify step is attributed to the position of its block's anchor, the
  number of tokens before it (the context length at that step): the prompt's length plus the
  tokens the earlier steps committed. `BUCKETS` gives pooled ``tau`` and steps per bucket; a
  bucket with no step has ``tau`` None (empty, not zero).
- **thinking modes**: pooled ``tau`` over the prompts of each mode present.
"""

from __future__ import annotations

from typing import Any

# (label, first token count, last token count or None: no end), anchors' positions in tokens
BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("0-1k", 0, 1023),
    ("1k-4k", 1024, 4095),
    ("4k-16k", 4096, 16383),
    ("16k+", 16384, None),
)
BUCKET_RULE = "each verify step counts in the bucket of its block's anchor position (tokens before the anchor)"
NO_VERIFY_RULE = ("a prompt whose generation ended at its first token makes no verify step: it has no tau, so it is left "
                  "out of the per-prompt figures and counted apart; pooled figures are unchanged")


def anchor_positions(prompt_tokens: int, lengths: list[int]) -> list[int]:
    """The anchor position of each verify step: the first anchor is the token right after the prompt
    (position `prompt_tokens`), each step moves it by the tokens the step committed."""
    out, pos = [], prompt_tokens
    for a in lengths:
        out.append(pos)
        pos += a
    return out


def bucket_of(position: int) -> str:
    """The label of the `BUCKETS` entry holding anchor `position`."""
    for label, lo, hi in BUCKETS:
        if position >= lo and (hi is None or position <= hi):
            return label
    raise ValueError(f"anchor position `{position}` is negative")


def made_steps(row: dict[str, Any]) -> bool:
    """Whether both drafts made at least one verify step on the prompt of `row` (else it is left out
    of the per-prompt figures: `NO_VERIFY_RULE`)."""
    return all(row[name]["acceptance_lengths"] for name in ("baseline", "trained"))


def no_verify_reason(row: dict[str, Any]) -> str:
    """Why the prompt of `row` made no verify step (its baseline draft's generation says)."""
    stop = row["baseline"].get("stopped_on")
    if stop is not None:
        return f"the teacher's first token is a stop token (`{stop}`)"
    return "`max_new_tokens` ended the generation at its first token"


def no_verify(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The prompts left out of the per-prompt figures: how many, which, and why."""
    out = [{"id": r["id"], "reason": no_verify_reason(r)} for r in rows if not made_steps(r)]
    return {"prompts": len(out), "rule": NO_VERIFY_RULE, "left_out": out}


def _pooled(lengths: list[int]) -> dict[str, Any]:
    steps = len(lengths)
    return {"steps": steps, "committed_tokens": sum(lengths), "tau": sum(lengths) / steps if steps else None}


def by_bucket(rows: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Pooled tau and step count of draft `name` per context bucket (`BUCKETS`, all of them, in order;
    an empty one has ``steps`` 0 and ``tau`` None)."""
    lengths: dict[str, list[int]] = {label: [] for label, _, _ in BUCKETS}
    for r in rows:
        steps = r[name]["acceptance_lengths"]
        for pos, a in zip(anchor_positions(r["prompt_tokens"], steps), steps):
            lengths[bucket_of(pos)].append(a)
    return [{"bucket": label, "min_tokens": lo, "max_tokens": hi, **_pooled(lengths[label])} for label, lo, hi in BUCKETS]


def by_mode(rows: list[dict[str, Any]], name: str) -> dict[str, dict[str, Any]]:
    """Pooled tau of draft `name` per thinking mode present in `rows` (``on`` / ``off``), with the
    prompts of that mode and how many of them made no verify step."""
    out: dict[str, dict[str, Any]] = {}
    for mode in sorted({r["thinking"] for r in rows if "thinking" in r}):
        mine = [r for r in rows if r.get("thinking") == mode]
        out[mode] = {"prompts": len(mine), "no_verify_prompts": sum(1 for r in mine if not made_steps(r)),
                     **_pooled([a for r in mine for a in r[name]["acceptance_lengths"]])}
    return out


def _fmt(tau: float | None) -> str:
    return "empty" if tau is None else f"{tau:.3f}"


def markdown(r: dict[str, Any]) -> list[str]:
    """report.md's lines for the breakdowns of report `r`: prompts left out, modes, context buckets."""
    b, t = r["baseline"], r["trained"]
    nv = r["no_verify"]
    lines = [f"Prompts with no verify step: {nv['prompts']} of {r['prompts']}, left out of the per-prompt figures"
             + (": " + ", ".join(f"`{m['id']}` ({m['reason']})" for m in nv["left_out"]) if nv["left_out"] else "") + ".", ""]
    if r.get("context_filter"):
        f = r["context_filter"]
        lines += [f"Prompts selected by length: {f['min_tokens']} to {f['max_tokens'] if f['max_tokens'] is not None else 'any'} "
                  "tokens.", ""]
    lines += ["Acceptance length tau (pooled) per thinking mode:", "", "| thinking | prompts | baseline tau | trained tau | "
              "verify steps (baseline / trained) |", "|---|---|---|---|---|"]
    for mode, bm in b["modes"].items():
        tm = t["modes"][mode]
        lines.append(f"| {mode} | {bm['prompts']} | {_fmt(bm['tau'])} | {_fmt(tm['tau'])} | {bm['steps']} / {tm['steps']} |")
    if "buckets" not in b:
        return lines
    lines += ["", f"Acceptance length tau (pooled) per context bucket ({BUCKET_RULE}):", "",
              "| context (tokens) | baseline tau | baseline steps | trained tau | trained steps |", "|---|---|---|---|---|"]
    for x, y in zip(b["buckets"], t["buckets"]):
        lines.append(f"| {x['bucket']} | {_fmt(x['tau'])} | {x['steps']} | {_fmt(y['tau'])} | {y['steps']} |")
    return lines


def summary_lines(r: dict[str, Any]) -> list[str]:
    """The `evaluate` command's lines after its headline: per thinking mode, per context bucket, and
    the prompts left out of the per-prompt figures; first, when the run's selection was an interpolated
    point or the released draft itself, the line saying so (``selection_note``)."""
    b, t = r["baseline"], r["trained"]
    modes = "; ".join(f"{m} {_fmt(bm['tau'])} -> {_fmt(t['modes'][m]['tau'])} ({bm['prompts']} prompts)"
                      for m, bm in b["modes"].items())
    lines = [f"evaluate: {r['selection_note']}"] if r.get("selection_note") else []
    lines.append(f"evaluate: per thinking mode, acceptance length (pooled) baseline -> trained: {modes}")
    if "buckets" in b:
        cells = "; ".join(f"{x['bucket']} " + ("empty" if not (x["steps"] or y["steps"]) else
                                               f"{_fmt(x['tau'])} -> {_fmt(y['tau'])} ({x['steps']} / {y['steps']} steps)")
                          for x, y in zip(b["buckets"], t["buckets"]))
        lines.append(f"evaluate: per context bucket (anchor position, tokens), baseline -> trained: {cells}")
    nv = r["no_verify"]
    if nv["prompts"]:
        lines.append(f"evaluate: {nv['prompts']} of {r['prompts']} prompts made no verify step (the generation ended at the "
                     "first token), left out of the per-prompt figures")
    return lines
