"""Benchmark: streamed loader vs transformers' `from_pretrained` on a ~1 GiB bf16 checkpoint of a target family.

Builds (once, cached under ``bench/out/``) a sharded bf16 checkpoint with
random weights for ``--family``, from a real transformers config:

- ``qwen3`` (default): the geometry of Qwen3-0.6B (28 layers, hidden 1024,
  vocab 151936, tied embeddings), 1.1 GiB;
- ``qwen3_moe``: Qwen3-30B-A3B narrowed (hidden 512, 12 layers, 128 experts,
  top-8, expert width 192, its vocab, untied), experts stored individually
  (``experts.{e}.{gate,up,down}_proj.weight``, as ``save_pretrained`` writes);
- ``qwen3_5_moe``: Qwen3.6-35B-A3B narrowed (hidden 512, 8 layers, 3 Gated
  DeltaNet : 1 gated attention, 256 experts, top-8, expert and shared-expert
  width 128, vocab 248320, untied), saved as the released multimodal wrapper:
  text under ``model.language_model.*`` with individually stored experts, a
  vision tower (the default one, 4 blocks deep) and ``mtp.*`` heads (one
  full-attention MoE layer's worth, written last);
- ``qwen3_5``: the dense 27B narrowed the same way (hidden 768, 8 layers), also
  as the wrapper with vision tower and ``mtp.*``.

``--tiny`` builds the family's test-sized geometry instead (for the smoke test;
its numbers mean nothing). An existing ``--path`` is measured as it is; its
family comes from its config.json.

Each checkpoint is loaded with `dflash_worker.weights.load_model` (its CPU
default: copy-on-write mapped shards; per-expert tensors are copied into their
packed parameters), with ``load_model(mmap=False)`` (private copies) and with
``from_pretrained(dtype=bfloat16)`` of the class transformers' auto mapping
gives for the file (``Qwen3_5MoeForCausalLM`` for a ``qwen3_5_moe`` wrapper:
its text tower, like ours), each in its own fresh subprocess. The goal is
stated for the default; the copy mode is printed so its cost is on record too.

Timed region, identical for all three: load + touch every weight (a sum over
each parameter and buffer). The model class is imported before the timer for
all. transformers 5 and our default memory-map bf16 tensors, so the touch is
inside the timing. Peak RSS is
measured over the process's baseline taken after imports, by a psutil sampling
thread (every 2 ms) and by ``getrusage(RUSAGE_SELF).ru_maxrss``; the larger is
reported, divided by the bytes of the tensors loaded (the text tower's: a
wrapper's vision tower and ``mtp.*`` bytes are skipped by both loaders and
printed separately).

Page cache: each loader runs once unmeasured to warm the cache, then the
measured rounds run the loaders in alternating order (forward, then reversed)
so no loader always gets the colder cache; the median of the runs is reported.

Shared cores: the load average before and during the runs is printed, and a
busy machine is flagged. transformers packs per-expert tensors with
multi-threaded torch copies, which slow down several-fold when other jobs hold
the cores, far more than our reads do; ratios from a busy machine flatter ours.

``--cold`` measures cold loads instead: the page cache is dropped
(``/proc/sys/vm/drop_caches``, Linux, root) before every run and there is no
warm-up.

Usage: .venv/bin/python bench/load.py [--family qwen3|qwen3_moe|qwen3_5|qwen3_5_moe] [--runs 5] [--cold]
       [--no-warmup] [--rebuild] [--tiny] [--path DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from dflash_worker.family_registry import FAMILIES as _REGISTRY
from dflash_worker.testing.full_size import QWEN3_0_6B, QWEN3_6_27B, QWEN3_6_35B_A3B

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
SHARD_BYTES = 300 * 1024 * 1024
TINY_SHARD_BYTES = 256 * 1024
KINDS = ("ours", "ours-copy", "transformers")

# Qwen3-30B-A3B (hidden 2048, 48 layers, 32/4 heads, 128 experts, top-8, expert width 768)
# narrowed to ~1.2 GiB: hidden 512, 12 layers, the expert width scaled with the hidden size.
QWEN3_30B_A3B_NARROW = dict(
    vocab_size=151936,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=128,
    moe_intermediate_size=192,
    num_experts=128,
    num_experts_per_tok=8,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)

# Text towers of Qwen3.6-35B-A3B and of the dense Qwen3.6-27B (`dflash_worker.testing.full_size`)
# narrowed to ~1 GiB: hidden 512 / 768, 8 layers (transformers' default 3 linear : 1 full attention),
# the released head dimensions and vocabulary, head counts and widths scaled with the hidden size.
_QWEN3_5_NARROWING = dict(num_hidden_layers=8, num_key_value_heads=1, linear_num_key_heads=4, rms_norm_eps=1e-6)
QWEN3_5_MOE_NARROW = dict(
    QWEN3_6_35B_A3B,
    **_QWEN3_5_NARROWING,
    hidden_size=512,
    num_attention_heads=8,
    linear_num_value_heads=8,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
)
QWEN3_5_DENSE_NARROW = dict(
    QWEN3_6_27B, **_QWEN3_5_NARROWING, hidden_size=768, intermediate_size=2560, num_attention_heads=6, linear_num_value_heads=12
)
VISION_DEPTH = 4  # the default vision tower (27 blocks of width 1152) cut to 4 blocks: skipped bytes only

FAMILIES = tuple(_REGISTRY)
# family -> the multimodal wrapper class its checkpoints are released as
WRAPPERS = {name: fam.architectures[0] for name, fam in _REGISTRY.items() if fam.wrapper}
# Wall-time goal for ours / transformers (load + touch). MoE checkpoints with per-expert
# tensors must be packed into [E, ...] parameters on load, which transformers does by
# stacking; the goal there is half its time.
WALL_GOALS = {name: 0.5 if fam.moe else 1.0 for name, fam in _REGISTRY.items()}
RSS_GOAL = 1.10
_EXPERT = re.compile(r"\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def default_path(family: str, tiny: bool) -> Path:
    if family == "qwen3" and not tiny:
        return OUT / "qwen3-0.6b-geometry-random-bf16"  # the name of the first runs' checkpoint
    return OUT / f"{family}{'-tiny' if tiny else ''}-random-bf16"


def bench_config(family: str, tiny: bool):
    """The transformers config of the checkpoint to build (a multimodal wrapper for Qwen3.5 families)."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3Config, Qwen3MoeConfig

    from dflash_worker.testing.tiny import tiny_qwen3_5_config, tiny_qwen3_config, tiny_qwen3_moe_config

    if tiny:
        if family in WRAPPERS:
            config = tiny_qwen3_5_config(moe=family == "qwen3_5_moe")
        else:
            config = tiny_qwen3_config() if family == "qwen3" else tiny_qwen3_moe_config()
    elif family == "qwen3":
        config = Qwen3Config(**QWEN3_0_6B)
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(**QWEN3_30B_A3B_NARROW)
    else:
        text = QWEN3_5_MOE_NARROW if family == "qwen3_5_moe" else QWEN3_5_DENSE_NARROW
        cls = Qwen3_5MoeConfig if family == "qwen3_5_moe" else Qwen3_5Config
        vision = dict(depth=VISION_DEPTH, out_hidden_size=text["hidden_size"])
        config = cls(text_config=dict(text), vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"])
    config.dtype = "bfloat16"
    if family in WRAPPERS:
        config.text_config.dtype = "bfloat16"
        config.architectures = [WRAPPERS[family]]
    return config


def _as_saved(name: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The tensors `save_pretrained` writes for one state-dict entry: packed experts
    (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`) go out per expert."""
    if name.endswith(".experts.gate_up_proj") and len(shape) == 3:
        base, (n, two_i, h) = name[: -len(".gate_up_proj")], shape
        return {f"{base}.{e}.{p}.weight": (two_i // 2, h) for e in range(n) for p in ("gate_proj", "up_proj")}
    if name.endswith(".experts.down_proj") and len(shape) == 3:
        base, (n, h, i) = name[: -len(".down_proj")], shape
        return {f"{base}.{e}.down_proj.weight": (h, i) for e in range(n)}
    return {name: shape}


def _mtp_layout(shapes: dict[str, tuple[int, ...]], text) -> dict[str, tuple[int, ...]]:
    """`mtp.*` as released Qwen3.5 checkpoints carry them (transformers writes none): the
    fusion projection and norms, and one full-attention decoder layer's worth (experts per expert)."""
    h = text.hidden_size
    layer = f"model.language_model.layers.{list(text.layer_types).index('full_attention')}."
    out = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
    }
    out.update({"mtp.layers.0." + k[len(layer) :]: s for k, s in shapes.items() if k.startswith(layer)})
    return out


def checkpoint_layout(family: str, config) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the checkpoint a release of `config` holds, in write order."""
    import torch
    import transformers

    with torch.device("meta"):
        if family in WRAPPERS:
            model = getattr(transformers, WRAPPERS[family])._from_config(config, dtype=torch.bfloat16)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        shapes.update(_as_saved(name, tuple(t.shape)))
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")  # tied: save_pretrained omits it too
    if family in WRAPPERS:
        shapes.update(_mtp_layout(shapes, config.text_config))
    return shapes


def build_checkpoint(path: Path, family: str, tiny: bool) -> None:
    """Write a sharded bf16 checkpoint of `family` with random weights, the layout a release has."""
    import torch
    from safetensors.torch import save_file

    config = bench_config(family, tiny)
    shapes = checkpoint_layout(family, config)
    limit = TINY_SHARD_BYTES if tiny else SHARD_BYTES
    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = 2 * int(torch.Size(shape).numel())
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    weight_map = {}
    total = 0
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            t = torch.randn(shapes[name], generator=gen, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * 2
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        del tensors
        print(f"  wrote {fname}", file=sys.stderr)
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config.save_pretrained(str(tmp))
    tmp.rename(path)


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def touch(tensors):
    import torch

    acc = torch.zeros((), dtype=torch.float32)
    with torch.no_grad():
        for p in tensors:
            # sum in the tensor's dtype (accumulated in fp32 internally); `sum(dtype=float32)`
            # would materialise an fp32 copy of each tensor and distort peak RSS
            acc += p.sum().float()
    return acc


def transformers_class(path: Path):
    """The class transformers' `AutoModelForCausalLM` gives for the checkpoint at `path`."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = json.loads((path / "config.json").read_text())["model_type"]
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def worker(kind: str, path: Path) -> None:
    """Child process: import, take a baseline, then load + touch under timing; print one JSON line."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    # Import the model class before the baseline and the timer, for both loaders:
    # its import (~2-7 s) is not loading.
    cls = transformers_class(path)

    from dflash_worker.weights import load_model
    from dflash_worker.weights import stream as _stream  # noqa: F401

    # Run the touch once on small tensors so its kernels' code is paged in (matters with --cold).
    touch([torch.ones(1 << 16, dtype=dt) for dt in (torch.bfloat16, torch.float32)])
    baseline = _rss()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = [baseline]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    c0 = time.process_time()  # all threads, user + system
    if kind == "transformers":
        model = cls.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    else:
        model = load_model(path, dtype=torch.bfloat16, mmap=kind == "ours")
    t_load = time.perf_counter() - t0
    acc = touch(list(model.parameters()) + list(model.buffers()))
    t_total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    stop.set()
    th.join()
    peak[0] = max(peak[0], _rss())
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = getattr(model, "load_report", None)
    print(
        json.dumps(
            {
                "kind": kind,
                "class": type(model).__name__,
                "load_s": t_load,
                "total_s": t_total,
                "cpu_s": cpu,
                "baseline": baseline,
                "peak_sampled": peak[0],
                "maxrss": maxrss,
                "maxrss_before": maxrss_before,
                "checksum": float(acc),
                "bytes_read": report.bytes_read if report else None,
                "bytes_mapped": report.bytes_mapped if report else None,
                "bytes_skipped": report.bytes_skipped if report else None,
            }
        )
    )


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_child(kind: str, path: Path, child_cmd: list[str] | None = None) -> dict:
    """One loader in a fresh process: `python bench/load.py --worker KIND --path DIR` (`child_cmd`, when
    given, stands for `python bench/load.py`)."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(
        [*(child_cmd or [sys.executable, __file__]), "--worker", kind, "--path", str(path)],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{kind} worker failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def describe(path: Path) -> tuple[str, int, int]:
    """Print what the checkpoint holds; return (family, bytes loaded, bytes skipped)."""
    from dflash_worker.families import detect_family
    from dflash_worker.weights import resolve_checkpoint
    from dflash_worker.weights.checkpoint import is_skipped_tensor, read_config_json, skips_outside_text_tower

    raw = read_config_json(path)
    family = detect_family(raw, where=str(path / "config.json")).name
    ckpt = resolve_checkpoint(path)
    tensors = {n: t for h in ckpt.shards for n, t in h.tensors.items()}
    skipped = {n: t.nbytes for n, t in tensors.items() if is_skipped_tensor(raw, n)}
    loaded = ckpt.total_bytes - sum(skipped.values())
    experts = sum(1 for n in tensors if n not in skipped and _EXPERT.search(n))
    print(f"checkpoint: {path}")
    print(f"  family {family}; transformers baseline: {transformers_class(path).__name__}.from_pretrained")
    print(f"  {len(ckpt.shards)} shards, {len(tensors)} tensors, {ckpt.total_bytes} bytes "
          f"({ckpt.total_bytes / 2**30:.3f} GiB), bf16")
    print(f"  loaded (text tower): {len(tensors) - len(skipped)} tensors, {loaded} bytes ({loaded / 2**30:.3f} GiB)"
          + (f"; {experts} of them per-expert MoE tensors, packed on load" if experts else ""))
    if skips_outside_text_tower(raw):
        vision = sum(b for n, b in skipped.items() if n.startswith("model.visual."))
        mtp = sum(b for n, b in skipped.items() if n.startswith("mtp."))
        print(f"  skipped unread by both loaders: {len(skipped)} tensors, {sum(skipped.values())} bytes "
              f"(vision tower {vision}, mtp {mtp})")
    return family, loaded, sum(skipped.values())


def measure(path: Path, runs: int, cold: bool, warmup: bool = True, child_cmd: list[str] | None = None) -> dict[str, list[dict]]:
    """Warm-up (unless `cold` or not `warmup`), then `runs` rounds over the loaders in alternating order."""
    if cold:
        try:
            drop_page_cache()
        except OSError as exc:
            raise SystemExit(f"--cold needs to write /proc/sys/vm/drop_caches (Linux, root): {exc}") from None
    elif warmup:
        for kind in KINDS:
            r = run_child(kind, path, child_cmd)
            print(f"  warm-up {kind:<12} total {r['total_s']:.2f}s")
    results: dict[str, list[dict]] = {k: [] for k in KINDS}
    for i in range(runs):
        order = KINDS if i % 2 == 0 else KINDS[::-1]
        for kind in order:
            if cold:
                drop_page_cache()
            results[kind].append(run_child(kind, path, child_cmd))
    return results


def report(results: dict[str, list[dict]], family: str, nbytes: int, skipped: int, load_before: float) -> None:
    """Print the medians, the per-run figures and the ratios against transformers, with the goals."""
    runs = len(results["ours"])
    checks = {r["checksum"] for rs in results.values() for r in rs}
    print(f"  checksum over all weights identical in every run: {len(checks) == 1} ({checks.pop():.6f})")
    classes = {r["class"] for rs in results.values() for r in rs}
    print(f"  every loader built the same class: {len(classes) == 1} ({', '.join(sorted(classes))})")
    exact = all(r["bytes_read"] == nbytes and r["bytes_skipped"] == skipped for r in results["ours"] + results["ours-copy"])
    mapped = results["ours"][0]["bytes_mapped"]
    print(f"  ours read exactly the text tower's bytes and skipped the rest: {exact}; "
          f"default mode mapped {mapped} of them ({mapped / nbytes:.1%}), copied the rest")

    def summary(kind: str) -> tuple[float, float, float, float]:
        rs = results[kind]
        total = statistics.median(r["total_s"] for r in rs)
        load = statistics.median(r["load_s"] for r in rs)
        cpu = statistics.median(r["cpu_s"] for r in rs)
        peak = statistics.median(max(r["peak_sampled"], r["maxrss"]) - r["baseline"] for r in rs)
        return total, load, peak / nbytes, cpu

    print()
    print(f"{'loader':<14}{'load s':>9}{'load+touch s':>14}{'cpu s':>8}{'peak RSS / loaded bytes':>26}   (median of {runs})")
    rows = {k: summary(k) for k in results}
    for kind, (total, load, ratio, cpu) in rows.items():
        print(f"{kind:<14}{load:>9.2f}{total:>14.2f}{cpu:>8.2f}{ratio:>26.3f}")
    for kind in results:
        print(f"  {kind} load+touch per run: " + ", ".join(f"{r['total_s']:.2f}" for r in results[kind]))
    ours, copy, tf = rows["ours"], rows["ours-copy"], rows["transformers"]
    load_avg, cores = os.getloadavg()[0], os.cpu_count() or 1
    print(f"  load average while running (1 min): {load_avg:.1f} on {cores} cores")
    # Busy: other jobs held half the cores before the runs, or the load (ours included: about
    # one loader's threads) passed twice the cores. transformers packs experts with multi-threaded
    # torch copies, which slow down far more than our reads when cores are shared, so the ratios
    # below then flatter ours.
    if load_before > cores / 2 or load_avg > 2 * cores:
        print("  warning: the machine was busy; the wall- and cpu-time ratios are not what a quiet machine gives")
    print()
    wall_goal = WALL_GOALS[family]
    wall, rss = ours[0] / tf[0], ours[2]
    print(f"wall-time ratio ours/transformers (load+touch): {wall:.3f}   (goal <= {wall_goal})")
    print(f"cpu-time ratio ours/transformers (load+touch):  {ours[3] / tf[3]:.3f}")
    print(f"peak RSS ratio ours (over baseline / loaded bytes): {rss:.3f}   (goal <= {RSS_GOAL:.2f})")
    print(f"peak RSS ratio transformers (same measure):        {tf[2]:.3f}")
    print(f"copy mode (mmap=False): wall-time ratio {copy[0] / tf[0]:.3f}, cpu-time ratio {copy[3] / tf[3]:.3f}, "
          f"peak RSS ratio {copy[2]:.3f}")
    met = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    print(f"goals ({family}): wall time {met(wall <= wall_goal)}, peak RSS {met(rss <= RSS_GOAL)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=FAMILIES, help="checkpoint to build and measure (default: qwen3, "
                    "or the family of an existing --path)")
    ap.add_argument("--runs", type=int, default=5, help="measured runs per loader (alternating)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the cached checkpoint")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every run (Linux, root)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up runs")
    ap.add_argument("--tiny", action="store_true", help="build the family's test-sized geometry (smoke test)")
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--child-cmd", metavar="CMD", help="the command that starts each loader's process, given "
                    "`--worker KIND --path DIR` (default: this Python running this script; the smoke test passes a "
                    "stand-in that forks a pre-warmed interpreter, so its figures mean nothing)")
    ap.add_argument("--path", type=Path, help="checkpoint directory (default: the family's cached one; "
                    "built there if absent)")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.path)
        return 0

    path = args.path or default_path(args.family or "qwen3", args.tiny)
    if args.rebuild and path.exists():
        import shutil

        shutil.rmtree(path)
    if not path.exists():
        print(f"building {path} (once) ...", file=sys.stderr)
        build_checkpoint(path, args.family or "qwen3", args.tiny)

    family, nbytes, skipped = describe(path)
    if args.family and args.family != family:
        raise SystemExit(f"--family {args.family}: `{path}` holds a `{family}` checkpoint")
    cache = "dropped before every run (cold)" if args.cold else (
        "no warm-up" if args.no_warmup else "one unmeasured warm-up run per loader")
    load_before = os.getloadavg()[0]
    print(f"  cpu cores: {os.cpu_count()}; load average before the runs (1 min): {load_before:.1f}; page cache: {cache}; "
          "runs alternate between loaders")
    child_cmd = shlex.split(args.child_cmd) if args.child_cmd else None
    results = measure(path, args.runs, args.cold, warmup=not args.no_warmup, child_cmd=child_cmd)
    report(results, family, nbytes, skipped, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
