#!/usr/bin/env bash
# Create (or reuse) the Python environment for this checkout at .venv.
#
# Heavy dependencies (torch and friends) live in a shared environment outside
# the checkout, keyed by the hash of requirements/lock.txt, requirements/nodeps.txt
# and the interpreter version, so a fresh clone (CI) reuses the torch install
# instead of unpacking it again. The checkout's own .venv is a small venv that
# sees the shared site-packages through a .pth file; this package and the Rust
# binaries are installed into .venv only, so two checkouts never overwrite each
# other. A .venv made by hand (without our marker) is used as it is.
#
# Environment variables:
#   DFLASH_ENV_ROOT  where keyed shared environments live (default: ~/.cache/dflash-worker/envs)
#   PYTHON           interpreter to build environments from (default: python3)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

python=${PYTHON:-python3}
lock=requirements/lock.txt
nodeps=requirements/nodeps.txt
marker=.venv/.dflash-shared-env

if [ -d .venv ] && [ ! -L .venv ] && [ ! -f "$marker" ]; then
  echo "setup-env: using the hand-made environment $root/.venv as it is" >&2
  exit 0
fi

pyver=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
key=$(cat "$lock" "$nodeps" | sha256sum | cut -c1-16)
env_root=${DFLASH_ENV_ROOT:-$HOME/.cache/dflash-worker/envs}
shared=$env_root/py$pyver-$key

if [ ! -f "$shared/.complete" ]; then
  echo "setup-env: creating $shared (torch is a large download, a few GB, the first time)" >&2
  rm -rf "$shared"
  mkdir -p "$env_root"
  "$python" -m venv "$shared"
  "$shared/bin/python" -m pip install --disable-pip-version-check -q -r "$lock"
  # test oracles whose own pins would drag in other versions: installed without deps
  "$shared/bin/python" -m pip install --disable-pip-version-check -q --no-deps -r "$nodeps"
  touch "$shared/.complete"
fi

if [ -L .venv ] || [ ! -f "$marker" ] || [ "$(cat "$marker")" != "$shared" ]; then
  rm -rf .venv
  "$shared/bin/python" -c 'import sys; sys.exit(0)'
  # No pip of its own (ensurepip took 7 s a checkout here): pip, like everything else, comes from
  # the shared environment through the .pth file below, and installs into .venv when run by
  # .venv/bin/python (as maturin develop runs it).
  "$python" -m venv --without-pip .venv
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  shared_site=$("$shared/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$shared_site" > "$site/_dflash_shared_env.pth"
  echo "$shared" > "$marker"
  # A new .venv is a new checkout (or a reset one): date its unmodified Rust sources back, so
  # that cargo reuses the shared build of the same sources (scripts/cargo-env.py says why this
  # is safe: the hash of the sources is in the crates' build fingerprint).
  "$python" scripts/cargo-env.py settle
fi
echo "setup-env: .venv overlays $shared" >&2
