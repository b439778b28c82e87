#!/usr/bin/env bash
# For a GPU host reached only by copying files (no network; a Python 3.12 image with torch, onnx,
# grpcio and tokenizers, but not this project's pins): builds what scripts/gpu-device.sh unpacks
# there, in parts small enough to copy one at a time. Run here, after `make install proto model`:
#   scripts/gpu-payload.sh            -> .gpu/pay.part.aa, .ab, ... (ignored by git)
# The payload: this checkout's Python packages the server, the benchmarks and the tests need, at the
# versions of .venv, as cp312 manylinux wheels unpacked into one site/ (onnxruntime-gpu 1.31.1 in
# place of the CPU wheel's; torch, numpy and the NVIDIA libraries are the host's), build/model, the
# sentence-transformers weights in fp16 (the peer runs `.half()` anyway), STS-B from DATA_DIR
# (../shared/data), and the generated gRPC stubs. One `tar | xz -9`, split into 64,000,000-byte parts
# (61 MiB: with the working tree, under a 64 MiB copy).
set -euo pipefail
OUT=${OUT:-.gpu}
DATA_DIR=${DATA_DIR:-../shared/data}
PY=.venv/bin/python
PART_BYTES=${PART_BYTES:-64000000}
[ -d build/model ] && [ -f proto/embedding/v1/embedding_pb2.py ] || {
    echo "gpu-payload: run make install proto model first" >&2
    exit 2
}
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
rm -rf "$OUT/pay" "$OUT/wheels" "$OUT"/pay.part.* "$OUT/pay.tar.xz"
mkdir -p "$OUT/wheels" "$OUT/pay/site" "$OUT/pay/data" "$OUT/pay/stubs"

# The packages' closure at .venv's versions, less what the host brings.
pins=$($PY - <<'EOF'
import importlib.metadata as md
import re
import tomllib

# The server's own requirements from pyproject.toml (a hand list here once missed setproctitle, and
# every server on the GPU host failed to start), and what the benchmarks and the GPU tests import.
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
roots = project["dependencies"] + project["optional-dependencies"]["server"]
roots = [re.match(r"[A-Za-z0-9_.\-]+", r).group(0) for r in roots]
roots += "scipy sentence-transformers pytest pytest-timeout onnx aiohttp".split()
host = {"torch", "numpy", "triton", "setuptools", "onnxruntime", "onnxruntime-gpu"}
seen: dict[str, str] = {}
todo = list(roots)
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen or name in host or name.startswith("nvidia-"):
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue  # an optional dependency for another platform or Python
    seen[name] = dist.version
    todo += [re.match(r"[A-Za-z0-9_.\-]+", r).group(0) for r in dist.requires or [] if "extra ==" not in r]
print(" ".join(f"{n}=={v}" for n, v in sorted(seen.items())), "onnxruntime-gpu==1.31.1")
EOF
)
# shellcheck disable=SC2086  # one argument per pin
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$OUT/wheels" $pins
for wheel in "$OUT"/wheels/*.whl; do
    unzip -q -o "$wheel" -d "$OUT/pay/site"
done
for data in "$OUT"/pay/site/*.data; do  # a wheel's purelib/platlib files belong in site/
    [ -d "$data" ] || continue
    for kind in purelib platlib; do
        if [ -d "$data/$kind" ]; then cp -a "$data/$kind/." "$OUT/pay/site/"; fi
    done
    rm -rf "$data"
done
find "$OUT/pay/site" -type d \( -name tests -o -name test \) -prune -exec rm -rf {} +
rm -f "$OUT"/pay/site/onnxruntime/capi/libonnxruntime_providers_tensorrt.so

cp -a build/model "$OUT/pay/model"
cp proto/embedding/v1/embedding_pb2*.py* "$OUT/pay/stubs/"
if [ -d "$DATA_DIR/stsbenchmark" ]; then cp -a "$DATA_DIR/stsbenchmark" "$OUT/pay/data/"; fi
st=$($PY -c "from minilm_embed.model.weights import default_weights_dir; print(default_weights_dir())")
mkdir -p "$OUT/pay/st"
(cd "$st" && tar -cf - --exclude=model.safetensors --exclude=README.md .) | tar -C "$OUT/pay/st" -xf -
$PY - "$st/model.safetensors" "$OUT/pay/st/model.safetensors" <<'EOF'
import sys

from safetensors.torch import load_file, save_file

tensors = load_file(sys.argv[1])
half = {k: v.half() if v.is_floating_point() else v for k, v in tensors.items()}
save_file(half, sys.argv[2], metadata={"format": "pt"})
EOF

tar -C "$OUT/pay" -cf - . | xz -9 -T0 >"$OUT/pay.tar.xz"
(cd "$OUT" && split -b "$PART_BYTES" pay.tar.xz pay.part.)
rm -rf "$OUT/pay" "$OUT/wheels"
ls -l "$OUT"/pay.part.*
sha256sum "$OUT/pay.tar.xz"
