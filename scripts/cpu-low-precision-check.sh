#!/usr/bin/env bash
# Issue 15's figures (CPU low precision) on any host, e.g. a 2-vCPU one, or the GPU host, whose Xeon
# has AMX (amx_bf16, amx_int8, amx_tile in its `lscpu`) where the project's 2-vCPU machines are mostly
# AMD EPYC (one Xeon with AMX was measured so: docs/benchmarks.md). Everything runs pinned to CORES
# (two cores: the layout of the project's other low-precision figures, docs/benchmarks.md), so each
# ratio is within one run on the same cores:
#   1. bench/bench_model.py: fp32 and int8 in process, sentence-transformers fp32 and bf16, the
#      matmul peaks, each row's share of its precision's peak, and each graph's one-thread profile;
#   2. bench/bench_server.py --low-precision: int8 served beside fp32 served, against
#      sentence-transformers fp32 and bf16 in the same run.
# On the GPU host: `bash scripts/gpu-device.sh scripts/cpu-low-precision-check.sh` (after the
# payload's parts, README "GPU"). Environment: MODEL_DIR (build/model; the int8 graph needs a model
# built with a data directory), DATA_DIR (the directory holding stsbenchmark/), OUT
# (build/bench/low-precision), PYTHON (python3), CORES (0,1), REPEATS (2), LEVEL_SECONDS (4, per served level).
# Writes at most 5 files to OUT (the device tool brings back 8).
set -u -o pipefail
OUT=${OUT:-build/bench/low-precision}
MODEL_DIR=${MODEL_DIR:-build/model}
PY=${PYTHON:-python3}
CORES=${CORES:-0,1}
mkdir -p "$OUT"
EMBED_MODEL_DIR=$(realpath "$MODEL_DIR")
export EMBED_MODEL_DIR
data=()
if [ -n "${DATA_DIR:-}" ]; then data=(--data-dir "$DATA_DIR"); fi
lscpu >"$OUT/lscpu.txt" 2>&1
grep -o -w -E 'amx_(bf16|int8|tile)|avx512_vnni|avx512_bf16' "$OUT/lscpu.txt" | sort -u | tr '\n' ' '
echo "(pinned to cores $CORES)"
if ! grep -q '"precision": "int8"' "$MODEL_DIR/manifest.json"; then
    echo "cpu-low-precision-check: $MODEL_DIR has no int8 graph (make model with DATA_DIR set builds one)" >&2
    exit 2
fi
# taskset without util-linux: the command, on CORES ("0,1"), children included.
pin='import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")}); os.execvp(sys.argv[2], sys.argv[2:])'
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$PY" -c "$pin" "$CORES" "$@" 2>&1 | tee "$OUT/$name.log" | tail -30
    echo "== $name: exit ${PIPESTATUS[0]}"
}
step bench-model 420 "$PY" bench/bench_model.py --model-dir "$MODEL_DIR" "${data[@]}" --threads 2 --profile \
    --repeats "${REPEATS:-2}" --out "$OUT/model.json"
step bench-low-precision 420 "$PY" bench/bench_server.py --model-dir "$MODEL_DIR" "${data[@]}" --low-precision \
    --seconds "${LEVEL_SECONDS:-4}" --repeats "${REPEATS:-2}" --out "$OUT/server.json"
