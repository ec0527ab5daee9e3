"""Read a DFlash draft's config the way SGLang does, in SGLang's own environment (scripts/interop-sglang.sh).

`python sglang_read.py DRAFT_DIR TARGET_NUM_LAYERS` prints one JSON object: what SGLang's own functions
make of `DRAFT_DIR/config.json`. SGLang loads the draft's config with
`sglang.srt.utils.hf_transformers_utils.get_config` (as its server does when it infers the block size
in `sglang/srt/arg_groups/speculative_hook.py`), then parses the DFlash fields with
`sglang.srt.speculative.dflash_utils.parse_dflash_draft_config` (its draft model, worker and target
feature hooks all call it) and the attention window with `get_dflash_attention_sliding_window_size`.
Nothing here interprets a field itself: every value is SGLang's.
"""

from __future__ import annotations

import dataclasses
import json
import sys


def main(draft_dir: str, target_num_layers: int) -> dict:
    import sglang
    from sglang.srt.speculative.dflash_utils import (
        get_dflash_attention_sliding_window_size,
        get_dflash_layer_types,
        parse_dflash_draft_config,
    )
    from sglang.srt.utils.hf_transformers_utils import get_config

    hf_config = get_config(draft_dir, trust_remote_code=False, revision=None, model_override_args={})
    parsed = parse_dflash_draft_config(draft_hf_config=hf_config)
    layer_types = get_dflash_layer_types(hf_config)
    return {
        "sglang_version": sglang.__version__,
        "sglang_file": sglang.__file__,
        "config_class": type(hf_config).__name__,
        "architectures": list(getattr(hf_config, "architectures", None) or []),
        "parsed": dataclasses.asdict(parsed),
        "block_size": parsed.resolve_block_size(default=None),
        "target_layer_ids": parsed.resolve_target_layer_ids(target_num_layers=target_num_layers),
        "layer_types": list(layer_types) if layer_types is not None else None,
        # SGLang keeps `window_left` (the HF window minus the current token)
        "sliding_window_left": get_dflash_attention_sliding_window_size(hf_config),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
