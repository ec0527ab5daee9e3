#!/usr/bin/env bash
# `make demo`: the project's main job on its embedded default, on a tiny model
# built here (no model hub is needed). Grows with the pipeline: it runs the
# most complete path that exists.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=.venv/bin/python
work=${DFLASH_DEMO_DIR:-$root/demo-work}
mkdir -p "$work"

echo "demo: building a tiny Qwen3 target in $work/target" >&2
"$py" - "$work/target" <<'PY'
import sys
from dflash_worker.testing import save_tiny_target
save_tiny_target(sys.argv[1], family="qwen3", dtype="bfloat16", max_shard_size="256KB")
PY
.venv/bin/run-manager --version
echo "demo: done; outputs in $work" >&2
