#!/usr/bin/env bash
# `make interop-sglang`: SGLang's own DFlash config parser reads the project's exports (tests/interop_sglang).
#
# SGLang 0.5.23 does not install on a CPU-only machine with its requirements (they pin CUDA torch 2.14.1,
# flashinfer, sgl-kernel, ...), and its DFlash runs on CUDA, NPU or XPU only, so no server is started here.
# What runs is SGLang's own code that reads a draft's config: `get_config` and `parse_dflash_draft_config`.
# The environment is the sglang wheel plus the packages importing those modules needs, all `--no-deps`
# (requirements/interop-sglang.txt), on top of the project's torch and transformers (a .pth naming the
# project environment's site-packages, searched after SGLang's own). It is built once under
# ~/.cache/dflash-worker/interop/sglang-0.5.23 (DFLASH_INTEROP_DIR moves the parent) and rebuilt when the
# requirements file or the project environment changes (their sha256 is stamped in it).
# The tests themselves, and the exports they read (tiny world, `dflash-worker train`, `dflash-worker export`),
# run in the project's own environment (.venv); SGLang's interpreter is passed as DFLASH_SGLANG_PYTHON.
# Arguments go to pytest (e.g. `-k broken`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -x .venv/bin/python ] || scripts/setup-env.sh
SGLANG_VERSION=0.5.23
requirements=$root/requirements/interop-sglang.txt
env_dir=${DFLASH_INTEROP_DIR:-$HOME/.cache/dflash-worker/interop}/sglang-$SGLANG_VERSION
python=${PYTHON:-python3}
# the folder holding the project's torch (the shared environment .venv points at, or .venv itself)
project_site=$(.venv/bin/python -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
key=$( { cat "$requirements"; echo "$project_site"; } | sha256sum | cut -d' ' -f1)
stamp=$env_dir/.dflash-requirements-sha256

if [ "$(cat "$stamp" 2>/dev/null || true)" != "$key" ]; then
  log=$env_dir.log
  echo "interop-sglang: building $env_dir (sglang $SGLANG_VERSION, --no-deps; log: $log)" >&2
  mkdir -p "$(dirname "$env_dir")"
  rm -rf "$env_dir"
  if ! {
    "$python" -m venv "$env_dir"
    "$env_dir/bin/python" -m pip install --disable-pip-version-check --no-deps -r "$requirements"
    site=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$project_site" >"$site/zz-dflash-project.pth"
    "$env_dir/bin/python" -c 'import sglang.srt.speculative.dflash_utils, sglang.srt.utils.hf_transformers_utils'
  } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "interop-sglang: building the environment failed (log: $log)" >&2
    exit 1
  fi
  echo "$key" >"$stamp"
fi

export DFLASH_SGLANG_PYTHON=$env_dir/bin/python
# tests/conftest.py (the main suite's hooks, which leave this folder out) is not loaded: --confcutdir.
# -rA prints what each test printed (SGLang's reading beside the project's, field by field).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
  exec .venv/bin/python -m pytest -p no:cacheprovider -p no:xdist --confcutdir tests/interop_sglang \
  --basetemp "${TMPDIR:-/tmp}/dflash-interop-sglang-$(id -u)" -v -rA tests/interop_sglang "$@"
