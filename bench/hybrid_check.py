"""The hybrid targets' stage of the prepared checks (`scripts/gpu-check.sh`, `scripts/mac-check.sh`):
capture, online training and speculative generation on Qwen3.5-architecture targets, and which
Gated DeltaNet kernels ran.

Per family (`--families`, default `qwen3_5_moe,qwen3_5`), at `--scale full`:
- `qwen3_5_moe`: the width of Qwen3.6-35B-A3B (hidden 2048, 256 experts, 8 routed + 1 shared, 16/32
  linear key/value heads, 16 attention heads with 2 KV heads of 256), `--layers` 4 of its 40
  (3 Gated DeltaNet + 1 gated attention, its 3:1 ratio);
- `qwen3_5`: the width of the dense Qwen3.6-27B (hidden 5120, MLP 17408), `--layers` 4 of its 64.
Values from `dflash_worker.testing.full_size`; the vocabulary is the test tokenizer's (384: width and
depth are what cost, and the real 248,320-row embedding and head would only add memory).
`--scale tiny` takes the CPU tests' tiny Qwen3.5 geometry (hidden 64) instead: the same phases in
seconds on a CPU (`tests/bench/test_hybrid_check.py` runs it).

Memory at full scale, 4 layers: the MoE target is 3.4 B parameters (each layer's experts
256 x 3 x 2048 x 512 = 805 M), 6.7 GB in bf16 and 13.5 GB in float32 (the speculative phase loads it
in float32, as `evaluate` does), its standard draft (6 layers) 0.4 B; the dense target 1.5 B
(3.0 / 6.1 GB), its standard draft (5 layers of the target's width and MLP) 1.8 B, which trains with
about 29 GB of float32 weights, gradients and AdamW moments beside the bf16 target (online features).
Within one 80 GB GPU with room for activations at `--max-length` 512; each phase runs as its own
process, so one phase's models are resident at a time. Wall time was not measured on a GPU when
this was written (no accelerator was lent): the phases are sized to a few minutes on an H200.

Phases, per family, each printed with its figures:
1. build: the random target initialised on the device in bf16 (seconds even at full width), saved
   as sharded safetensors (MoE experts packed, as released); a fresh draft (`init-draft --geometry
   standard`, its released tap count spread over the reduced target's layers: `draft_taps`); rows
   and prepared data;
2. capture (`dflash-worker capture`, cache features): examples/s and tokens/s, process start and
   teacher load included; the teacher's peak memory;
3. online training (`[train].features = "online"`: the frozen target runs inside each step): its
   ids-only capture, then `train`: tokens/s (median over the steps after the first);
4. speculative generation in this process (`speculative_generate(profile=True)`) against the
   target's own greedy decoding with the same kernels (`greedy_generate`): losslessness (outputs
   identical token for token), and the loop cost per verify step by phase (draft, verify,
   accept + crop, rollback: the recurrent state replayed over the accepted tokens) beside the
   greedy ms per token (`bench/effectiveness.py`'s `loop_cost`). The draft's forward runs, but its
   proposal is the target's greedy continuation made wrong from a planned offset per step on
   (`testing.oracle.OracleDraft`): random weights give an untrained draft nothing to agree on, and
   the rollback must be seen replaying several accepted tokens, with rejections inside blocks as a
   trained draft makes them (tau follows from the plan, not from a draft's quality);
5. kernels: what each Gated DeltaNet function ran (`weights/linear_kernels.py`), read in this
   process and from the capture manifest's `device.linear_attention_kernels`; they must agree.

Output: the lines above on stdout, then one JSON object (also written to `--json PATH`). Exit 1 when
a target's speculative output differs from its greedy decoding or the kernel records disagree (the
first differing position is printed with the greedy logits' top-2 margin there: a margin near the
dtype's rounding says a near-tie, anything larger a rollback fault).

Usage: .venv/bin/python bench/hybrid_check.py [--device cuda|mps|cpu] [--scale full|tiny] [--layers 4] ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CLI = [sys.executable, "-m", "dflash_worker.cli"]
BENCH = Path(__file__).resolve().parent
FAMILIES = ("qwen3_5_moe", "qwen3_5")
# feature taps of the released drafts (`init-draft --geometry standard`, model/geometry.py)
RELEASED_TAPS = {"qwen3_5_moe": 8, "qwen3_5": 5}


def draft_taps(family: str, layers: int) -> list[int]:
    """The full-scale draft's taps: the released count (at most one per layer) spread over all `layers`.
    The standard rule spreads them over layers 1 .. L-3, which leaves a 4-layer target one tap and
    the capture a fifth to an eighth of the released feature width."""
    n = min(layers, RELEASED_TAPS[family])
    return [0] if n == 1 else sorted({round(i * (layers - 1) / (n - 1)) for i in range(n)})


def _run(cmd: list[str], env: dict[str, str]) -> tuple[str, str, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc.stdout, proc.stderr, time.perf_counter() - t0


def _gib(n: float | int | None) -> str:
    return "n/a" if not n else f"{n / 2**30:.2f} GiB"


def target_config(family: str, scale: str, layers: int, tok):
    """The transformers config of a `family` target at `scale` (full: the released width) with `layers` layers."""
    from dflash_worker.testing.full_size import QWEN3_6_27B, QWEN3_6_35B_A3B
    from dflash_worker.testing.tiny import tiny_qwen3_5_config
    from dflash_worker.testing.tokenizer import IM_END, PAD_TOKEN

    # A projection's output has std ~ initializer_range x sqrt(hidden): about 0.9 at hidden 2048 with
    # transformers' 0.02, but 0.16 at the tiny hidden 64, where the argmax then barely depends on the
    # recurrent state and a broken rollback would go unseen (tests/model/test_speculate_hybrid.py): 0.2 there.
    width: dict[str, Any] = {"initializer_range": 0.2}
    if scale == "full":
        base = QWEN3_6_35B_A3B if family == "qwen3_5_moe" else QWEN3_6_27B
        width = {k: v for k, v in base.items() if k not in ("vocab_size", "num_hidden_layers")}
    return tiny_qwen3_5_config(
        moe=family == "qwen3_5_moe", **width, num_hidden_layers=layers, vocab_size=len(tok),
        eos_token_id=tok.convert_tokens_to_ids(IM_END), pad_token_id=tok.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=None, max_position_embeddings=4096,
    )


def build_target(path: Path, family: str, args) -> dict[str, Any]:
    """A random `family` target initialised on the device in bf16, saved as released; its facts."""
    import torch
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    from dflash_worker.testing.tokenizer import build_tiny_tokenizer, save_tiny_tokenizer

    tok = build_tiny_tokenizer()
    config = target_config(family, args.scale, args.layers, tok)
    cls = Qwen3_5MoeForConditionalGeneration if family == "qwen3_5_moe" else Qwen3_5ForConditionalGeneration
    torch.manual_seed(0)
    with torch.device("cuda:0" if args.device == "cuda" else args.device):
        model = cls._from_config(config, dtype=torch.bfloat16).eval()
    text = config.text_config
    facts = {"hidden": text.hidden_size, "layers": text.num_hidden_layers, "layer_types": list(text.layer_types),
             "parameters": sum(p.numel() for p in model.model.language_model.parameters())}
    if family == "qwen3_5_moe":
        facts.update(experts=text.num_experts, routed=text.num_experts_per_tok, shared=1)
    # packed experts: the layout released Qwen3.5-MoE checkpoints use (and fewer, larger tensors)
    model.save_pretrained(str(path), max_shard_size="4GB", save_original_format=family != "qwen3_5_moe")
    save_tiny_tokenizer(path, tok)
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return facts


def write_recipe(root: Path, family: str, args, features: str) -> Path:
    """A recipe over `root`'s target, draft and data whose capture and run directories are `features`'s own."""
    dtype = "float32" if args.device == "cpu" else args.dtype
    recipe = root / f"recipe-{features}.toml"
    recipe.write_text(f"""
[model]
target = "{root / 'target'}"
draft = "{root / 'draft'}"
family = "{family}"

[data]
dir = "{root / 'data'}"
thinking = "off"
max_length = {args.max_length}

[capture]
output = "{root / f'capture-{features}'}"
dtype = "{dtype}"
device = "{args.device}"
shard_examples = 16

[train]
scope = "full"
features = "{features}"
steps = {args.steps}
lr = 3e-4
grad_accum = {args.grad_accum}
blocks_per_sequence = 4
checkpoint_every = {args.steps}
val_every = {args.steps}
val_examples = 2
device = "{args.device}"
output = "{root / f'run-{features}'}"
""")
    return recipe


def capture_phase(recipe: Path, env: dict[str, str]) -> dict[str, Any]:
    """`dflash-worker capture --json`: throughput, the teacher's peak memory and the recorded kernels."""
    stdout, _, secs = _run([*CLI, "capture", "--recipe", str(recipe), "--json"], env)
    manifest = json.loads(stdout)
    examples = sum(s["examples"] for s in manifest["shards"])
    tokens = sum(s["tokens"] for s in manifest["shards"])
    run = manifest.get("run", {})
    mem = run.get("peak_memory") or {}
    device = run.get("device") or manifest.get("device") or {}
    return {"seconds": round(secs, 1), "examples": examples, "tokens": tokens, "examples_per_s": examples / secs,
            "tokens_per_s": tokens / secs, "peak_bytes": mem.get("bytes") or mem.get("process_max_rss_bytes"),
            "kernels": device.get("linear_attention_kernels")}


def train_phase(recipe: Path, run_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """`dflash-worker train`: tokens/s, the median over the steps after the first (`metrics.jsonl`)."""
    _, _, secs = _run([*CLI, "train", "--recipe", str(recipe)], env)
    lines = [json.loads(raw) for raw in (run_dir / "metrics.jsonl").read_text().splitlines() if raw.strip()]
    rates = [x["tokens_per_s"] for x in lines]
    rate = statistics.median(rates[1:]) if len(rates) > 1 else rates[0]
    return {"seconds": round(secs, 1), "steps": len(lines), "tokens_per_s": rate}


def _prompts(tok, count: int, length: int) -> list[list[int]]:
    """`count` seeded prompts of `length` ordinary (non-special) token ids: a random target has no text it knows."""
    import random

    rng = random.Random(0)
    special = set(tok.all_special_ids)
    ordinary = [i for i in range(len(tok)) if i not in special]
    return [[rng.choice(ordinary) for _ in range(length)] for _ in range(count)]


def _margin(target, ids: list[int], at: int) -> float:
    """The greedy logits' top-2 margin for the token at position `at` of `ids` (a near-tie is small)."""
    import torch

    with torch.inference_mode():
        x = torch.tensor([ids[:at]], device=target.device)
        logits = target(x, logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def speculative_phase(root: Path, args) -> dict[str, Any]:
    """Speculative generation against greedy decoding with the same kernels: losslessness and the loop cost."""
    import torch
    from transformers import AutoTokenizer

    from dflash_worker.device import now
    from dflash_worker.evaluate import greedy_generate, speculative_generate
    from dflash_worker.model import load_draft
    from dflash_worker.testing.oracle import OracleDraft
    from dflash_worker.testing.tokenizer import IM_END
    from dflash_worker.weights import load_model
    from dflash_worker.weights.linear_kernels import target_kernels

    if str(BENCH) not in sys.path:  # bench/ is a directory of scripts, not a package
        sys.path.insert(0, str(BENCH))
    from effectiveness import loop_cost

    dev = "cuda:0" if args.device == "cuda" else args.device
    tok = AutoTokenizer.from_pretrained(str(root / "target"))
    target = load_model(root / "target", device=dev, dtype=torch.float32)  # as `evaluate` loads it
    draft = load_draft(root / "draft", device=dev, dtype=torch.float32)
    stop = [tok.convert_tokens_to_ids(IM_END)]
    prompts = _prompts(tok, args.prompts, args.prompt_length)
    rec: dict[str, Any] = {"tau": [], "seconds": 0.0, "steps": 0, "tokens": 0, "phase_seconds": {}}
    measured = {"greedy_seconds": 0.0, "greedy_tokens": 0, "drafts": {"draft": rec}}
    x = torch.tensor([prompts[0]], device=dev)
    warm = greedy_generate(target, x, max_new_tokens=4, stop_token_ids=stop)  # untimed warm-up of both paths
    speculative_generate(OracleDraft(draft, warm), target, x, max_new_tokens=4, stop_token_ids=stop)
    lossless, mismatch = True, None
    for ids in prompts:
        x = torch.tensor([ids], device=dev)
        t0 = now(dev)
        ref = greedy_generate(target, x, max_new_tokens=args.new_tokens, stop_token_ids=stop)
        measured["greedy_seconds"] += now(dev) - t0
        measured["greedy_tokens"] += ref.shape[1] - len(ids)
        t0 = now(dev)
        res = speculative_generate(OracleDraft(draft, ref), target, x, max_new_tokens=args.new_tokens, stop_token_ids=stop,
                                   profile=True)
        rec["seconds"] += now(dev) - t0
        rec["steps"] += res.steps
        rec["tokens"] += sum(res.acceptance_lengths)
        for k, v in res.extra["phase_seconds"].items():
            rec["phase_seconds"][k] = rec["phase_seconds"].get(k, 0.0) + v
        got, want = res.output_ids[0].tolist(), ref[0].tolist()
        if got != want and lossless:
            lossless = False
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            mismatch = {"position": at - len(ids), "speculative": got[at:at + 4], "greedy": want[at:at + 4],
                        "greedy_top2_margin": _margin(target, want, at) if at < len(want) else None}
    cost = loop_cost([measured], "draft")
    return {"prompts": len(prompts), "new_tokens": args.new_tokens, "dtype": "float32", "lossless": lossless,
            "first_mismatch": mismatch, "cost": cost, "kernels": target_kernels(target)}


def run_target(root: Path, family: str, args, env: dict[str, str]) -> dict[str, Any]:
    """Every phase for one family under `root` (module docstring); prints a line per phase."""
    from dflash_worker.data import prepare_data
    from dflash_worker.testing.world import write_rows

    t0 = time.perf_counter()
    out: dict[str, Any] = {"geometry": build_target(root / "target", family, args)}
    geometry = "standard" if args.scale == "full" else "tiny"
    taps = ["--target-layer-ids", ",".join(map(str, draft_taps(family, args.layers)))] if args.scale == "full" else []
    _run([*CLI, "init-draft", "--target", str(root / "target"), "--geometry", geometry, *taps, "-o", str(root / "draft")], env)
    rows = write_rows(root / "rows.jsonl", examples=args.examples, seed=0)
    prepare_data([rows], root / "data", seed=0, val_fraction=0.05, test_fraction=0.05)
    out["build_seconds"] = round(time.perf_counter() - t0, 1)
    g = out["geometry"]
    moe = f", {g['experts']} experts ({g['routed']} routed + {g['shared']} shared)" if "experts" in g else ""
    print(f"[{family}] build: hidden {g['hidden']} x {g['layers']} layers ({g['layer_types'].count('linear_attention')} "
          f"Gated DeltaNet : {g['layer_types'].count('full_attention')} attention){moe}, "
          f"{g['parameters'] / 1e6:,.1f} M parameters, draft `{geometry}`: {out['build_seconds']} s", flush=True)

    cap = out["capture"] = capture_phase(write_recipe(root, family, args, "cache"), env)
    print(f"[{family}] capture: {cap['examples']} examples in {cap['seconds']} s, {cap['examples_per_s']:.2f} examples/s, "
          f"{cap['tokens_per_s']:,.0f} tokens/s (process start and teacher load included), "
          f"peak {_gib(cap['peak_bytes'])}", flush=True)
    online = write_recipe(root, family, args, "online")
    ids = capture_phase(online, env)
    tr = out["online_train"] = train_phase(online, root / "run-online", env)
    tr["ids_capture_seconds"] = ids["seconds"]
    print(f"[{family}] online training: {tr['tokens_per_s']:,.0f} tokens/s (median over steps 2-{tr['steps']}), "
          f"{tr['seconds']} s in all; its ids-only capture {ids['seconds']} s", flush=True)

    spec = out["speculative"] = speculative_phase(root, args)
    c = spec["cost"]
    print(f"[{family}] speculative ({spec['dtype']}, {spec['prompts']} prompts x {spec['new_tokens']} tokens): "
          f"lossless against greedy with the same kernels: {str(spec['lossless']).lower()}", flush=True)
    if spec["first_mismatch"]:
        print(f"[{family}]   first difference: {json.dumps(spec['first_mismatch'])}", flush=True)
    print(f"[{family}] loop cost per verify step (ms): draft {c['draft_ms']:.2f}, verify {c['verify_ms']:.2f}, "
          f"rest {c['accept_ms'] + c['crop_ms']:.2f}, rollback {c['rollback_ms']:.2f}; teacher greedy "
          f"{c['target_ms']:.2f} ms/token; verify / teacher {c['verify_ms'] / c['target_ms']:.2f}; "
          f"tau {c['tau_pooled']:.2f}; ceiling {c['ceiling']:.2f}; speedup {c['speedup']:.2f}", flush=True)

    out["kernels"] = spec["kernels"]
    out["kernels_agree"] = cap["kernels"] == spec["kernels"]
    for fam, chosen in (spec["kernels"] or {}).items():
        print(f"[{family}] kernels ({fam}): " + ", ".join(f"{k}={v}" for k, v in chosen.items()), flush=True)
    print(f"[{family}] capture manifest records the same kernels: {str(out['kernels_agree']).lower()}", flush=True)
    return out


def cost_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The loop-cost table over the targets (ms per verify step; teacher = greedy ms per token)."""
    lines = ["| target | draft | verify | rest | rollback | rollback share | teacher | verify / teacher | tau | "
             "ceiling | speedup | lossless |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for family, r in results.items():
        c = r["speculative"]["cost"]
        rest = c["accept_ms"] + c["crop_ms"]
        step = c["draft_ms"] + c["verify_ms"] + rest + c["rollback_ms"]
        lines.append(f"| {family} | {c['draft_ms']:.2f} | {c['verify_ms']:.2f} | {rest:.2f} | {c['rollback_ms']:.2f} | "
                     f"{c['rollback_ms'] / step:.1%} | {c['target_ms']:.2f} | {c['verify_ms'] / c['target_ms']:.2f} | "
                     f"{c['tau_pooled']:.2f} | {c['ceiling']:.2f} | {c['speedup']:.2f} | "
                     f"{str(r['speculative']['lossless']).lower()} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "mps", "cpu"), help="where every phase runs (default cuda)")
    p.add_argument("--scale", default="full", choices=("full", "tiny"), help="released widths, or the CPU tests' (default full)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)} (default both)")
    p.add_argument("--layers", type=int, default=4, help="target depth, >= 4 (default 4: 3 Gated DeltaNet + 1 attention)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                   help="capture dtype off the CPU (default bfloat16; float16 on a Mac without bf16); float32 on CPU")
    p.add_argument("--examples", type=int, default=64, help="rows (default 64)")
    p.add_argument("--max-length", type=int, default=512, help="[data].max_length (default 512)")
    p.add_argument("--steps", type=int, default=6, help="online training steps (default 6)")
    p.add_argument("--grad-accum", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--prompts", type=int, default=4, help="speculative prompts (default 4)")
    p.add_argument("--prompt-length", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per prompt (default 48)")
    p.add_argument("--json", type=Path, help="also write the JSON object here")
    p.add_argument("--keep", type=Path, help="work here and keep the files (default: a temporary directory)")
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    bad = [f for f in args.families if f not in FAMILIES]
    if bad or not args.families:
        p.error(f"--families: `{','.join(bad)}` is not among {', '.join(FAMILIES)}")
    if args.layers < 4:  # transformers' caches need an attention layer; the 4th is the first (interval 4)
        p.error("--layers must be >= 4: layers 1-3 are Gated DeltaNet, the 4th the first attention layer")
    for name in ("examples", "steps", "grad_accum", "prompts", "prompt_length", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("hybrid_check: --device cuda, but torch sees no CUDA device")
    if args.device == "mps" and not torch.backends.mps.is_available():
        raise SystemExit("hybrid_check: --device mps, but torch sees no MPS device")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    out: dict[str, Any] = {"device": args.device, "scale": args.scale, "layers": args.layers}
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="dflash-hybrid-check-") as tmp:
        base = (args.keep or Path(tmp)).resolve()
        for family in args.families:
            root = base / family
            root.mkdir(parents=True, exist_ok=True)
            results[family] = run_target(root, family, args, env)
    out["targets"] = results
    print("\n".join(["", "Speculative loop cost per verify step (ms): rest = accepting and cropping the caches, "
                     "rollback = the recurrent state replayed over the accepted tokens; teacher = greedy ms per token",
                     *cost_table(results), ""]), flush=True)
    text = json.dumps(out, sort_keys=True)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    failed = [f for f, r in results.items() if not (r["speculative"]["lossless"] and r["kernels_agree"])]
    if failed:
        print(f"hybrid_check: FAILED for {', '.join(failed)}: speculative output differs from greedy decoding "
              "or the kernel records disagree (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
