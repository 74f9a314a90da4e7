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

# The unit tier (pure-Python and fast CPU tests) runs in parallel on the host's cores
# (pytest-xdist, at most 4 workers). The integration tier runs two test files at a time (a file's
# tests stay on one worker and share its module fixtures): one at a time it kept 1.0 of 2 cores
# busy on average, its jobs waiting on env latency, heartbeats and engine start-up. Not more than
# two: the jobs' timeouts and heartbeats are sized for a loaded 2-core machine.
UNIT_TESTS := $(PY) -m pytest -q -n auto --maxprocesses 4 -m "not integration" tests
INTEGRATION_TESTS := $(PY) -m pytest -q -n auto --maxprocesses 2 --dist loadscope --durations=15 -m integration tests

# Every test tier that runs here (GPU tests skip with a reason when CUDA is absent): the unit
# tier, then the integration tier even when the first failed; fails when either did.
test: setup
	$(UNIT_TESTS); unit=$$?; \
	$(INTEGRATION_TESTS); integration=$$?; \
	exit $$(( unit || integration ))

# The unit tier only.
test-fast: setup
	$(UNIT_TESTS)
