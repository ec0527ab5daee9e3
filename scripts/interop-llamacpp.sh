#!/usr/bin/env bash
# `make interop-llamacpp`: llama.cpp's own converter turns the project's exports into GGUF (tests/interop_llamacpp).
#
# llama.cpp comes from PyPI: the llama-cpp-python 0.3.36 sdist vendors llama.cpp (commit 0c1e570) with DFlash and
# DFlash2 support: the converter (convert_hf_to_gguf.py, conversion/qwen.py) and the runtime (src/models/dflash.cpp,
# `--spec-type draft-dflash`). The sdist is downloaded with pip and unpacked, not installed (installing it would build
# the whole library for the Python bindings). The environment (requirements/interop-llamacpp.txt, `--no-deps`) adds
# cmake, ninja and PyPI's gguf to the project's torch and transformers (a .pth naming the project environment's
# site-packages). It is built once under ~/.cache/dflash-worker/interop/llamacpp-0.3.36 (DFLASH_INTEROP_DIR moves the
# parent) and rebuilt when the requirements file or the project environment changes (their sha256 is stamped in it).
#
# Running a draft needs llama.cpp built: the script builds `llama-speculative-simple` (ggml, llama, common) with
# cmake + ninja, nice'd, on 2 jobs, for at most DFLASH_LLAMACPP_BUILD_SECONDS (default 900; 0 skips it). Ninja keeps
# what it compiled, so a later run goes on where this one stopped. What the build reached is written to
# build-status.json in the environment, and the tests report it.
# The tests, and the exports they convert (tiny world, `dflash-worker train`, `dflash-worker export`), run in the
# project's own environment (.venv); llama.cpp's environment is passed as DFLASH_LLAMACPP_PYTHON and its sources as
# DFLASH_LLAMACPP_DIR. Arguments go to pytest (e.g. `-k renamed`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -x .venv/bin/python ] || scripts/setup-env.sh
LLAMA_CPP_PYTHON_VERSION=0.3.36
requirements=$root/requirements/interop-llamacpp.txt
env_dir=${DFLASH_INTEROP_DIR:-$HOME/.cache/dflash-worker/interop}/llamacpp-$LLAMA_CPP_PYTHON_VERSION
python=${PYTHON:-python3}
project_site=$(.venv/bin/python -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
key=$( { cat "$requirements"; echo "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"; echo "$project_site"; } | sha256sum | cut -d' ' -f1)
stamp=$env_dir/.dflash-requirements-sha256
llama_cpp=$env_dir/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp

if [ "$(cat "$stamp" 2>/dev/null || true)" != "$key" ]; then
  log=$env_dir.log
  echo "interop-llamacpp: building $env_dir (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sources, cmake, ninja; log: $log)" >&2
  mkdir -p "$(dirname "$env_dir")"
  rm -rf "$env_dir"
  if ! {
    "$python" -m venv "$env_dir"
    "$env_dir/bin/python" -m pip install --disable-pip-version-check --no-deps -r "$requirements"
    site=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$project_site" >"$site/zz-dflash-project.pth"
    # the sdist only; `--no-binary` for it alone, so pip fetches its build backend as wheels to read its metadata
    "$env_dir/bin/python" -m pip download --disable-pip-version-check --no-deps \
      --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$env_dir/sdist"
    mkdir -p "$env_dir/src"
    tar -xzf "$env_dir/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$env_dir/src"
    test -f "$llama_cpp/convert_hf_to_gguf.py"
  } >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "interop-llamacpp: building the environment failed (log: $log)" >&2
    exit 1
  fi
  echo "$key" >"$stamp"
fi

# Build llama-speculative-simple, within the time limit; record how far it got.
build=$env_dir/build
build_log=$env_dir/build.log
status=$env_dir/build-status.json
limit=${DFLASH_LLAMACPP_BUILD_SECONDS:-900}
binary=$build/bin/llama-speculative-simple
if [ ! -x "$binary" ] && [ "$limit" -gt 0 ]; then
  echo "interop-llamacpp: building llama.cpp's llama-speculative-simple (nice, 2 jobs, at most ${limit}s; log: $build_log)" >&2
  start=$(date +%s)
  rc=0
  {
    PATH=$env_dir/bin:$PATH nice -n 19 cmake -S "$llama_cpp" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DGGML_OPENMP=OFF
    PATH=$env_dir/bin:$PATH timeout "$limit" nice -n 19 cmake --build "$build" --target llama-speculative-simple -j 2
  } >>"$build_log" 2>&1 || rc=$?
  seconds=$(( $(date +%s) - start ))
  last=$(grep -o '^\[[0-9]*/[0-9]*\]' "$build_log" | tail -n 1 || true)
  printf '{"built": %s, "exit": %d, "seconds": %d, "limit_s": %d, "cores": %d, "last_step": "%s", "log": "%s"}\n' \
    "$([ -x "$binary" ] && echo true || echo false)" "$rc" "$seconds" "$limit" "$(nproc)" "$last" "$build_log" >"$status"
elif [ -x "$binary" ]; then
  printf '{"built": true, "binary": "%s"}\n' "$binary" >"$status"
else
  printf '{"built": false, "skipped": "DFLASH_LLAMACPP_BUILD_SECONDS=0"}\n' >"$status"
fi
echo "interop-llamacpp: build status: $(cat "$status")" >&2

export DFLASH_LLAMACPP_PYTHON=$env_dir/bin/python DFLASH_LLAMACPP_DIR=$llama_cpp DFLASH_LLAMACPP_BUILD_STATUS=$status
# tests/conftest.py (the main suite's hooks, which leave this folder out) is not loaded: --confcutdir.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} \
  exec .venv/bin/python -m pytest -p no:cacheprovider -p no:xdist --confcutdir tests/interop_llamacpp \
  --basetemp "${TMPDIR:-/tmp}/dflash-interop-llamacpp-$(id -u)" -v -rA tests/interop_llamacpp "$@"
