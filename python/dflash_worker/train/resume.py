"""Resuming a run: what must agree with a checkpoint, which checkpoint to resume, the metrics it keeps.

Resume compatibility: the resolved recipe minus operational fields
(`RESUME_IGNORED`: output and checkpoint cadence, devices, paths whose content
the data and draft fingerprints already cover, the export/evaluate sections),
the capture fingerprint (sha256 of the capture manifest, which names the
teacher's and data's hashes) and the draft fingerprint (sha256 of every file
of the released draft) must all equal the checkpoint's; otherwise
`ResumeError` names the differing fields (`compare_for_resume`). `run_identity`
is what a run writes into every checkpoint for this comparison.

`restore_newest_usable` (the job runner's `skip_unusable`): the newest committed
checkpoint that loads and fits the run, skipping each one that does not with a
warning, else a fresh start. `truncate_metrics` drops the metric lines past the
restored step, so every step appears in ``metrics.jsonl`` exactly once.
`verify_completed_run`: a completed run (``selection.json`` written) is checked, not retrained.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, ResumeError
from ..manifest import fingerprint, sha256_file
from ..recipe import Recipe
from ..worker.events import EventSink, Log
from . import checkpoint as ckpt

RESUME_IGNORED = frozenset(
    {
        "train.output",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.device",
        "capture.device",
        "capture.on_overlong",  # its effect is in the capture key, hence the data fingerprint
        "capture.output",
        "model.target",
        "model.draft",
        "data.dir",
    }
)
RESUME_IGNORED_SECTIONS = ("export", "evaluate")


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = obj
    return out


def resume_view(recipe: Recipe) -> dict[str, Any]:
    """The recipe fields a resume must agree on, flattened (`section.key`)."""
    flat = _flatten({k: v for k, v in recipe.resolved().items() if k not in RESUME_IGNORED_SECTIONS})
    return {k: v for k, v in flat.items() if k not in RESUME_IGNORED}


def draft_fingerprint(draft_dir: Path) -> dict[str, str]:
    """sha256 of every file of the released draft that shapes its weights or config."""
    files = sorted(p for p in Path(draft_dir).iterdir() if p.is_file() and (p.suffix in (".safetensors", ".json")))
    return {p.name: sha256_file(p) for p in files}


def capture_fingerprint(capture_dir: Path) -> str:
    """Identity of the captured payload: the capture key (every input that shapes the bytes,
    no paths) and each shard's sha256. Timings and absolute paths in the manifest do not count,
    so an identical re-capture (a new job directory, a restarted attempt) resumes."""
    manifest = json.loads((Path(capture_dir) / "manifest.json").read_text(encoding="utf-8"))
    return fingerprint({"capture_key": manifest["capture_key"], "shards": [[s["file"], s["sha256"]] for s in manifest["shards"]]})


def run_identity(recipe: Recipe) -> dict[str, Any]:
    """What every checkpoint of `recipe`'s run records and a resume compares (`compare_for_resume`)."""
    return {
        "recipe_view": resume_view(recipe),
        "recipe_fingerprint": fingerprint(resume_view(recipe)),
        "data_fingerprint": capture_fingerprint(recipe.require("capture").output),
        "draft_fingerprint": draft_fingerprint(recipe.model.draft),
    }


def check_capture_fits_draft(capture_dir: Path, draft_dir: Path, features: str = "cache") -> None:
    """The capture holds the features of the target layers the draft taps (manifests and config.json only),
    and it was made for `features` (`[train].features`): a cache capture holds them, an online one the tokens only.

    A capture made for another draft (another `target_layer_ids`) would otherwise train on the wrong layers
    whenever the number of taps agrees."""
    from ..errors import DataError
    from ..model.io import read_target_layer_ids

    manifest = json.loads((Path(capture_dir) / "manifest.json").read_text(encoding="utf-8"))
    stored = manifest.get("features", "cache")
    if stored != features:
        raise DataError(
            f"capture `{capture_dir}` was made with `[train].features = \"{stored}\"`, but this recipe trains with "
            f"`\"{features}\"`\nhint: capture again with this recipe (a new `[capture].output`), or set "
            f"`[train].features = \"{stored}\"`"
        )
    captured = manifest.get("target_layer_ids")
    tapped = read_target_layer_ids(draft_dir)
    if captured != tapped:
        raise DataError(
            f"capture `{capture_dir}` holds the features of target layers `{captured}`, but draft `{draft_dir}` "
            f"taps target layers `{tapped}`\nhint: capture again for this draft (a new `[capture].output`), "
            "or train the draft the capture was made for"
        )


def compare_for_resume(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise `ResumeError` naming every field in which `current` differs from `saved`."""
    diffs = []
    s_rec, c_rec = saved.get("recipe_view") or {}, current["recipe_view"]
    if s_rec and "train.interpolate" not in s_rec and "train.interpolate" in c_rec:
        # `[train].interpolate` only chooses the export once training is over: nothing a checkpoint holds depends
        # on it, so one written before the key resumes with either value (`keep_general` now sets "auto")
        s_rec = {**s_rec, "train.interpolate": c_rec["train.interpolate"]}
    if s_rec:  # a key added after a checkpoint was written (or absent from a view) counts as its default
        # (`data.train_turns`: "all" trains what "last" did on the rows that existed before it, whose final
        # turn was their only assistant turn; multi-turn captures change the capture key, hence the data fingerprint)
        added = {"train.features": "cache", "train.general_tolerance": 0.03, "train.guard_patience": 0, "train.replay_kd": 0.0,
                 "capture.chunk_tokens": 2048, "data.train_turns": "all"}
        s_rec, c_rec = {**added, **s_rec}, {**added, **c_rec}
    for key in sorted(set(s_rec) | set(c_rec)):
        if s_rec.get(key, "<absent>") != c_rec.get(key, "<absent>"):
            diffs.append(f"recipe `{key}`: checkpoint `{s_rec.get(key, '<absent>')}`, now `{c_rec.get(key, '<absent>')}`")
    if saved.get("data_fingerprint") != current["data_fingerprint"]:
        diffs.append(f"data fingerprint: checkpoint `{saved.get('data_fingerprint')}`, now `{current['data_fingerprint']}`")
    s_d, c_d = saved.get("draft_fingerprint") or {}, current["draft_fingerprint"]
    for name in sorted(set(s_d) | set(c_d)):
        if s_d.get(name) != c_d.get(name):
            diffs.append(f"draft file `{name}`: checkpoint `{s_d.get(name)}`, now `{c_d.get(name)}`")
    if diffs:
        raise ResumeError(
            "cannot resume: the run differs from its checkpoint in\n  "
            + "\n  ".join(diffs)
            + "\nhint: resume with the original recipe, data and draft, or start a new run directory"
        )


def restore_newest_usable(
    run_dir: Path,
    existing: Path,
    steps: int,
    *,
    restore: Callable[[ckpt.Loaded], None],
    reset: Callable[[], None],
    emit: EventSink,
) -> bool:
    """`restore` `existing`, else the next older committed checkpoint that loads and fits this run
    (`steps` its last step); False (a fresh start) when none does. Each one skipped is a warning,
    never a failure, after which `reset` undoes what a restore that failed midway may have changed:
    a coordinator job's checkpoints may come from another attempt (`skip_unusable`)."""
    older = [p for _, p in reversed(ckpt.committed(run_dir)) if p != existing]
    for path in [existing, *older]:
        try:
            loaded = ckpt.load(path)
            if not 0 <= loaded.step <= steps:
                raise CheckpointError(f"checkpoint `{path}` is at step {loaded.step}, outside this run's 0..{steps}")
            restore(loaded)
        except (CheckpointError, ResumeError, KeyError, ValueError, TypeError, RuntimeError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            emit(Log(level="warning", message=f"skipped checkpoint `{path}`: {why[:300]}"))
            reset()
            continue
        emit(Log(message=f"resumed from `{path}` at step {loaded.step}"))
        return True
    emit(Log(level="warning", message="no committed checkpoint could be resumed; training starts from step 0"))
    return False


def truncate_metrics(path: Path, step: int) -> None:
    """Keep only well-formed metric lines with ``step <= step`` (atomic rewrite)."""
    if not path.is_file():
        return
    kept = []
    for raw in path.read_bytes().splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("step"), int) and obj["step"] <= step:
            kept.append(raw + b"\n")
    from ..manifest import write_bytes_atomic

    write_bytes_atomic(path, b"".join(kept))


def verify_completed_run(run_dir: Path, identity: dict[str, Any]) -> tuple[dict[str, Any], Path, Path]:
    """A completed run: check its selection, the selected checkpoint (against `identity`) and the export
    instead of retraining; returns (the selection, the export directory, the checkpoint)."""
    from .export_run import SELECTION, verify_export

    sel = json.loads((run_dir / SELECTION).read_text())
    path = run_dir / ckpt.CHECKPOINTS / sel["checkpoint"]
    state = ckpt.load(path).state
    compare_for_resume(state, identity)
    if sha256_file(path / "manifest.json") != sel["checkpoint_manifest_sha256"]:
        raise ResumeError(f"selected checkpoint `{path}` changed after selection")
    out = run_dir / sel["export"]["dir"]
    verify_export(out)
    if sha256_file(out / "manifest.json") != sel["export"]["manifest_sha256"]:
        raise ResumeError(f"export `{out}` is not the one recorded in `{run_dir / SELECTION}`")
    return sel, out, path
