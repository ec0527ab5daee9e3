#!/usr/bin/env bash
# Build the CPU flavor of the worker image (docker/Dockerfile, FLAVOR=cpu) offline,
# for CPU machines and CI (the Docker-mode e2e tests: tests/e2e/test_e2e_docker.py).
#
#   1. a Docker engine (scripts/ensure-docker.sh; exit 3 when none can be had here, 4 when
#      starting one failed where it should not have);
#   2. the base: a Debian bookworm root filesystem made with `mmdebstrap` (installed with
#      apt-get when missing) holding python3.11, then `docker import`ed as
#      dflash-debian-base:bookworm-<hash of this script> (once; kept between runs);
#   3. the wheels of requirements/lock.txt, `pip download`ed on the host into
#      ~/.cache/dflash-worker/wheels/<lock hash>/ (once per lock);
#   4. the project wheel, `maturin build` on the host against Debian's /usr/bin/python3.11
#      (the base's interpreter: the native client embeds it), in its own cargo target
#      directory (so the checkout's `maturin develop` build is not rebuilt for another Python);
#   5. `docker build --network none` with a context of only the lock, the wheels and the
#      project wheel; the dependency layers are cached by content, so a code change
#      rebuilds only the last layer.
#
# Prints the image reference (dflash-worker-cpu:<hash of the lock and extra wheels>) on stdout, logs on stderr.
# Environment: DFLASH_CPU_IMAGE (the reference to build; default above), DFLASH_DOCKER
# (the docker CLI; one that can use BuildKit: `docker buildx` or a CLI before 23),
# CARGO_TARGET_DIR (the image's wheel is built in "$CARGO_TARGET_DIR-image").
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
log() { echo "build-cpu-image: $*" >&2; }
die() { log "$*"; exit "${2:-1}"; }

# Exit 3: no engine can be had here (callers skip); 4: one should have been and was not.
rc=0
scripts/ensure-docker.sh || rc=$?
[ "$rc" = 0 ] || exit "$rc"

# BuildKit is needed (it builds only the stages FLAVOR=cpu uses). The docker CLI since 23
# needs the buildx plugin for it; Debian's docker.io CLI (20.10) has BuildKit built in.
pick_docker() {
  local c
  for c in "${DFLASH_DOCKER:-docker}" /usr/bin/docker; do
    command -v "$c" >/dev/null 2>&1 || continue
    if "$c" buildx version >/dev/null 2>&1; then echo "$c"; return 0; fi
    local v
    v=$("$c" version --format '{{.Client.Version}}' 2>/dev/null || true)
    if [ -n "$v" ] && [ "${v%%.*}" -lt 23 ] 2>/dev/null; then echo "$c"; return 0; fi
  done
  return 1
}
docker=$(pick_docker) || die "no docker CLI here can build with BuildKit (no \`docker buildx\`, no CLI before 23)
hint: install the buildx plugin, or Debian's docker.io (its /usr/bin/docker has BuildKit built in)"
export DOCKER_BUILDKIT=1

cache=${DFLASH_CACHE_DIR:-$HOME/.cache/dflash-worker}
mkdir -p "$cache"
# One build at a time (`make test` starts one in the background and the tests ask again):
# the second waits for the first and then finds everything cached.
exec 9>"$cache/build-cpu-image.lock"
flock 9
lock=requirements/lock.txt
# The lock leaves out setuptools (pip-compile's "unsafe" packages), yet grpcio-tools requires
# setuptools>=77.0.1: installing from an index fetches the newest, offline it must be among the
# wheels. Pinned to the version `make install` resolved.
extra_wheels="setuptools==84.2.1"
lock_key=$( (cat "$lock"; echo "$extra_wheels") | sha256sum | cut -c1-16)
image=${DFLASH_CPU_IMAGE:-dflash-worker-cpu:$lock_key}
host_python=/usr/bin/python3.11

# ---- 2. the Debian base ------------------------------------------------------------
base_packages=python3.11,python3.11-venv,libpython3.11,ca-certificates
base_key=$(printf '%s\n' bookworm "$base_packages" | sha256sum | cut -c1-12)
base=dflash-debian-base:bookworm-$base_key
if ! "$docker" image inspect "$base" >/dev/null 2>&1; then
  if ! command -v mmdebstrap >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
      die "mmdebstrap is missing (hint: apt-get install mmdebstrap)"
    fi
    log "installing mmdebstrap (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >&2
  fi
  log "making the base root filesystem with mmdebstrap (bookworm, minbase + $base_packages)"
  t0=$(date +%s)
  # The tarball goes straight into `docker import`; apt's lists and caches are left out
  # (mmdebstrap expands "$1", the root directory, in the hook; hence the single quotes).
  # shellcheck disable=SC2016
  mmdebstrap --quiet --variant=minbase --include="$base_packages" \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
      bookworm - http://deb.debian.org/debian \
    | "$docker" import --change 'CMD ["/bin/bash"]' --message "mmdebstrap bookworm minbase + $base_packages" - "$base" >&2
  log "base $base imported in $(( $(date +%s) - t0 )) s"
fi

# ---- 3. the wheels -------------------------------------------------------------------
wheels=$cache/wheels/$lock_key
if [ ! -f "$wheels/.complete" ]; then
  [ -x "$host_python" ] || die "\`$host_python\` is missing: the wheels and the project wheel are made with Debian's Python 3.11 (hint: apt-get install python3.11-dev python3-pip)"
  log "downloading the wheels of $lock into $wheels (a few GB, once per lock)"
  rm -rf "$wheels.tmp" && mkdir -p "$wheels.tmp"
  "$host_python" -m pip download --disable-pip-version-check -q --no-deps --only-binary :all: \
      -r "$lock" -d "$wheels.tmp" >&2
  # shellcheck disable=SC2086  # a list of requirement specifiers
  "$host_python" -m pip download --disable-pip-version-check -q --no-deps --only-binary :all: \
      $extra_wheels -d "$wheels.tmp" >&2
  touch "$wheels.tmp/.complete"
  rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
fi

# ---- 4. the project wheel ------------------------------------------------------------
shared_env=$(cat .venv/.dflash-shared-env 2>/dev/null || true)
maturin=${shared_env:+$shared_env/bin/maturin}
[ -x "${maturin:-}" ] || maturin=$(command -v maturin || true)
[ -x "${maturin:-}" ] || die "maturin is missing (hint: \`make install\` first)"
ctx=$cache/docker-context/$lock_key
rm -rf "$ctx/project-wheel"
mkdir -p "$ctx/requirements" "$ctx/project-wheel"
log "building the project wheel against $host_python"
# The commit the binaries name and the hash of the Rust sources, as `make` sets them
# (scripts/cargo-env.py); a commit the caller names is kept.
DFLASH_RUST_SOURCES=$("$host_python" scripts/cargo-env.py hash) \
  DFLASH_GIT_COMMIT=${DFLASH_GIT_COMMIT:-$("$host_python" scripts/cargo-env.py commit)} \
  PYO3_PYTHON=$host_python CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/cargo-target}-image \
  "$maturin" build --locked --quiet --interpreter "$host_python" --out "$ctx/project-wheel" >&2

# ---- 5. the image --------------------------------------------------------------------
# The context: hard links (same file system) or copies of the wheels; nothing else of the checkout.
cp "$lock" "$ctx/requirements/lock.txt"
if [ ! -f "$ctx/wheels/.complete" ]; then
  rm -rf "$ctx/wheels"
  cp -al "$wheels" "$ctx/wheels" 2>/dev/null || cp -a "$wheels" "$ctx/wheels"
fi
log "docker build --network none -> $image"
t0=$(date +%s)
"$docker" build --network none -f docker/Dockerfile --build-arg FLAVOR=cpu --build-arg DEBIAN_IMAGE="$base" \
  --label dflash.lock="$lock_key" -t "$image" "$ctx" >&2
log "built $image in $(( $(date +%s) - t0 )) s"
# The image this one replaced (same tag, older project wheel) shares all but its last layers.
"$docker" image prune -f --filter label=dflash.lock >/dev/null || true
echo "$image"
