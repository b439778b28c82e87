"""python -m client: embed texts, embed a file of texts, or show the server's model and limits."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import grpc
import numpy as np
from google.protobuf.json_format import MessageToDict
from tqdm import tqdm

from client.client import (
    DEFAULT_ADDRESS,
    AsyncEmbeddingClient,
    EmbeddingClient,
    Security,
    embed_request,
    to_array,
)


class InputFileError(Exception):
    """A corpus file that cannot be embedded as given; the message names the line."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client", description=__doc__)
    p.add_argument(
        "--address",
        default=os.environ.get("EMBED_ADDRESS", DEFAULT_ADDRESS),
        help=f"server address [env EMBED_ADDRESS, default {DEFAULT_ADDRESS}]",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per call")
    p.add_argument(
        "--ca-cert",
        type=Path,
        help="PEM CA bundle: connect with TLS [env EMBED_CA_CERT]",
        default=os.environ.get("EMBED_CA_CERT") or None,
    )
    p.add_argument("--client-cert", type=Path, help="PEM client certificate for mutual TLS")
    p.add_argument("--client-key", type=Path, help="PEM key of --client-cert")
    p.add_argument("--server-name", help="name to check the server certificate against")
    p.add_argument("--token-file", type=Path, help="file with the bearer token [or env EMBED_TOKEN]")
    sub = p.add_subparsers(dest="command", required=True)
    embed = sub.add_parser("embed", help="embed texts given as arguments; JSON out")
    embed.add_argument("texts", nargs="+")
    embed.add_argument("--no-normalize", action="store_true")
    embed.add_argument("--no-truncate", action="store_true")
    ef = sub.add_parser(
        "embed-file", help="embed a file, one text per line, into a .npy of rows in file order"
    )
    ef.add_argument("path", type=Path)
    ef.add_argument("--out", type=Path, required=True)
    ef.add_argument("--batch-size", type=int, default=32, help="texts per request")
    ef.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    sub.add_parser("info", help="the model and limits of the server; JSON out")
    return p.parse_args(argv)


def security(args: argparse.Namespace) -> Security:
    token = (
        args.token_file.read_text(encoding="utf-8").strip()
        if args.token_file
        else os.environ.get("EMBED_TOKEN")
    )
    return Security(args.ca_cert, args.client_cert, args.client_key, token or None, args.server_name)


def cmd_embed(args: argparse.Namespace) -> int:
    with EmbeddingClient(args.address, args.timeout, security(args)) as c:
        request = embed_request(args.texts, normalize=not args.no_normalize, truncate=not args.no_truncate)
        response = c.embed_response(request)
    usage = [MessageToDict(e.usage, always_print_fields_with_no_presence=True) for e in response.embeddings]
    out = {
        "dimensions": response.dimensions,
        "embeddings": to_array(response).tolist(),
        "usage": usage,
        "timing": MessageToDict(response.timing, always_print_fields_with_no_presence=True),
    }
    print(json.dumps(out))
    return 0


async def embed_file(args: argparse.Namespace) -> np.ndarray:
    lines = args.path.read_text(encoding="utf-8").splitlines()
    blank = next((n for n, line in enumerate(lines, start=1) if not line), None)
    if blank is not None:
        raise InputFileError(f"{args.path}:{blank}: empty line (the file holds one text per line)")
    chunks = [lines[i : i + args.batch_size] for i in range(0, len(lines), args.batch_size)]
    results: list[np.ndarray | None] = [None] * len(chunks)
    slots = asyncio.Semaphore(args.concurrency)
    async with AsyncEmbeddingClient(args.address, args.timeout, security(args)) as c:
        with tqdm(total=len(lines), unit="text", file=sys.stderr) as bar:

            async def one(i: int) -> None:
                async with slots:
                    results[i] = await c.embed(chunks[i])
                bar.update(len(chunks[i]))

            await asyncio.gather(*(one(i) for i in range(len(chunks))))
    return np.concatenate([r for r in results if r is not None]) if chunks else np.zeros((0, 0), np.float32)


def cmd_embed_file(args: argparse.Namespace) -> int:
    vectors = asyncio.run(embed_file(args))
    np.save(args.out, vectors)
    print(
        f"wrote {vectors.shape[0]} x {vectors.shape[1] if vectors.ndim == 2 else 0} to {args.out}",
        file=sys.stderr,
    )
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with EmbeddingClient(args.address, args.timeout, security(args)) as c:
        info = c.info()
    print(json.dumps(MessageToDict(info, always_print_fields_with_no_presence=True), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    commands = {"embed": cmd_embed, "embed-file": cmd_embed_file, "info": cmd_info}
    try:
        return commands[args.command](args)
    except grpc.RpcError as e:
        print(f"client: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except (OSError, UnicodeDecodeError, InputFileError) as e:
        print(f"client: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
