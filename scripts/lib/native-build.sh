# shellcheck shell=bash
# What scripts/build-native-linux.sh and scripts/build-native-silicon.sh share;
# sourced after `set -euo pipefail`, with `root` set to the repository root.
# The steps speak through the scripts' globals: `parse_args` sets `python` and
# `out`; the script reads its Python's facts into `pyver`, `prefix`, `libdir`
# and `torch_version`; `build_release` sets `nc`, `verify_noop_job` `version`.

# Messages name the script: `build-native-linux: error: ...`.
_script=$(basename "$0" .sh)

die() {
  printf '%s: error: %s\n' "$_script" "$1" >&2
  [ -z "${2:-}" ] || printf 'hint: %s\n' "$2" >&2
  exit 1
}
log() { printf '%s: %s\n' "$_script" "$*" >&2; }

# parse_args ARG...: `--python PATH` and `--out DIR` (defaults: $PYTHON or
# .venv/bin/python, dist/native/); `--help` prints the script's leading comment.
parse_args() {
  python=${PYTHON:-$root/.venv/bin/python}
  out=$root/dist/native
  while [ $# -gt 0 ]; do
    case "$1" in
      --python) [ $# -ge 2 ] || die "\`--python\` needs a path"; python=$2; shift 2 ;;
      --out) [ $# -ge 2 ] || die "\`--out\` needs a directory"; out=$2; shift 2 ;;
      -h|--help) awk 'NR > 1 { if (!/^#/) exit; sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
      *) die "unknown argument \`$1\`" "see \`$0 --help\`" ;;
    esac
  done
}

# check_python: `python` must be executable; makes it an absolute path.
check_python() {
  [ -x "$python" ] || die "Python \`$python\` does not exist or is not executable" \
    "create the environment with \`make install\`, or pass \`--python PATH\`"
  python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
}

# build_release CARGO_ARG...: release-build run-manager, then the native client
# with `cargo CARGO_ARG...` (each platform links it its own way), both against
# `python`; copies both into `out` and sets `nc` to the native client there.
# (`prefix` is one of the facts the script read; see the top of this file.)
# shellcheck disable=SC2154
build_release() {
  cd "$root" || exit
  export PYO3_PYTHON=$python
  # The native client records the environment it was built against; option_env!
  # is tracked by cargo, so a different environment rebuilds only this binary.
  export DFLASH_BUILD_PYTHON_HOME=$prefix
  # The commit the binaries name and the hash of the Rust sources, as `make` sets them
  # (scripts/cargo-env.py); a commit the caller names is kept.
  DFLASH_RUST_SOURCES=$("$python" "$root/scripts/cargo-env.py" hash)
  DFLASH_GIT_COMMIT=${DFLASH_GIT_COMMIT:-$("$python" "$root/scripts/cargo-env.py" commit)}
  export DFLASH_RUST_SOURCES DFLASH_GIT_COMMIT
  log "cargo build --release (PYO3_PYTHON=$python)"
  cargo build --release --locked -p run-manager --bin run-manager
  cargo "$@"
  local target_dir=${CARGO_TARGET_DIR:-$root/target} bin
  mkdir -p "$out"
  for bin in dflash-native-client run-manager; do
    cp -f "$target_dir/release/$bin" "$out/$bin.tmp"
    mv -f "$out/$bin.tmp" "$out/$bin"
  done
  nc=$out/dflash-native-client
}

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

# write_build_info PLATFORM RPATHS [KEY=VALUE | KEY:bool=VALUE]...: write
# out/build-info.json with the facts every build records and the platform's
# own KEYs (a `:bool` value is true when it is `True`, Python's spelling).
# (`pyver`, `prefix`, `libdir` and `torch_version` are the script's facts.)
# shellcheck disable=SC2154
write_build_info() {
  local commit
  commit=$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  "$python" - "$out/build-info.json" "$version" "$commit" "$1" "$python" "$pyver" \
    "$prefix" "$libdir" "$torch_version" "$2" "${@:3}" <<'EOF'
import json, sys
out, version, commit, platform, python, pyver, home, libdir, torch_v, rpaths, *extra = sys.argv[1:]
info = {
    "native_client_version": version, "commit": commit, "platform": platform,
    "python": python, "python_version": pyver, "python_home": home, "python_libdir": libdir,
    "torch_version": torch_v, "rpaths": [p for p in rpaths.split(":") if p],
}
for item in extra:
    key, _, value = item.partition("=")
    if key.endswith(":bool"):
        info[key[: -len(":bool")]] = value == "True"
    else:
        info[key] = value
with open(out, "w") as f:
    json.dump(info, f, indent=2, sort_keys=True)
    f.write("\n")
EOF
  log "wrote $out/dflash-native-client, $out/run-manager and $out/build-info.json"
}
