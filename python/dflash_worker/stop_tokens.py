"""The one stop-token rule, shared by capture (regenerated responses) and evaluate.

A generation stops on any id of, in this order: the teacher's
``generation_config.json`` ``eos_token_id`` (an int or a list; when the file is
absent, ``config.json``'s, which is what transformers derives the generation
config from), then the tokenizer's ``eos_token_id``. Repeats are dropped, the
first occurrence keeps its place. Both the capture and the evaluate report
record the resulting list.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError

GENERATION_CONFIG = "generation_config.json"
RULE = "teacher generation_config.json eos ids (else config.json), then the tokenizer's eos; repeats dropped, order kept"


def _eos_ids(path: Path) -> list[int]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read `{path}`: {e}") from e
    eos = doc.get("eos_token_id") if isinstance(doc, dict) else None
    values = eos if isinstance(eos, list) else [eos]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def stop_token_sources(target: str | Path, tokenizer: Any) -> dict[str, list[int]]:
    """Where the stop ids come from, in rule order: `{file name or "tokenizer": ids}` (only sources that give ids)."""
    target = Path(target)
    sources: dict[str, list[int]] = {}
    for name in (GENERATION_CONFIG, "config.json"):
        if (target / name).is_file():
            ids = _eos_ids(target / name)
            if ids:
                sources[name] = ids
            break
    if getattr(tokenizer, "eos_token_id", None) is not None:
        sources["tokenizer"] = [int(tokenizer.eos_token_id)]
    return sources


def stop_token_ids(target: str | Path, tokenizer: Any) -> list[int]:
    """Stop ids for generating with the teacher in `target`: generation-config eos ids, then the tokenizer's eos."""
    return list(dict.fromkeys(i for ids in stop_token_sources(target, tokenizer).values() for i in ids))


def stop_tokens_record(target: str | Path, tokenizer: Any) -> dict[str, Any]:
    """The stop ids, their sources and the rule, as capture's manifest records them."""
    sources = stop_token_sources(target, tokenizer)
    return {"ids": list(dict.fromkeys(i for ids in sources.values() for i in ids)), "sources": sources, "rule": RULE}
