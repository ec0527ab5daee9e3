"""Preflight: will this recipe fit on this device? One near-max-length step, measured.

Two phases, each measured on its own and reported as a *peak*:

- capture: the frozen teacher's forward with ``output_hidden_states`` over one
  sequence of ``[data].max_length`` tokens (the teacher is then released);
- optimization: the draft's forward, backward and AdamW update over one
  sequence of ``max_length`` tokens with ``blocks_per_sequence`` anchored
  blocks (QAT and gradient checkpointing as the recipe says), with the
  target's embedding and head loaded.

Peaks: the allocator peak on CUDA (``max_memory_allocated``); on CPU and MPS
the process resident-set peak: on Linux ``VmHWM`` after resetting it through
``/proc/self/clear_refs``, elsewhere the maximum of RSS samples taken every
5 ms. The verdict is ``go`` when the larger peak plus a 10% margin fits in the
device's memory (CUDA: total device memory; CPU/MPS: total system memory).

The report's ``teacher`` says what was measured: the target's text tower (family,
layers, width, experts, tensor bytes from the headers) and ``bytes_read``, what the
capture phase's load actually took from the files. A Qwen3.5 checkpoint's vision
tower and MTP heads are skipped unread (``skipped_bytes``): they are in no peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
import time
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


def preflight(recipe: Recipe, *, length: int | None = None) -> dict[str, Any]:
    """Measure the capture and optimization peaks of one near-max-length step; returns the report."""
    from ..device import provenance, resolve_device
    from ..families import check_recipe_pair
    from ..model import load_draft
    from ..weights import load_model
    from .data import sample_anchors
    from .objectives import block_labels, position_weights, selector_loss_sum, token_loss_sum, weight_total
    from .params import load_target_head
    from .scopes import includes_selector, scope_names

    cfg = recipe.require("train")
    cap = recipe.capture
    pair = check_recipe_pair(recipe.model.target, recipe.model.draft, recipe.model.family)
    choice = resolve_device(cfg.device)
    dev = choice.torch_device
    L = int(length or recipe.data.max_length)
    gen = torch.Generator().manual_seed(cfg.seed)

    cap_dtype = getattr(torch, cap.dtype) if cap is not None else torch.bfloat16
    loaded: dict[str, int] = {}

    def capture_phase() -> None:
        target = load_model(recipe.model.target, device=dev, dtype=cap_dtype)
        loaded["bytes_read"] = target.load_report.bytes_read
        vocab = target.config.vocab_size
        ids = torch.randint(0, vocab, (1, L), generator=gen).to(dev)
        with torch.no_grad():
            target(ids, output_hidden_states=True)
        del target

    capture = _measure(dev, capture_phase)
    gc.collect()

    def optimize_phase() -> None:
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
        feats = torch.randn(1, L, model.config.context_width, generator=gen).to(dev)
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

    optimization = _measure(dev, optimize_phase)
    total, what = _device_memory(dev)
    need = max(capture["bytes"], optimization["bytes"])
    go = need * MARGIN <= total
    return {
        "sequence_length": L,
        "blocks": cfg.blocks_per_sequence,
        "teacher": dataclasses.asdict(pair.target) | loaded,
        "capture_peak": capture,
        "optimization_peak": optimization,
        "device_memory_bytes": total,
        "device_memory": what,
        "margin": MARGIN,
        "verdict": "go" if go else "no-go",
        "reason": (
            f"largest peak {need / 2**30:.2f} GiB x {MARGIN} {'fits in' if go else 'exceeds'} {total / 2**30:.2f} GiB of {what}"
        ),
        "device": provenance(choice),
    }
