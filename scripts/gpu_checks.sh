#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (see README, "GPU checks"):
# the weight sync between two processes in buckets (benchmarks/gpu_weight_sync.py), the trainer's
# step at 1.5B (benchmarks/gpu_trainer.py) and the GPU test tier; CHECKS picks some of them
# (default "sync trainer tests"; "ra2p" adds the RA2P micro-benchmark at the paper's size).
# That machine has torch and transformers but no registry access: the wheels of megatron-core,
# hydra-core, omegaconf and antlr4-python3-runtime for its Python travel in .whl/ (README).
# Writes logs and each benchmark's JSON under ${OUT:-gpu_out}; BENCH_COMMIT (the commit of the
# clean tree the machine was given) goes into each result, since its copy's .git may be older.
set -uo pipefail
OUT=${OUT:-gpu_out}
CHECKS=${CHECKS:-sync trainer tests}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch, megatron.core, transformers; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
rc=0
run() {  # NAME TIMEOUT COMMAND...: one check, its log under $OUT; a failure is remembered
    local name=$1 limit=$2; shift 2
    case " $CHECKS " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name" | tee -a "$OUT/gpu.txt"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    echo "== $name exit $status" | tee -a "$OUT/gpu.txt"
    [ "$status" -eq 0 ] || rc=1
}
run sync 150 python3 benchmarks/gpu_weight_sync.py --timeout-s 60 --out "$OUT/gpu_weight_sync.json"
run trainer 420 python3 benchmarks/gpu_trainer.py --out "$OUT/gpu_trainer.json"
run tests 180 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu
# Two of the four regimes by default (each regime runs five executors, ~40 s each at 1.5B);
# RA2P_REGIMES=high_ras_short_tprm,high_ras_long_tprm,low_ras_short_tprm,low_ras_long_tprm for all.
run ra2p "${BENCH_TIMEOUT:-560}" python3 benchmarks/ra2p_microbench.py --device cuda --model-size 1.5b --mb-tokens 8192 \
    --warmup 1 --steps "${BENCH_STEPS:-2}" --regimes "${RA2P_REGIMES:-high_ras_short_tprm,low_ras_long_tprm}" \
    --out "$OUT/ra2p_microbench_cuda.json"
exit $rc
