"""model.train: a tiny encoder learns on CPU, its checkpoint exports through the parity gate, it
resumes exactly where it stopped, and bad training data is refused with one line naming the line."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minilm_embed.model import checkpoints, directories, loop, pairs, train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--init", "scratch", "--hidden", "32", "--layers", "2", "--heads", "2", "--max-seq-length", "32"]
COLOURS = ["red", "blue", "green", "black"]
ANIMALS = ["cat", "dog", "horse", "bird"]


@pytest.fixture(autouse=True)
def no_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """Train without STS-B dev evaluation, whatever the environment says: the tests bring their data."""
    monkeypatch.delenv("EMBED_DATA_DIR", raising=False)


def write_pairs(path: Path) -> Path:
    rows = [
        {"anchor": f"the {c} {a} is sleeping", "positive": f"a {c} {a} sleeps"}
        for c in COLOURS
        for a in ANIMALS
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_scored(path: Path) -> Path:
    rows = [
        f"g\ts\t2012\t{i:04d}\t{5.0 if c == d else 1.0}\tthe {c} {a} runs.\ta {d} {a} is running."
        for i, (c, d, a) in enumerate((c, d, a) for c in COLOURS for d in COLOURS[:2] for a in ANIMALS[:2])
    ]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def losses(checkpoint: Path) -> list[float]:
    lines = (checkpoint / checkpoints.LOG_FILE).read_text(encoding="utf-8").splitlines()
    return [entry["loss"] for entry in map(json.loads, lines) if "loss" in entry]


def test_tiny_model_learns_and_its_checkpoint_exports_with_parity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    args = [*TINY, "--pairs", str(write_pairs(tmp_path / "pairs.jsonl")), "--batch-size", "8"]
    assert train.main([*args, "--max-steps", "16", "--lr", "3e-3", "--dropout", "0", "--out", str(ckpt)]) == 0
    curve = losses(ckpt)
    assert len(curve) == 16
    assert sum(curve[-4:]) / 4 < 0.7 * sum(curve[:4]) / 4, curve
    capsys.readouterr()
    # The export command's main, in this process: as a subprocess it cost ~10 CPU-s more, most of them
    # imports (tests/test_export.py runs `python -m minilm_embed.export` as a user does).
    export = importlib.import_module("minilm_embed.export.__main__")
    status = export.main(["--weights", str(ckpt), "--out", str(tmp_path / "onnx")])
    done = capsys.readouterr()
    assert status == 0, done.out + done.err
    assert "parity passed" in done.out
    assert (tmp_path / "onnx" / "model.onnx").is_file()


def test_an_interrupted_run_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scored = write_scored(tmp_path / "sts.csv")
    args = [*TINY, "--position", "sinusoidal", "--sts-train", str(scored), "--batch-size", "4"]
    args += ["--max-steps", "6", "--eval-every", "3"]
    assert train.main([*args, "--out", str(tmp_path / "whole")]) == 0

    real_step = loop.train_step

    def killed_at_step_5(run: loop.Run, batch: pairs.Batch) -> float:
        if run.step == 4:
            raise KeyboardInterrupt
        return real_step(run, batch)

    monkeypatch.setattr(loop, "train_step", killed_at_step_5)
    assert train.main([*args, "--out", str(tmp_path / "cut")]) == 130  # leaves the step-3 checkpoint
    cut = tmp_path / "cut"
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"train: interrupted at step 4; the last checkpoint, step 3, is in {cut} "
        f"(continue it with --resume {cut} and the same flags)"
    )
    monkeypatch.setattr(loop, "train_step", real_step)
    resumed = [*args, "--resume", str(tmp_path / "cut"), "--out", str(tmp_path / "resumed")]
    assert train.main(resumed) == 0

    assert losses(tmp_path / "resumed") == losses(tmp_path / "whole")
    want = load_file(str(tmp_path / "whole" / "model.safetensors"))
    got = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


GOOD_PAIR = b'{"anchor": "a", "positive": "b"}\n'
GOOD_ROW = b"g\ts\t2012\t1\t5.0\ta\tb\n"
BAD_DATA = {
    "missing field": ("--pairs", GOOD_PAIR + b'{"anchor": "a"}\n', ":2: missing field 'positive'"),
    "empty file": ("--pairs", b"", "no pairs (the file is empty)"),
    "not JSON": ("--pairs", GOOD_PAIR + b'\n{"anchor": \n', ":3: not valid JSON"),
    "pairs not UTF-8": ("--pairs", GOOD_PAIR + b'{"anchor": "\xff"}\n', ":2: not UTF-8"),
    "score above 5": ("--sts-train", GOOD_ROW + b"g\ts\t2012\t2\t7.5\ta\tb\n", ":2: score 7.5 is outside"),
    "scores not UTF-8": ("--sts-train", GOOD_ROW + b"g\ts\t2012\t2\t1.0\t\xe9t\xe9\tc\n", ":2: not UTF-8"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_bad_training_data_is_refused_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    flag, content, message = BAD_DATA[case]
    data = tmp_path / "bad.data"
    data.write_bytes(content)
    assert train.main([*TINY, flag, str(data), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"train: error: {data}:") and message in err
    assert not (tmp_path / "out").exists()


def test_bad_training_data_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    data = tmp_path / "pairs.jsonl"
    data.write_bytes(GOOD_PAIR + b'{"anchor": "caf\xe9", "positive": "b"}\n')
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "minilm_embed.model.train",
        *TINY,
        "--pairs",
        str(data),
        "--out",
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == f"train: error: {data}:2: not UTF-8 (byte 0xe9 at column 16)\n"
    assert done.stdout == ""


# main() on each argument list, in a process that has not imported torch: each status and stderr, and
# whether torch was imported by the end.
REFUSE = """
import contextlib, io, json, sys
from minilm_embed.model.train import main
seen = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse's refusal of a flag
            status = e.code
    seen.append([status, err.getvalue()])
print(json.dumps({"seen": seen, "torch": "torch" in sys.modules}))
"""


def test_bad_flags_data_and_out_are_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """A typo in a flag, a data file or --out is refused at once, not after the seconds torch takes to
    import (~4 CPU-s): checked in a process of its own, which imports only what the refusals need."""
    good = str(write_pairs(tmp_path / "pairs.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(GOOD_PAIR + b'{"anchor": "caf\xe9", "positive": "b"}\n')
    kept = tmp_path / "mine"
    kept.mkdir()
    (kept / "notes.txt").write_text("keep me")
    no_dev = tmp_path / "data"
    (no_dev / "stsbenchmark").mkdir(parents=True)
    (no_dev / "stsbenchmark" / "sts-train.csv").write_bytes(GOOD_ROW)
    out = ["--out", str(tmp_path / "out")]
    nowhere = tmp_path / "nowhere"
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "enc.partial").mkdir()
    (tmp_path / "enc.partial" / "d").write_text("y")
    flags = [
        (["--lr", "nan"], "--lr must be a positive number, not nan"),
        (["--lr", "inf"], "--lr must be a positive number, not inf"),
        (["--lr", "-1"], "--lr must be a positive number, not -1.0"),
        (["--dropout", "1.5"], "--dropout must be at least 0 and below 1, not 1.5"),
        (["--dropout", "-0.1"], "--dropout must be at least 0 and below 1, not -0.1"),
        (["--dropout", "nan"], "--dropout must be at least 0 and below 1, not nan"),
        (["--eval-every", "-5"], "--eval-every must be at least 0, not -5"),
        (["--seed", "-1"], "--seed must be at least 0 and below 2**32, not -1"),
    ]
    cases = [(["--pairs", good, *flag, *out], ": error: " + message) for flag, message in flags]
    cases += [
        (
            ["--pairs", good, "--out", "/proc/enc"],
            "train: error: --out /proc/enc: cannot create a directory in /proc",
        ),
        (
            ["--pairs", good, "--out", f"{afile}/sub"],
            f"train: error: --out {afile}/sub: {afile} is not a directory",
        ),
        (
            ["--pairs", good, "--out", str(tmp_path / "enc")],
            f"train: error: {tmp_path / 'enc.partial'} holds files but is not a checkpoint of model.train: "
            "move or remove it",
        ),
        (["--batch-size", "0", "--pairs", good, *out], ": error: --batch-size must be at least 1, not 0"),
        (["--pairs", str(nowhere), *out], f"train: error: [Errno 2] No such file or directory: '{nowhere}'"),
        (["--pairs", str(bad), *out], f"train: error: {bad}:2: not UTF-8"),
        (["--data-dir", str(nowhere), *out], f"train: error: {nowhere}: no STS Benchmark train split"),
        (["--pairs", good, "--data-dir", str(no_dev), *out], f"train: error: {no_dev}: no STS Benchmark dev"),
        (["--pairs", good, "--out", str(kept)], f"train: error: --out {kept} holds files but no training_"),
    ]
    command = [sys.executable, "-c", REFUSE, json.dumps([argv for argv, _ in cases])]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for (argv, message), (status, err) in zip(cases, result["seen"], strict=True):
        assert status == 2, (argv, err)
        if message.startswith("train: "):
            assert err.startswith(message) and err.count("\n") == 1, (argv, err)
        else:
            assert message in err.splitlines()[-1], (argv, err)  # argparse's: the usage, then its line
    assert not result["torch"], "torch was imported before a refusal"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "afile",
        "bad.jsonl",
        "data",
        "enc.partial",
        "mine",
        "pairs.jsonl",
    ]
    assert (kept / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "enc.partial" / "d").read_text() == "y"


def test_train_checks_out_against_the_state_file_that_checkpoints_write() -> None:
    assert train.STATE_FILE == checkpoints.STATE_FILE


def test_a_run_killed_while_saving_keeps_the_last_whole_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving steps 3 and 6 into one --out: killed after step 6's weights but before its optimizer
    state, the directory still holds step 3 whole (weights and state of one step), and resumes."""
    scored = write_scored(tmp_path / "sts.csv")
    args = [*TINY, "--sts-train", str(scored), "--batch-size", "4", "--max-steps", "6", "--eval-every", "3"]
    out = tmp_path / "ckpt"
    assert train.main([*args, "--max-steps", "3", "--out", str(out)]) == 0
    step_3 = load_file(str(out / "model.safetensors"))

    real_save = torch.save

    def killed(obj: object, f: object, *a: object, **kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    assert train.main([*args, "--resume", str(out), "--out", str(out)]) == 130
    monkeypatch.setattr(torch, "save", real_save)

    kept = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(step_3[k], kept[k]) for k in step_3), "step 3's weights were overwritten"
    assert torch.load(out / checkpoints.STATE_FILE, weights_only=True)["step"] == 3
    assert train.main([*args, "--resume", str(out), "--out", str(out)]) == 0
    assert torch.load(out / checkpoints.STATE_FILE, weights_only=True)["step"] == 6
    assert not any(p.name.startswith("ckpt.") for p in tmp_path.iterdir()), list(tmp_path.iterdir())


def test_a_run_stopped_between_the_renames_names_the_checkpoint_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scored = write_scored(tmp_path / "sts.csv")
    args = [*TINY, "--sts-train", str(scored), "--batch-size", "4", "--max-steps", "2"]
    assert train.main([*args, "--out", str(tmp_path / "ckpt")]) == 0
    (tmp_path / "ckpt").rename(tmp_path / "ckpt.previous")
    capsys.readouterr()
    status = train.main([*args, "--resume", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "ckpt.previous holds the last whole checkpoint" in err, err


def test_out_that_is_not_a_checkpoint_is_refused_and_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out is replaced whole: a directory holding anything but a checkpoint of this command (a typo
    such as `--out build`) is refused before training, and what it holds is kept."""
    notes = tmp_path / "mine"
    (notes / "sub").mkdir(parents=True)
    (notes / "sub" / "notes.txt").write_text("keep me")
    args = [*TINY, "--pairs", str(write_pairs(tmp_path / "pairs.jsonl")), "--max-steps", "1"]
    for out, message in [
        (notes, f"--out {notes} holds files but no training_state.pt"),
        (Path("."), "--out .: name a directory of its own"),
    ]:
        assert train.main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("train: error: ") and message in err, err
    assert (notes / "sub" / "notes.txt").read_text() == "keep me"
    assert train.main([*args, "--out", str(tmp_path / "ckpt")]) == 0
    assert train.main([*args, "--out", str(tmp_path / "ckpt")]) == 0  # its own checkpoint: replaced


def test_a_missing_or_unreadable_tokenizer_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --weights directory whose tokenizer.json is missing (a scratch model reads only that file) or
    not a tokenizer (an HTML error page saved by a failed download): one line naming it, status 2."""
    pairs_file = str(write_pairs(tmp_path / "pairs.jsonl"))
    bare = tmp_path / "bare"
    bare.mkdir()
    command = [*TINY, "--weights", str(bare), "--pairs", pairs_file, "--out", str(tmp_path / "a")]
    assert train.main(command) == 2
    assert capsys.readouterr().err.startswith(f"train: error: {bare / 'tokenizer.json'}: no such file")

    ckpt = tmp_path / "ckpt"
    assert train.main([*TINY, "--pairs", pairs_file, "--max-steps", "1", "--out", str(ckpt)]) == 0
    (ckpt / "tokenizer.json").write_text("<html>404 Not Found</html>\n")
    capsys.readouterr()
    for init in (["--init", "default"], TINY):
        command = [*init, "--weights", str(ckpt), "--pairs", pairs_file, "--out", str(tmp_path / "b")]
        assert train.main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"train: error: {ckpt / 'tokenizer.json'}: not a tokenizer"), err
        assert len(err.splitlines()) == 1


def test_resume_with_other_batches_is_refused_naming_the_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The batches of each step follow from the data, --batch-size and --seed: a resume given others
    would silently train on other batches than the run it continues, so it is refused, naming them."""
    scored = write_scored(tmp_path / "sts.csv")
    args = [*TINY, "--sts-train", str(scored), "--batch-size", "4", "--max-steps", "2"]
    ckpt = tmp_path / "ckpt"
    assert train.main([*args, "--out", str(ckpt)]) == 0
    capsys.readouterr()
    other_data = tmp_path / "other.jsonl"
    write_pairs(other_data)
    resume = ["--resume", str(ckpt), "--out", str(tmp_path / "resumed")]
    for extra, message in [
        (["--batch-size", "2"], "--batch-size 4, not 2"),
        (["--seed", "1"], "--seed 0, not 1"),
        (["--pairs", str(other_data)], "its training data were 0 pairs and 16 scored pairs"),
        (["--max-steps", "1"], "it is at step 2, past the 1 steps asked for"),
    ]:
        assert train.main([*args, *extra, *resume]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith(f"train: error: --resume {ckpt}: ") and message in err, err
    assert not (tmp_path / "resumed").exists()
    assert train.main([*args, "--max-steps", "3", *resume]) == 0  # the same batches, further: allowed


def test_pairs_written_with_a_byte_order_mark_train(tmp_path: Path) -> None:
    """Windows tools (PowerShell's Out-File, Excel's "CSV UTF-8") start UTF-8 files with a byte-order
    mark, and end lines with CR LF: the pairs are the same pairs."""
    plain = write_pairs(tmp_path / "pairs.jsonl").read_text(encoding="utf-8")
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.replace("\n", "\r\n").encode("utf-8"))
    assert pairs.read_pairs(marked) == pairs.read_pairs(tmp_path / "pairs.jsonl")


def test_ctrl_c_stops_with_one_line_naming_the_last_checkpoint(tmp_path: Path) -> None:
    scored = write_scored(tmp_path / "sts.csv")
    out = tmp_path / "ckpt"
    args = [*TINY, "--sts-train", str(scored), "--batch-size", "4", "--max-steps", "100000"]
    command = [sys.executable, "-m", "minilm_embed.model.train", *args, "--eval-every", "2", "--threads", "1"]
    process = subprocess.Popen(
        [*command, "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / checkpoints.STATE_FILE).is_file():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr + stdout
    pattern = (
        r"train: interrupted at step (\d+); the last checkpoint, step (\d+), is in (.+) "
        r"\(continue it with --resume \3 and the same flags\)"
    )
    stopped = re.fullmatch(pattern, stderr.splitlines()[-1])
    assert stopped, stderr.splitlines()[-1]
    assert stopped.group(3) == str(out)
    saved = int(stopped.group(2))
    assert 2 <= saved <= int(stopped.group(1))
    assert torch.load(out / checkpoints.STATE_FILE, weights_only=True)["step"] == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "sts.csv"]


def test_fine_tuning_a_fine_tuned_checkpoint_keeps_one_finetuned_suffix(tmp_path: Path) -> None:
    pairs_file = str(write_pairs(tmp_path / "pairs.jsonl"))
    common = ["--pairs", pairs_file, "--max-steps", "1", "--threads", "1"]
    assert train.main([*TINY, *common, "--out", str(tmp_path / "0")]) == 0
    for generation in ("1", "2"):
        previous = tmp_path / str(int(generation) - 1)
        assert train.main(["--weights", str(previous), *common, "--out", str(tmp_path / generation)]) == 0
        config = json.loads((tmp_path / generation / "config.json").read_text())
        assert config["_name_or_path"] == "scratch-learned-2x32-finetuned"


def test_a_fresh_run_removes_only_its_own_leftovers_beside_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A save removes `<out>.partial` and `<out>.previous`: a run refuses to start while either holds
    what is not its own to remove (a user's files, or a killed run's checkpoint, which it names to
    resume), and removes an empty one or an unfinished save (its marker inside)."""
    args = [*TINY, "--pairs", str(write_pairs(tmp_path / "pairs.jsonl")), "--max-steps", "1"]
    out = tmp_path / "enc"
    partial, previous = tmp_path / "enc.partial", tmp_path / "enc.previous"
    previous.mkdir()
    (previous / "n").write_text("x")
    assert train.main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"train: error: {previous} holds files but is not a checkpoint of model.train: move or remove it\n"
    )
    (previous / "n").unlink()
    partial.mkdir()
    (partial / "model.safetensors").write_text("half")
    (partial / directories.SAVING_MARKER).write_text("")
    assert train.main([*args, "--out", str(out)]) == 0  # an empty .previous, an unfinished save: removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["enc", "pairs.jsonl"]

    out.rename(previous)  # a run killed between save's two renames
    capsys.readouterr()
    assert train.main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"train: error: {previous} holds a checkpoint that a killed run left: resume it with "
        f"--resume {previous}, or remove it\n"
    )
    assert (previous / checkpoints.STATE_FILE).is_file()
    assert train.main([*args, "--max-steps", "2", "--resume", str(previous), "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["enc", "pairs.jsonl"]
    assert torch.load(out / checkpoints.STATE_FILE, weights_only=True)["step"] == 2

    shutil.copytree(out, previous)  # killed after the second rename: an older checkpoint is left
    capsys.readouterr()
    assert train.main([*args, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"train: error: {previous} holds a checkpoint that a killed run left, older than {out}'s: "
        "move or remove it\n"
    )
    previous.rename(partial)  # killed after writing it whole, before swapping it in
    assert train.main([*args, "--resume", str(out), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"train: error: {partial} holds a checkpoint that a killed run left: resume it with "
        f"--resume {partial} --out DIR (another directory), or remove it\n"
    )
    assert (partial / checkpoints.STATE_FILE).is_file()


def test_a_diverged_run_stops_at_its_first_non_finite_loss_and_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scored = write_scored(tmp_path / "sts.csv")
    args = [*TINY, "--sts-train", str(scored), "--batch-size", "4", "--lr", "1e-3", "--max-steps", "6"]
    args += ["--eval-every", "2"]
    out = tmp_path / "ckpt"
    real_loss = loop.batch_loss
    calls = []

    def nan_from_step_3(model: object, batch: pairs.Batch) -> torch.Tensor:
        calls.append(1)
        loss = real_loss(model, batch)  # type: ignore[arg-type]
        return loss * float("nan") if len(calls) >= 3 else loss

    monkeypatch.setattr(loop, "batch_loss", nan_from_step_3)
    assert train.main([*args, "--out", str(out)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "train: error: step 3: the loss or its gradients are not finite (the run diverged); try a lower "
        f"--lr than 0.001; the last checkpoint, step 2, is in {out}"
    )
    step_2 = load_file(str(out / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in step_2.values())
    calls[:] = [1, 1]
    assert train.main([*args, "--resume", str(out), "--out", str(out)]) == 1
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"; it saved no checkpoint: {out} is unchanged")
    kept = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(step_2[k], kept[k]) for k in step_2)
    assert torch.load(out / checkpoints.STATE_FILE, weights_only=True)["step"] == 2

    # A nan loss whose gradients were finite would pass the optimizer's check: no save takes it.
    monkeypatch.setattr(train, "stop_if_diverged", lambda run, lr: None)
    calls.clear()
    other = tmp_path / "other"
    assert train.main([*args, "--out", str(other)]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("train: error: step 3: the loss or its")
    assert torch.load(other / checkpoints.STATE_FILE, weights_only=True)["step"] == 2


def test_resume_with_another_lr_or_warmup_is_refused_and_without_them_keeps_the_schedule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The optimizer state carries the learning rate and the schedule's factor the warm-up: another
    --lr was ignored, another --warmup (or its default, 10% of a larger budget) re-warmed the run."""
    scored = write_scored(tmp_path / "sts.csv")
    args = [*TINY, "--sts-train", str(scored), "--batch-size", "4"]
    ckpt = tmp_path / "ckpt"
    assert train.main([*args, "--lr", "1e-3", "--warmup", "1", "--max-steps", "2", "--out", str(ckpt)]) == 0
    capsys.readouterr()
    resume = [*args, "--max-steps", "4", "--resume", str(ckpt), "--out", str(ckpt)]
    for extra, message in [
        (["--lr", "2e-3"], "--lr 0.001, not 0.002"),
        (["--warmup", "2"], "--warmup 1, not 2"),
    ]:
        assert train.main([*resume, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith(f"train: error: --resume {ckpt}: it was trained with {message}; "), err
    assert train.main(resume) == 0  # neither given: the run's own
    lines = (ckpt / checkpoints.LOG_FILE).read_text(encoding="utf-8").splitlines()
    lrs = [entry["lr"] for entry in map(json.loads, lines) if "lr" in entry]
    # Each step logs the rate of the next: warm-up 1, then decay to 0 at the (new) total of 4.
    assert lrs[2:] == pytest.approx([1e-3 / 3, 0.0])  # not 10% of 4 steps' warm-up (0): 1e-3 / 4
    assert train.main([*resume, "--max-steps", "5", "--lr", "1e-3", "--warmup", "1"]) == 0  # the same


def test_a_checkpoints_weights_are_readable_as_its_other_files_are(tmp_path: Path) -> None:
    """safetensors writes 0600: another uid (a container) could not read the weights."""
    previous = os.umask(0o022)
    try:
        args = [*TINY, "--pairs", str(write_pairs(tmp_path / "pairs.jsonl")), "--max-steps", "1"]
        assert train.main([*args, "--out", str(tmp_path / "ckpt")]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "ckpt").iterdir() if p.is_file()}
    assert set(modes.values()) == {0o644}, modes
