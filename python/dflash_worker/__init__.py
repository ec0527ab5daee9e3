"""dflash_worker: adapt DFlash2 speculative-decoding drafts to your own data.

Subpackages: ``weights`` (streamed safetensors loading), ``families`` (target
families and pair validation), ``model`` (DFlash/DFlash2 drafts, AF4G64),
``data``, ``capture``, ``train``, ``evaluate``, ``export``, ``coordinator``.
"""

__version__ = "0.1.0"
