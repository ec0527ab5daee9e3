#!/usr/bin/env bash
# Run the Python suite with the checkout's .venv. pytest's exit code 5 means it
# collected no tests: that is reported as its own failure, never as success.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run-pytest: pytest collected no tests (exit 5); an empty suite is a failure here" >&2
  exit 5
fi
exit "$rc"
