#!/usr/bin/env python3
"""Generate the gRPC stubs from proto/ under the name they are installed as: `minilm_embed.proto`.

    python scripts/generate_stubs.py              # into proto/ (what `make proto` and `pip install -e` do)
    python scripts/generate_stubs.py --out DIR    # into DIR, the directory of package `minilm_embed.proto`

protoc names a stub's imports after the path of its .proto below the -I root, so the .proto files are
laid out as `minilm_embed/proto/...` in a temporary root: `embedding_pb2_grpc.py` then imports
`from minilm_embed.proto.embedding.v1 import embedding_pb2`, the name the wheel installs, while the
repository keeps proto/ at its top level. setup.py's build_py runs this at every wheel build (the stubs
are never committed). Needs grpcio-tools (a build requirement in pyproject.toml).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"
PACKAGE = ("minilm_embed", "proto")  # the installed package that proto/ becomes
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(proto_dir: Path) -> list[Path]:
    return sorted(proto_dir.rglob("*.proto"))


def generate(out: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Write each .proto's stubs into `out` (the directory of `minilm_embed.proto`); returns them."""
    sources = proto_files(proto_dir)
    assert sources, f"no .proto files under {proto_dir}"
    with tempfile.TemporaryDirectory(prefix="minilm-embed-stubs-") as tmp:
        include, generated = Path(tmp, "include"), Path(tmp, "out")
        names = []
        for source in sources:
            name = Path(*PACKAGE, source.relative_to(proto_dir))
            (include / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, include / name)
            names.append(name.as_posix())
        generated.mkdir()
        flags = [f"-I{include}", f"--python_out={generated}", f"--pyi_out={generated}"]
        subprocess.run(
            [sys.executable, "-m", "grpc_tools.protoc", *flags, f"--grpc_python_out={generated}", *names],
            check=True,
        )
        written = []
        for stub in sorted(Path(generated, *PACKAGE).rglob("*")):
            if stub.name.endswith(SUFFIXES):
                target = out / stub.relative_to(Path(generated, *PACKAGE))
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(stub, target)
                written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=PROTO_DIR, help="directory of `minilm_embed.proto`")
    args = p.parse_args(argv)
    for stub in generate(args.out):
        print(stub)
    return 0


if __name__ == "__main__":
    sys.exit(main())
