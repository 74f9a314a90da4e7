# The two commands of the README. Both install what they need into the venv first
# ($(TIDE_VENV), .venv by default; CI points it at a fresh temporary folder).
TIDE_VENV ?= .venv
export TIDE_VENV
PY := $(TIDE_VENV)/bin/python
export OMP_NUM_THREADS := 1

.PHONY: setup tiny test test-fast

setup:
	bash scripts/setup_env.sh

# The tiny CPU recipe end to end in TIDE mode (CTB, RA2P): random tiny Qwen2 model, real SGLang +
# Megatron-core, 2 ranks.
tiny: setup
	$(PY) launch/torchrun.py --nproc-per-node 2 launch/train.py +recipe=tiny_cpu scheduler.mode=tide

# Every test tier that runs here (GPU tests skip with a reason when CUDA is absent).
test: setup
	$(PY) -m pytest -q --durations=15 tests

# Pure-Python and fast CPU tests only.
test-fast: setup
	$(PY) -m pytest -q -m "not integration" tests
