"""Run one Python fuzz target under atheris (libFuzzer): `run.py TARGET [libFuzzer flags] [CORPUS_DIR...]`.

`scripts/fuzz.sh` is the usual way in (it adds the time limit, the corpus and
seed directories, the dictionary and where crashes go); docs/fuzzing.md has the
details. The project's modules (and `tomllib`, pure Python, so the fuzzer
learns TOML's syntax from its branches) are imported inside
`atheris.instrument_imports`, which is what makes the run coverage-guided.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))

with atheris.instrument_imports(include=["dflash_worker", "tomllib", "targets"]):
    import targets


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in targets.TARGETS:
        sys.exit(f"usage: run.py TARGET [libFuzzer flags]; targets: {', '.join(targets.TARGETS)}")
    check = targets.TARGETS[sys.argv[1]]
    # libFuzzer reads flags and corpus directories from argv; the target name is ours.
    atheris.Setup([sys.argv[0], *sys.argv[2:]], check)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
