"""Inputs the fuzzers found crashing a parser, kept so the bug stays fixed (docs/fuzzing.md).

Every file under ``tests/fuzz/inputs/TARGET/`` is replayed through that fuzz
target's own check (`fuzz/python/targets.py`, no atheris needed), and each one
also has a test here asserting the clean error it now gets, with the file and
field named. `scripts/fuzz.sh` feeds the same files to the fuzzer as seeds.
Rust inputs (``rs_*``) are asserted by the parser's inline test (the one that
names the input) and replayed by `scripts/fuzz.sh`.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_worker.data.jsonl import FileStats, LineError, iter_jsonl
from dflash_worker.errors import ConfigError
from dflash_worker.recipe import load_recipe
from dflash_worker.worker.spec import SPEC_FILE, JobSpec

ROOT = Path(__file__).resolve().parents[2]
INPUTS = ROOT / "tests" / "fuzz" / "inputs"


def _targets():
    spec = importlib.util.spec_from_file_location("dflash_fuzz_targets", ROOT / "fuzz" / "python" / "targets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TARGETS = _targets().TARGETS
PY_INPUTS = sorted(p for p in INPUTS.glob("py_*/*") if p.is_file())


def test_input_directories_are_fuzz_targets():
    listed = subprocess.run([str(ROOT / "scripts" / "fuzz.sh"), "--list"], capture_output=True, text=True, check=True).stdout.split()
    assert set(TARGETS) - {"py_canary"} <= set(listed)
    dirs = sorted(d.name for d in INPUTS.iterdir() if d.is_dir())
    assert dirs and set(dirs) <= set(listed), dirs


@pytest.mark.parametrize("path", PY_INPUTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_input_passes_its_fuzz_target(path):
    TARGETS[path.parent.name](path.read_bytes())


def _spec_error(tmp_path: Path, name: str) -> str:
    job = tmp_path / "job"
    job.mkdir()
    shutil.copy(INPUTS / "py_spec" / name, job / SPEC_FILE)
    with pytest.raises(ConfigError) as info:
        JobSpec.load(job)
    return str(info.value)


def test_recipe_path_with_nul_is_named(tmp_path):
    # was: ValueError: embedded null byte, from Path.resolve
    path = tmp_path / "recipe.toml"
    shutil.copy(INPUTS / "py_recipe" / "path-with-nul.toml", path)
    with pytest.raises(ConfigError, match=r"`\[model\]\.target` contains a NUL character in `.*recipe\.toml`"):
        load_recipe(path)


def test_spec_recipe_path_for_unknown_user_is_named(tmp_path):
    # was: RuntimeError: Could not determine home directory, from Path.expanduser
    msg = _spec_error(tmp_path, "path-unknown-user.json")
    assert msg.startswith(f"`{(tmp_path / 'job' / SPEC_FILE).resolve()}`: ")
    assert "`[model].draft` is `~d` in `spec.recipe`: cannot expand `~d`, no user `d` here" in msg
    assert msg.endswith("\nhint: write the path out in full")


def test_spec_recipe_path_with_lone_surrogate_is_named(tmp_path):
    # was: UnicodeEncodeError: surrogates not allowed, from os.lstat in Path.resolve
    msg = _spec_error(tmp_path, "path-lone-surrogate.json")
    assert "`[model].draft` is not valid Unicode (a lone surrogate at character 0) in `spec.recipe`" in msg


def test_jsonl_integer_past_pythons_digit_limit_is_a_line_error():
    # found reviewing the targets (past libFuzzer's default 4 KiB inputs); was: ValueError: Exceeds
    # the limit (4300 digits) for integer string conversion, from json.loads
    got = list(iter_jsonl(INPUTS / "py_jsonl" / "integer-5000-digits.jsonl", FileStats()))
    assert got[0] == (1, {"prompt": "ok", "response": "fine"})
    line, err = got[1]
    assert line == 2 and isinstance(err, LineError)
    assert (err.reason, err.message) == ("invalid_json", "a number has more than `4300` digits")


def _recipe_error(tmp_path: Path, name: str) -> str:
    path = tmp_path / "recipe.toml"
    shutil.copy(INPUTS / "py_recipe" / name, path)
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    return str(info.value)


# The next three were found reviewing the py_recipe target (the fuzzer had not built such inputs in
# 2 minutes); each escaped load_recipe as a bare exception.
def test_recipe_nested_too_deeply_is_named(tmp_path):
    # was: RecursionError, from tomllib
    msg = _recipe_error(tmp_path, "nested-arrays-1000.toml")
    assert msg == f"recipe `{tmp_path / 'recipe.toml'}` is not valid TOML: arrays or tables nested too deeply"


def test_recipe_integer_past_pythons_digit_limit_is_named(tmp_path):
    # was: ValueError: Exceeds the limit (4300 digits) for integer string conversion, from tomllib
    msg = _recipe_error(tmp_path, "integer-5000-digits.toml")
    assert msg == f"recipe `{tmp_path / 'recipe.toml'}` is not valid TOML: an integer has more than `4300` digits"


def test_recipe_number_past_float_range_is_out_of_range(tmp_path):
    # was: OverflowError: int too large to convert to float, from math.isfinite
    msg = _recipe_error(tmp_path, "lr-past-float-range.toml")
    assert msg.startswith("`[train].lr` must be in `(0.0, inf]`, found `1000")
    assert msg.endswith(f"in `{tmp_path / 'recipe.toml'}`")


# The next three were found reviewing the py_spec target; each escaped JobSpec.load as a bare exception.
def test_spec_nested_too_deeply_for_json_is_named(tmp_path):
    # was: RecursionError, from json.loads
    msg = _spec_error(tmp_path, "nested-2000.json")
    assert msg == f"`{(tmp_path / 'job' / SPEC_FILE).resolve()}` is not valid JSON: nested too deeply"


def test_spec_nested_past_the_depth_limit_is_named(tmp_path):
    # was: RecursionError, from copy.deepcopy of the recipe (json.loads takes ~1000 levels, deepcopy ~500)
    msg = _spec_error(tmp_path, "recipe-nested-600.json")
    assert msg == f"`{(tmp_path / 'job' / SPEC_FILE).resolve()}`: spec.json is nested more than 64 levels deep"


def test_spec_job_dir_with_nul_is_named(tmp_path):
    # was: ValueError: embedded null byte, from Path.resolve
    msg = _spec_error(tmp_path, "job-dir-nul.json")
    assert msg.endswith(": `job_dir` contains a NUL character")
