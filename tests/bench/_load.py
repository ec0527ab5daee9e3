"""Import a script of `bench/` (not a package) as a module, for the benchmarks' smoke tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """`bench/<name>.py`, freshly executed (registered in `sys.modules` for dataclasses and pickling)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    before = dict(os.environ)
    spec.loader.exec_module(mod)
    # a script that sets the environment at import hands it to every process the test process starts
    # later (`MKL_CBWR` once made a resume test's subprocess GEMMs differ from its in-process ones)
    changed = sorted(k for k in {*before, *os.environ} if before.get(k) != os.environ.get(k))
    if changed:
        os.environ.clear()
        os.environ.update(before)
        raise AssertionError(f"importing bench/{name}.py changed the environment: {', '.join(changed)}; "
                             "set it in `main` instead")
    return mod
