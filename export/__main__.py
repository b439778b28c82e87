"""python -m minilm_embed.export: packaged (or given) weights -> a verified ONNX model repository.

Writes into a temporary directory beside --out and moves it into place only when the parity gate
passes, so a failed or interrupted export never leaves a half-written repository behind; one killed
outright (SIGKILL) leaves its staging directory, which the next export to the same --out removes
(one whose marker no process holds locked any more).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import re
import shutil
import socket
import stat
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Only what checking the arguments and --out needs is imported here: torch, onnx, onnxruntime and the
# parity gate's libraries (sentence-transformers, scipy) take seconds to import, so each step below
# imports what it uses when it runs. An --out refused fails at once; weights that cannot be read fail
# once torch (which the weights' module imports) is loaded, before the rest is.
from minilm_embed.model.checksum import sha256_file
from minilm_embed.model.data import DataError, read_sts, sts_path
from minilm_embed.model.directories import OutputError, check_out, interrupts_deferred
from minilm_embed.model.host import gpu_present
from minilm_embed.model.repository import (
    CUDA_PROVIDER,
    FP32_FILE,
    INT8_FILE,
    MANIFEST_FILE,
    TOKENIZER_FILE,
    Manifest,
    SharedTensor,
)

if TYPE_CHECKING:
    from minilm_embed.export.parity import ParityReport
    from minilm_embed.model.tokenizer import Tokenizer
    from minilm_embed.model.weights import Checkpoint

CALIBRATION_SENTENCES = 800
# In each staging directory from the start, locked (flock LOCK_EX) by its export for the export's whole
# life, removed just before the directory becomes --out: a marker no process holds locked is a killed
# export's leftover, whatever PID namespace or host it ran in. Its text (host, pid) is for people.
STAGING_MARKER = ".export-staging"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minilm_embed.export", description=__doc__.splitlines()[0])
    p.add_argument(
        "--weights", type=Path, help="Hugging Face BERT-family directory (default: packaged all-MiniLM-L6-v2)"
    )
    p.add_argument(
        "--sha256", help="expected sha256 of model.safetensors (checked for the default weights always)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("build/model"),
        help="model repository to write (default: build/model)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=os.environ.get("EMBED_DATA_DIR") or None,
        help="directory holding stsbenchmark/ for the parity gate [env EMBED_DATA_DIR]; "
        "without it parity runs on sentences the project carries",
    )
    p.add_argument(
        "--no-int8",
        action="store_true",
        help="skip the opt-in int8 graph (built only with a data directory: it is calibrated on STS-B train)",
    )
    return p.parse_args(argv)


def versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import tokenizers
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "tokenizers": tokenizers.__version__,
    }


def manifest(
    ckpt: Checkpoint,
    staging: Path,
    shared: SharedTensor,
    parity: dict[str, Any],
    int8: dict[str, Any] | None,
    fp16: dict[str, Any] | None,
) -> Manifest:
    from minilm_embed.export.fp16 import FP16_SKIPPED
    from minilm_embed.export.onnx import IR_VERSION, OPSET
    from minilm_embed.export.optimize import graph_plan

    return Manifest(
        model_id=ckpt.model_id,
        source=str(ckpt.directory),
        weights_sha256=ckpt.sha256,
        onnx_sha256=sha256_file(staging / FP32_FILE),
        tokenizer_sha256=sha256_file(staging / TOKENIZER_FILE),
        config=ckpt.config,
        opset=OPSET,
        ir_version=IR_VERSION,
        graphs=graph_plan(staging, int8 is not None, fp16 is not None),
        shared_tensors=(shared,),
        versions=versions(),
        parity=parity,
        parity_int8=int8 or {"skipped": "int8 is calibrated on STS-B train: give --data-dir"},
        parity_fp16=fp16 or {"skipped": FP16_SKIPPED},
    )


def build(
    weights: Path, expected_sha256: str | None, staging: Path, data_dir: Path | None, int8: bool
) -> None:
    from minilm_embed.model.tokenizer import save_unpadded
    from minilm_embed.model.weights import load_checkpoint, read_tokenizer

    encoder, ckpt = load_checkpoint(weights, expected_sha256)
    for line in ckpt.defaults:
        print(f"export: note: {line}", file=sys.stderr)
    tokenizer = read_tokenizer(weights / TOKENIZER_FILE, ckpt.config.max_seq_length)
    # The weights and their tokenizer read: now the libraries that export and gate them.
    import torch

    from minilm_embed.export.onnx import export_onnx, save, share_tensor
    from minilm_embed.export.optimize import cpu_session
    from minilm_embed.export.parity import run_parity

    onnx_path = staging / FP32_FILE
    with warnings.catch_warnings():
        # The trace unrolls the loop over the layers, as it should: its warning says so on every export.
        warnings.filterwarnings("ignore", "Iterating over a tensor", torch.jit.TracerWarning)
        save(export_onnx(encoder), onnx_path)
    shared = share_tensor(onnx_path)  # before the gate, which then runs the graph as shipped
    save_unpadded(weights / TOKENIZER_FILE, staging / TOKENIZER_FILE, ckpt.config.max_seq_length)
    reference = ckpt.config.position == "learned"  # sentence-transformers has no sinusoidal BERT
    with no_progress_bars():
        report = run_parity(encoder, cpu_session(onnx_path), tokenizer, weights, data_dir, reference)
    print(report.table())
    report.raise_on_failure()
    int8_report = (
        build_int8(staging, tokenizer, data_dir, report, ckpt.config.num_heads)
        if int8 and data_dir is not None
        else None
    )
    figures = int8_report.to_dict() if int8_report else None
    fp16 = build_fp16(staging, tokenizer, data_dir, ckpt.config.num_heads)
    text = manifest(ckpt, staging, shared, report.to_dict(), figures, fp16).to_json()
    (staging / MANIFEST_FILE).write_text(text, encoding="utf-8")


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off: the gate's reference model drew "Loading weights: 100%" on
    every export."""
    from transformers.utils import logging as transformers_logging

    was_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            transformers_logging.enable_progress_bar()


def build_int8(
    staging: Path, tokenizer: Tokenizer, data_dir: Path, fp32: ParityReport, num_heads: int
) -> ParityReport:
    """Per-token int8, smoothed with scales from STS-B train (never dev or test), behind its own gate."""
    from minilm_embed.export.onnx import share_tensor
    from minilm_embed.export.optimize import cpu_session, quantize_int8
    from minilm_embed.export.parity import run_int8_gate

    pairs = read_sts(sts_path(data_dir, "train"))
    sentences = list(dict.fromkeys(s for p in pairs for s in (p.first, p.second)))[:CALIBRATION_SENTENCES]
    quantize_int8(staging / FP32_FILE, staging / INT8_FILE, tokenizer.encode(sentences).ids, num_heads)
    share_tensor(staging / INT8_FILE)  # the same table: the same file
    # Against the fp32 graph's vectors from its own gate (the same texts), not a second run of it.
    if fp32.vectors is None:
        raise ValueError("the fp32 gate's report carries no vectors: run_parity's report is needed")
    report = run_int8_gate(fp32.vectors, cpu_session(staging / INT8_FILE), tokenizer, data_dir)
    print(report.table())
    report.raise_on_failure()
    return report


def build_fp16(
    staging: Path, tokenizer: Tokenizer, data_dir: Path | None, num_heads: int
) -> dict[str, Any] | None:
    """The fp16 graph for CUDA, where this host has a GPU to gate it on; a refused graph is one line,
    and the repository ships without it (CUDA then serves fp32)."""
    import onnxruntime

    from minilm_embed.export.fp16 import Fp16Error, fp16_record, gated_fp16

    if not gpu_present() or CUDA_PROVIDER not in onnxruntime.get_available_providers():
        return None
    try:
        return fp16_record(gated_fp16(staging, tokenizer, data_dir, num_heads))
    except Fp16Error as e:
        print(f"export: {e}", file=sys.stderr)
        return None


def replace_dir(staging: Path, out: Path, swapped: list[Path]) -> None:
    """Swap `staging` in as `out`, appending `out` to `swapped` the moment it is in place; a Ctrl-C
    meanwhile is raised once the swap is done (one before it began is raised with `swapped` empty)."""
    old = out.with_name(out.name + ".old")
    with interrupts_deferred():
        (staging / STAGING_MARKER).unlink()
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            out.rename(old)
        staging.rename(out)
        swapped.append(out)
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staging_beside(out: Path) -> Iterator[Path]:
    """A new staging directory beside `out`, carrying STAGING_MARKER, removed on the way out unless it
    was renamed to `out`; first, the ones killed exports to `out` left are removed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    clear_stale_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    lock: int | None = None
    try:
        staging.chmod(0o755)  # mkdtemp makes it 0700; the server may run as another user
        lock = locked_marker(staging)
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if lock is not None:
            os.close(lock)  # only now that the directory is gone (removed, or renamed to `out`)


def locked_marker(staging: Path) -> int:
    """Write `staging`'s STAGING_MARKER, locked: the open descriptor holding its flock (LOCK_EX), which
    lasts until that descriptor is closed or this process ends, however it ends. The marker is written
    under another name and renamed once locked, so no other export ever sees it unlocked."""
    pending = staging / (STAGING_MARKER + ".new")
    fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        owner = {"host": socket.gethostname(), "pid": os.getpid()}
        os.write(fd, (json.dumps(owner) + "\n").encode())
        pending.rename(staging / STAGING_MARKER)  # the same file: the lock goes with it
    except BaseException:
        os.close(fd)
        raise
    return fd


def clear_stale_staging(out: Path) -> None:
    """Remove each directory named as staging_beside names them whose marker no process holds locked
    (its export is gone); one whose marker is locked is a running export's, left alone. One without the
    marker may be someone's own: it is named, never removed."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.[a-z0-9_]{{8}}")  # tempfile.mkdtemp's 8 characters
    for path in sorted(out.parent.iterdir()):
        if not pattern.fullmatch(path.name) or path.is_symlink() or not path.is_dir():
            continue
        fd = open_marker(path / STAGING_MARKER)
        if fd is None:
            print(
                f"export: note: {path} is not removed: named like an export's staging directory, but "
                f"without the {STAGING_MARKER} marker of one; remove it if it is not in use",
                file=sys.stderr,
            )
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # held: that export is running (in whatever PID namespace, on whatever host)
            if not still_marks(fd, path / STAGING_MARKER):
                continue  # its export finished meanwhile: the directory was removed or became --out
            # Locked here now, so no other export's cleanup removes it at the same time.
            owner = marker_owner(fd)
            if remove(path):
                print(
                    f"export: removed {path}, the staging directory of an export that was killed{owner}",
                    file=sys.stderr,
                )
        finally:
            os.close(fd)


def open_marker(marker: Path) -> int | None:
    """A read-only descriptor of `marker` where it is a regular file (not a link), else None."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def still_marks(fd: int, marker: Path) -> bool:
    """Whether the file open on `fd` is still `marker` (not unlinked or replaced since it was opened)."""
    try:
        now = os.stat(marker, follow_symlinks=False)
    except OSError:
        return False
    opened = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def remove(path: Path) -> bool:
    """Whether `path` is gone after removing it."""
    shutil.rmtree(path, ignore_errors=True)
    return not path.exists()


def marker_owner(fd: int) -> str:
    """ " (host H, pid N)" as the marker open on `fd` names its export, or "" where it names none."""
    try:
        owner = json.loads(os.read(fd, 4096).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return ""
    if not isinstance(owner, dict):
        return ""
    host, pid = owner.get("host"), owner.get("pid")
    if not isinstance(host, str) or not isinstance(pid, int) or isinstance(pid, bool):
        return ""
    return f" (host {host}, pid {pid})"


def export(args: argparse.Namespace) -> None:
    """The export the arguments ask for, swapped in as --out once it has passed its gates."""
    check_out(args.out, MANIFEST_FILE, "a model repository")
    if args.data_dir is not None:  # dev for the gates, train to calibrate int8: found missing now
        for split in ("dev",) if args.no_int8 else ("dev", "train"):
            sts_path(args.data_dir, split)
    from minilm_embed.model.weights import DEFAULT_SHA256, default_weights_dir

    weights = args.weights or default_weights_dir()
    expected = args.sha256 or (DEFAULT_SHA256 if args.weights is None else None)
    swapped: list[Path] = []
    try:
        with staging_beside(args.out) as staging:
            build(weights, expected, staging, args.data_dir, not args.no_int8)
            replace_dir(staging, args.out, swapped)
    except KeyboardInterrupt:
        if not swapped:
            raise  # before the new repository was in place: --out is unchanged
        # Ctrl-C pressed while (or after) the new repository was swapped in: it is written, the export
        # is done.


def refused(e: Exception) -> bool:
    """Whether `e` is bad input or a failed gate, which main reports in one line. The weights' and the
    gate's errors are looked up among the modules loaded, not imported here: theirs import torch, and
    an error of theirs was raised after they were loaded."""
    weights = sys.modules.get("minilm_embed.model.weights")
    parity = sys.modules.get("minilm_embed.export.parity")
    return (
        isinstance(e, (DataError, OutputError, OSError))
        or (weights is not None and isinstance(e, weights.WeightsError))
        or (parity is not None and isinstance(e, parity.ParityError))
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        export(args)
    except KeyboardInterrupt:
        print(
            f"export: interrupted: {args.out} is unchanged (the staging directory is removed)",
            file=sys.stderr,
        )
        return 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
    except Exception as e:
        if not refused(e):
            raise  # a bug: its traceback
        print(f"export: error: {e}", file=sys.stderr)
        return 2
    print(f"export: wrote {args.out} (parity passed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
