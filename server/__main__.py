"""python -m server: serve embeddings over gRPC until SIGTERM or SIGINT, then drain and exit 0."""

from __future__ import annotations

import asyncio
import os
import sys

from server.app import configure_process, serve
from server.backend import ModelRepositoryError
from server.config import ConfigError, load_config
from server.security import SecurityConfigError


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv, os.environ)
        configure_process(config)
        asyncio.run(serve(config))
    except (ConfigError, ModelRepositoryError, SecurityConfigError, ValueError, OSError) as e:
        print(f"server: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
