"""The long-context world: documents of thousands of tokens whose continuation depends on their start.

Each row (`long_row`) is a `prompt` / `response` pair. The prompt opens with a ledger's facts (who
keeps it, its passphrase, the meaning of an invented term), then thousands of tokens of filler:
sentences drawn from a fixed vocabulary and distractor lines naming other ledgers' keepers, then a
question. The response restates the opening facts, so a draft predicts it well only by attending
back to the document's first tokens (a draft that sees only a short window near the question, or
was trained only on short contexts, cannot).

Lengths are measured with the target's tokenizer: the prompt's own tokens (before any chat
template) fall in `[min_tokens, max_tokens - TEMPLATE_ROOM]`, drawn per row. Deterministic by seed
(row `i` from its own `random.Random`, whatever `n` is). `cut_row` keeps the same opening, question
and response but only as much filler as fits a short budget: the same text at short context, the
control a long-context benchmark adapts on.
"""

from __future__ import annotations

import random
from typing import Any

# Tokens left for the chat template's markup around the prompt and for the response.
TEMPLATE_ROOM = 96

_SYLLABLES = ("ka", "lo", "mi", "ren", "tas", "vo", "ul", "dri", "sen", "pa", "zor", "eth", "qui", "mar", "bel")
_FILLER = (
    "the river ran past the old mill and the miller counted sacks of grain before the market opened while "
    "clerks copied figures into books and the harbour bell rang twice at noon as ships waited for the tide "
    "merchants argued over the price of salt wool and copper and a boy carried letters up the hill to the "
    "chapel where candles burned through the long winter evenings"
).split()


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def _facts(rng: random.Random, i: int) -> dict[str, str]:
    return {
        "ledger": f"Ledger {i}",
        "keeper": f"{_name(rng, 2)} {_name(rng, 3)}",
        "passphrase": f"{_name(rng, 2).lower()}-{_name(rng, 2).lower()}-{rng.randint(10, 99)}",
        "term": _name(rng, 3).lower(),
        "meaning": f"a {rng.choice(('copper', 'wool', 'salt', 'grain'))} tally kept for {rng.randint(3, 40)} days",
    }


def _paragraph(rng: random.Random, i: int) -> str:
    words = [rng.choice(_FILLER) for _ in range(rng.randint(40, 70))]
    text = " ".join(words).capitalize() + "."
    if rng.random() < 0.3:  # distractors: other ledgers' keepers, never this one's facts
        text += f" Ledger {i + rng.randint(1, 900)} was kept by {_name(rng, 2)} {_name(rng, 3)}."
    return text


def _assemble(f: dict[str, str], paragraphs: list[str]) -> tuple[str, str]:
    head = (f"{f['ledger']}. The keeper of this ledger is {f['keeper']}. Its passphrase is {f['passphrase']}. "
            f"In this ledger a {f['term']} means {f['meaning']}.")
    question = f"Question: who keeps {f['ledger']}, what is its passphrase, and what does {f['term']} mean?"
    response = (f"{f['ledger']} is kept by {f['keeper']}. Its passphrase is {f['passphrase']}. "
                f"A {f['term']} means {f['meaning']}.")
    return "\n\n".join([head, *paragraphs, question]), response


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def long_row(i: int, tokenizer: Any, *, seed: int = 0, min_tokens: int = 4096, max_tokens: int = 16384) -> dict[str, Any]:
    """Row `i` of the long-context world of `seed` (see the module docstring); `tokenizer` measures lengths."""
    if not 0 < min_tokens <= max_tokens - TEMPLATE_ROOM:
        raise ValueError(f"need 0 < min_tokens <= max_tokens - {TEMPLATE_ROOM}, found {min_tokens}, {max_tokens}")
    rng = random.Random(f"long:{seed}:{i}")
    facts = _facts(rng, i)
    goal = rng.randint(min_tokens, max_tokens - TEMPLATE_ROOM)
    paragraphs: list[str] = []
    # grow by the paragraphs' own counts (cheap), then settle on the whole prompt's count (exact)
    estimate = _count(tokenizer, _assemble(facts, [])[0])
    while estimate < goal:
        p = _paragraph(rng, i)
        paragraphs.append(p)
        estimate += _count(tokenizer, p) + 1
    prompt, response = _assemble(facts, paragraphs)
    while _count(tokenizer, prompt) > max_tokens - TEMPLATE_ROOM and paragraphs:
        paragraphs.pop()
        prompt, response = _assemble(facts, paragraphs)
    while _count(tokenizer, prompt) < min_tokens:
        paragraphs.append(_paragraph(rng, i))
        prompt, response = _assemble(facts, paragraphs)
    return {"prompt": prompt, "response": response, "source": "long-world", "facts": facts}


def long_rows(n: int, tokenizer: Any, *, seed: int = 0, min_tokens: int = 4096, max_tokens: int = 16384) -> list[dict[str, Any]]:
    """The first `n` rows of the long-context world of `seed`."""
    return [long_row(i, tokenizer, seed=seed, min_tokens=min_tokens, max_tokens=max_tokens) for i in range(n)]


def cut_row(row: dict[str, Any], tokenizer: Any, max_tokens: int = 256) -> dict[str, Any]:
    """`row` with its filler cut so the prompt fits `max_tokens` (opening, question and response kept)."""
    paragraphs = row["prompt"].split("\n\n")[1:-1]
    facts = row["facts"]
    prompt, response = _assemble(facts, paragraphs)
    while paragraphs and _count(tokenizer, prompt) > max_tokens:
        # halve the filler while it is long, then drop paragraphs one at a time
        paragraphs = paragraphs[: len(paragraphs) // 2] if len(paragraphs) > 8 else paragraphs[:-1]
        prompt, response = _assemble(facts, paragraphs)
    return {**row, "prompt": prompt, "response": response, "source": "long-world-cut"}
