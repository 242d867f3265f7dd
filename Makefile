# sglang-omni-flash: the two commands are `make serve` and `make test`; both do all set-up.
#
#   make serve [PORT=8000] [MODEL=base|tiny.en|DIR] [SPECULATIVE=auto|1|0] [DTYPE=auto|float32|bfloat16|float16]
#              [ARGS="extra sgl-omni serve flags"]
#              SPECULATIVE: auto (default) = Whisper-Flash when a shipped drafter fits MODEL, 1 = required, 0 = plain
#              DTYPE: auto (default) = bfloat16 on a CPU with AMX-BF16 or AVX512-BF16, else float32 (float16 on CUDA)
#   make test  [PYTEST_ARGS=...]
#
# Set-up (idempotent, fast when nothing changed): Debian packages from configs/apt.txt,
# .venv from the pinned lock (configs/requirements-*.lock, installed --no-deps because
# sglang 0.5.22 pins an sdist-only cuda-tile; see docs/install.md; with uv from PyPI and
# bytecode when it installs, 43 s instead of pip's 135 s for the 7.6 GB lock, else with pip), this package
# (editable), the embedded model(s) and the test audio in the user cache directory.

SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
PORT   ?= 8000
MODEL  ?= base
ARGS   ?=
SPECULATIVE ?= auto
DTYPE  ?= auto
PYTEST_ARGS ?=

# GPU machines get sglang's GPU kernels (flashinfer, ...); CPU machines the trimmed set.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
LOCK    := configs/requirements-cpu.lock
GPU_REQ := $(if $(HAS_GPU),configs/requirements-gpu.txt)
STAMP   := $(VENV)/.installed-$(if $(HAS_GPU),gpu,cpu)

.PHONY: setup apt venv serve test models test-audio clean-venv

setup: apt venv

apt:
	@missing=$$(for p in $$(grep -v '^\s*#' configs/apt.txt); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "[setup] installing Debian packages:" $$missing; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

venv: $(STAMP)

$(STAMP): $(LOCK) $(GPU_REQ) pyproject.toml setup.py
	@start=$$(date +%s); \
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV); \
	echo "[setup] installing $(LOCK) into $(VENV) (first time: a minute with uv, several without)"; \
	if $(BIN)/python -m pip install -q --disable-pip-version-check uv==0.13.9 2>&1 | sed "/^WARNING: Location/d" \
	   && $(BIN)/uv pip install -q --no-cache --compile-bytecode --python $(BIN)/python --no-deps -r $(LOCK); then :; \
	else echo "[setup] uv unavailable or failed: installing with pip"; \
	  $(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r $(LOCK) 2>&1 | sed "/^WARNING: Location/d" || exit 1; \
	fi; \
	if [ -n "$(GPU_REQ)" ]; then \
	  $(BIN)/python -m pip install -q --disable-pip-version-check -c $(LOCK) -r $(GPU_REQ) 2>&1 | sed "/^WARNING: Location/d" || exit 1; \
	fi; \
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | sed "/^WARNING: Location/d" || exit 1; \
	$(BIN)/python -c "import torch, transformers, sglang_omni_flash" || exit 1; \
	rm -f $(VENV)/.installed-*; touch $@; \
	echo "[setup] venv ready in $$(( $$(date +%s) - start )) s, $$(du -sh $(VENV) | cut -f1)"

models: setup
	@$(BIN)/whisper-flash models fetch base >/dev/null
	@$(BIN)/whisper-flash models fetch tiny.en >/dev/null

test-audio: setup
	@$(BIN)/whisper-flash corpus test-set >/dev/null

serve: setup
	@case "$(MODEL)" in base|tiny.en) $(BIN)/whisper-flash models fetch $(MODEL) >/dev/null ;; esac
	$(BIN)/whisper-flash serve --model $(MODEL) --port $(PORT) --dtype $(DTYPE) \
	  --speculative $(if $(filter 0 off no,$(SPECULATIVE)),off,$(if $(filter 1 on yes,$(SPECULATIVE)),on,auto)) -- $(ARGS)

test: setup models test-audio
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
