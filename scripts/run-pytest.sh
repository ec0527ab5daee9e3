#!/usr/bin/env bash
# Run the Python suite with the checkout's .venv. pytest's exit code 5 means it
# collected no tests: that is reported as its own failure, never as success.
#
# The suite runs on every core with pytest-xdist (a worker per core and one more; DFLASH_PYTEST_WORKERS=N
# sets the count, 0 runs in one process), each test file on one worker (`--dist loadfile`), so a
# module's fixtures are built once; files are handed out in collection order, which
# tests/conftest.py makes longest first from tests/durations.json (xdist's own reorder, by
# number of tests per file, is off). Arguments that choose workers themselves (`-n`,
# `-p no:xdist`) are passed as they are.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
# Byte-code caches on, even where the environment turns them off (PYTHONDONTWRITEBYTECODE=1, as
# some sandboxes and CI images set): otherwise every worker recompiles the test modules it collects
# (and pytest rewrites their asserts again: collection 10.4 s -> 6.6 s CPU here), and every CLI,
# worker and coordinator process a test starts recompiles dflash_worker (~0.2 s CPU each).
# `__pycache__/` is git-ignored.
unset PYTHONDONTWRITEBYTECODE
# One OpenMP/MKL thread per process unless the caller set a count: the suite runs a process per
# core (and every test starts more: CLIs, workers, ranks), the tiny models gain nothing from a
# second thread, and idle OpenMP threads spin while waiting for work (tests/e2e/test_e2e_graph.py:
# 98.9 -> 89.5 s CPU). Tests that are about thread counts set their own.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1}
# One worker per core and one more (`nproc` counts OMP_NUM_THREADS as the processor count: asked
# without it). Most of what the tests start now runs in forks of warm servers, so a worker spends a
# fifth of its time waiting (on sockets, subprocesses, Docker): on 2 cores, clean clones of c903c28
# ran test-python in 347.6-355.6 s at 80-81% CPU busy with 2 workers, 313.7 s at 95% with 3. (Before
# the warm forks, at 92% busy, a third worker only added CPU seconds: docs/history/testing-runs.md.)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)
workers=${DFLASH_PYTEST_WORKERS:-$((cores + 1))}
dist=()
case " $* " in
  *" -n "* | *" -n"[0-9]* | *" --numprocesses"* | *"no:xdist"*) ;;
  *) if [ "$workers" != 0 ] && .venv/bin/python -c 'import xdist' 2>/dev/null; then
       dist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
     fi ;;
esac
.venv/bin/python -m pytest "${dist[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run-pytest: pytest collected no tests (exit 5); an empty suite is a failure here" >&2
  exit 5
fi
exit "$rc"
