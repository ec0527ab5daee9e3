"""Preflight: will this recipe fit on this device? One near-max-length step, measured.

Two phases, each measured on its own and reported as a *peak*:

- capture: the frozen teacher's feature forward over one sequence of
  ``[data].max_length`` tokens, through the component capture calls
  (`capture.teacher.Teacher`, chunked by ``[capture].chunk_tokens`` as capture runs it;
  the teacher is then released);
- optimization: the draft's forward, backward and AdamW update over one
  sequence of ``max_length`` tokens with ``blocks_per_sequence`` anchored
  blocks (QAT and gradient checkpointing as the recipe says), with the
  target's embedding and head loaded.

Peaks: the allocator peak on CUDA (``max_memory_allocated``); on CPU and MPS
the process resident-set peak: on Linux ``VmHWM`` after resetting it through
``/proc/self/clear_refs``, elsewhere the maximum of RSS samples taken every
5 ms. The verdict is ``go`` when the larger peak plus a 10% margin fits in the
device's memory (CUDA: total device memory; CPU/MPS: total system memory).

A third phase measures the online plan (`[train].features = "online"`): the frozen
target loaded next to the draft through the component online training calls
(`capture.teacher.Teacher`), one target forward for the sequence's features (timed:
the extra forward time per sequence) and the same optimization step; its peak is
the online plan's memory need. ``plans`` sets the two modes side by side (`plans`):
cache disk bytes against free disk, online peak against device memory, and
recommends one for this machine.

The report's ``teacher`` says what was measured: the target's text tower (family,
layers, width, experts, tensor bytes from the headers) and ``bytes_read``, what the
capture phase's load actually took from the files. A Qwen3.5 checkpoint's vision
tower and MTP heads are skipped unread (``skipped_bytes``): they are in no peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..recipe import Recipe

MARGIN = 1.10


class _PeakRSS:
    """Peak resident set size of this process over a `with` block."""

    def __enter__(self) -> _PeakRSS:
        self.method = "sampled rss (5 ms)"
        self.peak = 0
        self._stop = threading.Event()
        clear = Path("/proc/self/clear_refs")
        try:
            clear.write_text("5")
            self.method = "linux VmHWM (reset via /proc/self/clear_refs)"
            self._thread = None
        except OSError:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        import psutil

        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            return
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                self.peak = int(line.split()[1]) * 1024


def _measure(device: torch.device, fn) -> dict[str, Any]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return {"kind": "peak", "what": "cuda max_memory_allocated", "bytes": int(torch.cuda.max_memory_allocated(device)),
                "baseline_bytes": int(base), "seconds": time.perf_counter() - t0}
    with _PeakRSS() as peak:
        t0 = time.perf_counter()
        fn()
        if device.type == "mps":
            torch.mps.synchronize()
        secs = time.perf_counter() - t0
    return {"kind": "peak", "what": f"process rss: {peak.method}", "bytes": int(peak.peak), "seconds": secs}


def _device_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory), "cuda total memory"
    import psutil

    return int(psutil.virtual_memory().total), "system memory"


@dataclasses.dataclass
class _Probe:
    """One near-max-length sequence of `recipe` on `device`: the capture phase and the optimization
    step, drawing their random tokens and features from one generator in the order they run."""

    recipe: Recipe
    device: torch.device
    length: int
    gen: torch.Generator
    layer_ids: list[int]
    cap_dtype: torch.dtype
    load_teacher: Callable[..., Any]  # `capture.teacher.Teacher.load`, imported before any phase is measured
    chunk_tokens: int  # `[capture].chunk_tokens`: the teacher forward runs as capture and online training run it
    loaded: dict[str, int] = dataclasses.field(default_factory=dict)  # `bytes_read` of the capture phase's load
    timing: dict[str, float] = dataclasses.field(default_factory=dict)  # `target_forward_seconds` of the online step

    def capture(self) -> None:
        """The frozen teacher's feature forward as capture runs it (`Teacher.features`, chunked by
        `chunk_tokens`); the teacher is then released."""
        dtype = str(self.cap_dtype).removeprefix("torch.")
        teacher = self.load_teacher(self.recipe.model.target, self.layer_ids, device=str(self.device), dtype=dtype,
                                    chunk_tokens=self.chunk_tokens)
        self.loaded["bytes_read"] = teacher.model.load_report.bytes_read
        vocab = teacher.model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (self.length,), generator=self.gen)
        teacher.features(ids.tolist())
        teacher.release()

    def optimize(self, online: bool = False) -> None:
        """The draft's forward, backward and AdamW update; `online`: the target sits beside the draft
        and computes the features in the step."""
        from ..model import load_draft
        from .data import sample_anchors
        from .objectives import block_labels, position_weights, selector_loss_sum, token_loss_sum, weight_total
        from .params import load_target_head
        from .scopes import includes_selector, scope_names

        recipe, dev, L, gen, cfg = self.recipe, self.device, self.length, self.gen, self.recipe.require("train")
        dtype = str(self.cap_dtype).removeprefix("torch.")
        teacher = (self.load_teacher(recipe.model.target, self.layer_ids, device=str(dev), dtype=dtype,
                                     chunk_tokens=self.chunk_tokens) if online else None)
        model = load_draft(recipe.model.draft, device=dev, dtype=torch.float32)
        head = load_target_head(recipe.model.target, device=dev, dtype=torch.float32)
        names = set(scope_names(cfg.scope, [n for n, _ in model.named_parameters()]))
        for n, p in model.named_parameters():
            p.requires_grad_(n in names)
        params = [p for n, p in model.named_parameters() if n in names]
        opt = torch.optim.AdamW(params, lr=cfg.lr)
        V = head.embed.shape[0]
        ids = torch.randint(0, V, (L,), generator=gen)
        mask = torch.zeros(L, dtype=torch.bool)
        mask[L // 4 :] = True
        if teacher is None:
            feats = torch.randn(1, L, model.config.context_width, generator=gen).to(dev)
        else:
            teacher.features(ids.tolist())  # warm-up: the first call pays one-time kernel setup
            t0 = time.perf_counter()
            feats = teacher.features(ids.tolist()).clone().to(dev, torch.float32)[None]
            self.timing["target_forward_seconds"] = time.perf_counter() - t0
        anchors = sample_anchors(mask, cfg.blocks_per_sequence, cfg.seed)
        labels, valid = block_labels(ids, mask, anchors, model.block_size)
        labels, valid = labels.to(dev), valid.to(dev)
        pw = position_weights(model.block_size, cfg.gamma, cfg.position_weights, device=dev)
        qctx = None
        if cfg.qat:
            from ..model import quant

            sel = quant.selector_context if cfg.qat_scope == "selector_context" else quant.full_projection
            qctx = quant.quantized_weights(model, sel(model).names)
        with qctx or contextlib.nullcontext():
            a = anchors.to(dev)[None]
            emb = model.embed(model.make_blocks(ids.to(dev)[None], a), head.embed)
            if cfg.gradient_checkpointing:
                from torch.utils.checkpoint import checkpoint

                hidden = checkpoint(model.forward_blocks, feats, a, emb, use_reentrant=False)
            else:
                hidden = model.forward_blocks(feats, a, emb)
            h = hidden[0, :, 1:]
            logits = model.logits(h, head.head)
            loss = token_loss_sum(logits, labels, valid, pw, cfg.objective)
            if model.candidate_selector is not None and includes_selector(cfg.scope):
                loss = loss + selector_loss_sum(model.candidate_selector, h, logits, ids.to(dev)[anchors.to(dev)], labels, valid, pw)
            (loss / max(weight_total(valid, pw), 1e-9)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def preflight(recipe: Recipe, *, length: int | None = None) -> dict[str, Any]:
    """Measure the capture and optimization peaks of one near-max-length step; returns the report."""
    from ..capture.teacher import DEFAULT_CHUNK_TOKENS, Teacher
    from ..device import provenance, resolve_device
    from ..families import check_recipe_pair
    from ..model.io import read_target_layer_ids

    cfg = recipe.require("train")
    cap = recipe.capture
    pair = check_recipe_pair(recipe.model.target, recipe.model.draft, recipe.model.family)
    choice = resolve_device(cfg.device)
    dev = choice.torch_device
    probe = _Probe(
        recipe, dev, int(length or recipe.data.max_length), torch.Generator().manual_seed(cfg.seed),
        read_target_layer_ids(recipe.model.draft), getattr(torch, cap.dtype) if cap is not None else torch.bfloat16,
        Teacher.load, cap.chunk_tokens if cap is not None else DEFAULT_CHUNK_TOKENS,
    )
    capture = _measure(dev, probe.capture)
    gc.collect()
    optimization = _measure(dev, probe.optimize)
    gc.collect()
    online = _measure(dev, lambda: probe.optimize(online=True))
    total, what = _device_memory(dev)
    need = max(capture["bytes"], optimization["bytes"], *([online["bytes"]] if cfg.features == "online" else []))
    go = need * MARGIN <= total
    forward_seconds = probe.timing["target_forward_seconds"]
    return {
        "sequence_length": probe.length,
        "chunk_tokens": probe.chunk_tokens,
        "blocks": cfg.blocks_per_sequence,
        "teacher": dataclasses.asdict(pair.target) | probe.loaded,
        "capture_peak": capture,
        "optimization_peak": optimization,
        "online_peak": online,
        "plans": plans(recipe, probe.layer_ids, pair.target.hidden_size, online["bytes"], forward_seconds, total),
        "device_memory_bytes": total,
        "device_memory": what,
        "margin": MARGIN,
        "verdict": "go" if go else "no-go",
        "reason": (
            f"largest peak {need / 2**30:.2f} GiB x {MARGIN} {'fits in' if go else 'exceeds'} {total / 2**30:.2f} GiB of {what}"
        ),
        "device": provenance(choice),
    }


ONLINE_BYTES_PER_TOKEN = 5  # an online shard's `int32` token id and `uint8` loss mask
ONLINE_BYTES_PER_EXAMPLE = 16  # its `index` and `offsets` entries (`int64` each)


def _capture_size(recipe: Recipe) -> tuple[int | None, int, str]:
    """(tokens, examples, basis) of the capture: counted by a finished capture's manifest, else an upper
    bound from the prepared splits (every example at `max_length`); tokens None when neither exists."""
    cap = recipe.capture
    if cap is not None:
        try:
            totals = json.loads((cap.output / "manifest.json").read_text(encoding="utf-8"))["totals"]
            return int(totals["tokens"]), int(totals["examples"]), "counted: the capture's manifest"
        except (OSError, ValueError, KeyError, TypeError):
            pass
    from ..data import PreparedData
    from ..errors import DflashError

    splits = cap.splits if cap is not None else ("train", "val")
    try:
        n = sum(1 for _ in PreparedData(recipe.data.dir).examples(splits))
    except DflashError:
        return None, 0, f"unknown: no finished capture and no prepared data in `{recipe.data.dir}`"
    return n * recipe.data.max_length, n, f"at most: {n} examples x max_length {recipe.data.max_length}"


def human_bytes(n: float) -> str:
    """`n` bytes in decimal units: `512 B`, `3.9 kB`, `51.2 GB`."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _free_disk(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (its nearest existing parent)."""
    p = path.absolute()
    while not p.exists():
        p = p.parent
    return int(shutil.disk_usage(p).free)


def plans(recipe: Recipe, layer_ids: list[int], hidden: int, online_peak: int, forward_seconds: float,
          memory: int) -> dict[str, Any]:
    """Both plans for `[train].features` on this machine and the one to pick.

    cache: the capture's disk bytes (`len(layer_ids) x hidden x bytes(dtype)` per token) against
    free disk where `[capture].output` lies; online: a few bytes per token on disk, but one target
    forward per training sequence (`forward_seconds`, measured at the preflight length, times
    `steps x grad_accum`) and `online_peak` (target + draft + optimizer) against `memory`.
    Recommended: `cache` when it fits on disk (the features are computed once), else `online` when
    it fits in memory, else `neither`."""
    cfg, cap = recipe.require("train"), recipe.capture
    dtype = cap.dtype if cap is not None else "bfloat16"
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    tokens, examples, basis = _capture_size(recipe)
    per_token = len(layer_ids) * hidden * elem
    if tokens is None:
        return {
            "tokens": None, "examples": 0, "tokens_basis": basis, "recipe_features": cfg.features,
            "cache": {"bytes_per_token": per_token, "dtype": dtype, "taps": len(layer_ids), "hidden_size": hidden},
            "online": {"bytes_per_token": ONLINE_BYTES_PER_TOKEN, "target_forward_seconds_per_sequence": forward_seconds,
                       "peak_memory_bytes": online_peak, "fits": online_peak * MARGIN <= memory},
            "recommended": "unknown", "reason": "the token count is unknown\nhint: run `prepare-data` first",
        }
    cache_bytes = tokens * per_token
    free = _free_disk(cap.output if cap is not None else Path.cwd())
    online_bytes = tokens * ONLINE_BYTES_PER_TOKEN + examples * ONLINE_BYTES_PER_EXAMPLE
    sequences = cfg.steps * cfg.grad_accum
    cache_fits = cache_bytes * MARGIN <= free
    online_fits = online_peak * MARGIN <= memory and online_bytes * MARGIN <= free
    disk = f"the cache ({human_bytes(cache_bytes)}) x {MARGIN}"
    peak = f"the online peak ({human_bytes(online_peak)}) x {MARGIN}"
    if cache_fits:
        pick, why = "cache", f"{disk} fits in {human_bytes(free)} of free disk; its features are computed once"
    elif online_fits:
        pick, why = "online", f"{disk} exceeds {human_bytes(free)} of free disk; {peak} fits in {human_bytes(memory)} of memory"
    else:
        pick, why = "neither", f"{disk} exceeds {human_bytes(free)} of free disk and {peak} exceeds {human_bytes(memory)} of memory"
    return {
        "tokens": tokens,
        "examples": examples,
        "tokens_basis": basis,
        "free_disk_bytes": free,
        "device_memory_bytes": memory,
        "cache": {"bytes_per_token": per_token, "disk_bytes": cache_bytes, "dtype": dtype, "taps": len(layer_ids),
                  "hidden_size": hidden, "fits": cache_fits},
        "online": {
            "bytes_per_token": ONLINE_BYTES_PER_TOKEN, "disk_bytes": online_bytes,
            "target_forward_seconds_per_sequence": forward_seconds,
            "extra_forward_seconds": forward_seconds * sequences, "sequences": sequences,
            "peak_memory_bytes": online_peak, "fits": online_fits,
        },
        "recipe_features": cfg.features,
        "recommended": pick,
        "reason": why,
    }
