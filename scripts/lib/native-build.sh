# shellcheck shell=bash
# Sourced by scripts/build-native-linux.sh and scripts/build-native-silicon.sh,
# which define `die` and `log`.

# verify_noop_job NATIVE_CLIENT: run a `noop` job with nothing in the
# environment but PATH (so the binary finds Python, its packages and torch on
# its own); sets `version` to the client's `--version` line.
verify_noop_job() {
  local nc=$1
  job=$(mktemp -d)  # global: the EXIT trap removes it
  trap 'rm -rf "$job"' EXIT
  printf '%s\n' '{"schema_version": 1, "spec": {"stages": ["noop"], "noop": {"steps": 2, "step_seconds": 0}}}' >"$job/spec.json"
  if ! env -i PATH=/usr/bin:/bin "$nc" --job-dir "$job" >"$job/events.jsonl" 2>"$job/stderr.log"; then
    cat "$job/stderr.log" >&2
    die "\`env -i PATH=/usr/bin:/bin $nc --job-dir DIR\` did not run the noop job"
  fi
  grep -q '"event": *"done"' "$job/events.jsonl" || die "the noop job ended without a \`done\` event"
  version=$(env -i PATH=/usr/bin:/bin "$nc" --version)
  log "verified: $version runs a noop job with an empty environment"
}
