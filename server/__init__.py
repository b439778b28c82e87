"""The batched gRPC embedding server on ONNX Runtime."""

from __future__ import annotations

import importlib.util
import sys

__version__ = "0.1.0"  # pyproject.toml's (the image runs from source, without package metadata)

# Top-level modules of pyproject's `server` extra: a client-only install lacks them.
SERVER_EXTRA = {"onnxruntime", "tokenizers", "zmq", "prometheus_client", "grpc_health", "grpc_reflection"}


def serve_command() -> int:
    """The `minilm-embed-serve` console script: `minilm-embed-serve`, or what to install for it."""
    from minilm_embed.server.__main__ import main

    # Looked for, not imported: the supervisor never imports ONNX Runtime or the tokenizer (its
    # children do), so a missing one would otherwise surface as a child's traceback after start.
    missing = sorted(name for name in SERVER_EXTRA if importlib.util.find_spec(name) is None)
    if missing:
        return needs_server_extra(f"No module named {missing[0]!r}")
    try:
        return main()  # which imports the server's modules first thing
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] not in SERVER_EXTRA:
            raise
        return needs_server_extra(str(e))


def needs_server_extra(error: str) -> int:
    """Say what is missing and what to install; exit status 2."""
    install = "pip install 'minilm-embed[server]'"
    print(f"minilm-embed-serve: error: {error}; the server needs: {install}", file=sys.stderr)
    return 2
