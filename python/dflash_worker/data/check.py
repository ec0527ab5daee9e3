"""`check-data`: render every prepared example with the target's tokenizer, before any weights load.

Only the tokenizer and chat template are read (`AutoTokenizer.from_pretrained`);
nothing here touches model weights, so training and capture call
`check_data` first and fail in seconds instead of after a long load.

Failure reasons (stable keys, counted in the report):

- ``special_token_in_text``: a control token string (``<|im_start|>``,
  ``</think>``, ...) inside message text; it would tokenize as the control
  token and corrupt the turn structure.
- ``render_error``: the template failed or does not produce the prompt as a
  prefix of the conversation.
- ``no_response``: a prompt-only row while responses are not regenerated.
- ``empty_loss_mask``: the response renders to no trainable tokens.
- ``too_long``: the rendered example exceeds ``max_length``; the message
  says how many response tokens truncation would keep.
- ``prompt_too_long``: the prompt alone fills ``max_length``; truncation
  would leave nothing to train on (or nothing to generate with).

``too_long`` and ``prompt_too_long`` are the *overlong* reasons: every such
example is also listed in `CheckReport.overlong` (not capped), with how many
response tokens truncation to ``max_length`` would keep, so capture can apply
``[capture].on_overlong`` (skip, truncate or fail) and `raise_if_failed` can
let them through.

Notes (counted, not failures): ``reasoning_dropped`` (thinking off, row has
reasoning), ``no_reasoning`` (thinking on, final turn has no reasoning).

Each example renders in its thinking mode (`render.resolve_thinking`: the
``thinking`` setting, or with ``per_row`` the row's own) with its ``tools``, and
trains the assistant turns ``train_turns`` says; `CheckReport.by_mode` counts
examples, tokens and response tokens per mode (``on`` / ``off``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, DataError
from .dataset import Example, PreparedData
from .prepare import SPLIT_NAMES
from .render import THINKING_SETTINGS, TRAIN_TURNS, control_tokens, render_example, render_prompt, resolve_thinking, special_tokens_in_text

MAX_LISTED_FAILURES = 20
OVERLONG_REASONS = ("too_long", "prompt_too_long")


@dataclass(frozen=True)
class Failure:
    """One failed example, located in the prepared split file and in the original input."""

    split: str
    file: str
    line: int
    id: str
    reason: str
    message: str
    origin: dict[str, Any]

    def describe(self) -> str:
        org = f" (input `{self.origin.get('file')}` line {self.origin.get('line')})" if self.origin else ""
        return f"`{self.file}` line {self.line}{org}: {self.reason}: {self.message}"


@dataclass(frozen=True)
class Overlong:
    """One example longer than `max_length`: its place, its length and what truncation would keep."""

    split: str
    id: str
    file: str
    line: int
    tokens: int  # rendered length (the prompt alone when responses are regenerated)
    kept_loss_tokens: int  # response tokens left after truncation to `max_length` (0: nothing to train on)


@dataclass
class CheckReport:
    """Summary of a check: counts, token statistics and the first failures."""

    thinking: str
    max_length: int
    regenerate: bool
    examples: int = 0
    examples_by_split: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    loss_tokens: int = 0
    longest: int = 0
    failure_counts: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    overlong: list[Overlong] = field(default_factory=list)
    train_turns: str = "all"
    # per resolved thinking mode (`on`, `off`): examples, tokens, loss_tokens
    by_mode: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(self.failure_counts.values())

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.examples > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "thinking": self.thinking,
            "train_turns": self.train_turns,
            "by_mode": self.by_mode,
            "max_length": self.max_length,
            "regenerate": self.regenerate,
            "examples": self.examples,
            "examples_by_split": self.examples_by_split,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "longest": self.longest,
            "failed": self.failed,
            "failure_counts": self.failure_counts,
            "notes": self.notes,
            "failures": [f.__dict__ | {"file": str(f.file)} for f in self.failures],
            "overlong": [o.__dict__ for o in self.overlong],
        }

    def raise_if_failed(self, *, overlong: str = "fail") -> None:
        """DataError listing the first failures (used by capture and training before loading weights).

        `overlong` is `[capture].on_overlong`: with `skip` or `truncate`, examples over
        `max_length` are not failures here (capture deals with them); with `fail`, when
        they are the only failures, the error names the first one's id and length.
        """
        if self.examples == 0:
            raise DataError("no examples to check in the prepared data")
        ignored = set(OVERLONG_REASONS) if overlong != "fail" else set()
        counted = {k: v for k, v in self.failure_counts.items() if k not in ignored}
        if not counted:
            return
        if set(counted) <= set(OVERLONG_REASONS) and self.overlong:
            o = self.overlong[0]
            raise DataError(
                f"example `{o.id}` (`{o.file}` line {o.line}) is `{o.tokens}` tokens, over max_length "
                f"`{self.max_length}` (`{len(self.overlong)}` of `{self.examples}` examples are)\n"
                "hint: `capture --on-overlong skip|truncate` (`[capture].on_overlong`), or raise `[data].max_length`"
            )
        lines = [f.describe() for f in self.failures if f.reason not in ignored][:5]
        counts = ", ".join(f"{k} `{v}`" for k, v in sorted(counted.items()))
        raise DataError(
            f"`{sum(counted.values())}` of `{self.examples}` examples failed the data check ({counts}):\n  "
            + "\n  ".join(lines)
            + "\nhint: run `dflash-worker check-data` for the full report"
        )


def load_tokenizer(target_dir: str | Path) -> Any:
    """The target's tokenizer and chat template, without reading any weights."""
    target_dir = Path(target_dir)
    if not target_dir.is_dir():
        raise CheckpointError(f"target dir `{target_dir}` does not exist")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(target_dir))
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError variously
        raise CheckpointError(
            f"cannot load the tokenizer from `{target_dir}`: {type(exc).__name__}: {exc}\n"
            "hint: the target dir needs `tokenizer.json` / `tokenizer_config.json`"
        ) from None
    if not getattr(tok, "chat_template", None):
        raise CheckpointError(
            f"the tokenizer in `{target_dir}` has no chat template\n"
            "hint: add `chat_template.jinja` (or `chat_template` in `tokenizer_config.json`)"
        )
    return tok


def check_example(
    tokenizer: Any,
    ex: Example,
    *,
    thinking: str,
    max_length: int,
    regenerate: bool,
    tokens: Sequence[str],
    train_turns: str = "all",
) -> tuple[list[tuple[str, str]], list[str], int, int, int]:
    """Check one example: `(failures as (reason, message), notes, length, loss_tokens, kept)`.

    `thinking`: the `[data].thinking` setting (resolved for this example by `resolve_thinking`).
    `kept`: the loss tokens within the first `max_length` tokens (what truncation keeps).
    """
    fails: list[tuple[str, str]] = []
    notes: list[str] = []
    for i, key, tok in special_tokens_in_text(ex.messages, tokens):
        fails.append(
            ("special_token_in_text", f"`messages[{i}].{key}` ({ex.messages[i]['role']}) contains control token `{tok}`")
        )
    if fails:
        return fails, notes, 0, 0, 0
    final = ex.messages[-1]
    enable = resolve_thinking(thinking, ex)
    tools = getattr(ex, "tools", None)
    if not enable and any(m.get("reasoning_content") for m in ex.messages):
        notes.append("reasoning_dropped")
    if enable and ex.has_response and not final.get("reasoning_content") and not regenerate:
        notes.append("no_reasoning")
    try:
        if regenerate:
            ids = render_prompt(tokenizer, ex.prompt_messages, thinking=enable, tools=tools)
            if len(ids) >= max_length:
                fails.append(
                    ("prompt_too_long", f"prompt is `{len(ids)}` tokens, leaving no room to generate within max_length `{max_length}`")
                )
            return fails, notes, len(ids), 0, 0
        if not ex.has_response:
            fails.append(("no_response", "prompt-only row\nhint: set `regenerate = true` in `[capture]` to generate responses"))
            return fails, notes, 0, 0, 0
        r = render_example(tokenizer, ex.messages, thinking=enable, tools=tools, train_turns=train_turns)
    except DataError as exc:
        fails.append(("render_error", str(exc)))
        return fails, notes, 0, 0, 0
    n, loss = len(r.input_ids), r.response_tokens
    kept = sum(r.loss_mask[:max_length])
    if loss == 0:
        fails.append(("empty_loss_mask", "the response renders to no trainable tokens"))
    elif r.prompt_length >= max_length:
        fails.append(
            ("prompt_too_long", f"prompt is `{r.prompt_length}` tokens >= max_length `{max_length}`; truncation would keep no response tokens")
        )
    elif n > max_length:
        fails.append(
            ("too_long", f"`{n}` tokens > max_length `{max_length}`; truncation would keep `{kept}` of `{loss}` response tokens")
        )
    return fails, notes, n, loss, kept


def check_data(
    data: str | Path | PreparedData,
    tokenizer: Any,
    *,
    thinking: str,
    max_length: int,
    regenerate: bool = False,
    splits: Sequence[str] = SPLIT_NAMES,
    on_progress: Callable[[int], None] | None = None,
    train_turns: str = "all",
) -> CheckReport:
    """Check every example of `splits`; `tokenizer` is a tokenizer or a target dir path.

    `thinking` and `train_turns` are the `[data]` settings. Never loads weights. Returns a
    report; call `report.raise_if_failed()` to turn failures into a DataError.
    """
    if thinking not in THINKING_SETTINGS:
        raise DataError(f"thinking mode is `{thinking}`\nhint: use `on`, `off` or `per_row`")
    if train_turns not in TRAIN_TURNS:
        raise DataError(f"train_turns is `{train_turns}`\nhint: use `last` or `all`")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise DataError(f"max_length must be a positive integer, found `{max_length}`")
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    prepared = data if isinstance(data, PreparedData) else PreparedData(data)
    tokens = control_tokens(tokenizer)
    report = CheckReport(thinking=thinking, max_length=max_length, regenerate=regenerate, train_turns=train_turns)
    by_mode = {mode: {"examples": 0, "tokens": 0, "loss_tokens": 0} for mode in ("on", "off")}
    fcounts: Counter[str] = Counter()
    ncounts: Counter[str] = Counter()
    by_split: Counter[str] = Counter()
    for ex in prepared.examples(splits):
        report.examples += 1
        by_split[ex.split] += 1
        fails, notes, n, loss, kept = check_example(
            tokenizer, ex, thinking=thinking, max_length=max_length, regenerate=regenerate, tokens=tokens,
            train_turns=train_turns,
        )
        mode = by_mode["on" if resolve_thinking(thinking, ex) else "off"]
        mode["examples"] += 1
        mode["tokens"] += n
        mode["loss_tokens"] += loss
        if fails and fails[0][0] in OVERLONG_REASONS:
            report.overlong.append(Overlong(split=ex.split, id=ex.id, file=str(ex.file), line=ex.line, tokens=n, kept_loss_tokens=kept))
        report.tokens += n
        report.loss_tokens += loss
        report.longest = max(report.longest, n)
        ncounts.update(notes)
        for reason, message in fails:
            fcounts[reason] += 1
            if len(report.failures) < MAX_LISTED_FAILURES:
                report.failures.append(
                    Failure(split=ex.split, file=str(ex.file), line=ex.line, id=ex.id, reason=reason, message=message, origin=ex.origin)
                )
        if on_progress is not None:
            on_progress(report.examples)
    report.failure_counts = dict(sorted(fcounts.items()))
    report.notes = dict(sorted(ncounts.items()))
    report.examples_by_split = {s: by_split[s] for s in splits}
    report.by_mode = by_mode
    return report
