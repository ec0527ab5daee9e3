"""The recipe: one typed TOML file that is the source of truth for a job.

A recipe has one section per pipeline area. Each section is a keyword-only
dataclass validated in ``__post_init__``; unknown sections and unknown keys
are rejected with the key and the file named. Relative paths resolve against
the directory of the recipe file, so a recipe and its data can move together.

Sections: ``[model]`` and ``[data]`` (required), ``[capture]``, ``[train]``,
``[export]`` and ``[evaluate]`` (each required by the stage that reads it).
A new section is a dataclass plus one entry in ``SECTIONS``. Every key is
explained in ``docs/training/recipe.md``; ``docs/examples/recipe.toml`` is a
complete example.

``Recipe.resolved()`` is the plain-dict form written into every manifest and
``Recipe.fingerprint()`` its sha256 over canonical JSON.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, overload

from .errors import ConfigError
from .families import FAMILIES as _REGISTRY
from .manifest import fingerprint as _fingerprint

# Family names a recipe may name: the registry's (`families` imports no torch, so parsing a
# recipe still never needs it; `families` validates the pair itself).
FAMILIES = tuple(_REGISTRY)
THINKING = ("on", "off", "per_row")
TRAIN_TURNS = ("last", "all")
DTYPES = ("float32", "bfloat16", "float16")
SAMPLING = ("greedy", "sampled")
SPLITS = ("train", "val", "test")
ON_OVERLONG = ("skip", "truncate", "fail")
# where training gets the target features: the capture cache, or the frozen target inside the step
FEATURES = ("cache", "online")


def _path_field(**kw: Any) -> Any:
    """A dataclass field holding a filesystem path, resolved against the recipe's directory."""
    return field(metadata={"path": True}, **kw)


def _check_type(section: str, name: str, value: Any, kinds: tuple[type, ...]) -> None:
    # bool is an int subclass; a TOML `true` must never pass as a number.
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        want = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(f"`[{section}].{name}` must be {want}, found `{value!r}` ({type(value).__name__})")


def _is_finite(value: int | float) -> bool:
    """`math.isfinite` for any int too: one past float's range (TOML and JSON allow any length) is not finite."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_choice(section: str, name: str, value: Any, choices: tuple[str, ...]) -> None:
    _check_type(section, name, value, (str,))
    if value not in choices:
        raise ConfigError(
            f"`[{section}].{name}` is `{value}`\nhint: choose one of " + ", ".join(f"`{c}`" for c in choices)
        )


def _check_positive_int(section: str, name: str, value: Any) -> None:
    _check_type(section, name, value, (int,))
    if value <= 0:
        raise ConfigError(f"`[{section}].{name}` must be a positive integer, found `{value}`")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """`[model]`: the frozen target (teacher) and the released draft to adapt."""

    target: Path = _path_field()
    draft: Path = _path_field()
    family: str

    def __post_init__(self) -> None:
        _check_type("model", "target", self.target, (Path,))
        _check_type("model", "draft", self.draft, (Path,))
        _check_choice("model", "family", self.family, FAMILIES)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """`[data]`: the directory written by `prepare-data` and how examples are rendered.

    `thinking` has no default on purpose: Qwen3 chat templates render differently with
    thinking on and off, and a silent default would train on the wrong format. `per_row`
    renders each row in its own mode (its `"thinking"`, else whether it carries reasoning;
    `data.render.resolve_thinking`). `train_turns`: the loss covers every assistant turn of a
    conversation (`all`) or only the final one (`last`).
    """

    dir: Path = _path_field()
    thinking: str
    max_length: int = 4096
    train_turns: str = "all"

    def __post_init__(self) -> None:
        _check_type("data", "dir", self.dir, (Path,))
        _check_choice("data", "thinking", self.thinking, THINKING)
        _check_choice("data", "train_turns", self.train_turns, TRAIN_TURNS)
        _check_positive_int("data", "max_length", self.max_length)


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    """`[capture]`: running the teacher over the prepared data and caching its features.

    Shards hold `shard_examples` examples each, or, when `shard_tokens` is set, as many whole
    examples as fit in `shard_tokens` tokens (at least one). Set at most one of the two.
    `on_overlong` is what becomes of an example longer than `[data].max_length`: `skip` it,
    `truncate` it to `max_length` (skipped when no response token would be left), or `fail`.
    `chunk_tokens`: the teacher forward (here and in online training) runs over an example in
    chunks of this many tokens, carrying the target's own cache between them, so its memory
    grows linearly with the example's length (`capture.teacher`).
    """

    output: Path = _path_field()
    dtype: str = "bfloat16"
    regenerate: bool = False
    sampling: str = "greedy"
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 512
    shard_examples: int | None = None
    shard_tokens: int | None = None
    splits: tuple[str, ...] = ("train", "val")
    device: str = "auto"
    on_overlong: str = "skip"
    chunk_tokens: int = 2048

    def __post_init__(self) -> None:
        s = "capture"
        _check_type(s, "output", self.output, (Path,))
        _check_choice(s, "dtype", self.dtype, DTYPES)
        _check_type(s, "regenerate", self.regenerate, (bool,))
        _check_choice(s, "sampling", self.sampling, SAMPLING)
        _check_type(s, "temperature", self.temperature, (int, float))
        if not (_is_finite(self.temperature) and self.temperature > 0):
            raise ConfigError(f"`[capture].temperature` must be a finite number > 0, found `{self.temperature}`")
        _check_type(s, "top_p", self.top_p, (int, float))
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"`[capture].top_p` must be in (0, 1], found `{self.top_p}`")
        _check_type(s, "seed", self.seed, (int,))
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"`[capture].seed` must be in [0, 2^63), found `{self.seed}`")
        _check_positive_int(s, "max_new_tokens", self.max_new_tokens)
        if self.shard_examples is not None and self.shard_tokens is not None:
            raise ConfigError(
                "`[capture]` sets both `shard_examples` and `shard_tokens`\nhint: keep one of them"
            )
        if self.shard_examples is not None:
            _check_positive_int(s, "shard_examples", self.shard_examples)
        if self.shard_tokens is not None:
            _check_positive_int(s, "shard_tokens", self.shard_tokens)
        _check_positive_int(s, "chunk_tokens", self.chunk_tokens)
        if self.shard_examples is None and self.shard_tokens is None:
            object.__setattr__(self, "shard_examples", 256)
        if isinstance(self.splits, list):
            object.__setattr__(self, "splits", tuple(self.splits))
        _check_type(s, "splits", self.splits, (tuple,))
        if not self.splits or len(set(self.splits)) != len(self.splits):
            raise ConfigError(f"`[capture].splits` must be a non-empty list without repeats, found `{list(self.splits)}`")
        for name in self.splits:
            _check_choice(s, "splits", name, SPLITS)
        _check_type(s, "device", self.device, (str,))
        base = self.device.split(":", 1)[0]
        if base not in ("auto", "cpu", "cuda", "mps"):
            raise ConfigError(
                f"`[capture].device` is `{self.device}`\nhint: use `auto`, `cpu`, `cuda`, `cuda:N` or `mps`"
            )
        _check_choice(s, "on_overlong", self.on_overlong, ON_OVERLONG)


SCOPES = ("selector", "context", "final_backbone", "recall", "full")
PRESETS = ("from_scratch", "keep_general")
# `keep_general`: the adaptation `bench/effectiveness.py` adopted because it held on every world it was
# measured on (docs/effectiveness.md, issue 35's fourth run); `TrainConfig.apply_preset` lists it
KEEP_GENERAL = {"scope": "full", "lr": 5e-4, "replay_kd": 10.0, "general_tolerance": 0.02, "guard_patience": 4,
                "interpolate": "auto"}
KEEP_GENERAL_VAL_EVERY = 25  # validate (and checkpoint) at least this often: forgetting sets in early
OBJECTIVES = ("weighted_ce", "prefix_survival")
SCHEDULES = ("cosine", "linear", "constant")
AUTOCAST = ("auto", "bf16", "off")
QAT_SCOPES = ("selector_context", "full_projection")
EXPORT_FORMATS = ("bf16", "af4g64")
INTERPOLATE = ("off", "auto")


def _check_device(section: str, value: Any) -> None:
    _check_type(section, "device", value, (str,))
    if value.split(":", 1)[0] not in ("auto", "cpu", "cuda", "mps"):
        raise ConfigError(f"`[{section}].device` is `{value}`\nhint: use `auto`, `cpu`, `cuda`, `cuda:N` or `mps`")


def _check_number(section: str, name: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False) -> None:
    _check_type(section, name, value, (int, float))
    ok = _is_finite(value) and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        raise ConfigError(f"`[{section}].{name}` must be in `{'(' if lo_open else '['}{lo}, {hi}]`, found `{value}`")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """`[train]`: what to train (scope), how (objective, optimizer, schedule) and how often to
    checkpoint and validate. Defined here so parsing a recipe never imports torch; the meaning
    of every field is documented in `dflash_worker.train` and docs/training/recipe.md."""

    scope: str
    objective: str = "weighted_ce"
    gamma: float | None = None  # None: 7 * block_size / 16
    position_weights: bool = True
    selector_weight: float | None = None  # None: 1 when the scope holds the selector, else 0
    steps: int = 100
    lr: float = 1e-4
    weight_decay: float = 0.0
    l2sp: float = 0.0  # strength of the pull toward the starting draft's weights (0: off); see `train.objectives`
    # on replay rows (`prepare-data --replay`): weight of the KL from the starting draft's block
    # distributions to the trained draft's (0: off); see `train.forward`
    replay_kd: float = 0.0
    betas: tuple[float, ...] = (0.9, 0.95)
    warmup_steps: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    grad_accum: int = 1
    blocks_per_sequence: int = 8
    seed: int = 0
    autocast: str = "auto"
    gradient_checkpointing: bool = False
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    val_every: int = 50
    val_examples: int = 64
    # the general-domain guard (`train.selection`): a checkpoint whose general validation acceptance is
    # below (1 - general_tolerance) x the released draft's is never selected; 1 turns it off
    general_tolerance: float = 0.03
    # with the guard: stop after this many validations in a row that it rejected (0: run every step)
    guard_patience: int = 0
    # with the guard: "auto" also tries the weights between the released draft and the best own-domain
    # checkpoint when the guard rejected it (`train.interpolate`); "off" selects among checkpoints only
    interpolate: str = "off"
    device: str = "auto"
    qat: str | None = None
    qat_scope: str = "selector_context"
    preset: str | None = None
    # "cache": capture stores the tap features and training reads them; "online": capture stores
    # only the tokens and training runs the frozen target in the step (`capture.teacher`)
    features: str = "cache"
    output: Path | None = _path_field(default=None)

    @staticmethod
    def apply_preset(table: dict[str, Any]) -> dict[str, Any]:
        """`[train]` with its `preset`'s defaults under the keys the table leaves out.

        ``from_scratch`` (a draft made by `init-draft`, nothing released to keep): scope
        ``full``, lr 6e-4, linear warmup over 4% of the steps (at least 1), cosine decay to
        10% of lr, weight decay 0.01.

        ``keep_general`` (adapt a released draft without forgetting the general domain; the data
        prepared with `prepare-data --replay FILE --replay-val-fraction F`): scope ``full``, lr 5e-4,
        warmup over 5% of the steps (at least 1), replay distillation ``replay_kd`` 10, the
        general-domain guard at ``general_tolerance`` 0.02 with ``guard_patience`` 4, interpolated
        exports (``interpolate = "auto"``), validating and checkpointing every ``min(steps // 8, 25)``
        steps (at least 1).

        Every value the table sets wins over the preset's."""
        preset = table.get("preset")
        if preset is None:
            return table
        _check_choice("train", "preset", preset, PRESETS)
        steps = table.get("steps", 100)
        steps = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 1
        if preset == "keep_general":
            every = max(1, min(steps // 8, KEEP_GENERAL_VAL_EVERY))
            defaults = {**KEEP_GENERAL, "warmup_steps": max(1, steps // 20), "val_every": every, "checkpoint_every": every}
        else:
            defaults = {"scope": "full", "lr": 6e-4, "warmup_steps": max(1, math.ceil(0.04 * steps)), "schedule": "cosine",
                        "min_lr_ratio": 0.1, "weight_decay": 0.01}
        return {**defaults, **table}

    def __post_init__(self) -> None:
        s = "train"
        _check_choice(s, "scope", self.scope, SCOPES)
        if self.preset is not None:
            _check_choice(s, "preset", self.preset, PRESETS)
            if self.scope != "full":
                what = "trains every tensor of a fresh draft" if self.preset == "from_scratch" else "is measured with scope `full`"
                undo = "to adapt part of a released draft" if self.preset == "from_scratch" else "and set its keys yourself"
                raise ConfigError(
                    f"`[train].preset = \"{self.preset}\"` {what}, but `scope` is `{self.scope}`"
                    f"\nhint: remove `scope` (the preset sets `full`), or remove `preset` {undo}"
                )
        _check_choice(s, "objective", self.objective, OBJECTIVES)
        if self.gamma is not None:
            _check_number(s, "gamma", self.gamma, 0.0, lo_open=True)
        _check_type(s, "position_weights", self.position_weights, (bool,))
        if self.selector_weight is not None:
            _check_number(s, "selector_weight", self.selector_weight, 0.0)
            if self.selector_weight > 0 and self.scope not in ("selector", "full"):
                raise ConfigError(
                    f"`[train].selector_weight` is `{self.selector_weight}` but scope `{self.scope}` does not train the selector"
                    "\nhint: remove `selector_weight` or use scope `selector` or `full`"
                )
        for name in ("steps", "grad_accum", "blocks_per_sequence", "checkpoint_every", "keep_checkpoints", "val_examples"):
            _check_positive_int(s, name, getattr(self, name))
        for name in ("warmup_steps", "val_every", "guard_patience"):
            _check_type(s, name, getattr(self, name), (int,))
            if getattr(self, name) < 0:
                raise ConfigError(f"`[train].{name}` must be >= 0, found `{getattr(self, name)}`")
        _check_number(s, "lr", self.lr, 0.0, lo_open=True)
        _check_number(s, "weight_decay", self.weight_decay, 0.0)
        _check_number(s, "l2sp", self.l2sp, 0.0)
        _check_number(s, "replay_kd", self.replay_kd, 0.0)
        _check_number(s, "general_tolerance", self.general_tolerance, 0.0, 1.0)
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))
        _check_type(s, "betas", self.betas, (tuple,))
        if len(self.betas) != 2:
            raise ConfigError(f"`[train].betas` must hold two numbers, found `{list(self.betas)}`")
        for b in self.betas:
            _check_number(s, "betas", b, 0.0, 1.0)
        _check_choice(s, "schedule", self.schedule, SCHEDULES)
        _check_number(s, "min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        _check_number(s, "grad_clip", self.grad_clip, 0.0)
        _check_type(s, "seed", self.seed, (int,))
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"`[train].seed` must be in [0, 2^63), found `{self.seed}`")
        _check_choice(s, "autocast", self.autocast, AUTOCAST)
        _check_type(s, "gradient_checkpointing", self.gradient_checkpointing, (bool,))
        _check_device(s, self.device)
        if self.qat is not None:
            _check_choice(s, "qat", self.qat, ("af4g64",))
        _check_choice(s, "qat_scope", self.qat_scope, QAT_SCOPES)
        _check_choice(s, "features", self.features, FEATURES)
        _check_choice(s, "interpolate", self.interpolate, INTERPOLATE)


@dataclass(frozen=True, kw_only=True)
class ExportConfig:
    """`[export]`: the format `train` exports the selected checkpoint in."""

    format: str = "bf16"

    def __post_init__(self) -> None:
        _check_choice("export", "format", self.format, EXPORT_FORMATS)


@dataclass(frozen=True, kw_only=True)
class EvaluateConfig:
    """`[evaluate]`: held-out speculative generation, released draft vs trained draft.

    A prompt is `tied` when the trained draft's mean acceptance length differs from the
    baseline's by at most `tie_tolerance` (relative), else improved or regressed.
    """

    split: str = "test"
    max_prompts: int = 32
    max_new_tokens: int = 64
    temperature: float = 0.0
    tie_tolerance: float = 0.02
    device: str = "auto"

    def __post_init__(self) -> None:
        s = "evaluate"
        _check_choice(s, "split", self.split, SPLITS)
        _check_positive_int(s, "max_prompts", self.max_prompts)
        _check_positive_int(s, "max_new_tokens", self.max_new_tokens)
        _check_number(s, "temperature", self.temperature, 0.0)
        _check_number(s, "tie_tolerance", self.tie_tolerance, 0.0, 1.0)
        _check_device(s, self.device)


# section name -> dataclass.
SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "capture": CaptureConfig,
    "train": TrainConfig,
    "export": ExportConfig,
    "evaluate": EvaluateConfig,
}
REQUIRED_SECTIONS = ("model", "data")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A parsed, validated recipe. `path` is the file it came from (None when built in code)."""

    model: ModelConfig
    data: DataConfig
    capture: CaptureConfig | None = None
    train: TrainConfig | None = None
    export: ExportConfig | None = None
    evaluate: EvaluateConfig | None = None
    path: Path | None = None

    @overload
    def require(self, section: Literal["capture"]) -> CaptureConfig: ...
    @overload
    def require(self, section: Literal["train"]) -> TrainConfig: ...
    @overload
    def require(self, section: Literal["export"]) -> ExportConfig: ...
    @overload
    def require(self, section: Literal["evaluate"]) -> EvaluateConfig: ...
    def require(self, section: str) -> Any:
        """The section `section`, or a ConfigError naming the recipe file if it is missing."""
        value = getattr(self, section, None)
        if value is None:
            where = f" in `{self.path}`" if self.path else ""
            raise ConfigError(f"recipe has no `[{section}]` section{where}\nhint: add a `[{section}]` table")
        return value

    def resolved(self) -> dict[str, Any]:
        """Plain-dict form of every present section (paths as absolute strings, tuples as lists)."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            sec = getattr(self, name, None)
            if sec is not None:
                out[name] = _plain(dataclasses.asdict(sec))
        return out

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of `resolved()`; goes into every manifest."""
        return _fingerprint(self.resolved())


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _resolve_path(name: str, key: str, value: Any, base: Path, where: str) -> Path:
    """A path field's value, absolute (relative ones against `base`); `~` expands to a home directory."""
    _check_type(name, key, value, (str,))
    if not value:
        raise ConfigError(f"`[{name}].{key}` is empty in `{where}`")
    # No filesystem takes NUL in a name; os.path refuses it with a bare ValueError.
    if "\0" in value:
        raise ConfigError(f"`[{name}].{key}` contains a NUL character in `{where}`")
    try:  # JSON can spell a lone surrogate (`"\\ud800"`); no path is made of one
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"`[{name}].{key}` is not valid Unicode (a lone surrogate at character {exc.start}) in `{where}`") from None
    try:
        p = Path(value).expanduser()
    except RuntimeError:  # `~user` for an unknown user, or no home directory at all
        user = value[1:].split("/", 1)[0]
        raise ConfigError(
            f"`[{name}].{key}` is `{value}` in `{where}`: cannot expand `~{user}`, "
            + (f"no user `{user}` here" if user else "no home directory")
            + "\nhint: write the path out in full"
        ) from None
    p = p if p.is_absolute() else base / p
    return Path(p.resolve(strict=False))


def _build_section(name: str, cls: type, table: Any, base: Path, where: str) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"`{name}` must be a table (`[{name}]`) in `{where}`")
    if hasattr(cls, "apply_preset"):
        try:
            table = cls.apply_preset(table)
        except ConfigError as exc:
            raise ConfigError(f"{exc}\nin `{where}`") from None
    known = {f.name: f for f in fields(cls) if f.init}
    for key in table:
        if key not in known:
            raise ConfigError(
                f"unknown key `{key}` in `[{name}]` of `{where}`\nhint: known keys: "
                + ", ".join(f"`{k}`" for k in known)
            )
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if known[key].metadata.get("path"):
            value = _resolve_path(name, key, value, base, where)
        kwargs[key] = value
    missing = [f.name for f in known.values() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in kwargs]  # noqa: E501
    if missing:
        raise ConfigError(
            f"`[{name}]` in `{where}` is missing " + ", ".join(f"`{m}`" for m in missing)
        )
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{exc}\nin `{where}`") from None


def recipe_from_dict(raw: dict[str, Any], *, base: str | Path, source: str = "<dict>") -> Recipe:
    """Build a Recipe from already-parsed TOML; relative paths resolve against `base`."""
    base = Path(base)
    for name in raw:
        if name not in SECTIONS:
            raise ConfigError(
                f"unknown section `[{name}]` in `{source}`\nhint: known sections: "
                + ", ".join(f"`[{k}]`" for k in SECTIONS)
            )
    for name in REQUIRED_SECTIONS:
        if name not in raw:
            raise ConfigError(f"`{source}` has no `[{name}]` section\nhint: add a `[{name}]` table")
    built = {name: _build_section(name, SECTIONS[name], table, base, source) for name, table in raw.items()}
    return Recipe(**built, path=Path(source) if source != "<dict>" else None)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe TOML file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read recipe `{path}`: {exc.strerror or exc}") from None
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"recipe `{path}` is not valid UTF-8 (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"recipe `{path}` is not valid TOML: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(f"recipe `{path}` is not valid TOML: arrays or tables nested too deeply") from None
    except ValueError:  # int() refusing an integer longer than sys.get_int_max_str_digits()
        raise ConfigError(f"recipe `{path}` is not valid TOML: an integer has more than `{sys.get_int_max_str_digits()}` digits") from None
    return recipe_from_dict(raw, base=path.resolve().parent, source=str(path))
