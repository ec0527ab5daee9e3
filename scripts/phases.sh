#!/usr/bin/env bash
# Run `make` targets one after another and time each: what `make test` uses to print where its
# time went. The times accumulate in $DFLASH_PHASE_TIMES (default .phase-times.tsv at the root,
# git-ignored) from `--reset` on; the table is printed after the last target, or after the
# first one that fails (whose exit code is then this script's).
#
#   scripts/phases.sh --reset            start a new table
#   scripts/phases.sh TARGET...          run and time each target, stop at the first failure
#   scripts/phases.sh --report           print the table (phase, seconds, exit code, total wall)
#
# Each phase also records how busy the machine's CPUs were during it (Linux: /proc/stat, all
# cores, all processes): a phase well under 100% waits more than it computes.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
file=${DFLASH_PHASE_TIMES:-$root/.phase-times.tsv}

# "busy idle" jiffies of all CPUs since boot; empty where /proc/stat is missing
cpu_ticks() {
  local _cpu u n s i w q sq st _rest
  [ -r /proc/stat ] || return 0
  read -r _cpu u n s i w q sq st _rest < /proc/stat
  echo "$((u + n + s + q + sq + st)) $((i + w))"
}

report() {
  [ -f "$file" ] || return 0
  local start now
  start=$(cat "$file.start" 2>/dev/null || echo "$EPOCHREALTIME")
  now=$EPOCHREALTIME
  echo "phase times:"
  awk -F'\t' -v wall="$(awk -v a="$start" -v b="$now" 'BEGIN { printf "%.1f", b - a }')" '
    { printf "  %-14s %8.1f s%s%s\n", $1, $2, ($4 == "" ? "" : sprintf("   cpu busy %3d%%", $4)), ($3 == 0 ? "" : "  (exit " $3 ")"); sum += $2 }
    END { printf "  %-14s %8.1f s\n  %-14s %8.1f s (%.1f min)\n", "phases", sum, "wall", wall, wall / 60 }' "$file"
}

# CPU seconds of a fixed pure-Python loop (the best of 5): how fast this machine runs now. A shared VM's speed drifts
# (one here ran the same tests in 1.5-2.2 times the CPU seconds hours apart), so runs are compared
# by their wall times only next to this figure, taken at the start and at the end of a run.
calibrate() {
  command -v python3 >/dev/null || return 0
  python3 -c 'import time
best = None
for _ in range(5):
    t = time.process_time()
    s = 0
    for i in range(1_000_000):
        s += i * i
    dt = time.process_time() - t
    best = dt if best is None else min(best, dt)
print(f"{best:.3f}")' 2>/dev/null
}

case "${1:-}" in
  --reset) : > "$file"; echo "$EPOCHREALTIME" > "$file.start"; calibrate > "$file.calibration"; exit 0 ;;
  --report)
    report
    [ -s "$file.calibration" ] && echo "  calibration    $(cat "$file.calibration") CPU s at the start, $(calibrate) at the end (the best of 5 runs of a fixed pure-Python loop: compare runs by it)"
    exit 0 ;;
  "" | -h | --help) sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
esac

for target in "$@"; do
  t0=$EPOCHREALTIME
  c0=$(cpu_ticks)
  make --no-print-directory "$target"
  rc=$?
  c1=$(cpu_ticks)
  awk -v t="$target" -v a="$t0" -v b="$EPOCHREALTIME" -v rc="$rc" -v c0="$c0" -v c1="$c1" 'BEGIN {
    busy = ""
    if (c0 != "" && c1 != "") {
      split(c0, x, " "); split(c1, y, " ")
      d = (y[1] - x[1]) + (y[2] - x[2])
      if (d > 0) busy = int(100 * (y[1] - x[1]) / d + 0.5)
    }
    printf "%s\t%.1f\t%d\t%s\n", t, b - a, rc, busy }' >> "$file"
  if [ "$rc" -ne 0 ]; then
    report
    exit "$rc"
  fi
done
