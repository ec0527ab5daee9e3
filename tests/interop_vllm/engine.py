"""vLLM's side of the interop test, run in a child process: `python engine.py REQUEST.json RESULT.json`.

Each request gets a fresh process, because vLLM keeps process-wide state (its distributed group,
the current config, compiled graphs) that a second engine in the same process would meet. The
engine core runs in that process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set by the caller), so a
patch made here reaches it.

Requests (JSON):
- ``{"op": "serve", "target", "speculative_config", "prompts": [[ids]], "max_tokens", "stop_token_ids"}``:
  greedy generation of every prompt, one sequence at a time (as the project's evaluate does); per
  prompt its output token ids and vLLM's own per-request spec-decode metrics (`detailed`: the
  accepted draft tokens of every verify step).
- ``{"op": "refusal", "target", "speculative_config"}``: vLLM's config validation alone; the
  error it raises, if any.
- ``{"op": "load", "target", "speculative_config"}``: the engine built with the CPU runner's
  refusal of candidate-head (DFlash2) drafts patched out, so vLLM's loader builds its draft class
  and loads the export; right after its `load_weights`, every parameter of that class is compared
  with the exported tensors (`check_loaded`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_MODEL_LEN = 512


def _llm(req: dict, **kw):
    from vllm import LLM

    return LLM(
        model=req["target"], tokenizer=req["target"], dtype="float32", speculative_config=req["speculative_config"],
        max_model_len=MAX_MODEL_LEN, seed=0, enforce_eager=True, **kw,
    )


def serve(req: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # one sequence at a time: the project's evaluate verifies one prompt at a time (batch size 1)
    llm = _llm(req, max_num_seqs=1, per_request_spec_decode_metrics="detailed")
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], stop_token_ids=req["stop_token_ids"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]], params, use_tqdm=False)
    rows = []
    for out in outs:
        c = out.outputs[0]
        spec = c.spec_decode_metrics
        rows.append({"token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                     "spec_decode": spec.to_dict() if spec is not None else None})
    return {"rows": rows, "draft_class": _draft_class(llm)}


def refusal(req: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=req["target"], dtype="float32", speculative_config=req["speculative_config"],
                      max_model_len=MAX_MODEL_LEN, enforce_eager=True)
    try:
        args.create_engine_config()
    except ValueError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def _draft_class(llm) -> str:
    return llm.collective_rpc(lambda worker: type(worker.model_runner.drafter.model).__name__)[0]


def check_loaded(model, export: str) -> dict:
    """Every parameter of vLLM's draft class against the export's tensors, byte for byte (in float32,
    which holds every BF16 value exactly). vLLM fuses q/k/v and gate/up projections into one
    parameter each: the expected value is the exported tensors concatenated in its order.

    Returns the names compared, the exported tensors no parameter took (`unused`), the parameters no
    exported tensor filled (`unfilled`, besides those the draft shares with the target), the
    mismatches, and the config vLLM built the class from."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(Path(export) / "model.safetensors"))
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    used, compared, mismatched, unfilled = set(), [], [], []
    for name, param in model.named_parameters():
        inner = name.removeprefix("model.")
        parts = [inner]
        for vname, hf_names in fused.items():
            if f".{vname}." in inner:
                parts = [inner.replace(f".{vname}.", f".{h}.") for h in hf_names]
        if not all(p in tensors for p in parts):
            unfilled.append(name)
            continue
        expected = torch.cat([tensors[p].float() for p in parts], dim=0)
        used.update(parts)
        compared.append(name)
        got = param.detach().float().cpu()
        if got.shape != expected.shape or not torch.equal(got, expected):
            mismatched.append({"param": name, "shape": list(got.shape), "expected_shape": list(expected.shape)})
    cfg = model.config
    return {
        "class": type(model).__name__,
        "compared": compared,
        "unused": sorted(set(tensors) - used),
        "unfilled": unfilled,
        "mismatched": mismatched,
        "dflash_config": dict(cfg.dflash_config),
        "layer_types": list(getattr(cfg, "layer_types", None) or []),
        "selector_top_k": model.model.candidate_selector.top_k,
        "conv": [{"taps": c.taps, "group_size": c.group_size, "block_size": c.block_size}
                 for layer in model.model.layers for c in (layer.attention_conv, layer.mlp_conv)],
    }


def load(req: dict) -> dict:
    from vllm.config import VllmConfig
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    # The refusal `refusal` records, patched out as the reproduction did: vLLM's own
    # loader then builds its DFlash2 class from the export's config and loads its tensors.
    VllmConfig._is_dflash_candidate_draft = lambda self: False
    export, checked = req["speculative_config"]["model"], {}
    load_weights = DFlash2Qwen3ForCausalLM.load_weights

    def checking_load_weights(self, weights):
        out = load_weights(self, weights)
        # checked here, right after loading: vLLM's CPU build then repacks the linear layers'
        # weights for its GEMM kernels and leaves their `.weight` empty
        checked["result"] = check_loaded(self, export)
        return out

    DFlash2Qwen3ForCausalLM.load_weights = checking_load_weights
    llm = _llm(req, max_num_seqs=1)
    assert _draft_class(llm) == "DFlash2Qwen3ForCausalLM" and "result" in checked, "vLLM did not load the draft through its DFlash2 class"
    return checked["result"]


def main(argv: list[str]) -> int:
    req = json.loads(Path(argv[1]).read_text())
    result = {"serve": serve, "refusal": refusal, "load": load}[req["op"]](req)
    Path(argv[2]).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
