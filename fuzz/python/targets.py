"""The Python fuzz targets: one `check_*` function per parser of untrusted bytes.

Each function feeds `data` to a parser the way the project does in production
(as a file on disk where the parser reads a file) and checks the one property
every parser here promises: it returns a valid result or raises a subclass of
`DflashError` (for the JSONL reader: yields a `LineError`). Any other exception
escaping (KeyError, TypeError, RecursionError, OverflowError, a bare ValueError,
...) is a bug and propagates, so the fuzzer records the input as a crash. What a
parser accepts is checked further where the result promises more (a safetensors
header tiles its data section; a recipe's `resolved()` builds the same recipe).

Nothing here imports atheris: `fuzz/python/run.py` instruments and drives these
functions, and `tests/fuzz/` replays committed crash inputs through the same
functions without it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from dflash_worker.data.jsonl import FileStats, LineError, iter_jsonl
from dflash_worker.data.schema import Row, exact_key, normalize_row, prompt_key
from dflash_worker.errors import DflashError
from dflash_worker.recipe import load_recipe, recipe_from_dict
from dflash_worker.weights.header import read_header
from dflash_worker.worker.spec import SPEC_FILE, JobSpec

# One scratch directory per process, on tmpfs where there is one: every input is
# written to a file there, as production reads files. scripts/fuzz.sh names one
# and removes it (libFuzzer ends the process without running `atexit`).
if os.environ.get("DFLASH_FUZZ_SCRATCH"):
    _SCRATCH = Path(os.environ["DFLASH_FUZZ_SCRATCH"])
    _SCRATCH.mkdir(parents=True, exist_ok=True)
else:
    _SCRATCH = Path(tempfile.mkdtemp(prefix="dflash-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    atexit.register(shutil.rmtree, _SCRATCH, ignore_errors=True)


def _scratch_file(name: str, data: bytes) -> Path:
    path = _SCRATCH / name
    path.write_bytes(data)
    return path


def check_header(data: bytes) -> None:
    """`weights.header.read_header` on `data` as a `.safetensors` file."""
    path = _scratch_file("model.safetensors", data)
    try:
        header = read_header(path)
    except DflashError:
        return
    # Accepted: the tensors tile the data section, in file order, exactly.
    cursor = header.data_start
    for t in header.tensors.values():
        assert t.begin == cursor and t.end >= t.begin, t
        cursor = t.end
    assert cursor == header.file_size == len(data)


def check_jsonl(data: bytes) -> None:
    """`data.jsonl.iter_jsonl` on `data` as a file, each row through `schema.normalize_row`.

    A small line limit (64 bytes) keeps the over-long-line paths reachable.
    """
    path = _scratch_file("rows.jsonl", data)
    for max_line_bytes in (64, 1 << 20):
        stats = FileStats()
        last = 0
        for lineno, value in iter_jsonl(path, stats, max_line_bytes=max_line_bytes):
            assert lineno > last, (lineno, last)
            last = lineno
            if isinstance(value, LineError):
                assert value.line == lineno and value.reason and value.message
                continue
            row = normalize_row(value, line=lineno, default_source="rows.jsonl")
            if isinstance(row, Row):
                # what prepare-data does with every kept row
                exact_key(row)
                prompt_key(row)
        assert stats.lines >= last


def check_recipe(data: bytes) -> None:
    """`recipe.load_recipe` on `data` as a `.toml` file; accepted: `resolved()` builds the same recipe."""
    path = _scratch_file("recipe.toml", data)
    try:
        recipe = load_recipe(path)
    except DflashError:
        return
    resolved = recipe.resolved()
    recipe.fingerprint()
    # The resolved form is what every manifest records; read back, it is the same recipe.
    # (None means "left at its default", which a TOML file cannot spell.)
    plain = {name: {k: v for k, v in table.items() if v is not None} for name, table in resolved.items()}
    again = recipe_from_dict(plain, base=_SCRATCH, source=str(path))
    assert again.resolved() == resolved, (again.resolved(), resolved)


def check_spec(data: bytes) -> None:
    """`worker.spec.JobSpec.load` on `data` as `spec.json`; accepted: `to_json()` reads back the same."""
    job_dir = _SCRATCH / "job"
    job_dir.mkdir(exist_ok=True)
    (job_dir / SPEC_FILE).write_bytes(data)
    try:
        spec = JobSpec.load(job_dir)
    except DflashError:
        return
    doc = spec.to_json()
    json.dumps(doc)
    again = JobSpec.from_json(doc, job_dir=spec.job_dir)
    assert again.to_json() == doc


def check_canary(data: bytes) -> None:
    """Crashes on purpose on input starting `FU` (its seed): tests/fuzz proves a crash fails the run."""
    if data.startswith(b"FU"):
        raise KeyError("canary")


TARGETS: dict[str, Callable[[bytes], None]] = {
    "py_header": check_header,
    "py_jsonl": check_jsonl,
    "py_recipe": check_recipe,
    "py_spec": check_spec,
    "py_canary": check_canary,  # not run by scripts/fuzz.sh unless named
}
