"""Chat-log worlds: multi-turn tool conversations and thinking rows, written as serving stacks log them.

Both generators are deterministic by seed (each row from its own `random.Random`, so row `i` of a
seed does not depend on how many rows are asked for) and write rows that `prepare-data` accepts
without `--skip-invalid`:

- `tool_rows`: the OpenAI / Hugging Face chat format with a row-level `tools` list (only the
  functions the row uses), assistant turns with `tool_calls` (arguments an object or a JSON string,
  content empty, null or a short preface), `tool` turns answering them by `tool_call_id`, and final
  answers that restate the tool results (so a draft must copy from the tool turn, not guess). One
  or two tool rounds, parallel calls, an optional system turn and a closing exchange. Rows cycle
  through four thinking shapes (`THINKING_SHAPES`) so `[data].thinking = "per_row"` sees both modes,
  given explicitly and inferred from `reasoning_content`.
- `thinking_rows`: short arithmetic questions answered with a reasoning trace in words and a short
  answer (thinking on) or, without reasoning (off), with the working in the answer in symbols (as
  served models write differently in each mode), every row with its explicit `"thinking"`;
  `on_fraction` sets the mix and `one_mode` keeps the rows of one mode (what a draft "released" on
  one mode only was trained on).

The tools' answers are computed, never drawn: `add` adds, `get_weather` hashes the city, and
`capital_of` looks the country up, so a conversation's final answer follows from its tool turns.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

# (explicit "thinking" key or None, assistant turns carry reasoning): rows cycle through these, so a
# per_row dataset holds both modes, each both given explicitly and inferred from the reasoning
THINKING_SHAPES = ((True, True), (False, False), (None, True), (None, False))

_CAPITALS = {
    "France": "Paris", "Peru": "Lima", "Japan": "Tokyo", "Kenya": "Nairobi", "Norway": "Oslo",
    "Chile": "Santiago", "Egypt": "Cairo", "Canada": "Ottawa", "Spain": "Madrid", "India": "New Delhi",
}
_CITIES = ("Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Madrid", "Nairobi", "Quito", "Hanoi", "Dakar")
_SKIES = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy")

TOOLS: dict[str, dict[str, Any]] = {
    "add": {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
    "get_weather": {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    "capital_of": {"type": "function", "function": {
        "name": "capital_of", "description": "The capital city of a country.",
        "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}},
}


def weather(city: str) -> dict[str, Any]:
    """`get_weather`'s answer: a function of the city's name alone (same city, same weather)."""
    h = hashlib.sha256(city.encode()).digest()
    return {"city": city, "temp_c": h[0] % 36 - 5, "sky": _SKIES[h[1] % len(_SKIES)]}


def _task(rng: random.Random) -> dict[str, Any]:
    """One user request, the calls answering it, their results, and the answer built from the results."""
    kind = rng.choice(("add", "get_weather", "capital_of", "weather_pair"))
    if kind == "add":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return {"ask": f"What is {a} plus {b}?", "calls": [("add", {"a": a, "b": b}, str(a + b))],
                "why": f"The user wants the sum of {a} and {b}, so I call add.",
                "answer": f"{a} plus {b} is {a + b}.", "after": f"The tool returned {a + b}."}
    if kind == "capital_of":
        country = rng.choice(sorted(_CAPITALS))
        cap = _CAPITALS[country]
        return {"ask": f"What is the capital of {country}?", "calls": [("capital_of", {"country": country}, cap)],
                "why": f"I should look up the capital of {country}.",
                "answer": f"The capital of {country} is {cap}.", "after": f"The tool says {cap}."}
    cities = rng.sample(_CITIES, 2 if kind == "weather_pair" else 1)
    results = [weather(c) for c in cities]
    calls = [("get_weather", {"city": c}, json.dumps(w)) for c, w in zip(cities, results, strict=True)]
    said = [f"in {w['city']} it is {w['temp_c']} degrees and {w['sky']}" for w in results]
    return {"ask": "What is the weather " + " and ".join(f"in {c}" for c in cities) + "?", "calls": calls,
            "why": "I need the weather of " + " and ".join(cities) + ", one call per city.",
            "answer": "Right now " + ", and ".join(said) + ".",
            "after": "The tool answered for " + " and ".join(cities) + "."}


def _round(rng: random.Random, task: dict[str, Any], *, row: int, k: int, reasoning: bool) -> list[dict[str, Any]]:
    """The assistant's call turn, one tool turn per call, and the assistant's answer."""
    calls, tool_turns = [], []
    for j, (name, args, result) in enumerate(task["calls"]):
        cid = f"call_{row}_{k}_{j}"
        # serving logs hold both: arguments as an object and as a JSON string
        calls.append({"type": "function", "id": cid,
                      "function": {"name": name, "arguments": json.dumps(args) if rng.random() < 0.5 else args}})
        turn = {"role": "tool", "tool_call_id": cid, "content": result}
        if rng.random() < 0.5:
            turn["name"] = name
        tool_turns.append(turn)
    call_turn: dict[str, Any] = {"role": "assistant", "content": rng.choice(("", None, "Let me check.")), "tool_calls": calls}
    answer: dict[str, Any] = {"role": "assistant", "content": task["answer"]}
    if reasoning:
        call_turn["reasoning_content"] = task["why"]
        answer["reasoning_content"] = task["after"]
    return [call_turn, *tool_turns, answer]


def tool_row(i: int, *, seed: int = 0) -> dict[str, Any]:
    """Row `i` of the tool world of `seed` (see the module docstring)."""
    rng = random.Random(f"tool:{seed}:{i}")
    explicit, reasoning = THINKING_SHAPES[i % len(THINKING_SHAPES)]
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are a helpful assistant. Use the tools when they help."})
    used: list[str] = []
    for k in range(rng.choice((1, 1, 2))):
        task = _task(rng)
        messages.append({"role": "user", "content": task["ask"]})
        messages += _round(rng, task, row=i, k=k, reasoning=reasoning)
        used += [name for name, _, _ in task["calls"] if name not in used]
    if rng.random() < 0.3:
        messages.append({"role": "user", "content": "Thanks, that is all."})
        closing: dict[str, Any] = {"role": "assistant", "content": "You are welcome."}
        if reasoning:
            closing["reasoning_content"] = "The user is done."
        messages.append(closing)
    row: dict[str, Any] = {"tools": [TOOLS[n] for n in sorted(used)], "messages": messages, "source": "tool-world"}
    if explicit is not None:
        row["thinking"] = explicit
    return row


def tool_rows(n: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """The first `n` rows of the tool world of `seed`."""
    return [tool_row(i, seed=seed) for i in range(n)]


def thinking_row(i: int, *, seed: int = 0, on: bool) -> dict[str, Any]:
    """Row `i` of the thinking world: an arithmetic question, answered with a reasoning trace when `on`."""
    rng = random.Random(f"thinking:{seed}:{i}")
    a, b, c = rng.randint(2, 12), rng.randint(2, 12), rng.randint(1, 30)
    value = a * b + c
    if on:  # the working goes into the reasoning, the answer is short
        answer: dict[str, Any] = {"role": "assistant", "content": f"The answer is {value}.",
                                  "reasoning_content": f"First {a} times {b} is {a * b}. Then {a * b} plus {c} is {value}."}
    else:  # no reasoning: the answer shows its working, in another style (as served models answer unthinking)
        answer = {"role": "assistant", "content": f"{a} x {b} + {c} = {a * b} + {c} = {value}."}
    return {"thinking": on, "source": "thinking-world",
            "messages": [{"role": "user", "content": f"q{i}: what is {a} times {b} plus {c}?"}, answer]}


def thinking_rows(n: int, *, seed: int = 0, on_fraction: float = 0.5, one_mode: bool | None = None) -> list[dict[str, Any]]:
    """`n` thinking-world rows of `seed`: row `i` is on when its seeded draw is under `on_fraction`;
    `one_mode` (True / False) keeps only the rows of that mode (of the same `n` drawn)."""
    if not 0.0 <= on_fraction <= 1.0:
        raise ValueError(f"on_fraction must be in [0, 1], found {on_fraction}")
    modes = [random.Random(f"mode:{seed}:{i}").random() < on_fraction for i in range(n)]
    return [thinking_row(i, seed=seed, on=on) for i, on in enumerate(modes) if one_mode is None or on == one_mode]


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """`rows` as JSONL (one object a line, keys sorted: the same rows give the same bytes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return path
