"""python -m model.train: fine-tune the encoder, or train a small one from scratch, on sentence pairs.

Two kinds of data, each batch drawn from one kind:
- pairs (JSONL ``{"anchor": ..., "positive": ...}``): contrastive loss with in-batch negatives
  (cross-entropy over the scaled cosine-similarity matrix; the positive is on the diagonal);
- scored pairs (STS-B rows, score 0-5): MSE between cos(u, v) and score / 5.

Saves the Hugging Face / sentence-transformers layout that ``python -m export --weights`` reads, plus
``training_state.pt`` (optimizer, scheduler, step, RNG) that ``--resume`` continues from.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from model.config import EncoderConfig
from model.data import DataError, ScoredPair, read_sts, sts_path, utf8_lines
from model.encoder import Encoder
from model.evaluate import length_sorted, spearman_x100, torch_embedder
from model.tokenizer import Tokenizer, pad_batch
from model.weights import WeightsError, default_weights_dir, load_checkpoint, save_checkpoint

STATE_FILE = "training_state.pt"
LOG_FILE = "training_log.jsonl"
CONTRASTIVE_SCALE = 20.0  # cosine similarities in [-1, 1] are too flat a softmax without it
MAX_GRAD_NORM = 1.0
DEFAULT_LR = {"default": 2e-5, "scratch": 1e-3}
LOSS_WINDOW = 20  # steps averaged for the loss reported at the start and end of a run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m model.train", description=__doc__.splitlines()[0])
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
    for name in ("max_steps", "lr"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}"
    if args.warmup is not None and args.warmup < 0:
        return f"--warmup must be at least 0, not {args.warmup}"
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not divisible by --heads {args.heads}"
    return None


# --- data -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """Token-id rows of both sides of each pair; ``scores`` (0-1) only for scored pairs."""

    first: list[list[int]]
    second: list[list[int]]
    scores: list[float] | None


@dataclass(frozen=True)
class TrainingData:
    """Both kinds of pairs, tokenized once."""

    pairs: list[tuple[list[int], list[int]]]
    scored: list[tuple[list[int], list[int], float]]

    def batches(self, size: int, seed: int, epoch: int) -> list[Batch]:
        """One epoch: each kind shuffled and cut into batches, then the batches shuffled together."""
        rng = random.Random(seed * 100_003 + epoch)
        pairs, scored = rng.sample(self.pairs, len(self.pairs)), rng.sample(self.scored, len(self.scored))
        out = [Batch([a for a, _ in c], [b for _, b in c], None) for c in _chunks(pairs, size)]
        out += [
            Batch([a for a, _, _ in c], [b for _, b, _ in c], [s for *_, s in c])
            for c in _chunks(scored, size)
        ]
        rng.shuffle(out)
        return out


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _pair(path: Path, number: int, line: str) -> tuple[str, str]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{number}: not valid JSON ({e.msg})") from e
    if not isinstance(row, dict):
        raise DataError(f"{path}:{number}: expected a JSON object with 'anchor' and 'positive'")
    for key in ("anchor", "positive"):
        if key not in row:
            raise DataError(f"{path}:{number}: missing field {key!r}")
        if not isinstance(row[key], str) or not row[key].strip():
            raise DataError(f"{path}:{number}: field {key!r} must be a non-empty string")
    return row["anchor"], row["positive"]


def read_pairs(path: Path) -> list[tuple[str, str]]:
    """JSONL anchor/positive pairs; blank lines are skipped, anything else malformed is a DataError."""
    pairs = [_pair(path, n, line) for n, line in utf8_lines(path) if line.strip()]
    if not pairs:
        raise DataError(f"{path}: no pairs (the file is empty)")
    return pairs


def read_scored(path: Path) -> list[ScoredPair]:
    pairs = read_sts(path)  # one pair per line: any other line is an error there
    for number, pair in enumerate(pairs, start=1):
        if not 0.0 <= pair.score <= 5.0:
            raise DataError(f"{path}:{number}: score {pair.score} is outside 0-5")
    return pairs


def read_training_data(args: argparse.Namespace) -> tuple[list[tuple[str, str]], list[ScoredPair]]:
    sts_train = args.sts_train
    if sts_train is None and args.pairs is None and args.data_dir is not None:
        sts_train = sts_path(args.data_dir, "train")
    if sts_train is None and args.pairs is None:
        raise DataError("no training data: give --pairs FILE.jsonl, --sts-train FILE or --data-dir DIR")
    pairs = read_pairs(args.pairs) if args.pairs else []
    scored = read_scored(sts_train) if sts_train else []
    return pairs, scored


def tokenize(tokenizer: Tokenizer, pairs: list[tuple[str, str]], scored: list[ScoredPair]) -> TrainingData:
    a = tokenizer.encode([p[0] for p in pairs]).ids if pairs else []
    b = tokenizer.encode([p[1] for p in pairs]).ids if pairs else []
    sa = tokenizer.encode([p.first for p in scored]).ids if scored else []
    sb = tokenizer.encode([p.second for p in scored]).ids if scored else []
    scores = [p.score / 5.0 for p in scored]
    return TrainingData(list(zip(a, b, strict=True)), list(zip(sa, sb, scores, strict=True)))


# --- model ------------------------------------------------------------------------------------


def scratch_config(args: argparse.Namespace, vocab_size: int) -> EncoderConfig:
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
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def build_model(args: argparse.Namespace) -> tuple[Encoder, Path, str]:
    """The encoder to train, the tokenizer.json it reads, and the name to save it under."""
    if args.resume is not None:
        model, ckpt = load_checkpoint(args.resume)
        return model, args.resume / "tokenizer.json", ckpt.model_id
    weights = args.weights or default_weights_dir()
    if args.init == "default":
        model, ckpt = load_checkpoint(weights)
        return model, weights / "tokenizer.json", f"{ckpt.model_id}-finetuned"
    vocab = Tokenizer(weights / "tokenizer.json", args.max_seq_length).vocab_size
    model = Encoder(scratch_config(args, vocab))
    model.apply(init_weights)
    if args.position == "sinusoidal":
        # The table's entries are of size 1: word embeddings of size 0.02 would drown in it, and
        # mean pooling would return mostly position (dev Spearman ~10 after 400 steps, measured).
        nn.init.normal_(model.embeddings.word.weight, std=1.0)
    name = f"scratch-{args.position}-{args.layers}x{args.hidden}"
    return model, weights / "tokenizer.json", name


# --- losses -----------------------------------------------------------------------------------


def encode_pairs(model: Encoder, batch: Batch) -> tuple[Tensor, Tensor]:
    """Both sides in one forward pass: (B, C) and (B, C), L2-normalised."""
    ids, lengths = pad_batch(batch.first + batch.second)
    pooled = model(torch.from_numpy(ids), torch.from_numpy(lengths))  # (2B, C)
    u, v = F.normalize(pooled, dim=-1).split(len(batch.first))
    return u, v


def contrastive_loss(u: Tensor, v: Tensor) -> Tensor:
    """Multiple negatives ranking: row i's positive is v[i], every other v[j] is a negative."""
    logits = CONTRASTIVE_SCALE * u @ v.T  # (B, B)
    return F.cross_entropy(logits, torch.arange(len(u)))


def cosine_loss(u: Tensor, v: Tensor, scores: list[float]) -> Tensor:
    return F.mse_loss((u * v).sum(-1), torch.tensor(scores))


def batch_loss(model: Encoder, batch: Batch) -> Tensor:
    u, v = encode_pairs(model, batch)
    return contrastive_loss(u, v) if batch.scores is None else cosine_loss(u, v, batch.scores)


# --- evaluation -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DevSet:
    pairs: list[ScoredPair]
    texts: list[str]
    rows: list[list[int]]

    @classmethod
    def load(cls, data_dir: Path, tokenizer: Tokenizer) -> DevSet:
        pairs = read_sts(sts_path(data_dir, "dev"))
        texts = list(dict.fromkeys(s for p in pairs for s in (p.first, p.second)))
        return cls(pairs, texts, tokenizer.encode(texts).ids)

    def spearman(self, model: Encoder) -> float:
        """STS-B dev Spearman x100 of cos(u, v), with dropout off."""
        model.eval()
        vectors = length_sorted(torch_embedder(model))(self.rows)
        model.train()
        return spearman_x100(dict(zip(self.texts, vectors, strict=True)), self.pairs)


# --- optimisation and checkpoints --------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def linear_schedule(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))

    return factor


@dataclass
class Run:
    model: Encoder
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int
    history: list[dict[str, float]]


def save(run: Run, tokenizer_file: Path, out: Path, model_id: str) -> None:
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
    path = directory / STATE_FILE
    if not path.is_file():
        raise WeightsError(f"{path}: no training state to resume from (was it written by model.train?)")
    state = torch.load(path, weights_only=True)
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    run.step, run.history = int(state["step"]), list(state["history"])


def batch_stream(data: TrainingData, size: int, seed: int, start: int) -> Iterator[Batch]:
    """Batches from step ``start`` on, epoch after epoch, in the order an unbroken run sees them."""
    per_epoch = len(data.batches(size, seed, 0))
    epoch, skip = divmod(start, per_epoch)
    while True:
        yield from data.batches(size, seed, epoch)[skip:]
        epoch, skip = epoch + 1, 0


def train_step(run: Run, batch: Batch) -> float:
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


# --- command line -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    first_step: int
    steps: int
    seconds: float
    spearman_before: float | None
    spearman_after: float | None
    loss_first: list[float]
    loss_last: list[float]

    def lines(self, out: Path) -> list[str]:
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


def total_steps(args: argparse.Namespace, data: TrainingData) -> int:
    per_epoch = len(data.batches(args.batch_size, args.seed, 0))
    return args.max_steps if args.max_steps is not None else args.epochs * per_epoch


def make_run(args: argparse.Namespace, model: Encoder, total: int) -> Run:
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.init]
    warmup = args.warmup if args.warmup is not None else total // 10
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_schedule(warmup, total))
    return Run(model, optimizer, scheduler, 0, [])


def evaluate(run: Run, dev: DevSet | None) -> float | None:
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


def fit(
    run: Run, data: TrainingData, dev: DevSet | None, args: argparse.Namespace, save_to: Callable[[], None]
) -> None:
    total = total_steps(args, data)
    stream = batch_stream(data, args.batch_size, args.seed, run.step)
    with tqdm(total=total, initial=run.step, desc="train", unit="step", mininterval=1.0) as bar:
        while run.step < total:
            loss = train_step(run, next(stream))
            run.history.append({"step": run.step, "loss": loss, "lr": float(run.scheduler.get_last_lr()[0])})
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if args.eval_every and run.step % args.eval_every == 0 and run.step < total:
                checkpoint(run, dev, save_to)


def prepare(args: argparse.Namespace) -> tuple[Run, TrainingData, DevSet | None, Callable[[], None]]:
    """The run to continue (fresh or resumed), its data, the dev set, and how to save it."""
    texts = read_training_data(args)  # before the model: a bad file fails fast
    seed_everything(args.seed)
    model, tokenizer_file, model_id = build_model(args)
    model.train()
    tokenizer = Tokenizer(tokenizer_file, model.config.max_seq_length)
    data = tokenize(tokenizer, *texts)
    dev = DevSet.load(args.data_dir, tokenizer) if args.data_dir is not None else None
    run = make_run(args, model, total_steps(args, data))
    if args.resume is not None:
        restore(run, args.resume)
    return run, data, dev, lambda: save(run, tokenizer_file, args.out, model_id)


def train(args: argparse.Namespace) -> Summary:
    run, data, dev, save_to = prepare(args)
    first = run.step
    before = evaluate(run, dev)
    started = time.perf_counter()
    fit(run, data, dev, args, save_to)
    seconds = time.perf_counter() - started
    after = evaluate(run, dev)
    save_to()
    losses = loss_window(run.history, last=False), loss_window(run.history, last=True)
    return Summary(first, run.step, seconds, before, after, *losses)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        summary = train(args)
    except (DataError, WeightsError, OSError) as e:
        print(f"train: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary.lines(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
