"""DFlash / DFlash2 draft models: config, network, loading and saving.

`model/quant.py` (AF4G64) lives here too but is imported on its own.
"""

from .config import DFLASH, DFLASH2, DraftConfig, default_target_layer_ids
from .draft import DraftCache, DraftModel, build_draft, context_features
from .io import load_draft, save_draft
from .selector import CandidateSelector

__all__ = [
    "DFLASH",
    "DFLASH2",
    "CandidateSelector",
    "DraftCache",
    "DraftConfig",
    "DraftModel",
    "build_draft",
    "context_features",
    "default_target_layer_ids",
    "load_draft",
    "save_draft",
]
