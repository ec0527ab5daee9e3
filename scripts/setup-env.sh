#!/usr/bin/env bash
# Create (or reuse) the Python environment for this checkout and link it at .venv.
#
# The environment lives outside the checkout, in a directory keyed by the hash of
# requirements/lock.txt and the interpreter version, so a fresh clone (CI) reuses
# the large torch install instead of unpacking it again. A checkout whose .venv is
# a real directory (made by hand) is used as it is.
#
# Environment variables:
#   DFLASH_ENV_ROOT  where keyed environments live (default: ~/.cache/dflash-worker/envs)
#   PYTHON           interpreter to build the environment from (default: python3)
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

python=${PYTHON:-python3}
lock=requirements/lock.txt
nodeps=requirements/nodeps.txt

if [ -d .venv ] && [ ! -L .venv ]; then
  env_dir=.venv
else
  pyver=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
  key=$(cat "$lock" "$nodeps" | sha256sum | cut -c1-16)
  env_root=${DFLASH_ENV_ROOT:-$HOME/.cache/dflash-worker/envs}
  env_dir=$env_root/py$pyver-$key
  if [ ! -f "$env_dir/.complete" ]; then
    echo "setup-env: creating $env_dir (torch is a large download, a few GB, the first time)" >&2
    rm -rf "$env_dir"
    mkdir -p "$env_root"
    "$python" -m venv "$env_dir"
    "$env_dir/bin/pip" install --disable-pip-version-check -q -r "$lock"
    # test oracles whose own pins would drag in other versions: installed without deps
    "$env_dir/bin/pip" install --disable-pip-version-check -q --no-deps -r "$nodeps"
    touch "$env_dir/.complete"
  fi
  ln -sfn "$env_dir" .venv
fi
echo "setup-env: using $(readlink -f .venv)" >&2
