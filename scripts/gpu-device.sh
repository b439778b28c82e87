#!/usr/bin/env bash
# On the GPU host, in a copy of this checkout, after scripts/gpu-payload.sh's parts were copied to
# $HOME/p: unpacks them once (into $HOME/w), puts the model, the stubs and the packages in place,
# points the dynamic linker at torch's CUDA libraries (onnxruntime-gpu's CUDA provider needs CUDA 13
# and cuDNN 9; the server's processes never import torch), then runs scripts/gpu-check.sh with its
# environment (BENCH_GPU_FLAGS, FRONT_BENCH, OUT), or the check script given as its argument (e.g.
# scripts/cpu-low-precision-check.sh: the host's Xeon, which has AMX, measured for issue 15). With
# SETUP_ONLY=1 it stops before the checks and prints the exports to reuse:
# `eval "$(SETUP_ONLY=1 bash scripts/gpu-device.sh)"`.
set -euo pipefail
CHECK=${1:-scripts/gpu-check.sh}
W=$HOME/w
if [ ! -d "$W/site" ]; then
    mkdir -p "$W"
    cat "$HOME"/p/pay.part.* | xz -dc -T0 | tar -C "$W" -xf -
fi
ln -sfn "$PWD" "$W/site/minilm_embed"
cp "$W"/stubs/* proto/embedding/v1/
rm -rf build/model
mkdir -p build
cp -a "$W/model" build/model
torch_site=$(python3 -c "import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec('torch').origin)))")
cuda_libs=""
if [ -d "$torch_site/nvidia" ]; then  # else the host's own CUDA libraries
    cuda_libs=$(find "$torch_site/nvidia" -maxdepth 3 -type d -name lib | tr '\n' ':')
fi
export PYTHONPATH=$W/site
export LD_LIBRARY_PATH=$cuda_libs${LD_LIBRARY_PATH:-}
if [ "${SETUP_ONLY:-0}" = 1 ]; then
    echo "export PYTHONPATH=$PYTHONPATH LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    exit 0
fi
python3 -c "import onnxruntime as o, grpc; print('onnxruntime', o.__version__, o.get_available_providers(), 'grpcio', grpc.__version__)"
data=()
if [ -d "$W/data/stsbenchmark" ]; then data=(DATA_DIR="$W/data"); fi
exec env "${data[@]}" BENCH_ST_WEIGHTS="$W/st" bash "$CHECK"
