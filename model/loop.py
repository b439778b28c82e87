"""The training loop: AdamW with linear warm-up and decay, one batch per step, in an order that an
interrupted run resumes exactly (the batches of step N are the same whether or not it stopped)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from minilm_embed.model.encoder import Encoder
from minilm_embed.model.evaluate import DevSet
from minilm_embed.model.losses import batch_loss
from minilm_embed.model.pairs import Batch, TrainingData

MAX_GRAD_NORM = 1.0
LOSS_WINDOW = 20  # steps averaged for the loss reported at the start and end of a run


@dataclass(frozen=True)
class Plan:
    """How long and in what order to train; built once by the command line."""

    batch_size: int
    seed: int
    total_steps: int
    eval_every: int  # steps between mid-run evaluations and checkpoints; 0: only at the end


def seed_everything(seed: int) -> None:
    """torch, random and numpy, so that a run is repeatable."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def linear_schedule(warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate factor per step: linear warm-up to 1, then linear decay to 0 at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


@dataclass
class Run:
    """What a step changes, and what a checkpoint saves to resume from."""

    model: Encoder
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int
    history: list[dict[str, float]]


def make_run(model: Encoder, lr: float, warmup: int, total: int) -> Run:
    """A fresh run at step 0: AdamW (weight decay 0.01) on the linear schedule."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(warmup, total))
    return Run(model, optimizer, scheduler, 0, [])


def batch_stream(data: TrainingData, size: int, seed: int, start: int) -> Iterator[Batch]:
    """Batches from step ``start`` on, epoch after epoch, in the order an unbroken run sees them."""
    per_epoch = len(data.batches(size, seed, 0))
    epoch, skip = divmod(start, per_epoch)
    while True:
        yield from data.batches(size, seed, epoch)[skip:]
        epoch, skip = epoch + 1, 0


def train_step(run: Run, batch: Batch) -> float:
    """One optimizer step on one batch, gradients clipped; returns the batch's loss."""
    loss = batch_loss(run.model, batch)
    loss.backward()
    nn.utils.clip_grad_norm_(run.model.parameters(), MAX_GRAD_NORM)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.step += 1
    return float(loss.detach())


def loss_window(history: list[dict[str, float]], last: bool) -> list[float]:
    """The first or last LOSS_WINDOW losses; at most half of them in a short run, so they differ."""
    losses = [h["loss"] for h in history if "loss" in h]
    n = min(LOSS_WINDOW, max(1, len(losses) // 2))
    return losses[-n:] if last else losses[:n]


def mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def evaluate(run: Run, dev: DevSet | None) -> float | None:
    """Dev Spearman x100, logged in the run's history; None without a dev set."""
    if dev is None:
        return None
    score = dev.spearman(run.model)
    run.history.append({"step": run.step, "dev_spearman": score})
    tqdm.write(f"step {run.step}: STS-B dev Spearman x100 {score:.2f}")
    return score


def checkpoint(run: Run, dev: DevSet | None, save_to: Callable[[], None]) -> None:
    """Mid-run: log the recent loss and the dev metric, and save what --resume needs."""
    recent = loss_window(run.history, last=True)
    tqdm.write(f"step {run.step}: loss {mean(recent):.4f} (mean of the last {len(recent)} steps)")
    evaluate(run, dev)
    save_to()


def fit(run: Run, data: TrainingData, dev: DevSet | None, plan: Plan, save_to: Callable[[], None]) -> None:
    """Steps from the run's step to the plan's total, with a checkpoint every `plan.eval_every`."""
    total = plan.total_steps
    stream = batch_stream(data, plan.batch_size, plan.seed, run.step)
    with tqdm(total=total, initial=run.step, desc="train", unit="step", mininterval=1.0) as bar:
        while run.step < total:
            loss = train_step(run, next(stream))
            run.history.append({"step": run.step, "loss": loss, "lr": float(run.scheduler.get_last_lr()[0])})
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if plan.eval_every and run.step % plan.eval_every == 0 and run.step < total:
                checkpoint(run, dev, save_to)
