# `make demo`: set up and run the main job on the embedded default. `make test`: the test suite.
# Uses the active virtual environment if there is one, else creates .venv here.
VENV ?= .venv
ifdef VIRTUAL_ENV
BIN := $(VIRTUAL_ENV)/bin
else
BIN := $(VENV)/bin
endif
PY := $(BIN)/python
# Everything the demo writes is under DEMO_DIR (never configs/tiny.yaml's default runs/tiny, a user's folder):
# a re-run finds its run finished and evaluates and exports it again; `make clean` deletes DEMO_DIR only.
DEMO_DIR ?= runs/demo
DEMO_DATA ?= $(DEMO_DIR)/data
RUN ?= $(DEMO_DIR)/tiny
LAUNCH ?= launch/cpu-2proc.yaml
STAMP := $(BIN)/.mmcl-installed
DEV_STAMP := $(BIN)/.mmcl-dev-installed

.PHONY: install install-dev demo demo-data train-demo eval-demo export-demo lint test test-fast bench clean

# The demo needs mmcl and its runtime dependencies only; the tests add the development extras.
$(STAMP): pyproject.toml constraints.txt Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	@echo "installing mmcl and its dependencies (torch is large; a few minutes on a fresh machine)"
	$(PY) -m pip install --progress-bar on -c constraints.txt -e .
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --progress-bar on -c constraints.txt -e ".[dev]"
	@# libauc (the SogCLR/FastCLIP authors' library) is the tests' peer for loss.global_contrastive; only its loss
	@# module is used, so it goes in without the graph and medical-imaging packages it lists as requirements.
	$(PY) -m pip install --quiet --no-deps libauc==2.0.1
	@touch $(DEV_STAMP)

install: $(STAMP)

install-dev: $(DEV_STAMP)

demo-data: install
	$(BIN)/mmcl demo-data --out $(DEMO_DATA)

train-demo: demo-data
	$(BIN)/mmcl launch --config_file $(LAUNCH) -m mmcl train --config configs/tiny.yaml \
		data.batch_size=32 train.output_dir=$(RUN) \
		'data.train=$(DEMO_DATA)/train/shard-*.tar' eval.zeroshot=$(DEMO_DATA)/zeroshot/colour

eval-demo:
	$(BIN)/mmcl zeroshot --model $(RUN) --data $(DEMO_DATA)/zeroshot/colour --out $(DEMO_DIR)/zeroshot-colour.json
	$(BIN)/mmcl zeroshot --model $(RUN) --data $(DEMO_DATA)/zeroshot/shape --out $(DEMO_DIR)/zeroshot-shape.json

export-demo:
	$(BIN)/mmcl export --model $(RUN) --format open_clip --out $(DEMO_DIR)/export/open_clip
	$(BIN)/mmcl export --model $(RUN) --format safetensors --out $(DEMO_DIR)/export/safetensors

demo: train-demo
	$(MAKE) --no-print-directory eval-demo export-demo
	@$(PY) -c "import json; r=json.load(open('$(DEMO_DIR)/zeroshot-colour.json')); s=json.load(open('$(DEMO_DIR)/zeroshot-shape.json')); print(f\"demo done: zero-shot top-1 colour {100*r['metrics']['acc1']:.1f}%, shape {100*s['metrics']['acc1']:.1f}% (run: $(RUN))\")"

# Lint first (ruff, configured in pyproject.toml): seconds, and a failure names the line.
lint: install-dev
	$(BIN)/ruff check mmcl tests bench docs

# One pytest worker per core (pytest-xdist); a test file stays on one worker, so its module fixtures run once.
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile

test: lint
	$(PYTEST)

test-fast: lint
	$(PYTEST) -m "not slow"

bench: install-dev
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,bench]"
	$(PY) bench/bench_losses.py
	$(PY) bench/bench_data.py
	$(PY) bench/bench_train.py

clean:
	rm -rf $(DEMO_DIR) .pytest_cache
