"""minilm-embed-serve: serve embeddings over gRPC until SIGTERM or SIGINT, then drain and exit 0 (a
second signal during the drain stops at once: exit 128 + its number)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from minilm_embed.server import signals

if TYPE_CHECKING:
    from minilm_embed.server.engine import BackendFactory


def main(argv: list[str] | None = None, backend_factory: BackendFactory | None = None) -> int:
    """Exit status: 0 after a drain, 1 when the engine died, 2 for a setting or file that cannot be used,
    128 + the signal's number when a second stop signal cut the drain short (130 for Ctrl-C twice).

    `backend_factory` is how tests and benchmarks put a stand-in model behind the real server; no
    flag reaches it. The server's modules are imported after the stop signals are caught (signals.py).
    """
    signals.catch()
    # Before onnxruntime is imported (the engine and fronts inherit it): onnxruntime 1.31 on Linux
    # otherwise keeps a device id under ~/.cache and uploads telemetry to Microsoft. An operator's own
    # setting stands.
    os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
    from minilm_embed.model.repository import ModelRepositoryError
    from minilm_embed.server import logs
    from minilm_embed.server.app import StartupError, configure_process, serve
    from minilm_embed.server.config import ConfigError, env_name, load_config, requested_log_format
    from minilm_embed.server.security import SecurityConfigError

    log_format = requested_log_format(argv, os.environ)
    try:
        config = load_config(argv, os.environ)
        log_format = config.log_format
        configure_process(config)
        return serve(config, backend_factory, os.environ)
    except ModelRepositoryError as e:  # the supervisor reads the repository --model-dir names
        logs.refusal(f"server: error: --model-dir ({env_name('model_dir')}): {e}", log_format)
        return 2
    except (ConfigError, SecurityConfigError, StartupError, ValueError, OSError) as e:
        logs.refusal(f"server: error: {e}", log_format)
        return 2


if __name__ == "__main__":
    # As the minilm-embed-serve script: in a client-only install, what to install, not a traceback.
    from minilm_embed.server import serve_command

    sys.exit(serve_command())
