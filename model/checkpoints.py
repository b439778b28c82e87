"""Checkpoints: the Hugging Face / sentence-transformers layout that ``python -m minilm_embed.export
--weights``
reads, plus ``training_state.pt`` (optimizer, scheduler, step, RNG) that ``--resume`` continues from,
and the run's log as JSON lines."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from minilm_embed.model.directories import SAVING_MARKER, STATE_FILE, beside
from minilm_embed.model.loop import Plan, Run
from minilm_embed.model.pairs import TrainingData
from minilm_embed.model.weights import WEIGHTS_FILE, WeightsError, save_checkpoint

LOG_FILE = "training_log.jsonl"


@dataclass(frozen=True)
class Schedule:
    """A run's peak learning rate and warm-up steps (None: not given, or not recorded)."""

    lr: float | None
    warmup: int | None


def save(run: Run, tokenizer_file: Path, out: Path, model_id: str, record: dict[str, Any]) -> None:
    """The model, its tokenizer and what --resume needs, into `out`, which holds either the last whole
    checkpoint or this one: a run killed while saving must not leave step N's weights beside step M's
    optimizer. Written beside it, then swapped in by renames; a crash between the two renames leaves
    the last checkpoint in `<out>.previous` (restore names it). The two are removed here unchecked: the
    command line has refused a run whose `.partial` or `.previous` is not its own to remove
    (directories.leftover_problem), so only this run's leftovers are there."""
    partial, previous = beside(out, "partial"), beside(out, "previous")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    (partial / SAVING_MARKER).write_text("an unfinished save of model.train: it may be removed\n")
    _write(run, tokenizer_file, partial, model_id, record)
    (partial / SAVING_MARKER).unlink()
    if out.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(out, previous)
    os.rename(partial, out)
    shutil.rmtree(previous, ignore_errors=True)


def _write(run: Run, tokenizer_file: Path, out: Path, model_id: str, record: dict[str, Any]) -> None:
    """The checkpoint, and the training state with `record` (what resume checks: run_record's)."""
    save_checkpoint(run.model, tokenizer_file, out, model_id)
    _follow_umask(out / WEIGHTS_FILE)
    state = {
        "step": run.step,
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "history": run.history,
        **record,
    }
    torch.save(state, out / STATE_FILE)
    lines = (json.dumps(entry) + "\n" for entry in run.history)
    (out / LOG_FILE).write_text("".join(lines), encoding="utf-8")


def _follow_umask(path: Path) -> None:
    """safetensors writes its file 0600, where the others follow the umask (0644 under 022): another
    uid (a container serving an export of it) could not read the weights."""
    mask = os.umask(0)
    os.umask(mask)  # read it back: the only portable way to learn it
    path.chmod(0o666 & ~mask)


def run_record(order: dict[str, Any], schedule: Schedule) -> dict[str, Any]:
    """What a checkpoint records of its run for resume to check: the batch order and the schedule."""
    return {"batch_order": order, "schedule": asdict(schedule)}


def resumable(directory: Path) -> Path:
    """`directory`, unless a run stopped between save's two renames: then say where its checkpoint is."""
    if not directory.exists() and beside(directory, "previous").is_dir():
        raise WeightsError(
            f"{directory}: missing, but {beside(directory, 'previous')} holds the last whole checkpoint "
            "(the run stopped while saving it): resume from that"
        )
    return directory


def batch_order(plan: Plan, data: TrainingData) -> dict[str, Any]:
    """What fixes the batches of every step: a resumed run must have the same, or it would continue on
    other batches than the run it continues."""
    return {
        "batch_size": plan.batch_size,
        "seed": plan.seed,
        "pairs": len(data.pairs),
        "scored_pairs": len(data.scored),
        "data_sha256": _digest(data),
    }


def _digest(data: TrainingData) -> str:
    """The tokenized pairs' sha256, fed a pair at a time: one JSON string of every token id of an
    NLI-sized set would take hundreds of MB at once."""
    digest = hashlib.sha256()
    for kind in (data.pairs, data.scored):
        for item in kind:
            digest.update(json.dumps(item).encode() + b"\n")
        digest.update(b"--\n")  # where the pairs end and the scored pairs begin
    return digest.hexdigest()


def _order_problem(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How the batch order asked for now differs from the checkpoint's, if it does."""
    for key in ("batch_size", "seed"):
        if saved[key] != now[key]:
            return f"it was trained with --{key.replace('_', '-')} {saved[key]}, not {now[key]}"
    if saved["data_sha256"] != now["data_sha256"]:
        return (
            f"its training data were {saved['pairs']} pairs and {saved['scored_pairs']} scored pairs, "
            f"those given now are {now['pairs']} and {now['scored_pairs']}"
            + (
                " (the same counts, other texts)"
                if (saved["pairs"], saved["scored_pairs"]) == (now["pairs"], now["scored_pairs"])
                else ""
            )
        )
    return None


def read_state(directory: Path) -> dict[str, Any]:
    """The training state of a checkpoint directory that `save` wrote, to resume from."""
    path = resumable(directory) / STATE_FILE
    if not path.is_file():
        raise WeightsError(f"{path}: no training state to resume from (was it written by model.train?)")
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def resumed_schedule(state: dict[str, Any], directory: Path, asked: Schedule) -> Schedule:
    """The learning rate and warm-up the run continues on: the checkpoint's, which an --lr or --warmup
    given must equal (the optimizer state carries the first, the schedule's factor the second: another
    would be ignored or re-warm a decayed schedule). Checkpoints written before the record carry the
    learning rate only (in the scheduler's state); their warm-up is the one asked for."""
    saved = state.get("schedule", {})
    lr = saved.get("lr", state["scheduler"]["base_lrs"][0])
    warmup = saved.get("warmup", asked.warmup)
    for flag, was, now in (("--lr", lr, asked.lr), ("--warmup", warmup, asked.warmup)):
        if now is not None and now != was:
            raise WeightsError(
                f"--resume {directory}: it was trained with {flag} {was:g}, not {now:g}; "
                f"leave {flag} out to continue it, or start a new run from it with --weights {directory}"
            )
    return Schedule(lr, warmup)


def restore(
    run: Run, state: dict[str, Any], directory: Path, order: dict[str, Any], total_steps: int
) -> None:
    """Continue `run` from a checkpoint directory's state (read_state), on the batches it would have seen."""
    problem = _order_problem(state["batch_order"], order) if "batch_order" in state else None
    if problem is None and int(state["step"]) > total_steps:
        problem = (
            f"it is at step {state['step']}, past the {total_steps} steps asked for (--max-steps/--epochs)"
        )
    if problem:
        raise WeightsError(
            f"--resume {directory}: {problem}; repeat the first run's data and flags to continue it, "
            f"or start a new run from it with --weights {directory}"
        )
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    run.step, run.history = int(state["step"]), list(state["history"])
