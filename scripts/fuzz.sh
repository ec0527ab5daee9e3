#!/usr/bin/env bash
# Run the coverage-guided fuzz targets for a bounded time each (docs/fuzzing.md).
#
#   scripts/fuzz.sh [--seconds N] [TARGET...]     N seconds per target (default 20); all targets by default
#   scripts/fuzz.sh --seconds 600                 the documented longer run
#   scripts/fuzz.sh --list                        the target names
#   scripts/fuzz.sh --build-only                  build the Rust targets and stop
#
# Python targets (py_*) run under atheris, Rust targets (rs_*) are libFuzzer
# binaries built on stable Rust with sancov `-C` flags into their own target
# directory. Each target's corpus persists between runs under
# $DFLASH_FUZZ_DIR (default ~/.cache/dflash-worker/fuzz); seeds and dictionaries
# are generated afresh each run (fuzz/python/seeds.py) and the committed
# regression inputs under tests/fuzz/inputs/TARGET are fed as seeds too.
#
# Targets run side by side, one per core ($DFLASH_FUZZ_JOBS to change), each for
# its full N seconds. Per target it prints executions, executions per second, corpus size and
# crashes. A crashing input is saved under fuzz/crashes/TARGET/ (gitignored;
# $DFLASH_FUZZ_CRASHES elsewhere) and the script exits 1. `make fuzz` runs it;
# `make test` includes it. `py_canary` crashes on purpose and runs only when
# named (tests/fuzz checks that a crash fails the run).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

PY_TARGETS=(py_header py_jsonl py_recipe py_spec)
RS_TARGETS=(rs_worker_event rs_job_spec)
# libFuzzer binary of each Rust target (fuzz/rust/Cargo.toml [[bin]] names)
rs_bin() { echo "${1#rs_}"; }

seconds=20
targets=()
build_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) [ $# -ge 2 ] || { echo "fuzz: --seconds needs a value" >&2; exit 2; }; seconds=$2; shift 2 ;;
    --seconds=*) seconds=${1#--seconds=}; shift ;;
    --list) printf '%s\n' "${PY_TARGETS[@]}" "${RS_TARGETS[@]}"; exit 0 ;;
    --build-only) build_only=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    -*) echo "fuzz: unknown option \`$1\`" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
case "$seconds" in ''|*[!0-9]*|0) echo "fuzz: --seconds must be a positive integer, got \`$seconds\`" >&2; exit 2 ;; esac
[ ${#targets[@]} -gt 0 ] || targets=("${PY_TARGETS[@]}" "${RS_TARGETS[@]}")
for t in "${targets[@]}"; do
  case " ${PY_TARGETS[*]} ${RS_TARGETS[*]} py_canary " in
    *" $t "*) ;;
    *) echo "fuzz: unknown target \`$t\`" >&2; echo "hint: scripts/fuzz.sh --list" >&2; exit 2 ;;
  esac
done

PY=$root/.venv/bin/python
[ -x "$PY" ] || { echo "fuzz: no .venv here" >&2; echo "hint: run \`make install\` first" >&2; exit 2; }
work=${DFLASH_FUZZ_DIR:-$HOME/.cache/dflash-worker/fuzz}
if [ "$build_only" = 0 ]; then
  mkdir -p "$work/corpus" "$work/logs"
  rm -rf "$work/seeds"
  "$PY" fuzz/python/seeds.py "$work/seeds"
fi

# Build the Rust targets only when one is asked for: the workspace member fuzz/rust (the same
# Cargo.lock, so the same serde_json and friends as the shipped binary, plus libfuzzer-sys) in the
# root's `fuzz` profile, into a target directory of its own (the coverage flags would otherwise
# invalidate the main build).
rs_dir=
if printf '%s\n' "${targets[@]}" | grep -q '^rs_'; then
  export CARGO_TARGET_DIR=${DFLASH_FUZZ_TARGET_DIR:-$HOME/.cache/dflash-worker/fuzz-target}
  host=$(rustc -vV | sed -n 's/^host: //p')
  # sancov from stable rustc: the flags cargo-fuzz passes on nightly, minus any
  # sanitizer (which needs -Zsanitizer). `--target` keeps them off build scripts.
  export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
  start=$(date +%s)
  # The hash of the Rust sources, as `make` sets it (scripts/cargo-env.py): part of the
  # run-manager crate's fingerprint, so a fresh clone reuses the build of the same sources.
  DFLASH_RUST_SOURCES=$("$PY" scripts/cargo-env.py hash) cargo build --locked -p dflash-fuzz --profile fuzz --bins \
    --target "$host" -j "${CARGO_BUILD_JOBS:-2}" --quiet
  echo "fuzz: rust targets built in $(( $(date +%s) - start ))s ($CARGO_TARGET_DIR)" >&2
  rs_dir=$CARGO_TARGET_DIR/$host/fuzz
fi
[ "$build_only" = 0 ] || exit 0

# Run one target; prints its row of the summary, returns non-zero on a crash.
run_target() {
  local t=$1 corpus=$work/corpus/$1 crashes=${DFLASH_FUZZ_CRASHES:-$root/fuzz/crashes}/$1 log=$work/logs/$1.log stamp
  mkdir -p "$corpus" "$crashes"
  stamp=$(mktemp)
  local seeds=("$work/seeds/$t")
  [ -d "tests/fuzz/inputs/$t" ] && seeds+=("tests/fuzz/inputs/$t")
  # 16 KiB inputs: deep nesting and 4300-digit integers (Python's int-parsing limit) need more than libFuzzer's default 4 KiB
  local flags=(-max_total_time="$seconds" -max_len=16384 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
    -dict="$work/seeds/$t.dict" -artifact_prefix="$crashes/")
  local cmd
  case "$t" in
    py_*) cmd=("$PY" fuzz/python/run.py "$t") ;;
    rs_*) cmd=("$rs_dir/$(rs_bin "$t")") ;;
  esac
  local rc=0 started scratch
  started=$(date +%s)
  # The bound is libFuzzer's; `timeout` only catches a run that ignores it.
  scratch=$(mktemp -d "$scratch_base/dflash-fuzz-$t.XXXXXX")
  DFLASH_FUZZ_SCRATCH=$scratch timeout $(( seconds + 120 )) "${cmd[@]}" "${flags[@]}" "$corpus" "${seeds[@]}" >"$log" 2>&1 || rc=$?
  rm -rf "$scratch"
  local execs rate new found elapsed
  elapsed=$(( $(date +%s) - started ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  # no final stats (killed): the last status line's count
  [ -n "$execs" ] || execs=$(sed -n 's/^#\([0-9]*\).*/\1/p' "$log" | tail -n 1)
  [ -n "$rate" ] || rate=$(( ${execs:-0} / (elapsed > 0 ? elapsed : 1) ))
  new=$(find "$crashes" -type f -newer "$stamp")
  found=$(printf '%s' "$new" | grep -c . || true)
  rm -f "$stamp"
  printf '%-16s %10s %9s %8s %8s %8s\n' "$t" "${execs:-0}" "$rate" "$(find "$corpus" -type f | wc -l)" "$found" "${elapsed}s"
  if [ "$rc" -ne 0 ] || [ "$found" -gt 0 ]; then
    {
      echo "fuzz: \`$t\` failed (exit $rc); log: $log"
      grep -v '^#[0-9]' "$log" | tail -n 40
      [ -z "$new" ] || printf '%s\n' "$new" | sed 's/^/fuzz: crashing input: /'
      echo "hint: fix the parser, then commit the input under tests/fuzz/inputs/$t/ with a test in tests/fuzz/ (docs/fuzzing.md)"
    } >&2
    return 1
  fi
}

# Each input is written to a file (the parsers read files): on tmpfs where there is one.
scratch_base=${TMPDIR:-/tmp}
if [ -d /dev/shm ] && [ -w /dev/shm ]; then scratch_base=/dev/shm; fi
# Targets run side by side, one per core (each libFuzzer process is single-threaded;
# DFLASH_FUZZ_JOBS=N sets the count): every target still gets its full `--seconds`.
# Rows are printed in target order once all have finished.
jobs=${DFLASH_FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)}
case "$jobs" in ''|*[!0-9]*|0) echo "fuzz: DFLASH_FUZZ_JOBS must be a positive integer, got \`$jobs\`" >&2; exit 2 ;; esac
rows=$(mktemp -d)
pids=()
for i in "${!targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  # in an `if`, as the sequential `run_target || status=1` was: `set -e` stays off inside it
  ( if run_target "${targets[$i]}" >"$rows/$i.row" 2>"$rows/$i.err"; then echo 0; else echo 1; fi >"$rows/$i.rc" ) &
  pids+=($!)
done
wait "${pids[@]}" || true
printf '%-16s %10s %9s %8s %8s %8s\n' target execs exec/s corpus crashes time
status=0
for i in "${!targets[@]}"; do
  cat "$rows/$i.row"
  cat "$rows/$i.err" >&2
  [ "$(cat "$rows/$i.rc" 2>/dev/null)" = 0 ] || status=1
done
rm -rf "$rows"
exit "$status"
