#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (see README, "GPU checks"):
# the GPU test tier and the RA2P micro-benchmark at the paper's size. Expects megatron-core's
# wheel for that machine's Python in .whl/ (that machine has torch and transformers but no
# registry access); writes logs and the benchmark JSON under ${OUT:-gpu_out}.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, megatron.core, transformers; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -rs -m gpu tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/ra2p_microbench.py --device cuda --model-size 1.5b --mb-tokens 8192 \
    --warmup 1 --steps ${BENCH_STEPS:-3} --out "$OUT/ra2p_microbench_cuda.json" 2>&1 | tee "$OUT/ra2p_microbench_cuda.log"
