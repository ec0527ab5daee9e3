"""`spec.json`, typed: what the run-manager tells the worker before every start.

The Rust writer is ``run-manager/src/worker/jobdir.rs`` (``JobSpecFile``); `JobSpec` mirrors
it field for field and `JobSpec.to_json()` gives back exactly what was read, so a
test can round-trip a file the Rust code wrote. Everything is validated once, when
the file is read, so a malformed spec fails before any stage writes anything:

- the file itself (``schema_version``, ``lease``, ``device``, ``local_ranks``,
  ``downgrades``, ``resume_checkpoint``, ``graph``, ...);
- the job (``spec``: the lease's ``spec_json``): ``stages``, ``inputs``, the
  ``prepare`` / ``evaluate`` / ``noop`` options, ``export_formats``, and the
  recipe, built once with the runner's output locations filled in.

The fields the run-manager adds (``lease``, ``device``, ...) may be left out of a
hand-written ``spec.json`` (``python -m dflash_worker.job`` without Rust); the worker
then runs standalone: devices come from the recipe, one rank, no downgrades.

Nothing here imports torch.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..recipe import Recipe, recipe_from_dict
from .fields import as_object, check_path, read_field, read_str_list, read_uint, refuse_unknown, short

SPEC_SCHEMA_VERSION = 1
SPEC_FILE = "spec.json"

# Output locations the runner owns, relative to the job directory.
DATA_DIR, CAPTURE_DIR, RUN_DIR, EVAL_DIR = "data", "capture", "run", "eval"
_OWNED = (("capture", "output", CAPTURE_DIR), ("data", "dir", DATA_DIR), ("train", "output", RUN_DIR))

STAGE_NAMES = ("prepare", "check", "capture", "train", "export", "evaluate", "noop")
PIPELINE_STAGES = frozenset(STAGE_NAMES) - {"noop"}
EXPORT_FORMATS = ("bf16", "af4g64")
BACKENDS = ("cuda", "mps", "cpu")


# ----------------------------------------------------------------- run-manager facts
@dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """The provider's device as the run-manager detected it (`jobdir.rs` ``DeviceInfo``)."""

    backend: str
    device_count: int
    memory_bytes: int
    supports_bf16: bool
    features: tuple[str, ...]
    platform: str

    @classmethod
    def from_json(cls, obj: Any, where: str) -> DeviceInfo:
        obj = as_object(obj, where)
        refuse_unknown(obj, ("backend", "device_count", "memory_bytes", "supports_bf16", "features", "platform"), where)
        backend = read_field(obj, "backend", where, (str,), "a string")
        if backend not in BACKENDS:
            raise ConfigError(f"{where}: `backend` is `{backend}`; known: {', '.join(BACKENDS)}")
        return cls(
            backend=backend,
            device_count=read_uint(obj, "device_count", where, hi=2**32 - 1),
            memory_bytes=read_uint(obj, "memory_bytes", where),
            supports_bf16=read_field(obj, "supports_bf16", where, (bool,), "true or false"),
            features=read_str_list(obj, "features", where),
            platform=read_field(obj, "platform", where, (str,), "a string"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device_count": self.device_count,
            "memory_bytes": self.memory_bytes,
            "supports_bf16": self.supports_bf16,
            "features": list(self.features),
            "platform": self.platform,
        }


@dataclass(frozen=True, kw_only=True)
class LeaseInfo:
    """Facts of the lease the job runs under (`jobdir.rs` ``LeaseInfo``)."""

    lease_id: str
    run_id: str
    job_id: str
    attempt: int
    checkpoint_policy: str
    required_features: tuple[str, ...]
    required_client_version: str

    _KEYS = ("lease_id", "run_id", "job_id", "attempt", "checkpoint_policy", "required_features", "required_client_version")

    @classmethod
    def from_json(cls, obj: Any, where: str) -> LeaseInfo:
        obj = as_object(obj, where)
        refuse_unknown(obj, cls._KEYS, where)
        text = {k: read_field(obj, k, where, (str,), "a string") for k in ("lease_id", "run_id", "job_id", "checkpoint_policy", "required_client_version")}
        return cls(
            **text,
            attempt=read_uint(obj, "attempt", where, hi=2**32 - 1),
            required_features=read_str_list(obj, "required_features", where),
        )

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self._KEYS}
        out["required_features"] = list(self.required_features)
        return out


@dataclass(frozen=True, kw_only=True)
class Downgrade:
    """A CUDA-only feature the run asked for that this provider lacks, and its stand-in (`policy.rs`)."""

    feature: str
    replacement: str
    reason: str

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Downgrade:
        obj = as_object(obj, where)
        refuse_unknown(obj, ("feature", "replacement", "reason"), where)
        return cls(**{k: read_field(obj, k, where, (str,), "a string") for k in ("feature", "replacement", "reason")})

    def to_json(self) -> dict[str, Any]:
        return {"feature": self.feature, "replacement": self.replacement, "reason": self.reason}


# Job kinds of a run's job graph (`coordinator.store.JOB_KINDS` less ``pipeline``) and the
# stages of the job spec each one runs, in the spec's order (docs/run-admin.md "Job graphs").
GRAPH_KIND_STAGES: dict[str, frozenset[str]] = {
    "prepare": frozenset({"prepare", "check"}),
    "capture": frozenset({"capture"}),
    "train": frozenset({"train", "export"}),
    "evaluate": frozenset({"evaluate"}),
    # Verification by replay: capture shard i of N again, into `VERIFY_DIR` (never over its inputs), or
    # replay the train job's training up to its selected checkpoint and export it there.
    "verify": frozenset({"capture", "train"}),
}
MAX_SHARD_COUNT = 1024  # the coordinator's `store.MAX_SHARDS`
# The step a graph's train job runs first when the spec captures: the capture jobs' shards (its
# inputs) become one capture with its manifest (`capture.assemble_capture`). Not a spec stage.
ASSEMBLE_STAGE = "assemble"
# What a graph's verify job runs instead of capture: the capture of its shard into `VERIFY_DIR`,
# reported under the same names there (`verify/capture/...`; the coordinator compares the digests).
VERIFY_STAGE = "verify"
VERIFY_DIR = "verify"
# What a graph's verify job of the train job runs (its inputs hold the train job's `SELECTION_INPUT`):
# training replayed from the lease's resume checkpoint (or step 0) to the selected step, in `VERIFY_DIR`.
VERIFY_TRAIN_STAGE = "verify-train"
SELECTION_INPUT = "run/selection.json"  # `RUN_DIR` / `train.export_run.SELECTION`


@dataclass(frozen=True, kw_only=True)
class InputFile:
    """An artifact of an earlier job of the graph, downloaded and verified by the run-manager."""

    name: str
    kind: str
    sha256: str
    size_bytes: int
    uri: str
    path: Path

    _KEYS = ("name", "kind", "sha256", "size_bytes", "uri", "path")

    @classmethod
    def from_json(cls, obj: Any, where: str) -> InputFile:
        obj = as_object(obj, where)
        refuse_unknown(obj, cls._KEYS, where)
        text = {k: read_field(obj, k, where, (str,), "a string") for k in ("name", "kind", "sha256", "uri")}
        path = check_path(read_field(obj, "path", where, (str,), "a path"), f"{where}.path")
        if len(text["sha256"]) != 64 or any(c not in "0123456789abcdef" for c in text["sha256"]):
            raise ConfigError(f"{where}: `sha256` must be 64 lowercase hex digits, got `{short(text['sha256'])}`")
        return cls(**text, size_bytes=read_uint(obj, "size_bytes", where), path=Path(path))

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self._KEYS}
        out["path"] = str(self.path)
        return out


@dataclass(frozen=True, kw_only=True)
class GraphInfo:
    """``graph``: which job of a run's job graph this is (absent for a whole-pipeline job).

    `kind` picks the stages (`GRAPH_KIND_STAGES`); `shard_index` of `shard_count` is the job's
    share of its stage (capture: shards k with k % count == index; evaluate: prompts likewise);
    `inputs` are the final artifacts of the jobs it needs, already in the job directory.
    """

    kind: str
    shard_index: int
    shard_count: int
    inputs: tuple[InputFile, ...] = ()

    @classmethod
    def from_json(cls, obj: Any, where: str = "`graph`") -> GraphInfo:
        obj = as_object(obj, where)
        refuse_unknown(obj, ("kind", "shard_index", "shard_count", "inputs"), where)
        kind = read_field(obj, "kind", where, (str,), "a string")
        if kind not in GRAPH_KIND_STAGES:
            raise ConfigError(f"{where}: `kind` is `{short(kind)}`; known: {', '.join(GRAPH_KIND_STAGES)}")
        count = read_uint(obj, "shard_count", where, hi=MAX_SHARD_COUNT)
        index = read_uint(obj, "shard_index", where, hi=MAX_SHARD_COUNT)
        if count < 1 or index >= count:
            raise ConfigError(f"{where}: shard `{index}` of `{count}` is not a shard (0 <= shard_index < shard_count)")
        inputs = read_field(obj, "inputs", where, (list,), "a list", [])
        return cls(
            kind=kind,
            shard_index=index,
            shard_count=count,
            inputs=tuple(InputFile.from_json(a, f"{where}.inputs[{i}]") for i, a in enumerate(inputs)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "shard_index": self.shard_index,
            "shard_count": self.shard_count,
            "inputs": [a.to_json() for a in self.inputs],
        }

    @property
    def replays_training(self) -> bool:
        """A verify job of the train job (handed its selection), not of a capture job."""
        return self.kind == "verify" and any(a.name == SELECTION_INPUT for a in self.inputs)

    def stages(self, listed: tuple[str, ...]) -> list[str]:
        """The job spec's stages this job runs, in the spec's order (a train job assembles the capture first;
        a verify job runs `VERIFY_STAGE` in place of capture, or `VERIFY_TRAIN_STAGE` in place of train)."""
        names = [s for s in listed if s in GRAPH_KIND_STAGES[self.kind]]
        if self.kind == "verify" and self.replays_training:
            return [ASSEMBLE_STAGE, VERIFY_TRAIN_STAGE] if "train" in names else []
        if self.kind == "verify":
            return [VERIFY_STAGE] if "capture" in names else []
        if self.kind == "train" and "capture" in listed:
            names.insert(0, ASSEMBLE_STAGE)
        return names


# ----------------------------------------------------------------- the job itself
@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """``spec.prepare``: `prepare_data` keyword arguments; absent ones keep its defaults.

    ``split`` sends every row to one split (a file that is all held-out data);
    ``holdout_file`` names groups that go to ``test`` whatever the hash says. Either
    one, as with `prepare-data --split` / `--holdout-file`; `split` excludes the rest.
    ``replay`` (JSONL paths) and ``replay_fraction`` mix general rows into train, as
    `prepare-data --replay` / `--replay-fraction` (anti-forgetting, docs/effectiveness.md);
    ``replay_val_fraction`` holds general rows out into val for training's general-domain
    guard, as `--replay-val-fraction`.
    """

    seed: int | None = None
    val_fraction: float | None = None
    test_fraction: float | None = None
    skip_invalid: bool | None = None
    split: str | None = None
    holdout_file: str | None = None
    replay: tuple[str, ...] | None = None
    replay_fraction: float | None = None
    replay_val_fraction: float | None = None

    @classmethod
    def from_json(cls, obj: Any) -> PrepareOptions:
        from ..data.prepare import SPLIT_NAMES

        where = "`spec.prepare`"
        obj = as_object(obj, where)
        refuse_unknown(
            obj, ("seed", "val_fraction", "test_fraction", "skip_invalid", "split", "holdout_file", "replay", "replay_fraction",
                  "replay_val_fraction"),
            where,
        )
        opts = cls(
            seed=read_field(obj, "seed", where, (int,), "an integer", None),
            val_fraction=read_field(obj, "val_fraction", where, (int, float), "a number", None),
            test_fraction=read_field(obj, "test_fraction", where, (int, float), "a number", None),
            skip_invalid=read_field(obj, "skip_invalid", where, (bool,), "true or false", None),
            split=read_field(obj, "split", where, (str,), "a split name", None),
            holdout_file=read_field(obj, "holdout_file", where, (str,), "a path", None),
            replay=read_str_list(obj, "replay", where, None) if obj.get("replay") is not None else None,
            replay_fraction=read_field(obj, "replay_fraction", where, (int, float), "a number", None),
            replay_val_fraction=read_field(obj, "replay_val_fraction", where, (int, float), "a number", None),
        )
        if opts.replay is not None:
            if not opts.replay or not all(opts.replay):
                raise ConfigError("`spec.prepare.replay` must be a non-empty list of JSONL paths")
            for i, path in enumerate(opts.replay):
                check_path(path, f"`spec.prepare.replay[{i}]`")
        else:
            for key in ("replay_fraction", "replay_val_fraction"):
                if getattr(opts, key) is not None:
                    raise ConfigError(f"`spec.prepare.{key}` is set but `spec.prepare.replay` names no file"
                                      f"\nhint: add `replay` (general-domain JSONL files) or remove `{key}`")
        if opts.holdout_file is not None:
            if not opts.holdout_file:
                raise ConfigError("`spec.prepare.holdout_file` is empty; give the path of a holdout list")
            check_path(opts.holdout_file, "`spec.prepare.holdout_file`")
        if opts.split is not None:
            if opts.split not in SPLIT_NAMES:
                raise ConfigError(f"`spec.prepare.split` must be one of {', '.join(f'`{n}`' for n in SPLIT_NAMES)}, found `{opts.split[:40]}`")
            given = [k for k in ("val_fraction", "test_fraction", "holdout_file") if getattr(opts, k) is not None]
            if given:
                raise ConfigError(
                    f"`spec.prepare.split` sends every row to `{opts.split}`; it cannot be combined with `spec.prepare.{given[0]}`"
                    "\nhint: give either `split` or the fractions and `holdout_file`"
                )
        return opts

    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class EvaluateOptions:
    """``spec.evaluate``: which split and how many prompts (None: the recipe's `[evaluate]`)."""

    split: str | None = None
    max_prompts: int | None = None

    @classmethod
    def from_json(cls, obj: Any) -> EvaluateOptions:
        where = "`spec.evaluate`"
        obj = as_object(obj, where)
        refuse_unknown(obj, ("split", "max_prompts"), where)
        max_prompts = read_field(obj, "max_prompts", where, (int,), "a positive integer", None)
        if max_prompts is not None and max_prompts < 1:
            raise ConfigError(f"{where}: `max_prompts` must be a positive integer, got `{max_prompts}`")
        return cls(split=read_field(obj, "split", where, (str,), "a split name", None), max_prompts=max_prompts)


@dataclass(frozen=True, kw_only=True)
class NoopOptions:
    """``spec.noop``: the counting stage the run-manager's tests use."""

    steps: int = 6
    step_seconds: float = 0.05
    checkpoint_every: int = 2

    @classmethod
    def from_json(cls, obj: Any) -> NoopOptions:
        obj = as_object(obj, "`spec.noop`")
        refuse_unknown(obj, ("steps", "step_seconds", "checkpoint_every"), "`spec.noop`")

        def number(key: str, default: float, lo: float, hi: float, integer: bool) -> Any:
            v = obj.get(key, default)
            ok = not isinstance(v, bool) and isinstance(v, int if integer else (int, float))
            if not ok or not (lo <= v <= hi) or (isinstance(v, float) and not math.isfinite(v)):
                what = "an integer" if integer else "a number"
                raise ConfigError(f"`spec.noop.{key}` must be {what} in [{lo:g}, {hi:g}], got `{v!r}`")
            return v if integer else float(v)

        return cls(
            steps=number("steps", 6, 0, 1_000_000, True),
            step_seconds=number("step_seconds", 0.05, 0.0, 60.0, False),
            checkpoint_every=number("checkpoint_every", 2, 1, 1_000_000, True),
        )


# `placement` (per-kind provider requirements of a job graph), `trust_inputs` (which earlier attempts'
# checkpoints and shards a lease names) and `verify_fraction` (the share of capture jobs another provider
# recomputes) are the coordinator's; the worker only lets them through.
_JOB_KEYS = ("stages", "inputs", "prepare", "recipe", "export_formats", "evaluate", "noop", "placement", "trust_inputs", "verify_fraction")


@dataclass(frozen=True, kw_only=True)
class Job:
    """``spec``: the stages to run and their inputs, validated; ``raw`` is the object as read."""

    raw: Mapping[str, Any]
    stages: tuple[str, ...]
    inputs: tuple[Path, ...] = ()
    prepare: PrepareOptions = field(default_factory=PrepareOptions)
    recipe: Recipe | None = None
    export_formats: tuple[str, ...] = ()
    evaluate: EvaluateOptions = field(default_factory=EvaluateOptions)
    noop: NoopOptions = field(default_factory=NoopOptions)

    @classmethod
    def from_json(cls, obj: Any, job_dir: Path) -> Job:
        obj = as_object(obj, "`spec`")
        refuse_unknown(obj, _JOB_KEYS, "`spec`")
        stages = obj.get("stages")
        if not isinstance(stages, list) or not stages or not all(isinstance(s, str) for s in stages):
            raise ConfigError("`spec.stages` must be a non-empty list of stage names")
        unknown = [s for s in stages if s not in STAGE_NAMES]
        if unknown:
            raise ConfigError(f"unknown stage(s) {', '.join(f'`{s}`' for s in unknown)}; known: {', '.join(STAGE_NAMES)}")
        inputs: tuple[str, ...] = ()
        if "prepare" in stages or "inputs" in obj:
            inputs = read_str_list(obj, "inputs", "`spec`", ())
            if not inputs or not all(inputs):
                raise ConfigError("`spec.inputs` must be a non-empty list of JSONL paths")
            for i, p in enumerate(inputs):
                check_path(p, f"`spec.inputs[{i}]`")
        formats = read_str_list(obj, "export_formats", "`spec`", ())
        bad = [f for f in formats if f not in EXPORT_FORMATS]
        if bad:
            raise ConfigError(f"`spec.export_formats` must be a list of `bf16` / `af4g64`, got `{bad[0]}`")
        prepare = PrepareOptions.from_json(obj.get("prepare", {}))
        evaluate = EvaluateOptions.from_json(obj.get("evaluate", {}))
        noop = NoopOptions.from_json(obj.get("noop", {}))
        recipe = None
        if set(stages) & PIPELINE_STAGES or "recipe" in obj:
            recipe = job_recipe(obj.get("recipe"), job_dir)
        return cls(
            raw=copy.deepcopy(obj),
            stages=tuple(stages),
            inputs=tuple(Path(p) for p in inputs),
            prepare=prepare,
            recipe=recipe,
            export_formats=formats,
            evaluate=evaluate,
            noop=noop,
        )

    def require_recipe(self) -> Recipe:
        if self.recipe is None:  # from_json builds it whenever a pipeline stage is listed
            raise ConfigError("`spec.recipe` is missing")
        return self.recipe


def job_recipe(raw: Any, job_dir: Path) -> Recipe:
    """The job's recipe with the runner's output locations (`data.dir`, ...) filled in."""
    if not isinstance(raw, dict):
        raise ConfigError("`spec.recipe` must be an object with the recipe's sections (see docs/examples/recipe.toml)")
    raw = copy.deepcopy(raw)  # the spec stays as it was
    for section, key, _ in _OWNED:
        table = raw.get(section)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"`spec.recipe.{section}` must be an object")
        if key in table:
            raise ConfigError(f"`spec.recipe.{section}.{key}` is set by the job runner; remove it from the spec")
    raw.setdefault("data", {})
    for section, key, sub in _OWNED:
        if section in raw:
            raw[section][key] = str(job_dir / sub)
    return recipe_from_dict(raw, base=job_dir, source="spec.recipe")


# ----------------------------------------------------------------- the file
# Far deeper than any spec.json (about five levels). Checked before anything walks
# the document, so copying, validating and quoting it never meets Python's
# recursion limit (json.loads accepts ~1000 levels; copy.deepcopy fails near 500).
MAX_DEPTH = 64


def _check_depth(doc: Any) -> None:
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"spec.json is nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


_FILE_KEYS = (
    "schema_version", "spec", "lease", "resume_checkpoint", "resume_step", "restart",
    "job_dir", "device", "local_ranks", "downgrades", "client_version", "graph",
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A validated ``spec.json``. ``None`` for a run-manager field means the file left it out."""

    schema_version: int
    job: Job
    job_dir: Path
    lease: LeaseInfo | None = None
    resume_checkpoint: Path | None = None
    resume_step: int = 0
    restart: int = 0
    device: DeviceInfo | None = None
    local_ranks: int = 1
    downgrades: tuple[Downgrade, ...] = ()
    client_version: str | None = None
    graph: GraphInfo | None = None
    # the keys the file had, so to_json() gives back exactly what was read
    present: frozenset[str] = frozenset()

    @classmethod
    def load(cls, job_dir: str | Path) -> JobSpec:
        """Read and validate ``job_dir/spec.json``; `ConfigError` names the file and the field."""
        job_dir = Path(job_dir).resolve()
        path = job_dir / SPEC_FILE
        try:
            doc = json.loads(path.read_bytes())
        except OSError as exc:
            raise ConfigError(f"cannot read `{path}`: {exc.strerror or exc}") from None
        except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise ConfigError(f"`{path}` is not valid JSON: {exc}") from None
        except RecursionError:
            raise ConfigError(f"`{path}` is not valid JSON: nested too deeply") from None
        try:
            return cls.from_json(doc, job_dir=job_dir)
        except ConfigError as exc:
            raise ConfigError(f"`{path}`: {exc}") from None

    @classmethod
    def from_json(cls, doc: Any, *, job_dir: Path) -> JobSpec:
        doc = as_object(doc, "spec.json")
        _check_depth(doc)
        refuse_unknown(doc, _FILE_KEYS, "spec.json")
        version = doc.get("schema_version")
        if version != SPEC_SCHEMA_VERSION or isinstance(version, bool):
            raise ConfigError(
                f"schema_version `{short(version)}`; this worker reads {SPEC_SCHEMA_VERSION}\n"
                "hint: run-manager and dflash_worker come from one install; reinstall both"
            )
        if "job_dir" in doc:
            written = Path(check_path(read_field(doc, "job_dir", "spec.json", (str,), "a path"), "`job_dir`"))
            if written.resolve() != job_dir:
                raise ConfigError(f"`job_dir` is `{written}` but the worker was started in `{job_dir}`")
        resume = read_field(doc, "resume_checkpoint", "spec.json", (str, type(None)), "a path or null", None)
        if resume is not None and not resume:
            raise ConfigError("`resume_checkpoint` is an empty string")
        if resume:
            check_path(resume, "`resume_checkpoint`")
        local_ranks = read_uint(doc, "local_ranks", "spec.json", 1, hi=1024)
        if local_ranks < 1:
            raise ConfigError("`local_ranks` must be at least 1")
        downgrades = read_field(doc, "downgrades", "spec.json", (list,), "a list", [])
        return cls(
            schema_version=version,
            job=Job.from_json(doc.get("spec"), job_dir),
            job_dir=job_dir,
            lease=LeaseInfo.from_json(doc["lease"], "`lease`") if "lease" in doc else None,
            resume_checkpoint=Path(resume) if resume else None,
            resume_step=read_uint(doc, "resume_step", "spec.json", 0),
            restart=read_uint(doc, "restart", "spec.json", 0, hi=2**32 - 1),
            device=DeviceInfo.from_json(doc["device"], "`device`") if "device" in doc else None,
            local_ranks=local_ranks,
            downgrades=tuple(Downgrade.from_json(d, f"`downgrades[{i}]`") for i, d in enumerate(downgrades)),
            client_version=read_field(doc, "client_version", "spec.json", (str,), "a string", None),
            graph=GraphInfo.from_json(doc["graph"]) if doc.get("graph") is not None else None,
            present=frozenset(doc),
        )

    def to_json(self) -> dict[str, Any]:
        """The file's object again (only the keys it had)."""
        full: dict[str, Any] = {
            "schema_version": self.schema_version,
            "spec": copy.deepcopy(dict(self.job.raw)),
            "lease": self.lease.to_json() if self.lease else None,
            "resume_checkpoint": str(self.resume_checkpoint) if self.resume_checkpoint else None,
            "resume_step": self.resume_step,
            "restart": self.restart,
            "job_dir": str(self.job_dir),
            "device": self.device.to_json() if self.device else None,
            "local_ranks": self.local_ranks,
            "downgrades": [d.to_json() for d in self.downgrades],
            "client_version": self.client_version,
            "graph": self.graph.to_json() if self.graph else None,
        }
        return {k: v for k, v in full.items() if k in self.present}
