"""Checkpoints: the Hugging Face / sentence-transformers layout that ``python -m minilm_embed.export
--weights``
reads, plus ``training_state.pt`` (optimizer, scheduler, step, RNG) that ``--resume`` continues from,
and the run's log as JSON lines."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minilm_embed.model.loop import Run
from minilm_embed.model.weights import WeightsError, save_checkpoint

STATE_FILE = "training_state.pt"
LOG_FILE = "training_log.jsonl"


def save(run: Run, tokenizer_file: Path, out: Path, model_id: str) -> None:
    """The model, its tokenizer and what --resume needs, into `out`."""
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


def restore(run: Run, directory: Path) -> None:
    """Continue `run` from a checkpoint directory that `save` wrote."""
    path = directory / STATE_FILE
    if not path.is_file():
        raise WeightsError(f"{path}: no training state to resume from (was it written by model.train?)")
    state = torch.load(path, weights_only=True)
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    run.step, run.history = int(state["step"]), list(state["history"])
