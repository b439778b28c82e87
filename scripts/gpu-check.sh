#!/usr/bin/env bash
# Every GPU check and figure on one CUDA host, in one go (README, "GPU"); logs and results in $OUT:
#   1. the fp16 graph added to the model repository, gated on this GPU (python -m minilm_embed.export.fp16)
#   2. the GPU tests (tests/test_gpu.py)
#   3. bench/bench_gpu.py: sentence-transformers fp16, the in-process ceiling, a profile, GPU memory
#      over 10k random batches, the gRPC server on CUDA with 1, 2, 4 and 8 fronts
#   4. with FRONT_BENCH=1: bench/bench_front.py's stand-in capacity with 1, 2, 4 and 8 fronts
# Environment: MODEL_DIR (build/model), DATA_DIR (the directory holding stsbenchmark/), OUT
# (build/bench/gpu), PYTHON (python3), BENCH_GPU_FLAGS (more flags for bench_gpu.py, e.g. a shorter
# run: "--skip memory --fronts 8 --seconds 3"). Each step has its own time limit and runs whatever the last did.
set -u -o pipefail
OUT=${OUT:-build/bench/gpu}
MODEL_DIR=${MODEL_DIR:-build/model}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
EMBED_MODEL_DIR=$(realpath "$MODEL_DIR")
export EMBED_MODEL_DIR
data=()
if [ -n "${DATA_DIR:-}" ]; then
    data=(--data-dir "$DATA_DIR")
    EMBED_DATA_DIR=$(realpath "$DATA_DIR")
    export EMBED_DATA_DIR
fi
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
lscpu >"$OUT/lscpu.txt" 2>&1
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40
    echo "== $name: exit ${PIPESTATUS[0]}"
}
step export-fp16 300 "$PY" -m minilm_embed.export.fp16 --model-dir "$MODEL_DIR" "${data[@]}"
step test-gpu 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py
read -r -a bench_flags <<<"${BENCH_GPU_FLAGS:-}"
step bench-gpu "${BENCH_GPU_LIMIT:-450}" "$PY" bench/bench_gpu.py --model-dir "$MODEL_DIR" "${data[@]}" --out "$OUT" \
    "${bench_flags[@]}"
if [ "${FRONT_BENCH:-0}" = 1 ]; then
    step bench-front 300 "$PY" bench/bench_front.py --model-dir "$MODEL_DIR" "${data[@]}" --skip-real-model \
        --fronts 1,2,4,8 --load-processes 4 --seconds 4 --repeats 1 --out "$OUT/front.json"
fi
