"""python -m minilm_embed.model.train: fine-tune the encoder, or train a small one from scratch, on sentence
pairs.

Two kinds of data, each batch drawn from one kind (model/pairs.py, model/losses.py):
- pairs (JSONL ``{"anchor": ..., "positive": ...}``): contrastive loss with in-batch negatives;
- scored pairs (STS-B rows, score 0-5): MSE between cos(u, v) and score / 5.

Saves the Hugging Face / sentence-transformers layout that ``python -m minilm_embed.export --weights`` reads,
plus
the training state that ``--resume`` continues from (model/checkpoints.py). This module is the command
line: it turns the arguments into a model, data and a plan, and runs model/loop.py's loop.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

# Only what checking the arguments, the data and --out needs is imported here: torch, which the model,
# the loop, the checkpoints' and the weights' modules import, takes seconds to import, so each step
# below imports what it uses when it runs. Bad flags, data and --out are refused at once; a checkpoint
# that cannot be read (--weights, --resume) is refused once torch is loaded.
from minilm_embed.model.config import EncoderConfig
from minilm_embed.model.data import DataError, ScoredPair, read_sts, sts_path
from minilm_embed.model.directories import (
    STATE_FILE,
    OutputError,
    check_leftovers,
    check_out,
    interrupts_deferred,
)
from minilm_embed.model.pairs import TrainingData, read_training_data, tokenize

if TYPE_CHECKING:
    from torch import nn

    from minilm_embed.model.checkpoints import Schedule
    from minilm_embed.model.encoder import Encoder
    from minilm_embed.model.evaluate import DevSet
    from minilm_embed.model.loop import Plan, Run

DEFAULT_LR = {"default": 2e-5, "scratch": 1e-3}
FINETUNED = "-finetuned"
Texts = tuple[list[tuple[str, str]], list[ScoredPair]]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m minilm_embed.model.train", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--init",
        choices=("default", "scratch"),
        default="default",
        help="fine-tune the --weights checkpoint, or train a new small encoder (default: default)",
    )
    p.add_argument(
        "--weights",
        type=Path,
        help="checkpoint to fine-tune, and whose tokenizer.json a scratch model uses "
        "(default: packaged all-MiniLM-L6-v2)",
    )
    p.add_argument("--position", choices=("learned", "sinusoidal"), default="learned", help="scratch only")
    p.add_argument("--layers", type=int, default=2, help="scratch only (default: 2)")
    p.add_argument("--hidden", type=int, default=128, help="scratch only (default: 128)")
    p.add_argument("--heads", type=int, default=4, help="scratch only (default: 4)")
    p.add_argument("--max-seq-length", type=int, default=128, help="scratch only (default: 128)")
    p.add_argument("--dropout", type=float, default=0.1, help="scratch only (default: 0.1)")
    p.add_argument("--pairs", type=Path, help='JSONL of {"anchor": ..., "positive": ...} (contrastive loss)')
    p.add_argument(
        "--sts-train",
        type=Path,
        help="STS-B-format scored pairs (cosine regression); default: the --data-dir train "
        "split when no --pairs are given",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=os.environ.get("EMBED_DATA_DIR") or None,
        help="directory holding stsbenchmark/ (dev split for evaluation) [env EMBED_DATA_DIR]",
    )
    p.add_argument("--epochs", type=int, default=1, help="passes over the data (default: 1)")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, default=16, help="pairs per step (default: 16)")
    p.add_argument(
        "--lr", type=float, help="peak AdamW learning rate (default: 2e-5 fine-tune, 1e-3 scratch)"
    )
    p.add_argument(
        "--warmup", type=int, help="linear warm-up steps, then linear decay (default: 10%% of steps)"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds torch, random and numpy (default: 0)")
    p.add_argument("--out", type=Path, default=Path("build/trained"), help="checkpoint directory to write")
    p.add_argument(
        "--resume", type=Path, help="checkpoint directory written by this command to continue from"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="evaluate dev Spearman and save a checkpoint every N steps (default: only at the end)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    args = p.parse_args(argv)
    problem = check_args(args)
    if problem:
        p.error(problem)  # exit status 2, with the usage
    return args


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the numbers given, if anything."""
    for name in ("batch_size", "epochs", "layers", "hidden", "heads", "max_seq_length", "threads"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}"
    if args.max_steps is not None and args.max_steps <= 0:
        return f"--max-steps must be positive, not {args.max_steps}"
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        return f"--lr must be a positive number, not {args.lr}"
    if not 0 <= args.dropout < 1:  # false for nan too
        return f"--dropout must be at least 0 and below 1, not {args.dropout}"
    for name in ("warmup", "eval_every"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be at least 0, not {getattr(args, name)}"
    if not 0 <= args.seed < 2**32:  # numpy's seeds
        return f"--seed must be at least 0 and below 2**32, not {args.seed}"
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not divisible by --heads {args.heads}"
    return None


def scratch_config(args: argparse.Namespace, vocab_size: int) -> EncoderConfig:
    """A new small encoder's shape from the scratch-only flags."""
    return EncoderConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.max_seq_length,
        max_seq_length=args.max_seq_length,
        dropout=args.dropout,
        position=args.position,
    )


def init_weights(module: nn.Module) -> None:
    """BERT's initialisation: N(0, 0.02) weights, zero biases, identity LayerNorm."""
    from torch import nn

    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def build_model(args: argparse.Namespace) -> tuple[Encoder, Path, str]:
    """The encoder to train, the tokenizer.json it reads, and the name to save it under."""
    from torch import nn

    from minilm_embed.model.checkpoints import resumable
    from minilm_embed.model.encoder import Encoder
    from minilm_embed.model.weights import default_weights_dir, load_checkpoint, read_tokenizer

    if args.resume is not None:
        model, ckpt = load_checkpoint(resumable(args.resume))
        return model, args.resume / "tokenizer.json", ckpt.model_id
    weights = args.weights or default_weights_dir()
    if args.init == "default":
        model, ckpt = load_checkpoint(weights)
        for line in ckpt.defaults:  # the fine-tuned checkpoint writes them: its export will not say so
            print(f"train: note: {line}", file=sys.stderr)
        return model, weights / "tokenizer.json", ckpt.model_id.removesuffix(FINETUNED) + FINETUNED
    vocab = read_tokenizer(weights / "tokenizer.json", args.max_seq_length).vocab_size
    model = Encoder(scratch_config(args, vocab))
    model.apply(init_weights)
    if args.position == "sinusoidal":
        # The table's entries are of size 1: word embeddings of size 0.02 would drown in it, and
        # mean pooling would return mostly position (dev Spearman ~10 after 400 steps, measured).
        nn.init.normal_(model.embeddings.word.weight, std=1.0)
    name = f"scratch-{args.position}-{args.layers}x{args.hidden}"
    return model, weights / "tokenizer.json", name


@dataclass(frozen=True)
class Summary:
    """What a run did, for the lines printed at its end."""

    first_step: int
    steps: int
    seconds: float
    spearman_before: float | None
    spearman_after: float | None
    loss_first: list[float]
    loss_last: list[float]

    def lines(self, out: Path) -> list[str]:
        """The report printed at the end of a run."""
        from minilm_embed.model.loop import mean

        def fmt(x: float | None) -> str:
            return "n/a (no --data-dir)" if x is None else f"{x:.2f}"

        return [
            f"train: STS-B dev Spearman x100 before {fmt(self.spearman_before)}, "
            f"after {fmt(self.spearman_after)}",
            f"train: steps {self.first_step}-{self.steps} in {self.seconds:.0f} s "
            "(the evaluations before and after not counted)",
            f"train: loss {mean(self.loss_first):.4f} -> {mean(self.loss_last):.4f} "
            f"(mean of the first and last {len(self.loss_last)} steps)",
            f"train: wrote {out}",
        ]


def plan(args: argparse.Namespace, data: TrainingData) -> Plan:
    """--max-steps, or --epochs passes over the data."""
    from minilm_embed.model.loop import Plan

    per_epoch = len(data.batches(args.batch_size, args.seed, 0))
    total = args.max_steps if args.max_steps is not None else args.epochs * per_epoch
    return Plan(args.batch_size, args.seed, total, args.eval_every)


class Diverged(Exception):
    """A step whose loss or gradients are not finite: the run stops before its weights take them."""


def schedule(args: argparse.Namespace, total: int, resumed: Schedule | None) -> Schedule:
    """The learning rate and warm-up asked for, else the resumed checkpoint's, else their defaults
    for the kind of model."""
    from minilm_embed.model.checkpoints import Schedule

    resumed = resumed or Schedule(None, None)
    lr = next(x for x in (args.lr, resumed.lr, DEFAULT_LR[args.init]) if x is not None)
    warmup = next(n for n in (args.warmup, resumed.warmup, total // 10) if n is not None)
    return Schedule(lr, warmup)


def new_run(model: Encoder, plan: Schedule, total: int) -> Run:
    """A run on `plan`, which stops (Diverged) at the first step whose gradients are not finite."""
    from minilm_embed.model.loop import make_run

    lr, warmup = plan.lr, plan.warmup
    assert lr is not None and warmup is not None
    run = make_run(model, lr, warmup, total)
    run.optimizer.register_step_pre_hook(lambda optimizer, *_: stop_if_diverged(run, lr))
    return run


def stop_if_diverged(run: Run, lr: float) -> None:
    """Before an optimizer step: non-finite gradients (a nan or inf loss makes them so, even clipped)
    raise Diverged, so that no weights, and no checkpoint, take them."""
    import torch

    grads = [p.grad for p in run.model.parameters() if p.grad is not None]
    if grads and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()):
        raise diverged(run.step + 1, lr)


def diverged(step: int, lr: float) -> Diverged:
    return Diverged(
        f"step {step}: the loss or its gradients are not finite (the run diverged); "
        f"try a lower --lr than {lr:g}"
    )


def check_inputs(args: argparse.Namespace) -> Texts:
    """--out, the training data and the data directory's dev split checked, before torch is imported
    (seconds) and hours of training: the training texts."""
    check_out(args.out, STATE_FILE, "a checkpoint written by model.train")
    check_leftovers(args.out, args.resume)
    texts = read_training_data(args.pairs, args.sts_train, args.data_dir)
    if args.data_dir is not None:
        read_sts(sts_path(args.data_dir, "dev"))  # read again once there is a tokenizer (DevSet.load)
    return texts


def prepare(
    args: argparse.Namespace, texts: Texts
) -> tuple[Run, TrainingData, Plan, DevSet | None, Callable[[], None]]:
    """The run to continue (fresh or resumed), its data and plan, the dev set, and how to save it."""
    from minilm_embed.model.checkpoints import (
        Schedule,
        batch_order,
        read_state,
        restore,
        resumed_schedule,
        run_record,
        save,
    )
    from minilm_embed.model.evaluate import DevSet
    from minilm_embed.model.loop import seed_everything
    from minilm_embed.model.weights import read_tokenizer

    seed_everything(args.seed)
    model, tokenizer_file, model_id = build_model(args)
    model.train()
    tokenizer = read_tokenizer(tokenizer_file, model.config.max_seq_length)
    data = tokenize(tokenizer, *texts)
    dev = DevSet.load(args.data_dir, tokenizer) if args.data_dir is not None else None
    steps = plan(args, data)
    state = read_state(args.resume) if args.resume is not None else None
    resumed = None
    if state is not None:
        resumed = resumed_schedule(state, args.resume, Schedule(args.lr, args.warmup))
    run_plan = schedule(args, steps.total_steps, resumed)
    run = new_run(model, run_plan, steps.total_steps)
    order = batch_order(steps, data)
    if state is not None:
        restore(run, state, args.resume, order, steps.total_steps)
    record = run_record(order, run_plan)
    return run, data, steps, dev, lambda: save(run, tokenizer_file, args.out, model_id, record)


@dataclass
class Progress:
    """How far a run got, for the line a Ctrl-C prints: the run, and the step of its last checkpoint."""

    run: Run | None = None
    saved_step: int | None = None

    def saving(self, save_to: Callable[[], None]) -> Callable[[], None]:
        """`save_to`, run whole even if Ctrl-C is pressed meanwhile, and recorded."""

        def save_whole() -> None:
            assert self.run is not None
            first_bad = next((h for h in self.run.history if not math.isfinite(h.get("loss", 0.0))), None)
            if first_bad is not None:  # never a checkpoint of a diverged run
                raise diverged(int(first_bad["step"]), float(self.run.scheduler.base_lrs[0]))
            with interrupts_deferred():
                save_to()
                self.saved_step = self.run.step

        return save_whole

    def kept(self, out: Path) -> str:
        """Where the run's last checkpoint is, for the line a failed run ends with."""
        if self.saved_step is None:
            return f"it saved no checkpoint: {out} is unchanged"
        return f"the last checkpoint, step {self.saved_step}, is in {out}"

    def interrupted(self, out: Path) -> str:
        """The line a Ctrl-C prints: where the run stopped, and where its last checkpoint is."""
        at = "" if self.run is None else f" at step {self.run.step}"
        if self.saved_step is None:
            return f"train: interrupted{at}, before it saved a checkpoint: {out} is unchanged"
        return (
            f"train: interrupted{at}; the last checkpoint, step {self.saved_step}, is in {out} "
            f"(continue it with --resume {out} and the same flags)"
        )


def train(args: argparse.Namespace, texts: Texts, progress: Progress | None = None) -> Summary:
    """Train as the arguments say on `texts` (check_inputs'), evaluating before and after; the
    checkpoint is saved at the end."""
    import torch

    from minilm_embed.model.loop import evaluate, fit, loss_window

    torch.set_num_threads(args.threads)
    progress = progress or Progress()
    run, data, steps, dev, save_to = prepare(args, texts)
    progress.run = run
    save_to = progress.saving(save_to)
    first = run.step
    before = evaluate(run, dev)
    started = time.perf_counter()
    fit(run, data, dev, steps, save_to)
    seconds = time.perf_counter() - started
    after = evaluate(run, dev)
    save_to()
    losses = loss_window(run.history, last=False), loss_window(run.history, last=True)
    return Summary(first, run.step, seconds, before, after, *losses)


def refuse(e: Exception) -> int:
    print(f"train: error: {e}", file=sys.stderr)
    return 2


def checked_then_trained(args: argparse.Namespace, progress: Progress) -> int:
    """Bad flags, data and --out refused before torch is loaded (seconds); then the training, whose bad
    checkpoints are refused too. torch failing to load is no bad input: its own traceback."""
    try:
        texts = check_inputs(args)
    except (DataError, OutputError, OSError) as e:
        return refuse(e)
    from minilm_embed.model.weights import WeightsError  # loads torch

    try:
        summary = train(args, texts, progress)
    except (DataError, WeightsError, OutputError, OSError) as e:
        return refuse(e)
    except Diverged as e:
        print(f"train: error: {e}; {progress.kept(args.out)}", file=sys.stderr)
        return 1  # no bad input: the run failed
    print("\n".join(summary.lines(args.out)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line: exit status 0, or 2 with one line naming the bad file or argument, or 1 with
    one line naming the step where the run diverged, or 130 after Ctrl-C with one line naming the last
    checkpoint."""
    args = parse_args(argv)
    progress = Progress()
    try:
        return checked_then_trained(args, progress)
    except KeyboardInterrupt:
        print(progress.interrupted(args.out), file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
