# kvbench: `make demo` and `make test` do all the set-up on a fresh machine (they create .venv when needed).
#
# .venv holds exactly the versions the suite last passed with: torch as TORCH_SPEC pins it, then every other package
# from requirements.lock (made by `make lock`; docs/development.md says when). pip takes a local CPU wheel of torch
# where one is configured (CI) and PyPI's default build elsewhere; choose another build with e.g.
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TEST_WORKERS ?= 2
LOCK := requirements.lock
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvbench-installed

.PHONY: install lock test test-all test-compat verify lint format demo bench-quick bench-gpu zoo zoo-tp zoo-diff clean

# The lock's packages without resolving anything (--no-deps: the lock is the resolution), then kvbench itself.
$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q --no-deps -r $(LOCK)
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# requirements.lock afresh from pyproject.toml's ranges (kvbench's dependencies and its dev extras), for every Python
# kvbench supports and every platform, with uv's resolver; torch (installed by TORCH_SPEC) and the CUDA packages of
# PyPI's torch build are left out, the rest resolved against TORCH_SPEC's torch.
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(BIN)/python -m uv pip compile pyproject.toml --extra dev --universal --python-version 3.10 --no-annotate \
		--no-emit-package torch -c $(VENV)/torch-constraint.txt --custom-compile-command "make lock" \
		-o $(VENV)/lock.txt -q
	grep -vE '^(nvidia-|cuda-|triton)' $(VENV)/lock.txt > $(LOCK)

# The default tier (every test not marked slow) on pytest-xdist workers, each test module whole on one worker.
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadscope

# Both tiers: the default one and the slow one (wheel build, zoo.py, gpu_check.sh, compiled steps, fresh Pythons).
test-all: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope

# The tests that read transformers, and verify with verify --hf on a tiny Llama, at the lowest transformers
# pyproject.toml declares and at the newest on PyPI, each in a venv of its own (.venv-compat-*): a release after the
# locked one is a report (its changed facts are skips naming them), not a red suite. Not in CI: it reaches PyPI for
# whatever is newest. Other releases: bash scripts/compat.sh 5.20.2 newest
test-compat: $(STAMP)
	TORCH_SPEC="$(TORCH_SPEC)" PYTHON=$(PYTHON) bash scripts/compat.sh lowest newest

# What a project's CI runs: every registered cache proven exact on the CPU (gpt2 architecture, random weights).
verify: $(STAMP)
	$(BIN)/kvbench verify --weights random --device cpu

# ruff's lint and format checks, and mypy over src/ (its settings in pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests scripts
	$(BIN)/ruff check --fix src tests scripts

# A short tour on the default device (about 3 minutes on a 2-core CPU once .venv exists): generate, verify, break, a small bench
# and the memory planner. Real GPT-2 when the hub (or its local cache) is reachable; clearly labelled random weights
# otherwise. The bench lands in results/<timestamp>-bench/ (summary.csv, steps.csv, meta.json, two plots).
# The demo's model: gpt2 when its weights are in the local Hugging Face cache or the hub answers, else the bundled
# gpt2-shakespeare (kvbench.model.weights.demo_model), sampled from a Shakespearean prompt (and break's greedy run
# given a line to continue: a model this small repeats a speaker's name from "ROMEO:" alone); never random weights.
# DEMO_MODEL=NAME chooses one.
demo: $(STAMP)
	$(eval DEMO_MODEL ?= $(shell $(BIN)/python -c "from kvbench.model.weights import demo_model; print(demo_model())"))
	$(eval SHAKESPEARE := $(filter gpt2-shakespeare,$(DEMO_MODEL)))
	$(eval DEMO_PROMPT := $(if $(SHAKESPEARE),ROMEO:,The key to fast inference is))
	@echo "demo model: $(DEMO_MODEL)$(if $(SHAKESPEARE), (the small GPT-2 trained on Shakespeare that ships with \
	kvbench: GPT-2's weights are neither cached nor reachable))"
	$(BIN)/kvbench generate "$(DEMO_PROMPT)" --model $(DEMO_MODEL) --new-tokens 40 --cache static \
		$(if $(SHAKESPEARE),--temperature 0.8 --top-k 40 --seed 1)
	$(BIN)/kvbench verify --model $(DEMO_MODEL) --caches dynamic,static,paged --new-tokens 40 --text none
	$(BIN)/kvbench break position --model $(DEMO_MODEL) --new-tokens 24 \
		$(if $(SHAKESPEARE),--prompt "$$(printf 'JULIET:\nWhat')")
	$(BIN)/kvbench bench --model $(DEMO_MODEL) --prompt-len 256 --new-tokens 24 --caches none,dynamic,static \
		--engine kvbench,hf --repeats 1 --warmup 1
	$(BIN)/kvbench memory --model llama-3-8b --ctx 8k,128k

# verify --hf on every causal-LM type transformers has, each as a tiny random config (about 30 minutes on a 2-core
# CPU), afresh: results/zoo/zoo.csv (a row per type as it finishes) and summary.md (docs/zoo.md). An interrupted
# sweep resumes with the same command without --fresh.
zoo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/zoo.py --out results/zoo --new-tokens 32 --fresh

# verify --hf --tp 2 on every causal-LM type with a tensor-parallel plan, each saved, then split over two ranks (over
# two hours on a 2-core CPU), afresh: results/zoo-tp/zoo.csv and summary.md (docs/zoo-tp.md). An interrupted sweep
# resumes with the same command without --fresh.
zoo-tp: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python scripts/zoo.py --tp 2 --out results/zoo-tp --new-tokens 32 --fresh

# The rows of a sweep (SWEEP: its folder, with zoo.csv) that moved against the committed results/zoo/zoo.csv, each
# classed from results/zoo/triage.toml; writes SWEEP/diff.md, exits 1 while a moved row is untriaged (docs/zoo.md).
SWEEP ?= /tmp/zoo-next
zoo-diff: $(STAMP)
	$(BIN)/python scripts/zoo.py --baseline results/zoo/zoo.csv --out $(SWEEP)

bench-quick: $(STAMP)
	$(BIN)/kvbench bench --config configs/bench/quick.toml

# On a GPU machine with the packages already installed and nothing installable: run from the source tree. The seed's
# table, verify on CUDA, the compiled step and gpt2-xl inside 6.5 minutes, into $OUT or results/<timestamp>-gpu/
# (docs/performance.md). `scripts/gpu_check.sh --device cpu` checks the same stages on a CPU in under a minute.
bench-gpu:
	PYTHONPATH=src bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
