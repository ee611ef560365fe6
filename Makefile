# Every target creates .venv and installs the project into it when needed.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CONFIG  ?= configs/default.yaml
NPROC   ?= 2
RUN_DIR ?= runs/default

.PHONY: install train test test-fast lint tensorboard bench bench-quick bench-qm9 bench-toy bench-strategies doctor clean

# Ranges in pyproject.toml, exact versions from constraints.txt (what CI tests); the qm9 and slurm extras are
# installed too, since the tests cover the QM9 data, the Slurm launcher, the timm backbone, the trackers,
# PEFT adapters and the HF datasets / WebDataset sources.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -c constraints.txt -e '.[dev,qm9,nash,slurm,vision,trackers,peft,data]'
	touch $(STAMP)

install: $(STAMP)

# The main job: NPROC processes on this machine (gloo on CPU, nccl on GPU, chosen automatically). MTL_MAKE_TARGET tells
# the launcher to word its hints as make train ARGS="..." (e.g. a re-run on a folder with checkpoints).
train: $(STAMP)
	MTL_MAKE_TARGET=train $(BIN)/python -m mtl.tools.launch --standalone --nproc_per_node=$(NPROC) train.py --config $(CONFIG) $(ARGS)

# The whole suite (what CI runs; it must stay under 30 min on 2 cores): the in-process tests spread over 2 workers
# (as test-fast), then the slow tier one test at a time (its tests start processes of their own, and some of them
# kill, stop or time processes), with the 25 slowest listed. Both tiers run; the target fails if either does.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n 2 $(PYTEST_ARGS); fast=$$?; \
	$(BIN)/python -m pytest -q -m slow --durations=25 $(PYTEST_ARGS); slow=$$?; \
	case "$$fast$$slow" in 00|05|50) ;; *) exit 1;; esac  # 5: a PYTEST_ARGS selection with no test in that tier

# The fast tier for forkers: in-process tests only (no multi-process runs, no tests of torch itself),
# spread over 2 workers (pytest-xdist).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n 2 $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check mtl tests train.py

tensorboard: $(STAMP)
	$(BIN)/tensorboard --logdir $(RUN_DIR)/tb --host 127.0.0.1

# The weighting benchmark: the full CPU sweep (sized for 60 min on 2 cores), and its quick preset (minutes; or
# make bench ARGS="--preset quick"). docs/benchmark.md
bench: $(STAMP)
	$(BIN)/python -m mtl.tools.bench $(ARGS)

bench-quick: $(STAMP)
	$(BIN)/python -m mtl.tools.bench --preset quick $(ARGS)

# The weighting benchmark on QM9, reduced to this CPU (configs/bench_qm9_cpu.yaml; the install step above brings the
# qm9 extra). The papers' protocol, for GPUs: python -m mtl.tools.bench --preset qm9. docs/benchmark.md
bench-qm9: $(STAMP)
	$(BIN)/python -m mtl.tools.bench --preset qm9_cpu $(ARGS)

# The papers' toy problem at CAGrad's setting (Fig. 1: lr 1e-3, 100,000 steps, its three starts; ARGS=--quick or --variant nashmtl), into runs/toy/
bench-toy: $(STAMP)
	$(BIN)/python -m mtl.tools.bench.toy --jobs 2 --out runs/toy $(ARGS)

bench-strategies: $(STAMP)
	$(BIN)/python -m mtl.tools.bench.strategies --config $(CONFIG) --write docs/strategies.md $(ARGS)

doctor: $(STAMP)
	$(BIN)/python -m mtl.tools.doctor --config $(CONFIG) $(ARGS)

clean:
	rm -rf runs .pytest_cache
