"""`python -m minilm_embed.export`: bad input fails cleanly, a real export is complete and deterministic, and
the
parity gate refuses a model that does not match."""

from __future__ import annotations

import copy
import importlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from tokenizers import Tokenizer as LibraryTokenizer

from minilm_embed.export import parity
from minilm_embed.export.fp16 import FP16_SKIPPED
from minilm_embed.export.onnx import OPSET, WORD_EMBEDDINGS
from minilm_embed.export.optimize import (
    CPU_DISABLED_OPTIMIZERS,
    MS_DOMAIN,
    cpu_session,
    fuse_attention,
    int8_gemm_nodes,
    int8_matmul_model,
    int8_shared_constants,
    runtime_op_types,
)
from minilm_embed.export.parity import (
    INT8_MAX_SPEARMAN_GAP,
    INT8_MIN_BATCH_COSINE,
    MAX_ABS_DIFF,
    MAX_SPEARMAN_GAP,
    MIN_COSINE,
    Check,
    ParityError,
    ParityReport,
    batch_invariance,
    compare,
    onnx_embedder,
    onnx_outputs,
    pooled_checks,
    run_int8_gate,
    run_parity,
)
from minilm_embed.model.config import EncoderConfig
from minilm_embed.model.encoder import Encoder
from minilm_embed.model.evaluate import Embedder, length_sorted, torch_embedder
from minilm_embed.model.repository import (
    CPU_PROVIDER,
    CUDA_PROVIDER,
    FP32_FILE,
    INT8_FILE,
    WORD_EMBEDDINGS_FILE,
)
from minilm_embed.model.tokenizer import Tokenizer, pad_batch
from minilm_embed.model.weights import (
    DEFAULT_SHA256,
    WEIGHTS_FILE,
    default_weights_dir,
    save_checkpoint,
    sha256_file,
)

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY_FILES = {"model.onnx", "word_embeddings.f32", "tokenizer.json", "manifest.json"}
CHECK_NAMES = [
    "1 pytorch vs sentence-transformers",
    "2 onnx vs pytorch",
    "3 batch invariance (onnx)",
    "4 sts-b dev spearman (onnx vs ref)",
    "5 embeddings = normalised pooled",
    "6 pooled (onnx vs pytorch)",
]
SENTENCES = ["A man is playing a guitar.", "ok", "Two dogs are running through a field of tall grass."]


def export_command(*args: str) -> dict[str, Any]:
    """The CLI as a user starts it, without a data directory (EMBED_DATA_DIR would supply one): the
    arguments of subprocess.run or Popen."""
    env = {k: v for k, v in os.environ.items() if k != "EMBED_DATA_DIR"}
    command = [sys.executable, "-m", "minilm_embed.export", *args]
    return {"args": command, "cwd": ROOT, "env": env, "text": True}


def run_export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(**export_command(*args), capture_output=True, timeout=300)


def export_here(capfd, monkeypatch, *args: str) -> tuple[int, str, str]:
    """The CLI's main() in this process, as export_command starts it (no EMBED_DATA_DIR, in the
    checkout): its exit status, stdout and stderr (fd-level: what libraries write too). For tests of
    what an export writes and says, where a process of its own would spend ~10 CPU-s importing torch
    and sentence-transformers again; those of the process itself (a kill, Ctrl-C, what a user sees of
    bad input) start one."""
    monkeypatch.delenv("EMBED_DATA_DIR", raising=False)
    monkeypatch.chdir(ROOT)
    # Imported (where no export here has yet) with capture off: transformers' log handler keeps the
    # stderr it found then, which must be fd 2, where capfd reads, not a capture pytest closes after.
    with capfd.disabled():
        importlib.import_module("sentence_transformers")
    capfd.readouterr()
    status = export_main().main(list(args))
    out, err = capfd.readouterr()
    return status, out, err


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """PyTorch on one thread in this module's process, as the sessions it makes are (threads=1): on
    CI's two vCPUs, shared by make test's three workers, a second thread mostly spins (CPU time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One real export of the default weights into an empty directory, without a data directory: the
    CLI's main() in this process (the CLI's own process is run to its end, on a small checkpoint, by
    test_exporting_a_trained_checkpoint_prints_no_load_report_for_the_unused_pooler)."""
    out = tmp_path_factory.mktemp("export") / "out"
    argv = ["--out", str(out)]
    # Imported before stderr is redirected: transformers' log handler keeps the stderr it found then.
    importlib.import_module("sentence_transformers")
    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(stdout), redirect_stderr(stderr):
        patch.delenv("EMBED_DATA_DIR", raising=False)
        patch.chdir(ROOT)
        status = export_main().main(argv)
    result = subprocess.CompletedProcess(argv, status, stdout.getvalue(), stderr.getvalue())
    assert result.returncode == 0, result.stderr
    return out, result


@pytest.fixture(scope="module")
def manifest(exported) -> dict:
    out, _ = exported
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def built_manifest(model_dir) -> dict:
    return json.loads((model_dir / "manifest.json").read_text())


def bad_input(case: str, tmp_path: Path, checkpoint_copy) -> tuple[list[str], Path]:
    """CLI arguments for one kind of bad input, and the file the error must name."""
    if case == "nonexistent weights":
        return ["--weights", str(tmp_path / "nowhere")], tmp_path / "nowhere"
    if case == "not a checkpoint":
        (tmp_path / "empty").mkdir()
        return ["--weights", str(tmp_path / "empty")], tmp_path / "empty"
    if case == "checksum mismatch":
        return ["--sha256", "0" * 64], default_weights_dir() / WEIGHTS_FILE
    if case == "unreadable tokenizer":
        directory = checkpoint_copy()
        (directory / "tokenizer.json").unlink()
        (directory / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
        return ["--weights", str(directory)], directory / "tokenizer.json"
    assert case == "unrepresentable config"
    directory = checkpoint_copy({"num_attention_heads": 7})
    return ["--weights", str(directory)], directory / "config.json"


@pytest.mark.parametrize(
    "case",
    [
        "nonexistent weights",
        "not a checkpoint",
        "checksum mismatch",
        "unreadable tokenizer",
        "unrepresentable config",
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_file(case, tmp_path, checkpoint_copy):
    args, culprit = bad_input(case, tmp_path, checkpoint_copy)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_export(*args, "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("export: error: ")
    assert str(culprit) in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no out/, no staging directory


def test_export_writes_a_complete_repository_and_nothing_else(exported):
    out, result = exported
    assert {p.name for p in out.iterdir()} == REPOSITORY_FILES
    assert [p.name for p in out.parent.iterdir()] == ["out"]  # the staging directory is gone
    assert result.stdout.rstrip().endswith(f"export: wrote {out} (parity passed)")
    assert "Traceback" not in result.stderr


def test_the_repositorys_tokenizer_makes_the_servers_ids(exported):
    """A caller who makes token ids with the repository's tokenizer.json, as the library reads it,
    gets the server's: unpadded, cut at 256 (the packaged file pads to 128 and cuts at 128)."""
    out, _ = exported
    shipped = LibraryTokenizer.from_file(str(out / "tokenizer.json"))
    server = Tokenizer(out / "tokenizer.json", 256)
    texts = ["A man is playing a guitar.", " ".join(["word"] * 300), " ".join(["long"] * 200)]
    assert [e.ids for e in shipped.encode_batch(texts)] == server.encode(texts).ids
    assert [len(e.ids) for e in shipped.encode_batch(texts)] == [9, 256, 202]
    checkpoint = LibraryTokenizer.from_file(str(default_weights_dir() / "tokenizer.json"))
    assert checkpoint.get_vocab() == shipped.get_vocab()


def test_manifest_describes_the_export(exported, manifest, encoder_and_checkpoint):
    out, _ = exported
    _, checkpoint = encoder_and_checkpoint
    assert manifest["model_id"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert manifest["weights_sha256"] == DEFAULT_SHA256
    assert manifest["onnx_sha256"] == sha256_file(out / "model.onnx")
    assert manifest["config"] == checkpoint.config.to_dict()
    assert manifest["dimensions"] == 384 and manifest["max_input_tokens"] == 256
    assert manifest["pooling"] == "mean" and manifest["normalize"] is True
    assert manifest["opset"] == OPSET == 17
    assert manifest["ir_version"] <= 13
    # No int8 graph (calibrated on STS-B train, needs a data directory), no fp16 graph (gated on a
    # GPU, which this machine lacks): fp32 for each provider, CUDA's with no fusion disabled.
    cpu, cuda = manifest["graphs"]
    assert cpu["provider"] == CPU_PROVIDER and cpu["file"] == "model.onnx"
    assert cpu["precision"] == "fp32"
    assert cpu["disabled_optimizers"] == list(CPU_DISABLED_OPTIMIZERS)
    assert cuda["provider"] == CUDA_PROVIDER and cuda["file"] == "model.onnx"
    assert cuda["precision"] == "fp32" and cuda["disabled_optimizers"] == []
    assert manifest["parity_fp16"] == {"skipped": FP16_SKIPPED}


def test_manifest_records_every_parity_check_passed(manifest):
    parity = manifest["parity"]
    assert [c["name"] for c in parity["checks"]] == CHECK_NAMES
    assert all(c["passed"] for c in parity["checks"])
    for check in parity["checks"][:3]:
        assert check["min_cosine"] >= MIN_COSINE
    for check in parity["checks"][:2]:
        assert check["max_abs_diff"] <= MAX_ABS_DIFF
    assert parity["checks"][3]["note"] == "skipped: no data directory given"


def test_the_gate_table_reads_skipped_for_a_check_not_run_and_fail_for_a_failed_one():
    # A new user's pass: "4 sts-b dev spearman (onnx vs ref) ok     skipped: no data directory given".
    report = ParityReport(
        [
            Check("1 a check run", True, {"min_cosine": 0.99999}),
            Check("2 a check not run", True, note="skipped: no data directory given"),
            Check("3 a failed check", False, {"min_cosine": 0.5}),
        ],
        inputs=3,
    )
    rows = [line[34:].split(None, 1) for line in report.table().splitlines()[2:]]  # after the names
    assert rows == [
        ["ok", "min_cosine 0.99999"],
        ["skipped", "no data directory given"],
        ["FAIL", "min_cosine 0.5"],
    ]


def test_onnx_model_passes_the_checker_with_the_declared_versions(exported, manifest):
    out, _ = exported
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    model = onnx.load(str(out / "model.onnx"))
    assert model.ir_version == manifest["ir_version"]
    assert {o.domain: o.version for o in model.opset_import}[""] == OPSET
    assert [i.name for i in model.graph.input] == ["input_ids", "lengths"]
    assert [o.name for o in model.graph.output] == ["embeddings", "pooled"]


def test_export_is_deterministic(exported, model_dir, built_manifest):
    out, _ = exported
    digest = sha256_file(out / "model.onnx")
    assert digest == sha256_file(model_dir / "model.onnx"), f"{model_dir} holds a different model.onnx"
    assert digest == built_manifest["onnx_sha256"]


def test_exported_model_matches_pytorch_on_dynamic_shapes(exported, encoder_and_checkpoint, tokenizer):
    out, _ = exported
    encoder, _ = encoder_and_checkpoint
    session = cpu_session(out / "model.onnx", threads=1)
    for texts in (SENTENCES, SENTENCES[:1], ["word " * 400, "a"]):
        ids, lengths = pad_batch(tokenizer.encode(texts).ids)
        embeddings, pooled = session.run(None, {"input_ids": ids, "lengths": lengths})
        with torch.no_grad():
            want = encoder(torch.from_numpy(ids), torch.from_numpy(lengths)).numpy()
        np.testing.assert_allclose(pooled, want, rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
        np.testing.assert_allclose(embeddings, want / np.linalg.norm(want, axis=1, keepdims=True), atol=1e-5)


def test_parity_gate_fails_a_perturbed_encoder(exported, encoder_and_checkpoint, tokenizer):
    out, _ = exported
    encoder, checkpoint = encoder_and_checkpoint
    perturbed = copy.deepcopy(encoder)  # the shared encoder must stay untouched
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in perturbed.layers[3].parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 1e-3)
    session = cpu_session(out / "model.onnx", threads=1)  # exported from the unperturbed weights
    # No sentence-transformers reference: check 1 is skipped, so check 2 alone must catch it.
    report = run_parity(perturbed, session, tokenizer, checkpoint.directory, None, reference=False)
    assert report.passed is False
    by_name = {c.name: c for c in report.checks}
    assert [c.name for c in report.checks if not c.passed] == [
        "2 onnx vs pytorch",
        "6 pooled (onnx vs pytorch)",
    ]
    onnx_vs_pytorch = by_name["2 onnx vs pytorch"].figures
    assert onnx_vs_pytorch["max_abs_diff"] > MAX_ABS_DIFF or onnx_vs_pytorch["min_cosine"] < MIN_COSINE
    assert by_name["3 batch invariance (onnx)"].passed
    with pytest.raises(ParityError, match="2 onnx vs pytorch"):
        report.raise_on_failure()


def test_parity_gate_fails_an_encoder_that_sentence_transformers_disagrees_with(
    exported, encoder_and_checkpoint, tokenizer
):
    """Check 1 holds the encoder to sentence-transformers on the same weights: an encoder that is
    wrong (here, perturbed) fails it, whatever the graph says."""
    out, _ = exported
    encoder, checkpoint = encoder_and_checkpoint
    perturbed = copy.deepcopy(encoder)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in perturbed.layers[2].parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 1e-3)
    session = cpu_session(out / "model.onnx", threads=1)
    report = run_parity(perturbed, session, tokenizer, checkpoint.directory, None)
    first = next(c for c in report.checks if c.name == "1 pytorch vs sentence-transformers")
    assert not first.passed, first.figures
    assert first.figures["max_abs_diff"] > MAX_ABS_DIFF or first.figures["min_cosine"] < MIN_COSINE


def test_batch_invariance_fails_rows_that_depend_on_their_batch():
    """Check 3 alone: a graph whose padding leaks into the vectors (rows change with the batch's
    longest row) fails it; one whose rows do not, passes."""

    def fair(rows: list[list[int]]) -> np.ndarray:
        return np.array([[float(len(r)), 1.0, 0.0, 0.0] for r in rows])

    def leaky(rows: list[list[int]]) -> np.ndarray:
        out = fair(rows)
        out[:, 2] = 0.01 * (max(map(len, rows)) - out[:, 0])  # the row's padding shows in its vector
        return out

    rows = [[1] * n for n in (2, 5, 9, 3)]
    assert batch_invariance(fair, rows).passed
    assert not batch_invariance(leaky, rows).passed


def test_batch_invariance_over_a_sample_still_runs_the_shortest_and_longest_rows_alone():
    """More rows than the sample: a graph that errs only on the longest row, or only on a 1-token
    row, is caught; the check says how many rows it ran."""
    rows = [[1] * (3 + i % 40) for i in range(3000)] + [[1] * 256, [1]]

    def wrong_on(length: int) -> Embedder:
        def embed(batch: list[list[int]]) -> np.ndarray:
            out = np.array([[1.0, 0.0] for _ in batch])
            out[:, 1] = [float(len(r) == length and len(batch) > 1) for r in batch]  # only when batched
            return out

        return embed

    fair = batch_invariance(wrong_on(-1), rows, sample=64)
    assert fair.passed and fair.figures["rows"] == 64
    assert not batch_invariance(wrong_on(256), rows, sample=64).passed
    assert not batch_invariance(wrong_on(1), rows, sample=64).passed


class NegatedPooled:
    """A session whose `pooled` output is wrong (negated) and whose `embeddings` are right."""

    def __init__(self, session) -> None:
        self.session = session

    def run(self, outputs: list[str], feeds: dict) -> list[np.ndarray]:
        got = self.session.run(outputs, feeds)
        return [-g if name == "pooled" else g for name, g in zip(outputs, got, strict=True)]


def test_parity_gate_checks_the_pooled_output_that_normalize_false_returns(
    exported, encoder_and_checkpoint, tokenizer
):
    out, _ = exported
    encoder, _ = encoder_and_checkpoint
    rows = tokenizer.encode(SENTENCES).ids
    session = cpu_session(out / "model.onnx", threads=1)
    embeddings = length_sorted(onnx_embedder(session))(rows)
    reference = length_sorted(torch_embedder(encoder, pooled=True))(rows)
    _, pooled = onnx_outputs(session, rows)
    assert all(c.passed for c in pooled_checks(pooled, embeddings, reference))
    _, negated = onnx_outputs(NegatedPooled(session), rows)  # type: ignore[arg-type]
    assert np.array_equal(negated, -pooled)
    wrong = pooled_checks(negated, embeddings, reference)
    assert [c.passed for c in wrong] == [False, False]  # the embeddings alone passed the gate before


class FakeGraph:
    """A stand-in session: (B, 4) vectors from the ids; one non-finite row if asked."""

    def __init__(self, non_finite: bool = False) -> None:
        self.non_finite = non_finite

    def run(self, outputs: list[str], feeds: dict) -> list[np.ndarray]:
        ids = feeds["input_ids"]
        pooled = np.ones((len(ids), 4), np.float32)
        pooled[:, 0] = ids[:, 1] % 7 + 1
        if self.non_finite:
            pooled[0, 0] = np.nan
        normalised = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
        return [normalised if name == "embeddings" else pooled for name in outputs]


def test_the_int8_gate_refuses_non_finite_vectors_with_its_message_not_a_traceback(tokenizer, monkeypatch):
    monkeypatch.setattr(parity, "parity_texts", lambda data_dir: (["a b", "c d e", "f"], []))
    monkeypatch.setattr(parity, "spearman_x100", lambda vectors, pairs: 80.0)
    assert run_int8_gate(FakeGraph(), FakeGraph(), tokenizer, Path(".")).passed
    report = run_int8_gate(FakeGraph(), FakeGraph(non_finite=True), tokenizer, Path("."))  # KeyError before
    failed = {c.name: c.note for c in report.checks if not c.passed}
    assert failed["int8 vs fp32"] == "non-finite values"


def test_the_int8_gate_given_fp32_vectors_judges_as_given_the_fp32_graph(tokenizer, monkeypatch):
    """The export hands the int8 gate the fp32 gate's vectors rather than running fp32 again."""
    texts = ["a b", "c d e", "f"]
    monkeypatch.setattr(parity, "parity_texts", lambda data_dir: (texts, []))
    rows = tokenizer.encode(texts).ids
    vectors, _ = onnx_outputs(FakeGraph(), rows)
    for low in (FakeGraph(), FakeGraph(non_finite=True)):
        by_graph = run_int8_gate(FakeGraph(), low, tokenizer, Path("."))
        by_vectors = run_int8_gate(vectors, low, tokenizer, Path("."))
        assert by_vectors.to_dict() == by_graph.to_dict()
    other = run_int8_gate(-vectors, FakeGraph(), tokenizer, Path("."))
    assert not {c.name: c.passed for c in other.checks}["int8 vs fp32"]
    with pytest.raises(ValueError, match="2 fp32 vectors for 3 texts"):
        run_int8_gate(vectors[:2], FakeGraph(), tokenizer, Path("."))


def test_out_that_is_not_a_model_repository_is_refused_and_kept(tmp_path):
    notes = tmp_path / "mine"
    notes.mkdir()
    (notes / "notes.txt").write_text("keep me")
    for out, message in [
        (notes, "holds files but no manifest.json"),
        (Path("."), "name a directory of its own"),
    ]:
        result = run_export("--out", str(out))
        assert result.returncode == 2, result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr
    assert (notes / "notes.txt").read_text() == "keep me"


# main() on each argument list, in a process that has not imported torch: each status and stderr, and
# whether torch was imported by the end.
REFUSE = """
import contextlib, io, json, sys
from minilm_embed.export.__main__ import main
seen = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        seen.append([main(argv), err.getvalue()])
print(json.dumps({"seen": seen, "torch": "torch" in sys.modules}))
"""


def test_an_out_or_data_dir_the_export_cannot_use_is_refused_before_torch_is_imported(tmp_path):
    """Found at once, not after the export and its gates (minutes): an --out no directory can be made
    beside, and a data directory without the train split that int8 is calibrated on."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    data = tmp_path / "data"
    (data / "stsbenchmark").mkdir(parents=True)
    (data / "stsbenchmark" / "sts-dev.csv").write_text("g\ts\t2012\t1\t5.0\ta\tb\n")
    cases = [
        (["--out", f"{afile}/sub"], f"export: error: --out {afile}/sub: {afile} is not a directory\n"),
        (["--out", "/proc/model"], "export: error: --out /proc/model: cannot create a directory in /proc ("),
        (
            ["--data-dir", str(data), "--out", str(tmp_path / "out")],
            f"export: error: {data}: no STS Benchmark train split (sts-train.csv)\n",
        ),
    ]
    command = export_command("placeholder")
    command["args"] = [sys.executable, "-c", REFUSE, json.dumps([argv for argv, _ in cases])]
    done = subprocess.run(**command, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    for (argv, message), (status, err) in zip(cases, result["seen"], strict=True):
        assert status == 2, (argv, err)
        assert err.startswith(message) and err.count("\n") == 1, (argv, err)
    assert not result["torch"], "torch was imported before a refusal"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "data"]


def test_compare_reports_a_shape_error_apart_from_values():
    check = compare("x", np.zeros((3, 4)), np.zeros((3, 5)))
    assert not check.passed
    assert check.note == "shape (3, 4) vs (3, 5)"
    assert check.figures == {}


def _turned(cosine: float, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Two (1, 4) rows of length `scale` at exactly this cosine."""
    want = np.array([[scale, 0.0, 0.0, 0.0]])
    got = np.array([[scale * cosine, scale * np.sqrt(1 - cosine**2), 0.0, 0.0]])
    return got, want


@pytest.mark.parametrize(
    ("rows", "passed"),
    [
        # The documented limits (README): min cosine 0.99999, max abs difference 1e-5.
        (_turned(0.999995, 1e-3), True),  # cosine just inside, differences tiny
        (_turned(0.99998, 1e-3), False),  # cosine just outside, differences tiny
        ((np.full((1, 4), 0.5 + 5e-6), np.full((1, 4), 0.5)), True),  # cosine 1, difference inside
        ((np.full((1, 4), 0.5 + 2e-5), np.full((1, 4), 0.5)), False),  # cosine 1, difference outside
    ],
)
def test_each_parity_limit_fails_a_gate_on_its_own(rows, passed):
    """The cosine and the max abs difference each decide alone: a gate loosened in either passes one of
    these (the perturbed-encoder test breaks both at once, and could not tell)."""
    got, want = rows
    assert compare("x", got, want).passed is passed


def test_built_repository_parity_figures(built_manifest):
    checks = {c["name"]: c for c in built_manifest["parity"]["checks"]}
    assert list(checks) == CHECK_NAMES
    assert all(c["passed"] for c in checks.values())
    for name in CHECK_NAMES[:3]:
        assert checks[name]["min_cosine"] >= MIN_COSINE, name
    assert built_manifest["weights_sha256"] == DEFAULT_SHA256


def test_built_repository_files_match_their_checksums(model_dir, built_manifest):
    assert built_manifest["onnx_sha256"] == sha256_file(model_dir / "model.onnx")
    for item in built_manifest["graphs"] + built_manifest["shared_tensors"]:
        assert item["sha256"] == sha256_file(model_dir / item["file"]), item["file"]


def test_every_graph_references_the_one_shared_word_embedding_table(
    model_dir, built_manifest, encoder_and_checkpoint
):
    """The table is in its own file, once, and every graph (int8 too, when built) reads it from there."""
    [shared] = built_manifest["shared_tensors"]
    assert (shared["name"], shared["file"]) == (WORD_EMBEDDINGS, WORD_EMBEDDINGS_FILE)
    assert shared["shape"] == [30522, 384] and shared["dtype"] == "float32"
    encoder, _ = encoder_and_checkpoint
    table = np.fromfile(model_dir / WORD_EMBEDDINGS_FILE, dtype="<f4").reshape(shared["shape"])
    np.testing.assert_array_equal(table, encoder.embeddings.word.weight.detach().numpy())
    graphs = [g["file"] for g in built_manifest["graphs"]]
    assert FP32_FILE in graphs
    for file in graphs:
        model = onnx.load(str(model_dir / file), load_external_data=False)
        external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert [t.name for t in external] == [WORD_EMBEDDINGS], file
        entries = {e.key: e.value for e in external[0].external_data}
        assert entries["location"] == WORD_EMBEDDINGS_FILE and int(entries["length"]) == table.nbytes, file
        assert not external[0].raw_data, file


def test_built_repository_sts_b_spearman(built_manifest):
    check = built_manifest["parity"]["checks"][3]
    if "gap" not in check:
        pytest.skip(f"the model repository was built without a data directory ({check.get('note')})")
    assert check["gap"] <= MAX_SPEARMAN_GAP
    assert abs(check["spearman_onnx"] - check["spearman_reference"]) <= MAX_SPEARMAN_GAP
    # all-MiniLM-L6-v2 scores about 86.7 on STS-B dev; counting pad tokens as real cost 12.6 points.
    assert check["spearman_onnx"] > 85


def int8_gemm_session(w: np.ndarray, bias: np.ndarray, absmax: np.ndarray) -> ort.InferenceSession:
    """One Gemm (x @ w.T + bias) rewritten by the int8 graph's builder, as a runnable graph."""
    k = w.shape[1]
    make = onnx.helper.make_node
    gemm = make("Gemm", ["x", "w", "bias"], ["y"], name="linear", transB=1)
    nodes, weights = int8_gemm_nodes(gemm, onnx.numpy_helper.from_array(w, "w"), absmax)
    weights += [onnx.numpy_helper.from_array(bias, "bias"), *int8_shared_constants()]
    graph = onnx.helper.make_graph(
        nodes,
        "int8_gemm",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["rows", k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["rows", w.shape[0]])],
        weights,
    )
    opsets = [onnx.helper.make_opsetid("", OPSET), onnx.helper.make_opsetid(MS_DOMAIN, 1)]
    model = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=8)
    return ort.InferenceSession(model.SerializeToString(), providers=[CPU_PROVIDER])


def test_int8_gemm_is_close_to_fp32_with_an_outlier_channel_and_each_row_is_quantised_alone():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 64)) * 0.1).astype(np.float32)
    bias = rng.standard_normal(48).astype(np.float32)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    x[:, 5] *= 25  # one outlier channel, as the GELU and LayerNorm outputs have
    x[3] *= 100  # one row far larger than the rest: a per-batch scale would crush the others
    session = int8_gemm_session(w, bias, np.abs(x).max(axis=0))
    (batch,) = session.run(None, {"x": x})
    want = x @ w.T + bias
    relative = np.abs(batch - want).max(axis=1) / np.abs(want).max(axis=1)
    assert relative.max() < 0.03, relative
    alone = np.concatenate([session.run(None, {"x": x[i : i + 1]})[0] for i in range(len(x))])
    np.testing.assert_allclose(alone, batch, rtol=0, atol=1e-5)


@pytest.mark.parametrize("key_mask", ["lengths", "lengths-and-starts"])
def test_fused_attention_computes_what_the_exported_attention_does(model_dir, tokenizer, key_mask):
    """The int8 and fp16 graphs' attention (one MultiHeadAttention per layer, the lengths its key
    padding mask; or the lengths and row starts, bench_gpu.py's alternative, whose starts the CPU
    kernel does not read), checked on the fp32 graph where nothing else differs: rows of every
    length, padded among longer ones, must get the exported graph's vectors."""
    model = onnx.load(str(model_dir / FP32_FILE))  # the shared word-embedding table read in
    fuse_attention(model, num_heads=12, key_mask=key_mask)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MultiHeadAttention") == 6 and "Softmax" not in ops
    fused = ort.InferenceSession(model.SerializeToString(), providers=[CPU_PROVIDER])
    exported = cpu_session(model_dir / FP32_FILE, threads=1)
    texts = [*SENTENCES, "word " * 300, "a b", "The cat sat on the mat while the dog slept by the door."]
    ids, lengths = pad_batch(tokenizer.encode(texts).ids)
    assert lengths.min() < 8 and lengths.max() == 256  # short rows padded to the longest possible
    for batch in (slice(None), slice(0, 1), slice(1, 2), slice(3, 5)):
        got = fused.run(None, {"input_ids": ids[batch], "lengths": lengths[batch]})
        want = exported.run(None, {"input_ids": ids[batch], "lengths": lengths[batch]})
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=2e-6)


def test_built_int8_graph_quantises_every_linear_layer_and_passed_its_gate(model_dir, built_manifest):
    if INT8_FILE not in {g["file"] for g in built_manifest["graphs"]}:
        pytest.skip("the model repository was built without an int8 graph (no data directory)")
    graph = onnx.load(str(model_dir / INT8_FILE), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert "Gemm" not in ops  # the FFN down projections too
    assert ops.count("MatMulIntegerToFloat") == 24  # 6 layers x (qkv, out, up, down)
    assert ops.count("MultiHeadAttention") == 6 and "Softmax" not in ops
    # One set of zero points, made once, for all 24 per-row quantisations.
    assert len({n.input[2] for n in graph.node if n.op_type == "QuantizeLinear"}) == 1
    checks = {c["name"]: c for c in built_manifest["parity_int8"]["checks"]}
    assert all(c["passed"] for c in checks.values())
    assert checks["int8 batch invariance"]["min_cosine"] >= INT8_MIN_BATCH_COSINE == 0.9999
    assert checks["int8 sts-b dev spearman vs fp32"]["gap"] <= INT8_MAX_SPEARMAN_GAP == 0.3


def test_the_cpu_sessions_run_gelu_apart_from_the_bias_add(model_dir, built_manifest):
    """ORT's BiasGelu kernel (its fusion of the FFN-up bias Add with Gelu, which fires on the int8
    graph, where the bias is a separate Add) ran slower than Add + Gelu, for the same vectors: the
    CPU provider disables that fusion. ORT ignores an optimizer name it does not know, so check that
    the name really switches it off in the graph ORT runs."""
    if INT8_FILE not in {g["file"] for g in built_manifest["graphs"]}:
        pytest.skip("the model repository was built without an int8 graph (no data directory)")
    assert "BiasGeluFusion" in CPU_DISABLED_OPTIMIZERS
    graph = model_dir / INT8_FILE
    served, all_fusions = runtime_op_types(graph, CPU_DISABLED_OPTIMIZERS), runtime_op_types(graph, [])
    assert all_fusions.count("BiasGelu") == 6  # the fusion fires when allowed: the check can fail
    assert "BiasGelu" not in served and served.count("Gelu") == 6


def test_built_int8_graph_sums_exactly_on_this_cpu_even_at_extreme_activations(model_dir, built_manifest):
    """The graph's vectors must not depend on the CPU it runs on. Without VNNI, MLAS's u8 x s8 kernel
    adds pairs of products in int16 (saturating); with 8-bit weights that changed the vectors."""
    if INT8_FILE not in {g["file"] for g in built_manifest["graphs"]}:
        pytest.skip("the model repository was built without an int8 graph (no data directory)")
    graph = onnx.load(str(model_dir / INT8_FILE), load_external_data=False).graph
    weights = {
        t.name: onnx.numpy_helper.to_array(t)
        for t in graph.initializer
        if t.data_location != onnx.TensorProto.EXTERNAL  # the shared word-embedding table
    }
    matmuls = [n for n in graph.node if n.op_type == "MatMulIntegerToFloat"]
    assert len(matmuls) == 24
    rng = np.random.default_rng(0)
    for node in matmuls:
        w = weights[node.input[1]]  # (K, N) int8
        session = ort.InferenceSession(
            int8_matmul_model(w, np.ones(w.shape[1], np.float32)).SerializeToString(),
            providers=[CPU_PROVIDER],
        )
        top, zero = np.full((1, w.shape[0]), 255), np.zeros((1, w.shape[0]))
        x = np.concatenate([top, zero, rng.integers(0, 256, (62, w.shape[0]))]).astype(np.uint8)
        (got,) = session.run(None, {"x": x, "x_scale": np.ones((len(x), 1), np.float32)})
        want = (x.astype(np.int64) - 128) @ w.astype(np.int64)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=node.name)


def test_a_checkpoint_that_does_not_normalise_exports(tmp_path, capfd, monkeypatch):
    """A sentence-transformers checkpoint without a Normalize module (modules.json lists only the
    Transformer and Pooling, as for a plain BERT) returns raw pooled vectors: the graph's `embeddings`
    are still their normalisation, and the gate compares it with that, not with the raw vectors."""
    ckpt = tiny_checkpoint(tmp_path / "ckpt", "plain-bert", normalize=False)
    args = ("--weights", str(ckpt), "--out", str(tmp_path / "out"), "--no-int8")
    status, stdout, stderr = export_here(capfd, monkeypatch, *args)
    assert status == 0, stdout + stderr
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["normalize"] is False


def tiny_checkpoint(directory: Path, model_id: str = "tiny", normalize: bool = True) -> Path:
    """A one-layer encoder saved as training saves it (no pooler weights), in seconds to export."""
    torch.manual_seed(0)
    config = EncoderConfig(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        max_seq_length=64,
        normalize=normalize,
    )
    save_checkpoint(Encoder(config).eval(), default_weights_dir() / "tokenizer.json", directory, model_id)
    return directory


def export_process(ckpt: Path, out: Path) -> subprocess.Popen[str]:
    command = export_command("--weights", str(ckpt), "--out", str(out), "--no-int8")
    return subprocess.Popen(**command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def staging_dirs(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def frozen_in_staging(process: subprocess.Popen[str], out: Path) -> Path:
    """The export's staging directory, with the export stopped (SIGSTOP) inside the guard that removes
    it (its marker written). The directory is looked for only while the export is stopped: a test
    process not scheduled for seconds (seen in CI: the directory was gone, the export done, 0.3 s of
    sleep after it had appeared) cannot let the export finish between the look and the signal sent
    next. The caller sends its signal, then SIGCONT."""
    deadline = time.monotonic() + 60
    while True:
        process.send_signal(signal.SIGSTOP)
        while process_state(process.pid) not in ("T", "t", "Z", None):
            time.sleep(0.001)
        found = [d for d in staging_dirs(out) if (d / export_main().STAGING_MARKER).is_file()]
        if found:
            return found[0]
        process.send_signal(signal.SIGCONT)
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no staging directory appeared"
        time.sleep(0.01)


def process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (T: stopped), None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def test_ctrl_c_removes_the_staging_directory_and_says_out_is_unchanged(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("the previous repository")
    process = export_process(tiny_checkpoint(tmp_path / "ckpt"), out)
    frozen_in_staging(process, out)
    process.send_signal(signal.SIGINT)  # delivered as the export goes on
    process.send_signal(signal.SIGCONT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr + stdout
    assert (
        stderr.splitlines()[-1]
        == f"export: interrupted: {out} is unchanged (the staging directory is removed)"
    )
    assert staging_dirs(out) == []
    assert (out / "manifest.json").read_text() == "the previous repository"


def test_the_next_export_removes_a_killed_exports_staging_directory_and_no_other(
    tmp_path, capfd, monkeypatch
):
    out = tmp_path / "out"
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    process = export_process(ckpt, out)
    left = frozen_in_staging(process, out)
    killed = process.pid
    process.kill()  # stopped or not
    process.communicate(timeout=60)
    assert left.is_dir()
    # A directory of the same shape of name that the export did not write is named, never removed.
    mine = tmp_path / ".out.mynotes1"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    # The next export: in this process (the marker's lock died with the killed one's).
    status, _, stderr = export_here(
        capfd, monkeypatch, "--weights", str(ckpt), "--out", str(out), "--no-int8"
    )
    assert status == 0, stderr
    assert not left.exists()
    killed_line = f"export: removed {left}, the staging directory of an export that was killed"
    assert f"{killed_line} (host {socket.gethostname()}, pid {killed})" in stderr
    assert (mine / "notes.txt").read_text() == "keep me"
    assert f"export: note: {mine} is not removed" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.mynotes1", "ckpt", "out"]
    assert {p.name for p in out.iterdir()} == REPOSITORY_FILES


def export_main():  # the CLI module in this process (its name: importing it runs nothing)
    return importlib.import_module("minilm_embed.export.__main__")


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


def lock_holder(marker: Path) -> subprocess.Popen[str]:
    """Another process holding flock(LOCK_EX) on `marker` as a running export does, until its stdin closes."""
    code = (
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(marker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    return holder


@pytest.mark.parametrize("host", ["this", "another"])
def test_a_staging_directory_whose_marker_a_live_process_holds_locked_is_not_removed(tmp_path, capsys, host):
    """Whether an export is running is its lock on the marker, not the host and pid the marker names:
    an export in another PID namespace (same hostname, same volume) shows a pid that is dead here."""
    module = export_main()
    out = tmp_path / "out"
    staging = tmp_path / ".out.abcd1234"
    staging.mkdir()
    (staging / "model.onnx").write_text("being written")
    hostname = socket.gethostname() if host == "this" else "another-host"
    marker = staging / module.STAGING_MARKER
    marker.write_text(json.dumps({"host": hostname, "pid": dead_pid()}) + "\n")
    holder = lock_holder(marker)
    try:
        module.clear_stale_staging(out)
        assert (staging / "model.onnx").read_text() == "being written"
        assert "export: removed" not in capsys.readouterr().err
    finally:
        holder.communicate("", timeout=30)  # its export ends: the lock goes with it
    module.clear_stale_staging(out)
    assert not staging.exists()
    assert f"export: removed {staging}, the staging directory of an export that was killed" in (
        capsys.readouterr().err
    )


def fake_build(weights, expected_sha256, staging, data_dir, int8):
    (staging / "manifest.json").write_text("the new repository")


@contextmanager
def interrupted_before():  # Ctrl-C before interrupts_deferred has put its handler in place
    raise KeyboardInterrupt
    yield


@contextmanager
def interrupted_during():  # Ctrl-C deferred while the swap ran, raised once it is done
    yield
    raise KeyboardInterrupt


@pytest.mark.parametrize("deferred", [interrupted_before, interrupted_during])
def test_ctrl_c_around_the_swap_reports_what_out_holds(tmp_path, capsys, monkeypatch, deferred):
    module = export_main()
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("the previous repository")
    monkeypatch.setattr(module, "build", fake_build)
    monkeypatch.setattr(module, "interrupts_deferred", deferred)
    status = module.main(["--weights", str(tmp_path / "ckpt"), "--out", str(out), "--no-int8"])
    captured = capsys.readouterr()
    assert staging_dirs(out) == []
    if deferred is interrupted_before:
        assert status == 130
        assert "wrote" not in captured.out
        assert captured.err.splitlines()[-1] == (
            f"export: interrupted: {out} is unchanged (the staging directory is removed)"
        )
        assert (out / "manifest.json").read_text() == "the previous repository"
    else:
        assert status == 0
        assert captured.out == f"export: wrote {out} (parity passed)\n"
        assert (out / "manifest.json").read_text() == "the new repository"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_exporting_a_trained_checkpoint_prints_no_load_report_for_the_unused_pooler(tmp_path):
    """Training saves no pooler (mean pooling never uses it): the reference model is built without
    one, so transformers has no missing weights to report; nothing else is left to the defaults.
    The CLI in its own process, as a user starts it (what transformers logs is that process's), run to
    its end: the one such export here, so it also shows the process writes a complete repository."""
    out = tmp_path / "out"
    process = export_process(tiny_checkpoint(tmp_path / "ckpt"), out)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert "LOAD REPORT" not in stderr and "pooler" not in stderr, stderr
    assert "TracerWarning" not in stderr and "Loading weights" not in stderr, stderr
    assert "export: note:" not in stderr
    assert "Traceback" not in stderr
    assert stdout.rstrip().endswith(f"export: wrote {out} (parity passed)")
    assert {p.name for p in out.iterdir()} == REPOSITORY_FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]  # the staging directory is gone


def test_a_checkpoint_without_its_sentence_transformers_files_exports_saying_which_defaults_it_took(
    tmp_path, capfd, monkeypatch
):
    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    for name in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json"):
        (ckpt / name).unlink()
    args = ("--weights", str(ckpt), "--out", str(tmp_path / "out"), "--no-int8")
    status, _, stderr = export_here(capfd, monkeypatch, *args)
    assert status == 0, stderr
    notes = [line for line in stderr.splitlines() if line.startswith("export: note:")]
    assert notes == [
        f"export: note: {ckpt / 'modules.json'} is missing: took sentence-transformers' default, "
        "normalize false (no Normalize module)",
        f"export: note: {ckpt / '1_Pooling' / 'config.json'} is missing: took sentence-transformers' "
        "default, pooling mean",
        f"export: note: {ckpt / 'sentence_bert_config.json'} is missing: took sentence-transformers' "
        "default, max_input_tokens 512 (config.json's max_position_embeddings)",
    ]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["normalize"], manifest["pooling"], manifest["max_input_tokens"]) == (False, "mean", 512)
