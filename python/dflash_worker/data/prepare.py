"""`prepare-data`: normalise JSONL inputs, deduplicate, and split by prompt group.

Pipeline: read every input (strict reader, `jsonl.py`) -> normalise each row
to chat messages (`schema.py`) -> drop exact duplicates (the same normalised
conversation, any source; the first occurrence in input order wins, the
others are counted as `duplicate`) -> group by prompt identity (NFKC +
folded whitespace, across sources) -> assign each group a split from a
seeded hash of its key -> write ``train.jsonl``, ``val.jsonl``, ``test.jsonl``
and ``manifest.json``.

Two ways to fix a split instead of hashing (`SplitPlan`): ``split="test"``
(or ``"train"``, ``"val"``) sends every kept row to that one split, for a
held-out set prepared on its own; a holdout file (`read_holdout`) lists
group keys or row ids whose groups must land in ``test`` while the rest are
hashed as usual, so a test set stays fixed as more data is added. A row id
is the ``id`` written on each prepared row; a listed row pulls its whole
group into ``test`` (a group never straddles splits). Neither is recorded
in the manifest unless used, so an invocation without them writes the same
bytes as before they existed.

Replay (``replay`` files, ``replay_fraction``): rows of another domain,
typically general prompts the released draft was made for, mixed into
``train`` only so that adapting a draft keeps what it could do (`_replay`).
They are read, normalised and deduplicated like the inputs, never split,
and recorded in the manifest's ``replay`` section (their ids in
``replay.train_ids``); the teacher answers them during capture like any other row. With ``replay_val_fraction`` some replay
rows are held out into ``val`` instead, tagged ``"domain": "general"`` and
listed in ``replay.val_ids``: training validates them apart from the own
rows and its checkpoint selection keeps general-domain acceptance within a
tolerance of the released draft's (`train.selection`, the general-domain guard).

Each prepared row records its own thinking mode (``"thinking"``: the input
row's ``thinking``, else whether an assistant turn carries reasoning) and, when
the input row has them, its ``tools`` (function schemas for the template).

A prompt that appears in two sources (or with different spacing) is one
group: all of its rows land in the same split, each keeping its own `source`
tag; only rows identical in every message are duplicates.

Output is a pure function of the input bytes, their file names, the order
they are given in, the seed, the fractions, `split`, the holdout file's
bytes and the replay files' bytes and fractions: rows keep input order within a split, JSON is written with sorted keys, and the manifest holds no
timestamps or absolute paths. Every file is written atomically (temporary
file, fsync, rename), manifest last, and nothing is written until every input
has been read, so a failure never touches what is already in the output dir.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import ConfigError, DataError
from ..manifest import fingerprint, sha256_bytes, sha256_file, write_bytes_atomic, write_json_atomic
from .jsonl import DEFAULT_MAX_LINE_BYTES, FileStats, LineError, iter_jsonl
from .render import row_thinking
from .schema import Row, exact_key, normalize_row, prompt_key

FORMAT = "dflash-worker/prepared-data/v1"
SPLIT_NAMES = ("train", "val", "test")
MAX_LISTED_DROPS = 50
MAX_LISTED_UNKNOWN = 20
_DEFAULT_FRACTION = 0.05
DEFAULT_REPLAY_FRACTION = 0.25
# A row id is `exact_key(row)[:16]`; a group key is the whole `prompt_key(row)` (a sha256 hex digest).
ROW_ID_LEN = 16
GROUP_KEY_LEN = 64
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class _Kept:
    row: Row
    file: str
    line: int
    group: str
    exact: str
    replay: bool = False  # from a `replay` file: mixed into train (or held out into val) by `_replay`, never split


def split_of(group: str, *, seed: int, val_fraction: float, test_fraction: float) -> str:
    """The split of a prompt group: a uniform draw in [0, 1) from sha256(seed, group)."""
    digest = hashlib.sha256(f"dflash-split\0{seed}\0{group}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"


@dataclass(frozen=True)
class Holdout:
    """A parsed holdout file: its listed keys (first-seen order, lowercased) and what identifies it."""

    file: str
    sha256: str
    keys: tuple[str, ...]
    lines: int


def read_holdout(path: str | Path) -> Holdout:
    """Parse a holdout file: one group key or row id per line; blank lines and `#` comments ignored.

    Raises DataError naming the file and line for bytes that are not UTF-8, a
    NUL byte, or an entry that is neither a row id nor a group key.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read holdout file `{path}`: {exc.strerror or exc}") from None
    hint = "\nhint: one group key (64 hex digits) or row id (16 hex digits, the `id` of a prepared row) per line"
    body = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    keys: dict[str, None] = {}
    raw_lines = body.split(b"\n")
    for lineno, raw in enumerate(raw_lines, 1):
        if b"\0" in raw:
            raise DataError(f"holdout file `{path}` line {lineno}: contains a NUL byte (not a text file?)" + hint)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"holdout file `{path}` line {lineno}: not valid UTF-8 (byte {exc.start + 1} of the line)" + hint
            ) from None
        entry = text.split("#", 1)[0].strip().lower()
        if not entry:
            continue
        if len(entry) not in (ROW_ID_LEN, GROUP_KEY_LEN) or not set(entry) <= _HEX:
            raise DataError(
                f"holdout file `{path}` line {lineno}: `{entry[:80]}` is neither a row id nor a group key" + hint
            )
        keys.setdefault(entry, None)
    lines = len(raw_lines) - (1 if body.endswith(b"\n") or not body else 0)
    return Holdout(file=path.name, sha256=sha256_bytes(data), keys=tuple(keys), lines=lines)


@dataclass(frozen=True)
class SplitPlan:
    """How kept rows are assigned to splits, decided once from the arguments.

    `mode` is ``"hash"`` (seeded hash of the group key, the default),
    ``"hash+holdout"`` (listed groups to ``test``, the rest hashed) or
    ``"all:<split>"`` (every row to one split).
    """

    seed: int
    val_fraction: float | None
    test_fraction: float | None
    mode: str = "hash"
    holdout: Holdout | None = None

    @classmethod
    def resolve(
        cls, *, seed: int, val_fraction: float | None, test_fraction: float | None,
        split: str | None, holdout: Holdout | None,
    ) -> SplitPlan:
        if split is not None:
            if split not in SPLIT_NAMES:
                raise ConfigError(f"`--split` must be one of {', '.join(f'`{s}`' for s in SPLIT_NAMES)}, found `{split}`")
            given = [n for n, f in (("--val-fraction", val_fraction), ("--test-fraction", test_fraction)) if f is not None]
            if given:
                raise ConfigError(
                    f"`--split {split}` sends every row to `{split}`; it cannot be combined with `{given[0]}`"
                    "\nhint: pass either `--split` or the fractions"
                )
            if holdout is not None:
                raise ConfigError(
                    f"`--split {split}` sends every row to `{split}`; it cannot be combined with `--holdout-file`"
                    "\nhint: pass either `--split` or `--holdout-file`"
                )
            return cls(seed=seed, val_fraction=None, test_fraction=None, mode=f"all:{split}")
        vf = _DEFAULT_FRACTION if val_fraction is None else val_fraction
        tf = _DEFAULT_FRACTION if test_fraction is None else test_fraction
        return cls(seed=seed, val_fraction=vf, test_fraction=tf,
                   mode="hash" if holdout is None else "hash+holdout", holdout=holdout)

    def hashed(self, group: str) -> str:
        """The split the seeded hash gives `group` (only in the hash modes)."""
        assert self.val_fraction is not None and self.test_fraction is not None
        return split_of(group, seed=self.seed, val_fraction=self.val_fraction, test_fraction=self.test_fraction)

    def params(self) -> dict[str, Any]:
        """What the split fingerprint covers; the default mode adds nothing to the pre-existing fields."""
        p: dict[str, Any] = {"seed": self.seed, "val_fraction": self.val_fraction, "test_fraction": self.test_fraction}
        if self.mode != "hash":
            p["split_mode"] = self.mode
        if self.holdout is not None:
            p["holdout_sha256"] = self.holdout.sha256
        return p


def _assign(kept: Sequence[_Kept], plan: SplitPlan) -> tuple[list[str], dict[str, Any] | None]:
    """The split of every kept row, and the manifest's `holdout` section when a holdout file is used."""
    if plan.mode.startswith("all:"):
        return [plan.mode[4:]] * len(kept), None
    if plan.holdout is None:
        return [plan.hashed(k.group) for k in kept], None
    listed = set(plan.holdout.keys)
    held: set[str] = set()
    matched: set[str] = set()
    for k in kept:
        for key in (k.group, k.exact[:ROW_ID_LEN]):
            if key in listed:
                held.add(k.group)
                matched.add(key)
    out: list[str] = []
    moved: Counter[str] = Counter()
    for k in kept:
        s = plan.hashed(k.group)
        if k.group in held:
            moved[s] += s != "test"
            s = "test"
        out.append(s)
    unknown = [key for key in plan.holdout.keys if key not in matched]
    section = {
        "file": plan.holdout.file,
        "sha256": plan.holdout.sha256,
        "lines": plan.holdout.lines,
        "keys": len(plan.holdout.keys),
        "matched_keys": len(matched),
        "unknown_keys": len(unknown),
        "unknown_listed": unknown[:MAX_LISTED_UNKNOWN],
        "groups": len(held),
        "rows": sum(1 for k in kept if k.group in held),
        # Rows the hash alone would have put elsewhere.
        "moved_from": {s: moved[s] for s in ("train", "val")},
    }
    return out, section


def _check_fraction(flag: str, fraction: float) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (0.0 < fraction < 1.0):
        raise ConfigError(f"`{flag}` must be in (0, 1), found `{fraction}`")


def _check_replay(plan: SplitPlan, fraction: float, val_fraction: float | None) -> None:
    if plan.mode.startswith("all:"):
        raise ConfigError(
            f"`--replay` mixes rows into `train`, but `--split {plan.mode[4:]}` sends every row to one split"
            "\nhint: prepare replay only with the fractions (a held-out set takes no replay)"
        )
    if val_fraction is not None:
        _check_fraction("--replay-val-fraction", val_fraction)
    if fraction == 0 and val_fraction is not None and not isinstance(fraction, bool):
        return  # general validation rows for the guard only, none mixed into train
    if fraction == 0:
        raise ConfigError("`--replay-fraction` 0 mixes no replay row into train, which only makes sense with "
                          "`--replay-val-fraction`\nhint: give `--replay-val-fraction F` to hold general rows out "
                          "for the general-domain guard alone, or a fraction in (0, 1)")
    _check_fraction("--replay-fraction", fraction)


def _replay(
    pool: Sequence[_Kept], kept: Sequence[_Kept], assigned: Sequence[str], *, seed: int, fraction: float,
    inputs: list[dict[str, Any]], val_fraction: float | None = None,
) -> tuple[list[_Kept], list[_Kept], dict[str, Any]]:
    """The replay rows mixed into train, those held out into val, and the manifest's `replay` section.

    Replay rows make up `fraction` of the train split: ``round(fraction / (1 - fraction) * own)``
    rows for ``own`` train rows of the inputs, or all of the pool when it holds fewer (``short``).
    A replay row whose prompt group is also an input's group is left out (``overlap_dropped``),
    so replay never puts a held-out prompt into train. The rows are the first of a seeded hash
    order of their ids and keep their file order, so the choice is a pure function of the bytes.

    `val_fraction` (``--replay-val-fraction``) holds out the last ``max(1, round(val_fraction *
    pool_rows))`` rows of that order, with every usable row of their prompt groups, into val (the
    general validation rows, ``val_ids``); train draws from the rest, so the two never share a
    prompt, and train's rows are those it takes without a held-out set unless the pool runs short.
    """
    own_groups = {k.group for k in kept}
    usable = [k for k in pool if k.group not in own_groups]
    own_train = sum(1 for s in assigned if s == "train")
    wanted = round(fraction / (1.0 - fraction) * own_train)
    rank = sorted(range(len(usable)), key=lambda i: hashlib.sha256(f"dflash-replay\0{seed}\0{usable[i].exact}".encode()).digest())
    held_out: set[int] = set()
    if val_fraction is not None and usable:
        groups = {usable[i].group for i in rank[len(rank) - max(1, round(val_fraction * len(usable))):]}
        held_out = {i for i, k in enumerate(usable) if k.group in groups}
    chosen = sorted([i for i in rank if i not in held_out][:wanted])
    mixed = [usable[i] for i in chosen]
    general_val = [usable[i] for i in sorted(held_out)]
    section = {
        "inputs": inputs,
        "fraction": fraction,
        "own_train_rows": own_train,
        "pool_rows": len(usable),
        "overlap_dropped": len(pool) - len(usable),
        "wanted_rows": wanted,
        "rows": len(mixed),
        "short": len(mixed) < wanted,
        "source": dict(sorted(Counter(k.row.source for k in mixed).items())),
        # the replay rows of train by id, in file order: what `[train].replay_kd` distils on
        "train_ids": [k.exact[:ROW_ID_LEN] for k in mixed],
    }
    if val_fraction is not None:  # only then: a replay manifest without a held-out set stays what it was
        section["val_fraction"] = val_fraction
        section["val_rows"] = len(general_val)
        section["val_ids"] = [k.exact[:ROW_ID_LEN] for k in general_val]
    return mixed, general_val, section


def _check_args(inputs: Sequence[Path], seed: int, val_fraction: float, test_fraction: float, max_line_bytes: int) -> None:
    if not inputs:
        raise ConfigError("no `--input` files given")
    names = [p.name for p in inputs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(
            f"two inputs share the file name `{dup}`\nhint: file names tag rows and key the manifest; rename one"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"`--seed` must be a non-negative integer, found `{seed}`")
    for name, f in (("--val-fraction", val_fraction), ("--test-fraction", test_fraction)):
        if not (0.0 <= f < 1.0):
            raise ConfigError(f"`{name}` must be in [0, 1), found `{f}`")
    if val_fraction + test_fraction >= 1.0:
        raise ConfigError(
            f"`--val-fraction` + `--test-fraction` is `{val_fraction + test_fraction}`, leaving nothing to train on"
        )
    if max_line_bytes < 2:
        raise ConfigError(f"`--max-line-bytes` must be at least 2, found `{max_line_bytes}`")


def _row_json(kept: _Kept, *, general: bool = False) -> dict[str, Any]:
    row = {
        "id": kept.exact[:16],
        "messages": list(kept.row.messages),
        "origin": {"file": kept.file, "line": kept.line},
        "schema": kept.row.schema,
        "source": kept.row.source,
        # the row's own mode, what `[data].thinking = "per_row"` renders it in (`render.resolve_thinking`)
        "thinking": row_thinking(kept.row.messages, kept.row.thinking),
    }
    if kept.row.tools is not None:
        row["tools"] = list(kept.row.tools)
    if general:  # a replay row held out for validation (`_replay`); other rows carry no `domain`
        row["domain"] = "general"
    return row


def dumps_row(obj: dict[str, Any]) -> bytes:
    """One output line: sorted keys, compact, UTF-8 (not ASCII-escaped), newline-terminated."""
    return (json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


class _Reader:
    """Reads input and replay files into kept rows: bad rows refused (or dropped and counted with
    `skip_invalid`), exact duplicates of an earlier row dropped."""

    def __init__(self, *, skip_invalid: bool, max_line_bytes: int, on_drop: Callable[[str, int, str, str], None] | None) -> None:
        self.skip_invalid = skip_invalid
        self.max_line_bytes = max_line_bytes
        self.on_drop = on_drop
        self.kept: list[_Kept] = []
        self.seen: dict[str, tuple[str, int]] = {}
        self.dropped: Counter[str] = Counter()
        self.drops: list[dict[str, Any]] = []
        self.ignored: Counter[str] = Counter()
        self.schema_counts: Counter[str] = Counter()
        self.inputs_meta: list[dict[str, Any]] = []  # the manifest's `inputs` (and `replay.inputs`) entries
        self.replay_meta: list[dict[str, Any]] = []

    def read_all(self, paths: Sequence[Path], replay_paths: Sequence[Path]) -> None:
        """Read the inputs, then the replay files."""
        self.inputs_meta += [self.read_file(p, replay=False) for p in paths]
        self.replay_meta += [self.read_file(p, replay=True) for p in replay_paths]

    def drop(self, file: str, line: int, reason: str, message: str) -> None:
        self.dropped[reason] += 1
        if len(self.drops) < MAX_LISTED_DROPS:
            self.drops.append({"file": file, "line": line, "reason": reason, "message": message})
        if self.on_drop is not None:
            self.on_drop(file, line, reason, message)

    def read_file(self, path: Path, *, replay: bool) -> dict[str, Any]:
        """Read one file (in order: inputs first, then replay files); its manifest entry."""
        if not path.is_file():
            raise DataError(f"{'replay file' if replay else 'input'} `{path}` does not exist or is not a file")
        stats = FileStats()
        read = kept_here = 0
        try:
            for lineno, value in iter_jsonl(path, stats, max_line_bytes=self.max_line_bytes):
                read += 1
                kept_here += self._keep(path, lineno, value, replay=replay)
        except OSError as exc:
            raise DataError(f"cannot read input `{path}`: {exc.strerror or exc}") from None
        return {
            "file": path.name,
            "sha256": sha256_file(path),
            "bytes": path.stat().st_size,
            "lines": stats.lines,
            "rows_read": read,
            "rows_kept": kept_here,
            "blank_lines": stats.blank_lines,
            "crlf_lines": stats.crlf_lines,
            "bom": stats.bom,
        }

    def _keep(self, path: Path, lineno: int, value: Any, *, replay: bool) -> bool:
        """Keep one line's row unless it is unusable or a duplicate; whether it was kept."""
        name = path.name
        row = value if isinstance(value, LineError) else normalize_row(value, line=lineno, default_source=name)
        if isinstance(row, LineError):
            if not self.skip_invalid:
                raise DataError(
                    f"`{path}` line {lineno}: {row.message}"
                    + ("" if "\nhint:" in row.message else "\nhint: fix the line, or pass `--skip-invalid` to drop and count bad rows")
                )
            self.drop(name, lineno, row.reason, row.message)
            return False
        ek = exact_key(row)
        if ek in self.seen:
            f0, l0 = self.seen[ek]
            self.drop(name, lineno, "duplicate", f"exact duplicate of `{f0}` line {l0}")
            return False
        self.seen[ek] = (name, lineno)
        self.kept.append(_Kept(row=row, file=name, line=lineno, group=prompt_key(row), exact=ek, replay=replay))
        self.schema_counts[row.schema] += 1
        self.ignored.update(row.ignored)
        return True


def _split_files(rows: Sequence[_Kept], assigned: Sequence[str], n_own: int) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The bytes of each split file and the per-split counts (the manifest's `counts` from `source` on).

    `rows[n_own:]` are replay rows; those assigned to ``val`` are general validation rows."""
    split_rows: dict[str, list[bytes]] = {s: [] for s in SPLIT_NAMES}
    by_split: Counter[str] = Counter()
    source_counts: Counter[str] = Counter()
    source_split: dict[str, Counter[str]] = {}
    groups_split: dict[str, set[str]] = {s: set() for s in SPLIT_NAMES}
    prompt_only: Counter[str] = Counter()
    for i, (k, s) in enumerate(zip(rows, assigned, strict=True)):
        split_rows[s].append(dumps_row(_row_json(k, general=i >= n_own and s == "val")))
        by_split[s] += 1
        source_counts[k.row.source] += 1
        source_split.setdefault(k.row.source, Counter())[s] += 1
        groups_split[s].add(k.group)
        if not k.row.has_response:
            prompt_only[s] += 1
    blobs = {f"{s}.jsonl": b"".join(split_rows[s]) for s in SPLIT_NAMES}
    counts = {
        "source": dict(sorted(source_counts.items())),
        "split": {s: by_split[s] for s in SPLIT_NAMES},
        "source_split": {src: {s: c[s] for s in SPLIT_NAMES} for src, c in sorted(source_split.items())},
        "groups_split": {s: len(groups_split[s]) for s in SPLIT_NAMES},
        "prompt_only_split": {s: prompt_only[s] for s in SPLIT_NAMES},
    }
    return blobs, counts


def _check_plan(
    plan: SplitPlan, paths: Sequence[Path], replay_paths: Sequence[Path], *, seed: int, max_line_bytes: int,
    replay_fraction: float, replay_val_fraction: float | None,
) -> None:
    """Refuse arguments `prepare_data` cannot honour, before any file is read."""
    _check_args([*paths, *replay_paths], seed, plan.val_fraction or 0.0, plan.test_fraction or 0.0, max_line_bytes)
    if replay_paths:
        _check_replay(plan, replay_fraction, replay_val_fraction)
    elif replay_val_fraction is not None:
        raise ConfigError("`--replay-val-fraction` is set but no `--replay` file is given\nhint: add `--replay FILE.jsonl`")


def _groups_in_several_sources(kept: Sequence[_Kept]) -> int:
    """How many prompt groups have rows from more than one source (the group key ignores the source)."""
    sources_of: dict[str, set[str]] = {}
    for k in kept:
        sources_of.setdefault(k.group, set()).add(k.row.source)
    return sum(1 for v in sources_of.values() if len(v) > 1)


def _params(plan: SplitPlan, replay_meta: Sequence[dict[str, Any]], fraction: float, val_fraction: float | None) -> dict[str, Any]:
    """What the split fingerprint covers: the plan's parameters, and the replay files and fractions when there are any."""
    params = plan.params()
    if replay_meta:
        params["replay"] = {"fraction": fraction, "sha256": [m["sha256"] for m in replay_meta]}
        if val_fraction is not None:
            params["replay"]["val_fraction"] = val_fraction
    return params


def _manifest(
    reader: _Reader, params: dict[str, Any], counts: dict[str, Any], blobs: dict[str, bytes], sections: dict[str, Any]
) -> dict[str, Any]:
    """The manifest of the prepared data; `sections` (`holdout`, `replay`) appear only when not None."""
    files = {
        name: {"sha256": sha256_bytes(blob), "bytes": len(blob), "rows": counts["split"][name.split(".")[0]]}
        for name, blob in blobs.items()
    }
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "params": {**params, "skip_invalid": reader.skip_invalid, "max_line_bytes": reader.max_line_bytes},
        "inputs": reader.inputs_meta,
        "counts": counts,
        "dropped": dict(sorted(reader.dropped.items())),
        "dropped_total": sum(reader.dropped.values()),
        "drops_listed": reader.drops,
        "ignored_fields": dict(sorted(reader.ignored.items())),
        **{name: section for name, section in sections.items() if section is not None},
        "files": files,
        # Identifies the exact split contents; capture and training record it.
        "split_fingerprint": fingerprint({"files": {n: f["sha256"] for n, f in files.items()}, **params}),
        "inputs_fingerprint": fingerprint([[m["file"], m["sha256"]] for m in reader.inputs_meta]),
        "software": {"dflash-worker": __version__},
    }
    manifest["fingerprint"] = fingerprint(manifest)
    return manifest


def prepare_data(
    inputs: Sequence[str | Path],
    output: str | Path,
    *,
    seed: int = 0,
    val_fraction: float | None = None,
    test_fraction: float | None = None,
    skip_invalid: bool = False,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    on_drop: Callable[[str, int, str, str], None] | None = None,
    split: str | None = None,
    holdout_file: str | Path | None = None,
    replay: Sequence[str | Path] = (),
    replay_fraction: float = DEFAULT_REPLAY_FRACTION,
    replay_val_fraction: float | None = None,
) -> dict[str, Any]:
    """Prepare `inputs` into `output`; returns the manifest that was written.

    The fractions default to 0.05 each. `split` sends every kept row to that
    one split (exclusive with the fractions and `holdout_file`);
    `holdout_file` forces the groups it lists into ``test`` (see `read_holdout`).
    `replay` files (general-domain rows, read like the inputs) are mixed into ``train`` only,
    as `replay_fraction` of the train split (see `_replay`); the manifest's ``replay`` records it.
    `replay_val_fraction` also holds that share of the replay rows out into ``val`` as general
    validation rows (``"domain": "general"``, listed in ``replay.val_ids``).

    Raises DataError naming file and line for the first unusable row unless
    `skip_invalid`, in which case each one is dropped, counted by reason in the
    manifest, listed (first 50) and reported through `on_drop(file, line, reason, message)`.
    """
    paths = [Path(p) for p in inputs]
    holdout = None if holdout_file is None else read_holdout(holdout_file)
    plan = SplitPlan.resolve(seed=seed, val_fraction=val_fraction, test_fraction=test_fraction,
                             split=split, holdout=holdout)
    replay_paths = [Path(p) for p in replay]
    _check_plan(plan, paths, replay_paths, seed=seed, max_line_bytes=max_line_bytes,
                replay_fraction=replay_fraction, replay_val_fraction=replay_val_fraction)
    output = Path(output)

    reader = _Reader(skip_invalid=skip_invalid, max_line_bytes=max_line_bytes, on_drop=on_drop)
    reader.read_all(paths, replay_paths)
    pool = [k for k in reader.kept if k.replay]
    kept = [k for k in reader.kept if not k.replay]
    if not kept:
        raise DataError("no usable rows in " + ", ".join(f"`{p}`" for p in paths))

    # Every row of a group gets the group's split; replay rows join train (or val) after.
    several_sources = _groups_in_several_sources(kept)
    assigned, holdout_section = _assign(kept, plan)
    replay_section = None
    n_own = len(kept)
    if replay_paths:
        mixed, general_val, replay_section = _replay(pool, kept, assigned, seed=seed, fraction=replay_fraction,
                                                     inputs=reader.replay_meta, val_fraction=replay_val_fraction)
        kept = [*kept, *mixed, *general_val]
        assigned = [*assigned, *(["train"] * len(mixed)), *(["val"] * len(general_val))]
    blobs, split_counts = _split_files(kept, assigned, n_own)
    counts = {"rows": len(kept), "schema": dict(sorted(reader.schema_counts.items())), **split_counts,
              "groups_in_several_sources": several_sources}
    params = _params(plan, reader.replay_meta, replay_fraction, replay_val_fraction)
    manifest = _manifest(reader, params, counts, blobs, {"holdout": holdout_section, "replay": replay_section})

    output.mkdir(parents=True, exist_ok=True)
    for name, blob in blobs.items():
        write_bytes_atomic(output / name, blob)
    write_json_atomic(output / "manifest.json", manifest)
    return manifest
