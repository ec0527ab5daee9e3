"""Training a released draft on captured teacher features: scopes, objectives, exact resume.

`train(recipe, run_dir=..., resume=...)` runs (or resumes, or verifies) a run;
`preflight(recipe)` measures one near-max-length step's memory. See
`loop` for the run directory layout, step order and events, `selection` for the
selection rule and the general-domain guard, `resume` for what a resume must agree on,
`setup`, `forward` and `validate` for the components the loop is built from,
`objectives` for the losses and metrics, `checkpoint` for the commit protocol.
"""

from .loop import Hooks, Trainer, TrainResult, train
from .signals import StopFlags

__all__ = ["Hooks", "StopFlags", "TrainResult", "Trainer", "train"]
