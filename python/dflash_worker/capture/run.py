"""`capture`: run the frozen teacher over prepared data and cache the draft's target features.

Order of work, cheapest checks first:

1. read the recipe sections, verify the prepared data hashes, load the
   tokenizer and run `check_data` (no weights read yet);
2. read `target_layer_ids` from the released draft's config.json
   (`dflash_config` first, then top level) and check them against the
   target's `num_hidden_layers`; check the tokenizer fits the target vocab;
3. hash the teacher files and the tokenizer into the *capture key*: every
   input that shapes the payload bytes (no paths, no timestamps);
4. resume: shards whose sidecar names the same key and whose sha256 verifies
   are kept; the first one that does not verify, and everything after it,
   is rewritten; a dir holding a different capture is refused;
5. stream the teacher in (`dflash_worker.weights.load_model`), optionally
   regenerate each response (greedy or per-example seeded sampling), run the
   teacher once over prompt+response with `output_hidden_states` and keep
   ``hidden_states[id + 1]`` for each target layer id;
6. write shards atomically (shard, then sidecar) on a writer thread that
   overlaps the next examples' forward passes; release the teacher
   (``del`` + ``gc``), write ``manifest.json`` last.

Examples run one at a time (batch 1, no padding), so a stored feature equals a
plain forward of that example bit for bit.

Note on the last layer: in transformers 5, ``hidden_states[num_layers]`` is the
*final-normed* output (it equals ``last_hidden_state``), not the raw output of
the last decoder layer. Drafts pick earlier layers, so this only matters if a
draft names the last layer; the value stored is what `output_hidden_states`
returns, as the reference does.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import struct
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .. import __version__
from ..data import PreparedData, check_data, load_tokenizer, render_example, render_prompt
from ..errors import CheckpointError, DataError, ResumeError
from ..families import check_recipe_pair
from ..manifest import (
    commit_file,
    device_provenance,
    fingerprint,
    sha256_bytes,
    sha256_file,
    software_versions,
    write_json_atomic,
)
from ..recipe import Recipe
from .layout import FORMAT, MANIFEST, SHARD_FORMAT, shard_path, sidecar_path

EventFn = Callable[[dict[str, Any]], None]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def read_target_layer_ids(draft_dir: str | Path) -> list[int]:
    """`target_layer_ids` of a released draft: `dflash_config.target_layer_ids` first, then top level."""
    cfg = Path(draft_dir) / "config.json"
    try:
        doc = json.loads(cfg.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"`{cfg}` not found\nhint: `[model].draft` must be the released draft's dir") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read `{cfg}`: {exc}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"`{cfg}` is not a JSON object")
    sub = doc.get("dflash_config")
    ids = sub.get("target_layer_ids") if isinstance(sub, dict) else None
    if ids is None:
        ids = doc.get("target_layer_ids")
    if ids is None:
        raise CheckpointError(f"`{cfg}` has no `target_layer_ids` (looked in `dflash_config`, then top level)")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"`{cfg}`: `target_layer_ids` must be a non-empty list of non-negative integers, found `{ids}`")
    if len(set(ids)) != len(ids):
        raise CheckpointError(f"`{cfg}`: `target_layer_ids` has repeats: `{ids}`")
    return list(ids)


def _teacher_hashes(target: Path) -> dict[str, str]:
    files = sorted(p for p in target.iterdir() if p.is_file() and (p.suffix == ".safetensors" or p.name == "model.safetensors.index.json" or p.name == "config.json"))
    if not any(p.suffix == ".safetensors" for p in files):
        raise CheckpointError(f"no `.safetensors` files in target dir `{target}`")
    return {p.name: sha256_file(p) for p in files}


def _tokenizer_hashes(target: Path) -> dict[str, str]:
    return {n: sha256_file(target / n) for n in TOKENIZER_FILES if (target / n).is_file()}


def _stop_ids(tokenizer: Any, config: dict[str, Any]) -> list[int]:
    ids: set[int] = set()
    eos = config.get("eos_token_id")
    for v in eos if isinstance(eos, list) else [eos]:
        if isinstance(v, int):
            ids.add(v)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end >= 0:
        ids.add(im_end)
    return sorted(ids)


def teacher_features(model: Any, input_ids: list[int], layer_ids: list[int], device: Any):
    """`[T, len(layer_ids) * H]` on the CPU: ``hidden_states[id + 1]`` of each id, concatenated."""
    import torch

    with torch.inference_mode():
        x = torch.tensor([input_ids], dtype=torch.long, device=device)
        out = model(input_ids=x, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        hs = out.hidden_states
        return torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1).to("cpu")


def _verify_shard(root: Path, i: int, key: str) -> dict[str, Any] | None:
    """The sidecar of shard `i` if the shard is complete; None if missing or corrupt.

    A sidecar written for another capture key raises ResumeError: the dir holds a different capture.
    """
    sc, sp = sidecar_path(root, i), shard_path(root, i)
    if not sc.is_file() or not sp.is_file():
        return None
    try:
        side = json.loads(sc.read_text(encoding="utf-8"))
        if side.get("format") != SHARD_FORMAT:
            return None
    except (OSError, ValueError, AttributeError):
        return None
    if side.get("capture_key") != key:
        raise ResumeError(
            f"`{sc}` belongs to a different capture (key `{side.get('capture_key')}`, this recipe gives `{key}`)\n"
            "hint: point `[capture].output` at a new dir, or delete the old capture"
        )
    if sp.stat().st_size != side.get("bytes") or sha256_file(sp) != side.get("sha256"):
        return None
    return side


def _remove_from(root: Path, first: int) -> int:
    """Delete shards and sidecars with index >= `first`, stale temporaries, and the manifest."""
    removed = 0
    for p in root.iterdir():
        name = p.name
        if name.startswith(".shard-") and ".tmp-" in name or name.startswith(f".{MANIFEST}.tmp-"):
            p.unlink(missing_ok=True)
        elif name.startswith("shard-") and name.endswith((".safetensors", ".json")):
            try:
                idx = int(name[6:11])
            except ValueError:
                continue
            if idx >= first:
                p.unlink(missing_ok=True)
                removed += 1
    (root / MANIFEST).unlink(missing_ok=True)
    return removed


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32", "int64": "I64", "uint8": "U8"}


def _raw(t: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (works for bf16, which numpy lacks)."""
    import torch

    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _write_shard(path: Path, items: list[dict[str, Any]], meta: dict[str, Any]) -> tuple[str, int]:
    """Stream one shard to `path` atomically in safetensors format; returns `(sha256, bytes)`.

    Written by hand instead of `safetensors.torch.save` so each example's features go
    from their own tensor to the file and the hash with no concatenated copy and no
    in-memory blob; the result is a regular safetensors file (`safe_open` reads it).
    Tensors are laid out by element size, largest first, so every tensor is aligned;
    the header is padded with spaces to 8 bytes, as the format allows. Only one
    metadata key is written: safetensors' own writer orders `__metadata__` from a
    hash map that changes between processes, which would break byte-identical shards.
    """
    import torch

    ids = torch.tensor([t for it in items for t in it["ids"]], dtype=torch.int32)
    mask = torch.tensor([m for it in items for m in it["mask"]], dtype=torch.uint8)
    offsets = [0]
    for it in items:
        offsets.append(offsets[-1] + len(it["ids"]))
    index_t = torch.tensor([it["index"] for it in items], dtype=torch.int64)
    offsets_t = torch.tensor(offsets, dtype=torch.int64)
    feats = [it["features"].contiguous() for it in items]
    width = feats[0].shape[1]
    fdtype = str(feats[0].dtype).removeprefix("torch.")
    fbytes = sum(f.numel() * f.element_size() for f in feats)
    layout = [  # (name, dtype, shape, nbytes) in file order: 8-byte, then 4/2-byte, then 1-byte elements
        ("index", "int64", [len(items)], index_t.numel() * 8),
        ("offsets", "int64", [len(offsets)], offsets_t.numel() * 8),
        ("features", fdtype, [offsets[-1], width], fbytes),
        ("input_ids", "int32", [offsets[-1]], ids.numel() * 4),
        ("loss_mask", "uint8", [offsets[-1]], mask.numel()),
    ]
    header: dict[str, Any] = {"__metadata__": {"dflash_capture": json.dumps(meta, sort_keys=True, separators=(",", ":"))}}
    pos = 0
    for name, dt, shape, n in layout:
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)
    chunks = [struct.pack("<Q", len(hb)), hb, _raw(index_t), _raw(offsets_t)]
    chunks += [_raw(x) for x in feats] + [_raw(ids), _raw(mask)]
    h = hashlib.sha256()
    total = 0
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                h.update(c)
                f.write(c)
                total += len(c)
        commit_file(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return h.hexdigest(), total


def _commit_shard(root: Path, items: list[dict[str, Any]], meta: dict[str, Any], side: dict[str, Any]) -> dict[str, Any]:
    """Write one shard, then its sidecar (both atomic); returns the sidecar."""
    sha, nbytes = _write_shard(shard_path(root, side["shard"]), items, meta)
    side = {**side, "sha256": sha, "bytes": nbytes}
    write_json_atomic(sidecar_path(root, side["shard"]), side)
    return side


def run_capture(recipe: Recipe, *, on_event: EventFn | None = None) -> dict[str, Any]:
    """Run (or resume) the capture described by `recipe`; returns the manifest written."""
    emit: EventFn = on_event or (lambda e: None)
    t0 = time.perf_counter()
    cap = recipe.require("capture")
    mcfg, dcfg = recipe.model, recipe.data

    # 1. data and tokenizer, no weights
    prepared = PreparedData(dcfg.dir)
    tokenizer = load_tokenizer(mcfg.target)
    report = check_data(
        prepared, tokenizer, thinking=dcfg.thinking, max_length=dcfg.max_length, regenerate=cap.regenerate, splits=cap.splits
    )
    report.raise_if_failed()
    emit({"event": "data_checked", "examples": report.examples})
    check_recipe_pair(mcfg.target, mcfg.draft, mcfg.family)  # headers and config.json only

    # 2. geometry
    from ..weights.loader import read_config_json

    tcfg = read_config_json(mcfg.target)
    layer_ids = read_target_layer_ids(mcfg.draft)
    n_layers, hidden, vocab = tcfg.get("num_hidden_layers"), tcfg.get("hidden_size"), tcfg.get("vocab_size")
    if not all(isinstance(v, int) for v in (n_layers, hidden, vocab)):
        raise CheckpointError(f"`{mcfg.target / 'config.json'}` lacks `num_hidden_layers`/`hidden_size`/`vocab_size`")
    bad = [i for i in layer_ids if i >= n_layers]
    if bad:
        raise CheckpointError(
            f"draft `target_layer_ids` `{layer_ids}` name layer `{bad[0]}`, but the target has `{n_layers}` layers\n"
            "hint: this draft was released for a different target"
        )
    if len(tokenizer) > vocab:
        raise CheckpointError(
            f"the tokenizer has `{len(tokenizer)}` tokens but the target's `vocab_size` is `{vocab}`\n"
            "hint: tokenizer and weights of `[model].target` do not belong together"
        )

    from ..device import memory_peak, reset_peak, resolve_device

    choice = resolve_device(cap.device)

    # 3. capture key: everything that shapes payload bytes
    teacher = _teacher_hashes(mcfg.target)
    tok_files = _tokenizer_hashes(mcfg.target)
    chat_sha = sha256_bytes(tokenizer.chat_template.encode("utf-8"))
    generation = (
        {
            "sampling": cap.sampling,
            "temperature": cap.temperature if cap.sampling == "sampled" else None,
            "top_p": cap.top_p if cap.sampling == "sampled" else None,
            "seed": cap.seed if cap.sampling == "sampled" else None,
            "max_new_tokens": cap.max_new_tokens,
        }
        if cap.regenerate
        else None
    )
    shard_policy = {"examples": cap.shard_examples} if cap.shard_tokens is None else {"tokens": cap.shard_tokens}
    key_doc = {
        "format": FORMAT,
        "teacher_files": teacher,
        "tokenizer_files": tok_files,
        "chat_template_sha256": chat_sha,
        "thinking": dcfg.thinking,
        "max_length": dcfg.max_length,
        "target_layer_ids": layer_ids,
        "dtype": cap.dtype,
        "device_type": choice.type,
        "split_fingerprint": prepared.split_fingerprint,
        "splits": list(cap.splits),
        "regenerate": generation,
        "shard_policy": shard_policy,
    }
    key = fingerprint(key_doc)

    # 4. resume
    out = cap.output
    out.mkdir(parents=True, exist_ok=True)
    old = out / MANIFEST
    if old.is_file():
        try:
            old_key = json.loads(old.read_text(encoding="utf-8")).get("capture_key")
        except (OSError, ValueError, AttributeError):
            old_key = None
        if old_key is not None and old_key != key:
            raise ResumeError(
                f"`{out}` holds a different capture (key `{old_key}`, this recipe gives `{key}`)\n"
                "hint: point `[capture].output` at a new dir, or delete the old capture"
            )
    sides: list[dict[str, Any]] = []
    while (side := _verify_shard(out, len(sides), key)) is not None:
        if side.get("first") != (sides[-1]["end"] if sides else 0):
            break
        sides.append(side)
    reused = len(sides)
    if old.is_file() and reused and json.loads(old.read_text(encoding="utf-8")).get("shards_total") == reused:
        manifest = json.loads(old.read_text(encoding="utf-8"))
        emit({"event": "already_complete", "shards": reused})
        return manifest
    _remove_from(out, reused)
    for side in sides:
        emit({"event": "shard_reused", "shard": side["shard"], "examples": side["examples"], "tokens": side["tokens"]})

    examples = list(prepared.examples(cap.splits))
    start = sides[-1]["end"] if sides else 0
    emit({"event": "start", "examples": len(examples), "resume_from": start, "shards_reused": reused})

    import torch

    dtype = getattr(torch, cap.dtype)
    reset_peak(choice)
    load_seconds = 0.0
    truncated_total = sum(s.get("generation_truncated", 0) for s in sides)
    if start < len(examples):
        from ..weights import load_model

        tl = time.perf_counter()
        model = load_model(mcfg.target, device=choice.device, dtype=dtype)
        load_seconds = time.perf_counter() - tl
        model_ref = weakref.ref(model)
        emit({"event": "teacher_loaded", "seconds": load_seconds})
        stops = _stop_ids(tokenizer, tcfg)
        items: list[dict[str, Any]] = []
        item_tokens = 0
        truncated_in_shard = 0

        # Shards are encoded, hashed and written on one writer thread while the teacher runs
        # the next examples; at most one shard is in flight, so memory stays at two shards.
        # Commit events are emitted from this thread, once the write has finished.
        pending: Future | None = None

        def settle() -> None:
            nonlocal pending
            if pending is not None:
                side = pending.result()
                pending = None
                sides.append(side)
                emit({"event": "shard_committed", "shard": side["shard"], "examples": side["examples"], "tokens": side["tokens"], "end": side["end"]})  # noqa: E501

        def flush() -> None:
            nonlocal items, item_tokens, truncated_in_shard, pending
            settle()
            idx = len(sides)
            meta = {
                "format": SHARD_FORMAT,
                "capture_key": key,
                "target_layer_ids": layer_ids,
                "hidden_size": hidden,
                "dtype": cap.dtype,
                "examples": [[it["split"], it["id"]] for it in items],
            }
            side = {
                "format": SHARD_FORMAT,
                "capture_key": key,
                "shard": idx,
                "file": shard_path(out, idx).name,
                "first": items[0]["index"],
                "end": items[-1]["index"] + 1,
                "examples": len(items),
                "tokens": item_tokens,
                "loss_tokens": sum(sum(it["mask"]) for it in items),
                "generation_truncated": truncated_in_shard,
            }
            pending = pool.submit(_commit_shard, out, items, meta, side)
            items, item_tokens, truncated_in_shard = [], 0, 0

        from .generate import example_seed, generate

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-capture-writer") as pool:
            for i in range(start, len(examples)):
                ex = examples[i]
                if cap.regenerate:
                    prompt = render_prompt(tokenizer, ex.prompt_messages, thinking=dcfg.thinking)
                    budget = min(cap.max_new_tokens, dcfg.max_length - len(prompt))
                    g = generate(
                        model, prompt, max_new_tokens=budget, stop_ids=stops, greedy=cap.sampling == "greedy",
                        temperature=cap.temperature, top_p=cap.top_p, seed=example_seed(cap.seed, ex.id),
                        device=choice.device,
                    )
                    ids, mask = prompt + g.ids, [0] * len(prompt) + [1] * len(g.ids)
                    if not g.stopped:
                        truncated_in_shard += 1
                        truncated_total += 1
                else:
                    r = render_example(tokenizer, ex.messages, thinking=dcfg.thinking)
                    ids, mask = r.input_ids, r.loss_mask
                if len(ids) > dcfg.max_length:  # check_data guarantees this never happens
                    raise DataError(f"`{ex.file}` line {ex.line}: `{len(ids)}` tokens > max_length `{dcfg.max_length}`")
                if cap.shard_tokens is not None and items and item_tokens + len(ids) > cap.shard_tokens:
                    flush()
                feats = teacher_features(model, ids, layer_ids, choice.device).to(dtype)
                items.append({"index": i, "split": ex.split, "id": ex.id, "ids": ids, "mask": mask, "features": feats})
                item_tokens += len(ids)
                emit({"event": "example", "index": i, "total": len(examples), "tokens": len(ids)})
                if cap.shard_tokens is None and len(items) >= cap.shard_examples:
                    flush()
            if items:
                flush()
            settle()
        emit({"event": "shards_done", "shards": len(sides)})
        # 6. release the teacher before anything else allocates
        del model
        gc.collect()
        if choice.type == "cuda":
            torch.cuda.empty_cache()
        released = model_ref() is None
        emit({"event": "teacher_released", "released": released})
    else:
        released = True
    peak = memory_peak(choice)

    by_split: dict[str, int] = {s: 0 for s in cap.splits}
    for ex in examples:
        by_split[ex.split] += 1
    manifest = {
        "format": FORMAT,
        "capture_key": key,
        "key_inputs": key_doc,
        "recipe_fingerprint": recipe.fingerprint(),
        "recipe": recipe.resolved(),
        "teacher": {"path": str(mcfg.target), "family": mcfg.family, "files": teacher, "num_hidden_layers": n_layers, "hidden_size": hidden, "vocab_size": vocab},  # noqa: E501
        "draft": {"path": str(mcfg.draft), "config_sha256": sha256_file(mcfg.draft / "config.json")},
        "tokenizer": {"files": tok_files, "fingerprint": fingerprint(tok_files), "chat_template_sha256": chat_sha, "tokens": len(tokenizer)},  # noqa: E501
        "thinking": dcfg.thinking,
        "max_length": dcfg.max_length,
        "target_layer_ids": layer_ids,
        "hidden_size": hidden,
        "feature_dim": hidden * len(layer_ids),
        "dtype": cap.dtype,
        "data": {"dir": str(dcfg.dir), "split_fingerprint": prepared.split_fingerprint, "manifest_fingerprint": prepared.manifest.get("fingerprint"), "splits": list(cap.splits)},  # noqa: E501
        "generation": generation,
        "shards": [
            {k: s[k] for k in ("file", "sha256", "bytes", "first", "end", "examples", "tokens", "loss_tokens")} for s in sides
        ],
        "shards_total": len(sides),
        "totals": {
            "examples": sum(s["examples"] for s in sides),
            "tokens": sum(s["tokens"] for s in sides),
            "loss_tokens": sum(s["loss_tokens"] for s in sides),
            "payload_bytes": sum(s["bytes"] for s in sides),
            "examples_by_split": by_split,
            "generation_truncated": truncated_total,
        },
        "software": software_versions() | {"dflash-worker": __version__},
        "device": device_provenance(choice),
        # Everything below describes this run, not the payload; it differs between runs.
        "run": {
            "shards_reused": reused,
            "shards_written": len(sides) - reused,
            "teacher_load_seconds": round(load_seconds, 3),
            "seconds": round(time.perf_counter() - t0, 3),
            "teacher_released": released,
            "peak_memory": peak,
            # CPU float results can depend on the intra-op thread count; byte-identity holds at equal counts
            "torch_threads": torch.get_num_threads(),
        },
    }
    assert manifest["totals"]["examples"] == len(examples), "shards must cover every example exactly once"
    write_json_atomic(out / MANIFEST, manifest)
    emit({"event": "done", "shards": len(sides), "tokens": manifest["totals"]["tokens"]})
    return manifest
