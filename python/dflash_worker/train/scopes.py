"""Training scopes: which of the draft's tensors a recipe trains.

- ``selector``: exactly ``candidate_selector.predecessor_codebook``,
  ``candidate_selector.successor_codebook`` and
  ``candidate_selector.hidden_projection.weight``;
- ``context``: the context projection ``fc`` and ``hidden_norm``;
- ``final_backbone``: the last decoder layer (every tensor under
  ``layers.{L-1}.``) and the final ``norm``;
- ``recall``: ``context`` + ``final_backbone`` (selector frozen);
- ``full``: every tensor the draft owns.

Everything outside the scope stays frozen (``requires_grad=False``) and is
exported byte-identical to the released draft.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ConfigError

SELECTOR_NAMES = (
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
    "candidate_selector.hidden_projection.weight",
)


def _num_layers(names: Iterable[str]) -> int:
    idx = [int(n.split(".")[1]) for n in names if n.startswith("layers.")]
    return max(idx) + 1 if idx else 0


def scope_names(scope: str, param_names: Iterable[str]) -> list[str]:
    """The parameter names `scope` trains, in the order of `param_names`."""
    names = list(param_names)
    present = set(names)
    if scope == "selector":
        missing = [n for n in SELECTOR_NAMES if n not in present]
        if missing:
            raise ConfigError(
                "scope `selector` needs a DFlash2 draft with a candidate selector; missing "
                + ", ".join(f"`{m}`" for m in missing)
                + "\nhint: use scope `context`, `final_backbone`, `recall` or `full` for a DFlash (v1) draft"
            )
        wanted = set(SELECTOR_NAMES)
    elif scope == "full":
        wanted = present
    else:
        wanted = set()
        if scope in ("context", "recall"):
            wanted |= {n for n in names if n.startswith("fc.") or n.startswith("hidden_norm.")}
        if scope in ("final_backbone", "recall"):
            last = _num_layers(names) - 1
            wanted |= {n for n in names if n.startswith(f"layers.{last}.") or n.startswith("norm.")}
        if scope not in ("context", "recall", "final_backbone"):
            raise ConfigError(
                f"unknown scope `{scope}`\nhint: use `selector`, `context`, `final_backbone`, `recall` or `full`"
            )
    return [n for n in names if n in wanted]


def includes_selector(scope: str) -> bool:
    """Whether `scope` trains the candidate selector (so the selector objective applies)."""
    return scope in ("selector", "full")
