"""Step 1 of a capture (`capture.run`): the plan, decided before any weight is read.

`plan_capture` reads the recipe sections, verifies the prepared data hashes, loads the
tokenizer and runs `check_data`; reads `target_layer_ids` from the released draft's
config.json and checks them, and the tokenizer, against the target (`read_geometry`);
decides `[capture].on_overlong` (`capture.overlong`), reads the stop ids
(`dflash_worker.stop_tokens`) and hashes every input that shapes the payload bytes into
the *capture key* (`capture_key`: no paths, no timestamps), which names the shards a
resume may keep (`capture.shards`). The result, a `CapturePlan`, is what every later
step reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data import Example, PreparedData, check_data, load_tokenizer
from ..errors import CheckpointError, DataError
from ..families import check_recipe_pair
from ..manifest import fingerprint, sha256_bytes, sha256_file
from ..model.io import read_target_layer_ids
from ..recipe import CaptureConfig, Recipe
from ..stop_tokens import stop_tokens_record
from ..worker.events import EventSink, Log
from .layout import FORMAT
from .overlong import OverlongDecision

if TYPE_CHECKING:
    from ..device import DeviceChoice

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


@dataclass(frozen=True)
class TeacherGeometry:
    """The target's shape as far as capture cares, and the layers the draft reads."""

    config: dict[str, Any]  # the target's config.json
    layer_ids: list[int]
    num_layers: int
    hidden: int
    vocab: int


def read_geometry(target: Path, draft: Path, tokenizer: Any) -> TeacherGeometry:
    """The target's geometry from its config.json, checked against the draft's layer ids and the tokenizer."""
    from ..weights.checkpoint import read_text_config

    tcfg = read_text_config(target)  # a multimodal wrapper's text tower
    layer_ids = read_target_layer_ids(draft)
    n_layers, hidden, vocab = tcfg.get("num_hidden_layers"), tcfg.get("hidden_size"), tcfg.get("vocab_size")
    if not (isinstance(n_layers, int) and isinstance(hidden, int) and isinstance(vocab, int)):
        raise CheckpointError(f"`{target / 'config.json'}` lacks `num_hidden_layers`/`hidden_size`/`vocab_size`")
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
    return TeacherGeometry(tcfg, layer_ids, n_layers, hidden, vocab)


def _teacher_hashes(target: Path) -> dict[str, str]:
    files = sorted(p for p in target.iterdir() if p.is_file() and (p.suffix == ".safetensors" or p.name == "model.safetensors.index.json" or p.name == "config.json"))
    if not any(p.suffix == ".safetensors" for p in files):
        raise CheckpointError(f"no `.safetensors` files in target dir `{target}`")
    return {p.name: sha256_file(p) for p in files}


def _tokenizer_hashes(target: Path) -> dict[str, str]:
    return {n: sha256_file(target / n) for n in TOKENIZER_FILES if (target / n).is_file()}


@dataclass(frozen=True)
class CaptureKey:
    """The capture key and the inputs it hashes (recorded in the manifest as `key_inputs`)."""

    key: str
    inputs: dict[str, Any]
    teacher_files: dict[str, str]
    tokenizer_files: dict[str, str]
    chat_template_sha256: str
    generation: dict[str, Any] | None  # the regeneration settings; None without `regenerate`


def features_mode(recipe: Recipe) -> str:
    """`[train].features` (`cache` without a `[train]` section): what the capture stores."""
    return recipe.train.features if recipe.train is not None else "cache"


def _generation(cap: CaptureConfig) -> dict[str, Any] | None:
    if not cap.regenerate:
        return None
    sampled = cap.sampling == "sampled"
    return {
        "sampling": cap.sampling,
        "temperature": cap.temperature if sampled else None,
        "top_p": cap.top_p if sampled else None,
        "seed": cap.seed if sampled else None,
        "max_new_tokens": cap.max_new_tokens,
    }


def capture_key(
    recipe: Recipe, prepared: PreparedData, tokenizer: Any, layer_ids: list[int], device_type: str,
    overlong: OverlongDecision | None = None,
) -> CaptureKey:
    """Fingerprint of everything that shapes the payload bytes (no paths, no timestamps).

    `on_overlong` enters the key only when some example is over `max_length`: otherwise it
    changes no byte, and keys (hence training data fingerprints) stay what they were.
    """
    cap, dcfg = recipe.require("capture"), recipe.data
    teacher = _teacher_hashes(recipe.model.target)
    tok_files = _tokenizer_hashes(recipe.model.target)
    chat_sha = sha256_bytes(tokenizer.chat_template.encode("utf-8"))
    generation = _generation(cap)
    inputs = {
        "format": FORMAT,
        "teacher_files": teacher,
        "tokenizer_files": tok_files,
        "chat_template_sha256": chat_sha,
        "thinking": dcfg.thinking,
        "max_length": dcfg.max_length,
        "target_layer_ids": layer_ids,
        "dtype": cap.dtype,
        "device_type": device_type,
        "split_fingerprint": prepared.split_fingerprint,
        "splits": list(cap.splits),
        "regenerate": generation,
        "shard_policy": {"examples": cap.shard_examples} if cap.shard_tokens is None else {"tokens": cap.shard_tokens},
    }
    if overlong is not None and overlong.items:
        inputs["on_overlong"] = overlong.policy
    if dcfg.max_length > cap.chunk_tokens:  # only then can an example run in chunks (`capture.teacher`)
        inputs["chunk_tokens"] = cap.chunk_tokens
    if features_mode(recipe) == "online":  # only then: a cache capture's key stays what it was
        inputs["features"] = "online"
    if any(ex.earlier_turns for ex in prepared.examples(cap.splits)):  # only then does it change a byte
        inputs["train_turns"] = dcfg.train_turns
    return CaptureKey(fingerprint(inputs), inputs, teacher, tok_files, chat_sha, generation)


@dataclass(frozen=True)
class CapturePlan:
    """Everything checked and decided before any weight is read."""

    recipe: Recipe
    cap: CaptureConfig
    prepared: PreparedData
    tokenizer: Any
    geometry: TeacherGeometry
    choice: DeviceChoice
    key: CaptureKey
    overlong: OverlongDecision
    stop_tokens: dict[str, Any]  # `stop_tokens_record`: ids, sources, rule

    @property
    def online(self) -> bool:
        """`[train].features = "online"`: shards hold the tokens only, training computes the features."""
        return features_mode(self.recipe) == "online"

    def examples(self) -> list[Example]:
        """The examples to capture, in capture order: `splits`, less those `on_overlong` skips."""
        skip = self.overlong.skip_keys()
        return [ex for ex in self.prepared.examples(self.cap.splits) if (ex.split, ex.id) not in skip]


def plan_capture(recipe: Recipe, emit: EventSink, device: DeviceChoice | None = None) -> CapturePlan:
    """Data check, pair check, geometry, device and capture key: every refusal before weights load.

    `device`: where to run (the job runner's placement); None resolves `[capture].device` here.
    """
    cap = recipe.require("capture")
    mcfg, dcfg = recipe.model, recipe.data
    prepared = PreparedData(dcfg.dir)
    tokenizer = load_tokenizer(mcfg.target)
    report = check_data(
        prepared, tokenizer, thinking=dcfg.thinking, max_length=dcfg.max_length, regenerate=cap.regenerate, splits=cap.splits,
        train_turns=dcfg.train_turns,
    )
    report.raise_if_failed(overlong=cap.on_overlong)
    emit(Log(level="debug", message=f"data checked: `{report.examples}` examples"))
    overlong = OverlongDecision.decide(cap.on_overlong, dcfg.max_length, report.overlong)
    if len(overlong.skipped) == report.examples:
        raise DataError(
            f"every one of the `{report.examples}` examples is over max_length `{dcfg.max_length}`, nothing is left to capture\n"
            "hint: raise `[data].max_length`"
        )
    if (warning := overlong.warning()) is not None:
        emit(Log(level="warning", message=warning))
    check_recipe_pair(mcfg.target, mcfg.draft, mcfg.family)  # headers and config.json only
    geometry = read_geometry(mcfg.target, mcfg.draft, tokenizer)

    from ..device import resolve_device

    choice = device or resolve_device(cap.device)
    key = capture_key(recipe, prepared, tokenizer, geometry.layer_ids, choice.type, overlong)
    stops = stop_tokens_record(mcfg.target, tokenizer)
    return CapturePlan(recipe, cap, prepared, tokenizer, geometry, choice, key, overlong, stops)
