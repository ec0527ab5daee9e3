#!/usr/bin/env bash
# `make demo`: the project's main job on its embedded default.
#
# Builds a tiny world (no model hub needed): a Qwen3 target with a trained BPE
# tokenizer and a Qwen3-style chat template, a "released" DFlash2 draft and
# own-data rows. Then `run-manager --local` starts a loopback coordinator on
# SQLite, creates a run and a provider token, and runs the job through the
# native client: prepare-data, check-data, capture, train (full scope), BF16
# export, evaluate (released vs trained draft with real speculative decoding).
#
# Environment: DFLASH_DEMO_DIR (default ./demo-work), DFLASH_DEMO_STEPS (default 40).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=.venv/bin/python
work=${DFLASH_DEMO_DIR:-$root/demo-work}
steps=${DFLASH_DEMO_STEPS:-40}
rm -rf "$work"
mkdir -p "$work"

echo "demo: building a tiny world (target + tokenizer, released draft, own data) in $work/world" >&2
"$py" - "$work" "$steps" <<'PY'
import json, sys
from pathlib import Path
from dflash_worker.testing.world import build_world, job_spec

work, steps = Path(sys.argv[1]), int(sys.argv[2])
world = build_world(work / "world", examples=48)
spec = job_spec(world, steps=steps, checkpoint_every=10, regenerate=True)
spec["recipe"]["train"]["val_every"] = 10
(work / "run.json").write_text(json.dumps({"name": "demo", "spec": spec}, indent=2))
PY

echo "demo: run-manager --local (coordinator, provider and worker on this machine)" >&2
.venv/bin/run-manager --local --spec "$work/run.json" --work-dir "$work/provider"

# The export travels: fetch it back from the coordinator's artifact store, as the person
# who ordered the run would from another machine (sha256-verified by the CLI).
echo "demo: fetching the export from the coordinator's artifact store (dflash-coordinator artifacts get)" >&2
coord_dir="$work/provider/coordinator"
token=$("$py" -c 'import secrets; print(secrets.token_hex(16))')
DFLASH_ADMIN_TOKEN="$token" .venv/bin/dflash-coordinator serve --db "$coord_dir/coordinator.db" --listen 127.0.0.1:0 \
  >"$work/serve.json" 2>"$work/serve.log" &
serve_pid=$!
trap 'kill "$serve_pid" 2>/dev/null || true' EXIT
for _ in $(seq 300); do [ -s "$work/serve.json" ] && break; sleep 0.1; done
addr=$("$py" -c 'import json, sys; print(json.load(open(sys.argv[1]))["address"])' "$work/serve.json")
run_id=$(DFLASH_ADMIN_TOKEN="$token" .venv/bin/dflash-coordinator runs list --json --server "$addr" | "$py" -c 'import json, sys; print(json.load(sys.stdin)[0]["run_id"])')
# The regression gate published the export only if the evaluation did not regress.
published=$(DFLASH_ADMIN_TOKEN="$token" .venv/bin/dflash-coordinator runs show "$run_id" --json --server "$addr" \
  | "$py" -c 'import json, sys; p = json.load(sys.stdin)["jobs"][0].get("publication") or {}; print(("yes " if p.get("published") else "no ") + p.get("reason", "not decided"))')
echo "demo: regression gate: ${published#* }" >&2
if [ "${published%% *}" = yes ]; then
  DFLASH_ADMIN_TOKEN="$token" .venv/bin/dflash-coordinator artifacts get "$run_id" --export -o "$work/fetched-export" --server "$addr"
  echo "demo: the export, fetched and verified, is in $work/fetched-export" >&2
else
  echo "demo: the export was held back, so it is not fetched; \`dflash-coordinator runs publish $run_id --override\` would publish it" >&2
fi
kill "$serve_pid"
wait "$serve_pid" 2>/dev/null || true
trap - EXIT

report=$(find "$work/provider/jobs" -path '*/eval/report.md' | head -n 1)
if [ -n "$report" ]; then
  echo
  cat "$report"
fi
echo "demo: done; the job directory is $(dirname "$(dirname "$report")")" >&2
