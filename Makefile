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
# The interpreter pyo3 builds against: the shared environment's (scripts/setup-env.sh), whose path
# is the same in every clone, so a fresh clone does not rebuild pyo3 (its build script reruns when
# PYO3_PYTHON changes); the same CPython as .venv's. A hand-made .venv is used as it is.
# `|| true`: .SHELLFLAGS has -e, under which a failed `cat` in the assignment would end the snippet
# with no output. (Each phase of `test` is its own `make` run, so PYO3_PY is asked after `install`.)
PYO3_SH = p="$$(cat $(VENV)/.dflash-shared-env 2>/dev/null || true)/bin/python"; if [ -x "$$p" ]; then echo "$$p"; else echo "$(abspath $(PY))"; fi
PYO3_PY = $(shell $(PYO3_SH))

.PHONY: install demo test lint test-python test-rust fuzz proto lock bench-effectiveness docker-image-cpu

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
# pytest, even at nice 19, slowed pytest by far more than it saved (docs/testing.md: a clean clone
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

# Lint gates (CI runs them through `make test`): ruff with the config in pyproject.toml; no class
# over 400 lines in the coordinator (scripts/check-structure.py); no module import cycle in the
# run-manager (scripts/check-import-cycles.py); rustfmt, and clippy with the workspace's lint
# levels ([workspace.lints]) as errors.
# `rustup component add` is a quick no-op when both are installed (a fresh CI machine may lack them).
lint:
	$$(cat $(VENV)/.dflash-shared-env)/bin/ruff check --no-cache .
	$(PY) scripts/check-structure.py
	$(PY) scripts/check-import-cycles.py run-manager/src
	@if command -v rustup >/dev/null; then rustup --quiet component add rustfmt clippy; fi
	cargo fmt --all --check
	PYO3_PYTHON=$(PYO3_PY) cargo clippy --workspace --all-targets --locked -- -D warnings

test-python:
	@scripts/run-pytest.sh $(PYTEST_ARGS)

test-rust:
	PYO3_PYTHON=$(PYO3_PY) cargo test --workspace --locked

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
