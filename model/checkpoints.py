"""Checkpoints: the Hugging Face / sentence-transformers layout that ``python -m minilm_embed.export
--weights``
reads, plus ``training_state.pt`` (optimizer, scheduler, step, RNG) that ``--resume`` continues from,
and the run's log as JSON lines."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from minilm_embed.model.loop import Run
from minilm_embed.model.weights import WeightsError, save_checkpoint

STATE_FILE = "training_state.pt"
LOG_FILE = "training_log.jsonl"


def save(run: Run, tokenizer_file: Path, out: Path, model_id: str) -> None:
    """The model, its tokenizer and what --resume needs, into `out`, which holds either the last whole
    checkpoint or this one: a run killed while saving must not leave step N's weights beside step M's
    optimizer. Written beside it, then swapped in by renames; a crash between the two renames leaves
    the last checkpoint in `<out>.previous` (restore names it)."""
    partial, previous = _beside(out, "partial"), _beside(out, "previous")
    shutil.rmtree(partial, ignore_errors=True)
    _write(run, tokenizer_file, partial, model_id)
    if out.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(out, previous)
    os.rename(partial, out)
    shutil.rmtree(previous, ignore_errors=True)


def _beside(out: Path, what: str) -> Path:
    return out.with_name(f"{out.name}.{what}")


def _write(run: Run, tokenizer_file: Path, out: Path, model_id: str) -> None:
    save_checkpoint(run.model, tokenizer_file, out, model_id)
    state = {
        "step": run.step,
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "history": run.history,
    }
    torch.save(state, out / STATE_FILE)
    lines = (json.dumps(entry) + "\n" for entry in run.history)
    (out / LOG_FILE).write_text("".join(lines), encoding="utf-8")


def resumable(directory: Path) -> Path:
    """`directory`, unless a run stopped between save's two renames: then say where its checkpoint is."""
    if not directory.exists() and _beside(directory, "previous").is_dir():
        raise WeightsError(
            f"{directory}: missing, but {_beside(directory, 'previous')} holds the last whole checkpoint "
            "(the run stopped while saving it): resume from that"
        )
    return directory


def restore(run: Run, directory: Path) -> None:
    """Continue `run` from a checkpoint directory that `save` wrote."""
    path = resumable(directory) / STATE_FILE
    if not path.is_file():
        raise WeightsError(f"{path}: no training state to resume from (was it written by model.train?)")
    state = torch.load(path, weights_only=True)
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    run.step, run.history = int(state["step"]), list(state["history"])
