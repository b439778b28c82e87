"""End to end: real `minilm-embed-serve` processes on port 0 with the real model, compared with in-process
ORT.

One server per role, shared by the tests of a module (each start costs model load and warm-up):
the main server for the API, a tiny-queue server for overload, a fault-injecting server for backend
failures, and a lifecycle server for warm-up health and the SIGTERM drain.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import json
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from prometheus_client.parser import text_string_to_metric_families

from minilm_embed.client.client import AsyncEmbeddingClient, EmbeddingClient, embed_request, to_array
from minilm_embed.client.errors import InvalidInput
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from minilm_embed.server.batcher import running_time
from minilm_embed.server.front import SHUTDOWN_NOTICE_S
from tests.reference import Reference
from tests.server_process import (
    SERVICE_NAME,
    ServerProcess,
    fault_entry,
    flags,
    one_instance_held,
    serving,
    start_server,
    wait_for,
)
from tests.stand_in_server import HOLD_TEXT

ROOT = Path(__file__).resolve().parents[1]
MIN_COSINE = 0.99999
DIMENSIONS = 384
MAX_TOKENS = 256
VOCAB = 30522
FAULT = "__fault__"

# Non-default limits, so that Info and the error messages show the flags really took effect.
MAIN_FLAGS = {
    "max_inputs_per_request": 64,
    "max_text_chars": 200_000,
    "max_batch_size": 16,
    "max_batch_tokens": 2048,
    "max_stream_in_flight": 8,
    "queue_limit": 2048,
    "bulk_queue_share": 0.25,
}

SHORT = (ROOT / "export" / "parity_sentences.txt").read_text(encoding="utf-8").splitlines()
# STS-B-like sentences of mixed lengths: the parity sentences alone, joined in runs, and one past 256 tokens.
SENTENCES = (
    SHORT + [" ".join(SHORT[i : i + k]) for k in (2, 4, 7) for i in range(0, 21, 3)] + [" ".join(SHORT)]
)
LONG = " ".join(SHORT)  # 414 tokens
# Short texts for the load tests: 3 to 8 tokens each.
TINY = [
    "a",
    "ok",
    "hello world",
    "good morning",
    "a red car",
    "the cat sat down",
    "rain again today",
    "open the door please",
    "I like green tea",
    "where is the station?",
]
HUNDRED_KB = ("lorem ipsum dolor sit amet " * 4000)[:100_000]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    cos = cosines(got, want)
    worst = int(cos.argmin())
    assert cos.min() >= MIN_COSINE, (
        f"min cosine {cos.min():.7f} at row {worst}; max abs diff {np.abs(got - want).max():.2e}"
    )


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return 0.0


def status(outcome: object) -> grpc.StatusCode:
    return outcome.code() if isinstance(outcome, grpc.RpcError) else grpc.StatusCode.OK


async def embed_concurrently(address: str, requests: Sequence[pb.EmbedRequest], timeout: float) -> list:
    """Send every request at once on one channel; each outcome is a response or an RpcError."""
    async with AsyncEmbeddingClient(address, timeout) as c:
        return await asyncio.gather(*(c.embed_response(r) for r in requests), return_exceptions=True)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Reference:
    return Reference(model_dir)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serving(*flags(MAIN_FLAGS)) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[EmbeddingClient]:
    with EmbeddingClient(server.address, timeout=60) as c:
        yield c


# Parity and the shape of answers --------------------------------------------------------------------


def test_embeddings_equal_in_process_onnx_runtime(client, reference):
    assert len(SENTENCES) == 50
    got = client.embed(SENTENCES)
    assert got.shape == (50, DIMENSIONS)
    assert_close(got, reference.embed(SENTENCES))
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_normalize_false_gives_the_pooled_vector(client, reference):
    texts = SHORT[:4]
    pooled = client.embed(texts, normalize=False)
    normalised = client.embed(texts)
    norms = np.linalg.norm(pooled, axis=1)
    assert (np.abs(norms - 1) > 1e-3).all(), norms
    assert np.allclose(pooled / norms[:, None], normalised, atol=1e-5)
    assert np.allclose(pooled, reference.embed(texts, normalize=False), rtol=1e-4, atol=1e-5)


def test_float_and_float32_bytes_formats_agree(client):
    texts = SHORT[:3]
    answers = {}
    for fmt in (
        pb.EMBEDDING_FORMAT_UNSPECIFIED,
        pb.EMBEDDING_FORMAT_FLOATS,
        pb.EMBEDDING_FORMAT_FLOAT32_BYTES,
    ):
        answers[fmt] = client.stub.Embed(pb.EmbedRequest(texts=texts, format=fmt), timeout=30)
    for fmt in (pb.EMBEDDING_FORMAT_UNSPECIFIED, pb.EMBEDDING_FORMAT_FLOATS):
        assert all(len(e.values) == DIMENSIONS and not e.float32_le for e in answers[fmt].embeddings)
    as_bytes = answers[pb.EMBEDDING_FORMAT_FLOAT32_BYTES]
    assert all(len(e.float32_le) == 4 * DIMENSIONS and not e.values for e in as_bytes.embeddings)
    floats = to_array(answers[pb.EMBEDDING_FORMAT_FLOATS])
    assert np.allclose(to_array(as_bytes), floats, atol=1e-6)
    assert np.allclose(to_array(answers[pb.EMBEDDING_FORMAT_UNSPECIFIED]), floats, atol=1e-6)


def test_token_ids_input_equals_text_input(client, reference):
    texts = [SHORT[0], SHORT[10], LONG]
    tokens = client.tokenize(texts).tokens
    ids = [list(t.ids) for t in tokens]
    assert ids == reference.ids(texts)
    assert np.allclose(client.embed_ids(ids), client.embed(texts), atol=1e-6)


def test_over_long_token_ids_are_cut_as_a_text_is_keeping_the_end_token(client):
    """Tokenize's whole ids (truncate=false) of a 414-token text, sent as token_ids: cut to 256 as the
    tokenizer cuts the text, [CLS] ... [SEP], not by a plain slice that drops [SEP]."""
    whole = list(client.tokenize([LONG], truncate=False).tokens[0].ids)
    assert len(whole) == 414 and whole[-1] == 102
    response = client.embed_response(embed_request(token_ids=[whole]))
    usage = response.embeddings[0].usage
    assert (usage.tokens, usage.truncated, usage.original_tokens) == (256, True, 414)
    assert np.allclose(to_array(response), client.embed([LONG]), atol=1e-6)
    with pytest.raises(InvalidInput, match=r"must start with \[CLS\] \(101\) and end with \[SEP\]"):
        client.embed_ids([whole[:-1]])  # cut by the caller without its end token


def test_order_is_kept_within_a_request_of_many_inputs(client, reference):
    # 64 inputs of 3 to 39 tokens in a shuffled order: batching regroups them by length.
    texts = [(SHORT + TINY)[i % 38] for i in np.random.default_rng(0).permutation(64)]
    got = client.embed(texts)
    want = reference.embed(texts)
    assert_close(got, want)
    # Each row's nearest reference vector is that of its own text (or of an identical text).
    first = {t: i for i, t in reversed(list(enumerate(texts)))}
    nearest = (got @ want.T).argmax(1)
    assert [first[texts[j]] for j in nearest] == [first[t] for t in texts]


def test_usage_and_timing_are_filled(client, reference):
    texts = ["a", SHORT[0], LONG]
    response = client.embed_response(embed_request(texts))
    ids = reference.ids(texts)
    usage = [(e.usage.tokens, e.usage.truncated, e.usage.original_tokens) for e in response.embeddings]
    full = len(reference.whole_ids(LONG))
    assert usage == [(3, False, 3), (len(ids[1]), False, len(ids[1])), (MAX_TOKENS, True, full)]
    assert full > MAX_TOKENS
    assert response.total_tokens == 3 + len(ids[1]) + MAX_TOKENS
    assert response.dimensions == DIMENSIONS
    t = response.timing
    assert t.inference_us > 0 and t.total_us > 0
    assert t.total_us >= t.inference_us and t.total_us >= t.queue_us


def test_inference_time_counts_batches_that_ran_at_once_once():
    # Batches 1 and 2 overlap on two instances (10.0-10.4 and 10.1-10.3); batch 3 runs later alone.
    spans = [(10.0, 10.4), (10.1, 10.3), (10.0, 10.4), (11.0, 11.1)]
    assert running_time(spans) == pytest.approx(0.5)


# Every refusal ------------------------------------------------------------------------------------


def _ids(*rows: Sequence[int]) -> list[pb.TokenIds]:
    return [pb.TokenIds(ids=list(r)) for r in rows]


# case: (request, the message's pattern, the ErrorInfo reason, the BadRequest field, ErrorInfo metadata)
INVALID = {
    "no inputs": (pb.EmbedRequest(), r"no inputs", "NO_INPUTS", "texts", {}),
    "empty string": (
        pb.EmbedRequest(texts=["ok", ""]),
        r"input 1 is an empty string",
        "EMPTY_INPUT",
        "texts[1]",
        {"input": "1"},
    ),
    "empty token ids": (
        pb.EmbedRequest(token_ids=_ids([101, 102], [])),
        r"input 1 is an empty token-id",
        "EMPTY_INPUT",
        "token_ids[1].ids",
        {"input": "1"},
    ),
    "texts and token ids": (
        pb.EmbedRequest(texts=["a"], token_ids=_ids([101, 102])),
        r"not both",
        "TEXTS_AND_TOKEN_IDS",
        "token_ids",
        {},
    ),
    "too many texts": (
        pb.EmbedRequest(texts=["x"] * 65),
        r"65 inputs .*max_inputs_per_request=64",
        "TOO_MANY_INPUTS",
        "texts",
        {"setting": "max_inputs_per_request", "limit": "64", "value": "65"},
    ),
    "too many token ids": (
        pb.EmbedRequest(token_ids=_ids(*[[101, 102]] * 65)),
        r"65 inputs .*max_inputs_per_request=64",
        "TOO_MANY_INPUTS",
        "token_ids",
        {"setting": "max_inputs_per_request", "limit": "64", "value": "65"},
    ),
    "text too long, no truncation": (
        pb.EmbedRequest(texts=["short", LONG], truncate=False),
        r"input 1 has 414 tokens, over the limit max_input_tokens=256",
        "TOO_MANY_TOKENS",
        "texts[1]",
        {
            "input": "1",
            "setting": "max_input_tokens",
            "limit": "256",
            "value": "414",
            "valueIsLowerBound": "false",
        },
    ),
    "token ids too long, no truncation": (
        pb.EmbedRequest(token_ids=_ids([101, *[1000] * 298, 102]), truncate=False),
        r"input 0 has 300 tokens, over the limit max_input_tokens=256",
        "TOO_MANY_TOKENS",
        "token_ids[0].ids",
        {"input": "0", "limit": "256", "value": "300"},
    ),
    "negative token id": (
        pb.EmbedRequest(token_ids=_ids([101, 7592, 102], [101, -5, 102])),
        r"input 1: token id -5 at position 1 is outside the vocabulary \[0, 30522\)",
        "TOKEN_ID_OUT_OF_RANGE",
        "token_ids[1].ids[1]",
        {"input": "1", "position": "1", "value": "-5", "vocabularySize": "30522"},
    ),
    "token id past the vocabulary": (
        pb.EmbedRequest(token_ids=_ids([101, VOCAB, 102])),
        r"input 0: token id 30522 at position 1 is outside the vocabulary",
        "TOKEN_ID_OUT_OF_RANGE",
        "token_ids[0].ids[1]",
        {"value": "30522"},
    ),
    "another tokenizer's ids (tiktoken's for 'hello world')": (
        pb.EmbedRequest(token_ids=_ids([101, 7592, 2088, 102], [15339, 1917])),
        r"input 1: token ids must start with \[CLS\] \(101\) and end with \[SEP\] \(102\), as the "
        r"model's tokenizer makes them \(gRPC's Tokenize returns them\); these start with 15339 and end "
        r"with 1917. Ids of another.*check_embedding_ctx_length=False",
        "TOKEN_IDS_NOT_FRAMED",
        "token_ids[1].ids",
        {"firstId": "15339", "lastId": "1917", "expectedFirstId": "101", "expectedLastId": "102"},
    ),
    "a text's ids without [CLS] and [SEP]": (
        pb.EmbedRequest(token_ids=_ids([7592, 2088])),
        r"input 0: token ids must start with \[CLS\]",
        "TOKEN_IDS_NOT_FRAMED",
        "token_ids[0].ids",
        {"input": "0"},
    ),
    # Named as another tokenizer's, not as out of range (what LangChain's users were told before).
    "another tokenizer's ids, one past this vocabulary": (
        pb.EmbedRequest(token_ids=_ids([15339, 66694, 1917])),
        r"input 0: token ids must start with \[CLS\].*check_embedding_ctx_length=False",
        "TOKEN_IDS_NOT_FRAMED",
        "token_ids[0].ids",
        {"firstId": "15339"},
    ),
    "ids padded to a fixed length": (
        pb.EmbedRequest(token_ids=_ids([101, 7592, 102, 0, 0])),
        r"these start with 101 and end with 0. Ids after \[SEP\] are taken for padding: send each "
        r"input's ids unpadded",
        "TOKEN_IDS_NOT_FRAMED",
        "token_ids[0].ids",
        {"lastId": "0"},
    ),
    # proto3 keeps an enum value it does not know as its number: answered as floats before.
    "unknown format": (
        pb.EmbedRequest(texts=["a"], format=7),  # type: ignore[arg-type]
        r"format is 7, not an EmbeddingFormat: send EMBEDDING_FORMAT_UNSPECIFIED \(0\), "
        r"EMBEDDING_FORMAT_FLOATS \(1\) or EMBEDDING_FORMAT_FLOAT32_BYTES \(2\)",
        "UNKNOWN_FORMAT",
        "format",
        {"value": "7"},
    ),
    "unknown priority": (
        pb.EmbedRequest(texts=["a"], priority=9),  # type: ignore[arg-type]
        r"priority is 9, not a Priority: send PRIORITY_UNSPECIFIED \(0\), PRIORITY_INTERACTIVE \(1\) or "
        r"PRIORITY_BULK \(2\)",
        "UNKNOWN_PRIORITY",
        "priority",
        {"value": "9"},
    ),
    "text over max_text_chars": (
        pb.EmbedRequest(texts=["x" * 200_001]),
        r"input 0 has 200001 characters, over the limit max_text_chars=200000",
        "TEXT_TOO_LONG",
        "texts[0]",
        {"setting": "max_text_chars", "limit": "200000", "value": "200001"},
    ),
}


def error_details(error: grpc.RpcError) -> dict[str, object]:
    """The google.rpc details of a failed call's trailer, read as gRPC's own library reads them."""
    status = rpc_status.from_call(error)
    assert status is not None, f"no google.rpc details: {error.trailing_metadata()}"
    found: dict[str, object] = {}
    for detail in status.details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if detail.Is(kind.DESCRIPTOR):
                found[kind.__name__] = message = kind()
                detail.Unpack(message)
    assert len(found) == len(status.details), status
    return found


@pytest.mark.parametrize("case", INVALID.keys())
def test_invalid_requests_get_invalid_argument_naming_the_limit(client, case):
    request, message, reason, field, metadata = INVALID[case]
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Embed(request, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, e.value.details()), e.value.details()
    # The same in google.rpc details, for a program: the reason, the limit and value, the field.
    found = error_details(e.value)
    assert set(found) == {"ErrorInfo", "BadRequest"}, found  # no RetryInfo: retrying cannot help
    info, bad = found["ErrorInfo"], found["BadRequest"]
    assert (info.reason, info.domain) == (reason, "minilm-embed")
    assert metadata.items() <= dict(info.metadata).items(), info.metadata
    assert [(v.field, v.reason, v.description) for v in bad.field_violations] == [
        (field, reason, e.value.details())
    ]


def test_a_unary_call_sent_without_its_request_is_refused_with_details(server):
    """Only a hand-made client can end a unary call's stream before its message; still answered
    INVALID_ARGUMENT with its request id and the details every refusal carries."""
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_unary(f"/{SERVICE_NAME}/Embed")
        with pytest.raises(grpc.RpcError) as e:
            call(iter(()), timeout=30, metadata=(("x-request-id", "no-message-1"),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "the Embed call ended without its request"
    assert dict(e.value.trailing_metadata())["x-request-id"] == "no-message-1"
    assert error_details(e.value)["ErrorInfo"].reason == "NO_REQUEST"


def test_an_empty_tokenize_request_names_its_own_field(client):
    """TokenizeRequest has no `token_ids`: the refusal told its caller to set one."""
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Tokenize(pb.TokenizeRequest(), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "no inputs: set `texts` with at least one text"


def test_deadline_shorter_than_the_queue_wait_is_exceeded_and_the_server_keeps_serving(
    server, client, reference
):
    dropped_before = sum(
        metric(server, "embed_inputs_dropped_total", reason=r) for r in ("deadline", "cancelled")
    )
    # 32 inputs of 256 tokens: four full batches of 2048 padded tokens; the short input cannot join them.
    heavy = client.stub.Embed.future(embed_request([f"{i} {LONG}" for i in range(32)]), timeout=120)
    waiting = 32 - 8 * client.info().model_instances  # a batch runs on each instance, the rest wait
    deadline = time.monotonic() + 30
    while metric(server, "embed_queue_depth") < waiting:
        assert time.monotonic() < deadline and not heavy.done(), "the heavy request never queued"
        time.sleep(0.005)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Embed(embed_request(["a short text behind the queue"]), timeout=0.2)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    assert to_array(heavy.result()).shape == (32, DIMENSIONS)
    assert_close(client.embed([SHORT[0]]), reference.embed([SHORT[0]]))
    dropped = sum(metric(server, "embed_inputs_dropped_total", reason=r) for r in ("deadline", "cancelled"))
    assert dropped == dropped_before + 1  # the late input was dropped, never computed


# Awkward inputs and load ------------------------------------------------------------------------------


def test_awkward_texts_are_embedded(client, reference):
    texts = [
        "nul\x00byte and a bell\x07 and an escape\x1b[0m",
        "\x00",
        "\t\n\r",
        "🚀 Launch day! 🎉👍🏽👨‍👩‍👧",
        "机器学习是人工智能的一个分支。",
        "東京は日本の首都です。",
        "مرحبا بالعالم، كيف حالك اليوم؟",
        "שלום עולם",
        "e\u0301te\u0301 \u200b zero width \ufeff",
        HUNDRED_KB,
    ]
    response = client.embed_response(embed_request(texts))
    got = to_array(response)
    assert np.isfinite(got).all()
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert_close(got, reference.embed(texts))
    big = response.embeddings[-1].usage
    assert (big.tokens, big.truncated) == (MAX_TOKENS, True)
    assert big.original_tokens > MAX_TOKENS


def test_same_vector_alone_and_among_200_concurrent_requests(server, client, reference):
    target = "The quick brown fox jumps over the lazy dog."
    alone = client.embed([target])
    texts = [target if i % 10 == 0 else SHORT[i % len(SHORT)] for i in range(200)]
    outcomes = asyncio.run(embed_concurrently(server.address, [embed_request([t]) for t in texts], 60))
    assert [status(o) for o in outcomes] == [grpc.StatusCode.OK] * 200
    got = np.concatenate([to_array(o) for o in outcomes])
    assert_close(got[::10], np.repeat(alone, 20, axis=0))
    assert_close(got, reference.embed(texts))


def test_50_clients_of_20_requests_all_get_correct_vectors(server, reference):
    want = dict(zip(TINY, reference.embed(TINY), strict=True))

    def one_client(c: int) -> list[float]:
        with EmbeddingClient(server.address, timeout=60) as client:
            texts = [TINY[(c + r) % len(TINY)] for r in range(20)]
            return [float(cosines(client.embed([t]), want[t][None])[0]) for t in texts]

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(one_client, range(50)))
    assert sum(len(r) for r in results) == 1000
    assert min(min(r) for r in results) >= MIN_COSINE


# Streams, Tokenize, Info, reflection ---------------------------------------------------------------


def test_embed_stream_answers_every_item_and_goes_on_after_a_bad_one(client, reference):
    texts = {f"item-{i}": SHORT[i] for i in range(12)}
    texts["item-5"] = ""  # refused: an empty string
    items = [pb.EmbedStreamRequest(id=k, request=embed_request([t])) for k, t in texts.items()]
    answers = {a.id: a for a in client.stub.EmbedStream(iter(items), timeout=60)}
    assert set(answers) == set(texts)
    bad = answers.pop("item-5")
    assert bad.WhichOneof("result") == "error"
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] == 3
    assert "empty string" in bad.error.message
    # What Embed's google.rpc details would say, in the item's own fields.
    assert (bad.error.reason, bad.error.field, dict(bad.error.metadata)) == (
        "EMPTY_INPUT",
        "texts[0]",
        {"input": "0"},
    )
    assert all(a.WhichOneof("result") == "response" for a in answers.values())
    got = np.concatenate([to_array(a.response) for a in answers.values()])
    assert_close(got, reference.embed([texts[k] for k in answers]))


def test_a_stream_item_with_an_unknown_format_is_refused_and_the_stream_goes_on(client):
    items = [
        pb.EmbedStreamRequest(id="odd", request=pb.EmbedRequest(texts=["a"], format=7)),  # type: ignore[arg-type]
        pb.EmbedStreamRequest(
            id="ok", request=pb.EmbedRequest(texts=["a"], format=pb.EMBEDDING_FORMAT_FLOATS)
        ),
    ]
    answers = {a.id: a for a in client.stub.EmbedStream(iter(items), timeout=60)}
    assert answers["odd"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "format is 7, not an EmbeddingFormat" in answers["odd"].error.message
    assert len(answers["ok"].response.embeddings[0].values) == DIMENSIONS


def test_a_stream_outlives_the_connections_maximum_age():
    """At --max-connection-age-s the server sends GOAWAY: no new call on that connection, but an
    EmbedStream open on it goes on (it was cut with UNAVAILABLE at age + drain timeout before)."""

    async def stream_for(address: str, seconds: float) -> list[str]:
        async with grpc.aio.insecure_channel(address) as channel:
            call = pb_grpc.EmbeddingServiceStub(channel).EmbedStream(timeout=60)
            ids = []
            started = time.monotonic()
            for i in itertools.count():
                await call.write(pb.EmbedStreamRequest(id=str(i), request=embed_request([f"item {i}"])))
                ids.append((await call.read()).id)
                if time.monotonic() - started > seconds:
                    break
                await asyncio.sleep(0.2)
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            return ids

    with serving("--max-connection-age-s", "1", "--drain-timeout-s", "1") as server:
        ids = asyncio.run(stream_for(server.address, 4.0))
    assert ids == [str(i) for i in range(len(ids))] and len(ids) >= 10


KEEPALIVE_MS = 5000  # what the server allows (README); Go's and Java's clients ping at 10 s at the least
# A client that keeps its connection alive as grpc-go's keepalive.ClientParameters{Time: 5 * time.Second,
# PermitWithoutStream: true} does: pings whether or not a call is open, with or without data.
PINGING = [
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def test_a_client_pinging_every_5_s_keeps_its_idle_connection_and_its_open_stream(server):
    """gRPC's server default allows one ping per 5 minutes and none without a call: a client with
    keepalive on got GOAWAY too_many_pings at its third ping, 15 s in, its idle connection dropped
    and an open EmbedStream cut with UNAVAILABLE "Too many pings"."""
    idle = grpc.insecure_channel(server.address, options=PINGING)
    streaming = grpc.insecure_channel(server.address, options=PINGING)
    try:
        pb_grpc.EmbeddingServiceStub(idle).Embed(embed_request(["hello"]), timeout=30)
        states: list[grpc.ChannelConnectivity] = []
        idle.subscribe(states.append)
        items: queue.Queue[pb.EmbedStreamRequest | None] = queue.Queue()
        stream = pb_grpc.EmbeddingServiceStub(streaming).EmbedStream(iter(items.get, None), timeout=60)
        items.put(pb.EmbedStreamRequest(id="before", request=embed_request(["hello"])))
        assert next(stream).id == "before"
        time.sleep(4 * KEEPALIVE_MS / 1000 - 2)  # three pings past the first on each connection
        items.put(pb.EmbedStreamRequest(id="after", request=embed_request(["hello"])))
        assert next(stream).id == "after"
        items.put(None)
        assert stream.code() == grpc.StatusCode.OK
        assert grpc.ChannelConnectivity.IDLE not in states, states  # the connection was never dropped
    finally:
        idle.close()
        streaming.close()


STREAM_THEN_HANG = """
import queue, sys, grpc
from minilm_embed.client.client import embed_request
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb, embedding_pb2_grpc as pb_grpc
items = queue.Queue()
channel = grpc.insecure_channel(sys.argv[1])
stream = pb_grpc.EmbeddingServiceStub(channel).EmbedStream(iter(items.get, None))
items.put(pb.EmbedStreamRequest(id="one", request=embed_request(["hello"])))
print(next(stream).id, flush=True)
items.get()  # the stream stays open, waiting for a next item that never comes
"""


def stream_counts(server: ServerProcess) -> str:
    codes = {
        c.name: metric(server, "embed_requests_total", method="EmbedStream", code=c.name)
        for c in grpc.StatusCode
    }
    counted = {code: n for code, n in codes.items() if n}
    return f"EmbedStream calls by code {counted}, in flight {metric(server, 'embed_requests_in_flight')}"


def test_a_client_gone_silent_has_its_open_stream_ended_by_the_servers_pings():
    """A client whose node is lost sends no FIN: its open EmbedStream held a call place until gRPC's
    default server ping, after 2 hours. A stopped process answers no ping, as a lost one would."""
    with serving("--keepalive-s", "1") as server:
        client = subprocess.Popen(
            [sys.executable, "-c", STREAM_THEN_HANG, server.address],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert client.stdout is not None and client.stdout.readline().strip() == "one"
            assert metric(server, "embed_requests_in_flight") == 1
            client.send_signal(signal.SIGSTOP)

            # Counted, then out of flight (service._record): a scrape that read the counter just before
            # and the gauge just after could see neither, so the wait is on the counter. Counted
            # CANCELLED, or OK: when the dead connection's end of input reaches the handler before
            # gRPC's cancel (grpc.aio tells a handler nothing else), the stream returns as after a
            # half-close (a `make test` run counted it OK; an earlier clean-clone failure, from before
            # the test said how the stream was counted, was most likely the same).
            def ended() -> bool:
                return (
                    sum(
                        metric(server, "embed_requests_total", method="EmbedStream", code=code)
                        for code in ("CANCELLED", "OK")
                    )
                    == 1
                )

            assert wait_for(ended, timeout=20), f"after 20 s: {stream_counts(server)}"
            assert metric(server, "embed_requests_in_flight") == 0
        finally:
            client.kill()
            client.wait(10)


def test_answers_over_the_message_limit_are_refused_naming_it_and_a_stream_goes_on():
    """gRPC fails an answer over --max-message-bytes once it is made, with "Sent message larger than
    max", counted OK and logged as a server error, and ends a stream with it. At 150,000 bytes an
    Embed answer holds 96 vectors of 384 floats: 98 are refused before compute by their floats alone
    (150,528 bytes), 97 once sized; a stream's item is sized with its id and refused alone.
    Tokenize: every "!" is a token of two bytes ([CLS] and [SEP] one each), so 90 kB of text asks
    for a 180 kB answer."""
    limit = "max_message_bytes=150000"
    with serving("--max-message-bytes", "150000") as server, EmbeddingClient(server.address, 60) as c:
        assert c.embed(["a"] * 96).shape == (96, DIMENSIONS)
        for count, would_be in (
            (97, r"\d+ bytes"),
            (98, r"at least 150528 bytes \(98 vectors of 384 floats\)"),
        ):
            with pytest.raises(grpc.RpcError) as e:
                c.stub.Embed(embed_request(["a"] * count), timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert re.search(f"the answer would be {would_be}, over the limit {limit}", e.value.details())
            info = error_details(e.value)["ErrorInfo"]
            assert (info.reason, info.metadata["setting"], info.metadata["limit"]) == (
                "ANSWER_TOO_LARGE",
                "max_message_bytes",
                "150000",
            )
            assert int(info.metadata["value"]) > 150_000
        items = [
            pb.EmbedStreamRequest(id="small", request=embed_request(["a"])),
            pb.EmbedStreamRequest(id="x" * 3000, request=embed_request(["a"] * 96)),  # fits alone
            pb.EmbedStreamRequest(id="97", request=embed_request(["a"] * 97)),
            pb.EmbedStreamRequest(id="after", request=embed_request(["a"] * 96)),
        ]
        answers = {a.id: a for a in c.stub.EmbedStream(iter(items), timeout=60)}
        assert [answers[k].WhichOneof("result") for k in ("small", "x" * 3000, "97", "after")] == [
            "response",
            "error",
            "error",
            "response",
        ]
        assert {answers[k].error.reason for k in ("x" * 3000, "97")} == {"ANSWER_TOO_LARGE"}
        assert len(answers["after"].response.embeddings) == 96
        with pytest.raises(InvalidInput, match=f"over the limit {limit}") as refused:
            c.tokenize(["!" * 90_000], truncate=False)
        assert "at least 180002 bytes (90002 token ids)" in refused.value.details()
        assert "truncate=true" in refused.value.details()
        assert len(c.tokenize(["!" * 90_000]).tokens[0].ids) == 256  # cut, it fits
        assert metric(server, "embed_requests_total", method="Embed", code="INVALID_ARGUMENT") == 2
    assert "Sent message larger" not in "\n".join(server.lines)


def test_tokenize_matches_the_model_tokenizer(client, reference):
    texts = [SHORT[0], SHORT[10], LONG]
    cut = client.tokenize(texts).tokens
    assert [list(t.ids) for t in cut] == reference.ids(texts)
    assert (cut[2].usage.tokens, cut[2].usage.truncated, cut[2].usage.original_tokens) == (256, True, 414)
    full = client.tokenize([LONG], truncate=False).tokens[0]
    assert list(full.ids) == reference.whole_ids(LONG)
    assert (full.usage.tokens, full.usage.truncated) == (414, False)


def test_an_int8_server_says_so_and_names_the_int8_graph(client, model_dir):
    """Info's onnx_sha256 is the graph served: under --precision int8 it named the fp32 graph's."""
    graphs = {g["precision"]: g for g in json.loads((model_dir / "manifest.json").read_text())["graphs"]}
    if "int8" not in graphs:
        pytest.skip("the model repository ships no int8 graph (built without --data-dir)")
    with serving("--precision", "int8") as server, EmbeddingClient(server.address, timeout=60) as c:
        info = c.info()
        int8 = c.embed(SHORT[:8])
        answered_by = c.embed_response(embed_request(SHORT[:2])).onnx_sha256
    assert info.precision == pb.PRECISION_INT8
    assert info.onnx_sha256 == graphs["int8"]["sha256"] != graphs["fp32"]["sha256"]
    assert client.info().onnx_sha256 == graphs["fp32"]["sha256"]
    # Each answer names the graph that computed it (a bulk job stops where it changes).
    assert answered_by == graphs["int8"]["sha256"]
    assert client.embed_response(embed_request(SHORT[:2])).onnx_sha256 == graphs["fp32"]["sha256"]
    cosines = (int8 * client.embed(SHORT[:8])).sum(axis=1)
    assert cosines.min() >= 0.98  # the int8 gate's floor against fp32 (README)


def test_info_describes_the_model_and_the_limits_set_by_flags(client, model_dir):
    info = client.info()
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert info.model_id == manifest["model_id"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert info.onnx_sha256 == manifest["onnx_sha256"]
    assert (info.dimensions, info.max_input_tokens, info.vocab_size) == (DIMENSIONS, MAX_TOKENS, VOCAB)
    assert info.execution_provider == "CPUExecutionProvider"
    assert info.pooling == pb.POOLING_MEAN and info.normalize_default
    limits = info.limits
    assert {name: getattr(limits, name) for name in MAIN_FLAGS} == MAIN_FLAGS
    assert limits.max_input_tokens == MAX_TOKENS
    assert {"server", "onnxruntime", "grpcio", "tokenizers", "python"} <= set(info.versions)


def test_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in answer.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


# Overload and backend failure --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_queue_server() -> Iterator[ServerProcess]:
    with serving("--queue-limit", "4", "--max-batch-size", "4") as process:
        yield process


def test_a_full_queue_refuses_with_resource_exhausted(tiny_queue_server, reference):
    texts = [f"{i} {' '.join(SHORT[:8])}" for i in range(3)]  # ~130 tokens each; 3 of the 4 queue places
    with EmbeddingClient(tiny_queue_server.address, timeout=30) as c:
        c.embed(texts)  # a batch has run: the engine's pace is known
    outcomes = asyncio.run(embed_concurrently(tiny_queue_server.address, [embed_request(texts)] * 30, 60))
    codes = [status(o) for o in outcomes]
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    refused = [o for o in outcomes if status(o) == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert all("queue_limit is 4" in o.details() for o in refused)
    for o in refused:  # the front's admission or the engine's (test_protocol), the same details
        found = error_details(o)
        assert set(found) == {"ErrorInfo", "RetryInfo"}, found
        info = found["ErrorInfo"]
        assert info.reason == "QUEUE_FULL", info
        assert {k: info.metadata[k] for k in ("setting", "limit", "asked")} == {
            "setting": "queue_limit",
            "limit": "4",
            "asked": "3",
        }
        assert 1 < int(info.metadata["value"]) <= 4  # waiting: with these 3, past the limit
        # When the inputs waiting will have been computed at the recent pace (a full second before).
        assert 0.1 <= found["RetryInfo"].retry_delay.ToTimedelta().total_seconds() < 1, found["RetryInfo"]
    for o in outcomes:
        if status(o) == grpc.StatusCode.OK:
            assert_close(to_array(o), reference.embed(texts))
    assert metric(tiny_queue_server, "embed_requests_refused_total", reason="queue") == len(refused)
    assert metric(tiny_queue_server, "embed_queue_depth") == 0
    with EmbeddingClient(tiny_queue_server.address, timeout=30) as c:
        assert_close(c.embed(texts), reference.embed(texts))  # and it keeps serving
    # A queue smaller than a request may be is said at the start.
    warned = "--queue-limit (EMBED_QUEUE_LIMIT) 4 is below --max-inputs-per-request"
    assert any(warned in line for line in tiny_queue_server.lines), tiny_queue_server.lines[:20]


def test_bulk_requests_are_held_back_at_their_share_of_the_queue_and_interactive_ones_get_in(
    tiny_queue_server, reference
):
    """--queue-limit 4 at the default --bulk-queue-share 0.5: bulk requests are admitted only while
    fewer than 2 inputs wait (at most 3 then), so the interactive call always finds its place."""
    texts = [f"{i} {' '.join(SHORT[:8])}" for i in range(2)]
    bulk_before = metric(tiny_queue_server, "embed_requests_refused_total", reason="bulk_queue")
    requests = [embed_request(texts, priority="bulk")] * 30 + [embed_request(["an interactive query"])]
    outcomes = asyncio.run(embed_concurrently(tiny_queue_server.address, requests, 60))
    assert status(outcomes[-1]) == grpc.StatusCode.OK, outcomes[-1]
    bulk_outcomes = outcomes[:-1]
    codes = {status(o) for o in bulk_outcomes}
    assert codes == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    refused = [o for o in bulk_outcomes if status(o) == grpc.StatusCode.RESOURCE_EXHAUSTED]
    for o in bulk_outcomes:
        if status(o) == grpc.StatusCode.OK:
            assert_close(to_array(o), reference.embed(texts))
    for o in refused:
        assert "queue full for bulk requests" in o.details(), o.details()
        info = error_details(o)["ErrorInfo"]
        assert (info.reason, info.metadata["setting"], info.metadata["limit"]) == (
            "QUEUE_FULL",
            "bulk_queue_share",
            "0.5",
        )
    # Counted as pacing, not as a full queue (EmbedQueueSaturated pages on that).
    bulk_after = metric(tiny_queue_server, "embed_requests_refused_total", reason="bulk_queue")
    assert bulk_after - bulk_before == len(refused)


# After the full-queue test, which counts every refusal the tiny queue's server has made. On a server of
# its own kind (the real model, no input held for seconds), so that no test before it sets the pace.
def test_openais_client_retries_a_full_queue_after_the_wait_the_server_gives(tiny_queue_server, caplog):
    """A 429 says when the request would fit the queue: retry-after-ms (which OpenAI's client reads
    before Retry-After) is the compute time of the inputs that must leave it, at the recent pace,
    0.1 s at least, where it said 1 s whatever the queue. The client waits exactly that, and every
    call is served."""
    texts = [f"{i} {' '.join(SHORT[:8])}" for i in range(3)]  # 3 of the 4 queue places each
    hints: list[float] = []

    async def seen(response: httpx.Response) -> None:
        if response.status_code == 429:
            hints.append(int(response.headers["retry-after-ms"]) / 1000)
            assert response.headers["retry-after"] == "1"  # whole seconds, rounded up (RFC 9110)

    async def flood() -> list[object]:
        http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [seen]})
        url = tiny_queue_server.http_url + "/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=50, http_client=http) as c:
            await c.embeddings.create(model="m", input=texts)  # a batch has run: the pace is known
            calls = [c.embeddings.create(model="m", input=texts) for _ in range(30)]
            return await asyncio.gather(*calls, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="openai"):
        outcomes = asyncio.run(flood())
    assert all(isinstance(o, openai.types.CreateEmbeddingResponse) for o in outcomes), outcomes
    waits = [
        float(m[1])
        for record in caplog.records
        if (m := re.match(r"Retrying request in ([0-9.]+) seconds", record.getMessage()))
    ]
    assert hints, "no call was refused: nothing tested"
    assert all(0.1 <= hint < 1 for hint in hints), hints
    assert sorted(waits) == pytest.approx(sorted(hints), abs=1e-6)


def test_a_request_the_full_queue_cannot_take_is_refused_before_it_is_tokenized():
    """Overload is refused before its cost is paid: with the queue full (its depth published), the
    next request gets RESOURCE_EXHAUSTED and the tokenizer never sees it. The queue is filled by a
    bulk and an interactive request, and the interactive depth counts the second's inputs only."""
    settings = {"model_instances": 1, "queue_limit": 4, "max_batch_size": 4}
    with serving(*flags(settings), entry=fault_entry(FAULT)) as process:

        async def behind_a_busy_instance() -> tuple[float, object, float]:
            async with one_instance_held(process.address), AsyncEmbeddingClient(process.address, 60) as c:
                bulk = asyncio.ensure_future(c.embed_response(embed_request(SHORT[:2], priority="bulk")))
                await asyncio.to_thread(
                    wait_for, lambda: metric(process, "embed_queue_depth") == 2, 10.0, 0.05
                )
                filling = asyncio.ensure_future(c.embed_response(embed_request(SHORT[2:4])))
                full = await asyncio.to_thread(
                    wait_for, lambda: metric(process, "embed_queue_depth") == 4, 10.0, 0.05
                )
                assert full, "the queue did not fill"
                assert metric(process, "embed_queue_interactive_depth") == 2
                before = metric(process, "embed_tokenization_duration_seconds_count")
                try:
                    refused: object = await c.embed_response(embed_request(SHORT[4:6]))
                except grpc.RpcError as e:
                    refused = e
                after = metric(process, "embed_tokenization_duration_seconds_count")
                await filling, await bulk
                return before, refused, after

        before, refused, after = asyncio.run(behind_a_busy_instance())
        assert status(refused) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue_limit is 4" in refused.details()  # type: ignore[attr-defined]
        assert after == before, "the refused request was tokenized"


@pytest.fixture(scope="module")
def fault_server() -> Iterator[ServerProcess]:
    # A long queue delay, so that the faulty input shares its batch with the others.
    with serving("--max-queue-delay-ms", "100", entry=fault_entry(FAULT)) as process:
        yield process


def test_backend_failure_fails_only_the_request_holding_the_input(fault_server, reference):
    texts = [[SHORT[i]] for i in range(20)]
    texts.insert(7, [FAULT])

    async def behind_a_busy_instance() -> list:
        async with one_instance_held(fault_server.address):
            return await embed_concurrently(fault_server.address, [embed_request(t) for t in texts], 60)

    outcomes = asyncio.run(behind_a_busy_instance())
    failed = outcomes.pop(7)
    assert status(failed) == grpc.StatusCode.INTERNAL
    assert "model run failed" in failed.details()
    assert [status(o) for o in outcomes] == [grpc.StatusCode.OK] * 20
    assert_close(np.concatenate([to_array(o) for o in outcomes]), reference.embed(SHORT[:20]))
    assert metric(fault_server, "embed_batch_failures_total") == 1
    # Inputs re-run one by one after the failure: the others shared the faulty input's batch.
    assert metric(fault_server, "embed_batch_size_bucket", le="1.0") >= 1
    with EmbeddingClient(fault_server.address, timeout=30) as c:
        assert_close(c.embed(SHORT[:2]), reference.embed(SHORT[:2]))


def test_requests_waiting_for_the_model_are_bounded_by_their_bytes_not_only_by_their_inputs(reference):
    """Each waiting request keeps its bytes, parsed message and strings in the front until answered;
    the queue limit counts inputs, so 4,096 one-input requests of 400 kB would have held ~5 GB. Past
    --max-request-bytes-held the rest are refused at once, naming it; what was held is answered."""
    text = " ".join(SHORT) * 40  # ~80 kB: cut at 256 tokens, but kept whole while it waits
    limit = 1_000_000
    settings = {
        "model_instances": 1,
        "max_message_bytes": 200_000,
        "max_request_bytes_in_flight": 200_000,
        "max_request_bytes_held": limit,
    }
    with serving(*flags(settings), entry=fault_entry(FAULT)) as process:

        async def behind_a_busy_instance() -> list:
            # One after another (each is tokenized in milliseconds): what fills is the held budget,
            # not the one for requests being parsed and tokenized at once.
            async with one_instance_held(process.address), AsyncEmbeddingClient(process.address, 60) as c:
                calls = []
                for _ in range(30):
                    calls.append(asyncio.ensure_future(c.embed_response(embed_request([text]))))
                    await asyncio.sleep(0.04)
                return await asyncio.gather(*calls, return_exceptions=True)

        outcomes = asyncio.run(behind_a_busy_instance())
        refused = [o for o in outcomes if status(o) == grpc.StatusCode.RESOURCE_EXHAUSTED]
        served = [o for o in outcomes if status(o) == grpc.StatusCode.OK]
        assert len(served) + len(refused) == 30, [status(o) for o in outcomes]
        assert served and 30 * len(text) > limit
        assert len(served) * len(text) <= limit, f"{len(served)} requests of {len(text)} bytes held at once"
        held = [o for o in refused if "max_request_bytes_held" in o.details()]
        assert held, [o.details() for o in refused]
        assert f"max_request_bytes_held is {limit}" in held[0].details()
        assert metric(process, "embed_requests_refused_total", reason="request_bytes_held") == len(held)
        assert_close(to_array(served[0]), reference.embed([text]))


def test_server_keeps_serving_after_a_request_with_several_failing_inputs(fault_server, reference):
    with EmbeddingClient(fault_server.address, timeout=30) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.embed([FAULT, FAULT, SHORT[0]])
        assert e.value.code() == grpc.StatusCode.INTERNAL
    with EmbeddingClient(fault_server.address, timeout=10) as c:
        assert_close(c.embed(SHORT[:2]), reference.embed(SHORT[:2]))


# Warm-up and drain ------------------------------------------------------------------------------------


# Reconnect at once while the server is not yet listening (gRPC's default backoff waits seconds).
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 50),
]


class Lifecycle:
    """A server started on a known port, watched from the moment it starts listening."""

    def __init__(self) -> None:
        self.port = free_port()
        self.process = start_server("--address", f"127.0.0.1:{self.port}", "--drain-timeout-s", "30")
        self.address = f"127.0.0.1:{self.port}"
        self.statuses: list[int] = []  # health of the service, in the order seen
        self.embed_while_warming: tuple[grpc.StatusCode, str] | None = None
        self.info_while_warming: tuple[grpc.StatusCode, str] | None = None
        self.whole_server: int | None = None  # health of "" once the service said SERVING

    def watch_start(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(self.address, options=FAST_RECONNECT) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = pb_grpc.EmbeddingServiceStub(channel)
            while health_pb2.HealthCheckResponse.SERVING not in self.statuses:
                assert time.monotonic() < deadline, "the server never said SERVING"
                assert self.process.proc.poll() is None, "".join(self.process.lines)
                time.sleep(0.01)
                try:
                    answer = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1)
                except grpc.RpcError:
                    continue  # not listening yet
                self.statuses.append(answer.status)
                if answer.status == not_serving and self.embed_while_warming is None:
                    self.embed_while_warming = self._try(stub.Embed, embed_request(["too early"]))
                    # Not an empty answer, which a client would read as 0 dimensions.
                    self.info_while_warming = self._try(stub.Info, pb.InfoRequest())
            self.whole_server = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status

    @staticmethod
    def _try(method: grpc.UnaryUnaryMultiCallable, request: object) -> tuple[grpc.StatusCode, str]:
        """The call's status, and its ErrorInfo reason where it failed."""
        try:
            method(request, timeout=5)
        except grpc.RpcError as e:
            return e.code(), error_details(e)["ErrorInfo"].reason
        return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def lifecycle() -> Iterator[Lifecycle]:
    server = Lifecycle()
    try:
        server.watch_start()
        server.process.wait_serving()
        yield server
    finally:
        server.process.stop()


def test_health_says_not_serving_until_warm_up_ends(lifecycle):
    seen = lifecycle.statuses
    serving = health_pb2.HealthCheckResponse.SERVING
    assert seen[0] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert seen[-1] == serving and serving not in seen[:-1]
    assert lifecycle.embed_while_warming == (grpc.StatusCode.UNAVAILABLE, "WARMING_UP")
    assert lifecycle.info_while_warming == (grpc.StatusCode.UNAVAILABLE, "WARMING_UP")
    assert lifecycle.whole_server == serving


def _watch_until_not_serving(address: str, seen: list[int], watching: threading.Event) -> None:
    with grpc.insecure_channel(address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=60
        )
        for answer in call:
            seen.append(answer.status)
            watching.set()
            if answer.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                call.cancel()  # seen what it waited for
                return


def test_an_open_health_watch_ends_unavailable_at_the_drain_and_does_not_hold_it():
    """gRPC's graceful stop waits for every open call: a Watch left open (a load balancer's, a
    monitor's) held each drain until its timeout. It sees NOT_SERVING, then ends; the drain goes on."""
    seen: list[object] = []
    with serving("--drain-timeout-s", "60") as server, grpc.insecure_channel(server.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=120
        )
        seen.append(next(watch).status)
        server.terminate()
        with pytest.raises(grpc.RpcError) as ended:
            seen.extend(answer.status for answer in watch)
        code = server.wait(30)  # half the drain timeout: a held drain would take all 60 s
    assert seen == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
    assert (ended.value.code(), ended.value.details()) == (
        grpc.StatusCode.UNAVAILABLE,
        "the server is shutting down",
    )
    assert code == 0
    drained = [line for line in server.lines if "gRPC drained in" in line or "were cancelled" in line]
    assert len(drained) == 1 and "gRPC drained in" in drained[0], drained


def test_open_reflection_streams_and_health_calls_without_their_message_end_at_the_drain() -> None:
    """An open reflection stream held the drain to its timeout (21 s at the defaults), and a health
    Check or Watch still waiting for its message (--message-timeout-s outlasts the drain) was cut off
    there by gRPC with a logged traceback, one a call, for any anonymous client (a review). Each ends
    UNAVAILABLE at the drain now, and nothing is logged for them."""

    async def scenario(server: ServerProcess) -> list[tuple[grpc.StatusCode, str]]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            never = asyncio.Event()

            async def no_request() -> AsyncIterator[health_pb2.HealthCheckRequest]:
                await never.wait()
                yield health_pb2.HealthCheckRequest()

            codecs = {
                "request_serializer": health_pb2.HealthCheckRequest.SerializeToString,
                "response_deserializer": health_pb2.HealthCheckResponse.FromString,
            }
            check = channel.stream_unary("/grpc.health.v1.Health/Check", **codecs)(no_request())
            watch = channel.stream_stream("/grpc.health.v1.Health/Watch", **codecs)(no_request())
            info = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
            await info.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            assert (await info.read()).list_services_response.service  # open, answered, kept open
            await asyncio.sleep(0.5)
            server.terminate()
            ended = []
            for call in (check, watch, info):
                ended.append((await call.code(), await call.details()))
            return ended

    with serving("--drain-timeout-s", "60") as server:
        ended = asyncio.run(scenario(server))
        code = server.wait(30)  # half the drain timeout: a held drain would take all 60 s
    assert code == 0
    assert [c for c, _ in ended] == [grpc.StatusCode.UNAVAILABLE] * 3, ended
    assert all("the server is shutting down" in d for _, d in ended), ended
    logged = "".join(server.lines)
    assert "Traceback" not in logged and "ERROR" not in logged, logged[-3000:]
    drained = [line for line in server.lines if "gRPC drained in" in line or "were cancelled" in line]
    assert len(drained) == 1 and "gRPC drained in" in drained[0], drained


def test_a_reflection_stream_whose_client_stopped_reading_holds_the_drain_and_the_log_says_so() -> None:
    """A client that sends reflection requests and never reads the answers: the stream's end cannot be
    sent past them, so it holds the drain to its timeout, and gRPC cancels it there. The log said
    "gRPC drained in 20.00s", its count of open calls being the embedding service's only (a review)."""
    symbol = pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name

    async def scenario(server: ServerProcess) -> None:
        async with grpc.aio.insecure_channel(server.address) as channel:

            async def requests() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
                for _ in range(3000):  # ~10 MB of answers: past every window and socket buffer
                    yield reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
                await asyncio.Event().wait()

            info = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(requests())
            assert (await info.read()).file_descriptor_response.file_descriptor_proto  # then no more reads
            await asyncio.sleep(2)
            server.terminate()
            await asyncio.to_thread(server.wait, 30)
            info.cancel()

    with serving("--drain-timeout-s", "2") as server:
        asyncio.run(scenario(server))
    assert server.proc.returncode == 0
    said = [line for line in server.lines if "front 0" in line]
    assert any("draining: 0 gRPC calls being served, 0 waiting" in line for line in said), said
    assert any(", 1 health and reflection calls" in line for line in said), said
    drained = [line for line in said if "gRPC drained in" in line or "were cancelled" in line]
    assert len(drained) == 1, drained
    assert "WARNING" in drained[0] and "calls open past the drain timeout (2s) were cancelled" in drained[0]


def test_a_drain_with_no_call_open_says_nothing_was_cancelled_even_at_a_zero_timeout():
    """At --drain-timeout-s 0 each listener's stop takes "the timeout": an operator's pass saw
    "calls open past the drain timeout (0s) were cancelled" after "0 gRPC calls being served"."""
    with serving("--drain-timeout-s", "0") as server:
        with urllib.request.urlopen(server.http_url + "/health", timeout=10) as health:
            assert health.status == 200
        server.terminate()
        assert server.wait(30) == 0
    idle = "draining: 0 gRPC calls being served, 0 waiting, 0 HTTP calls"
    assert any(idle in line for line in server.lines)
    assert not [line for line in server.lines if "were cancelled" in line]


def test_an_open_stream_is_answered_then_ended_unavailable_at_the_drain_and_does_not_hold_it():
    """A long-lived EmbedStream held each drain until its timeout, and every item sent on it meanwhile
    was refused one by one (UNAVAILABLE "not serving"), the stream itself still open: a client had to
    know to open another. Now the item in flight is answered, then the stream ends UNAVAILABLE."""
    items: queue.Queue[pb.EmbedStreamRequest | None] = queue.Queue()
    with (
        serving("--drain-timeout-s", "20", entry=fault_entry(FAULT)) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        stream = pb_grpc.EmbeddingServiceStub(channel).EmbedStream(iter(items.get, None), timeout=60)
        items.put(pb.EmbedStreamRequest(id="open", request=embed_request(["hello"])))
        assert next(stream).id == "open"
        items.put(pb.EmbedStreamRequest(id="held", request=embed_request([HOLD_TEXT])))
        time.sleep(0.5)  # in its batch, which takes HOLD_S
        server.terminate()
        started = time.monotonic()
        held = next(stream)
        with pytest.raises(grpc.RpcError) as ended:
            next(stream)
        took = time.monotonic() - started
        items.put(None)
        code = server.wait(12)  # well inside the drain timeout: a held drain would take all 20 s
    assert (held.id, held.WhichOneof("result")) == ("held", "response")
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "the server is shutting down" in ended.value.details(), ended.value.details()
    assert took < 10, took
    assert code == 0
    drained = [line for line in server.lines if "gRPC drained in" in line or "were cancelled" in line]
    assert len(drained) == 1 and "gRPC drained in" in drained[0], drained


def _post_embeddings(port: int, body: dict, answers: list) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/embeddings",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            answers.append((response.status, response.headers, response.read()))
    except urllib.error.HTTPError as e:
        answers.append((e.code, e.headers, e.read()))


def test_a_call_outlasting_the_drain_timeout_is_answered_unavailable_and_the_log_says_so():
    """HOLD_TEXT holds its batch for HOLD_S (4 s) on the fault server, past a 1 s drain. Both APIs'
    calls get UNAVAILABLE naming the drain timeout; HTTP's got a bare 500 and a traceback in the log."""
    with serving("--drain-timeout-s", "1", entry=fault_entry("__fault__")) as server:
        with grpc.insecure_channel(server.address) as channel:
            held = pb_grpc.EmbeddingServiceStub(channel).Embed.future(embed_request([HOLD_TEXT]), timeout=30)
            answers: list = []
            http = threading.Thread(
                target=_post_embeddings, args=(server.http_port, {"input": HOLD_TEXT}, answers)
            )
            http.start()
            time.sleep(0.5)  # both taken into batches
            server.terminate()
            ended = held.exception(30)
            http.join(30)
        assert server.wait(30) == 0
    assert isinstance(ended, grpc.RpcError) and ended.code() == grpc.StatusCode.UNAVAILABLE, ended
    assert "its drain timeout, 1 s, passed" in ended.details(), ended.details()
    ((code, headers, body),) = answers
    assert code == 503 and headers["Retry-After"] == "1", (code, body)
    assert "its drain timeout, 1 s, passed" in json.loads(body)["error"]["message"]
    assert not [line for line in server.lines if "Exception in ASGI application" in line]
    said = [line for line in server.lines if "drain" in line]
    # The HTTP call is named too: the line said "0 calls" of a front waiting on an HTTP call.
    held = "front 0: draining: 1 gRPC calls being served, 0 waiting, 1 HTTP calls being served"
    assert any(held in line for line in said), said
    cut = "front 0: 2 calls still waiting for the engine at the drain timeout (1s) were answered UNAVAILABLE"
    assert any("WARNING" in line and cut in line for line in said), said


def test_an_http_body_still_coming_at_the_drain_timeout_is_answered_unavailable():
    """An upload stalled mid-body as the drain timeout passes, which uvicorn then cancels: it got a bare
    500, a traceback in the log, and was counted OK (an operator's pass)."""
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    with serving("--drain-timeout-s", "1") as server:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            sock.sendall(head + b'{"input": ')
            time.sleep(0.5)  # its body being read
            server.terminate()
            answer = b"".join(iter(lambda: sock.recv(65536), b""))
        assert server.wait(30) == 0
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 503 "), answer[:300]
    assert b"retry-after: 1\r\n" in status.lower()
    assert "its drain timeout, 1 s, passed" in json.loads(body)["error"]["message"]
    assert not [line for line in server.lines if "Exception in ASGI application" in line]


def test_sigterm_under_load_finishes_every_accepted_request_and_exits_0(lifecycle, reference):
    server = lifecycle.process
    texts = [" ".join(SHORT[i : i + 4]) for i in range(3)]  # 30 x 3 inputs of ~60 tokens: outlasts the signal
    health_seen: list[int] = []
    watching = threading.Event()
    watcher = threading.Thread(target=_watch_until_not_serving, args=(server.address, health_seen, watching))
    watcher.start()
    assert watching.wait(10)
    with EmbeddingClient(server.address, timeout=120) as c:
        calls = [c.stub.Embed.future(embed_request(texts), timeout=120) for _ in range(30)]
        deadline = time.monotonic() + 30
        while sum(call.done() for call in calls) + metric(server, "embed_requests_in_flight") < 30:
            assert time.monotonic() < deadline, "the 30 requests were never all in flight"
            time.sleep(0.01)
        server.terminate()  # every request is accepted, most still running
        watcher.join(10)  # until health says NOT_SERVING: the drain has begun
        unfinished = sum(not call.done() for call in calls)
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as late:
            pb_grpc.EmbeddingServiceStub(channel).Embed(embed_request(["after SIGTERM"]), timeout=5)
        outcomes = [call.exception() or call.result() for call in calls]
    assert health_seen == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
    assert unfinished > 0  # NOT_SERVING was said while accepted requests were still running
    assert late.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [status(o) for o in outcomes] == [grpc.StatusCode.OK] * 30
    for o in outcomes:
        assert_close(to_array(o), reference.embed(texts))
    assert server.wait(60) == 0


def test_a_second_signal_while_draining_stops_at_once_cutting_the_calls_in_flight():
    """Ctrl-C twice: the first drains, and a call still sending its request holds that drain to its 60 s
    timeout; the second stops every process at once, exit 130 (128 + SIGINT, as a shell reports a death
    by it), with one line saying so. A user-acceptance pass waited out the whole drain instead."""
    release = threading.Event()

    def request() -> Iterator[bytes]:  # an Embed call whose one message never comes (a slow upload)
        release.wait(60)
        yield from ()

    with serving("--drain-timeout-s", "60") as server, grpc.insecure_channel(server.address) as channel:
        embed = channel.stream_unary(f"/{SERVICE_NAME}/Embed")
        call = embed.future(request(), timeout=120)
        children = [*server.front_pids(), server.engine_pid]
        server.proc.send_signal(signal.SIGINT)
        held = "front 0: draining: 1 gRPC calls being served"  # it has its place, waiting for its message
        assert wait_for(lambda: any(held in line for line in server.lines), 30)
        time.sleep(SHUTDOWN_NOTICE_S + 0.5)  # past the notice: the drain itself waits for the call
        assert not call.done()
        server.proc.send_signal(signal.SIGINT)
        code = server.wait(15)  # a quarter of the drain timeout
        with pytest.raises(grpc.RpcError) as cut:
            call.result()
        release.set()
    assert code == 130
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value
    said = [line for line in server.lines if "second stop signal" in line]
    assert len(said) == 1 and "(SIGINT) while draining: stopping now" in said[0], said
    assert not [pid for pid in children if pid is not None and Path(f"/proc/{pid}").exists()]


def test_a_stop_signal_delivered_twice_at_once_is_one_stop_not_a_forced_one():
    """Process managers (honcho, foreman, some CI runners) signal the process group and forward the
    signal too: two SIGTERMs a moment apart must drain as one, not cut the calls in flight."""
    with serving() as server:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.send_signal(signal.SIGTERM)
        code = server.wait(60)
    assert code == 0, "".join(server.lines[-20:])
    assert not [line for line in server.lines if "second stop signal" in line]


def test_a_second_stop_signal_after_the_fronts_stopped_cuts_nothing_and_exits_0():
    """An operator's pass: a second Ctrl-C just after the drain ended (while the engine exits) gave
    exit 130 and "calls in flight are cut", after "fronts stopped ... exit codes [0]". Here the engine
    is held stopped (SIGSTOP) so that the supervisor is surely waiting for it when the signal comes."""
    with serving() as server:
        assert server.engine_pid is not None
        os.kill(server.engine_pid, signal.SIGSTOP)
        server.proc.send_signal(signal.SIGINT)
        assert wait_for(lambda: any("fronts stopped after" in line for line in server.lines), 30)
        time.sleep(1.5)  # past SAME_STOP_S: not taken for the first signal delivered twice
        server.proc.send_signal(signal.SIGINT)
        code = server.wait(30)
    assert code == 0, "".join(server.lines[-20:])
    said = [line for line in server.lines if "second stop signal" in line]
    assert len(said) == 1 and "after the fronts had stopped: the engine stopped at once" in said[0], said
    assert not [line for line in server.lines if "are cut" in line or "did not stop in time" in line]


def test_sighup_drains_as_sigterm_does_and_the_children_ignore_it():
    """A closed terminal's SIGHUP, which reaches every process of its group: the supervisor died of it
    at once (exit 129, its calls cut, not a word logged) and a front would have. Now the children
    ignore it and the supervisor drains, says which signal, and exits 0."""
    with serving() as server:
        children = [server.engine_pid, *server.front_pids()]
        for pid in children:
            os.kill(pid, signal.SIGHUP)
        time.sleep(0.5)
        assert server.health() == health_pb2.HealthCheckResponse.SERVING
        assert [server.engine_pid, *server.front_pids()] == children  # none died, none restarted
        server.proc.send_signal(signal.SIGHUP)
        code = server.wait(30)
    assert code == 0, "".join(server.lines[-20:])
    assert any("SIGHUP received: draining for up to" in line for line in server.lines)


def test_a_killed_supervisors_children_stop_at_once_and_its_directory_goes_with_the_next_start(tmp_path):
    """An operator's pass killed the supervisor (kill -9, as the OOM killer would). Its fronts drained
    as usual, a second of notice first, though the engine had stopped with it: a server started again
    0.2 s after the kill found the port in use and exited 2. Now they stop at once. And its run
    directory was left in /tmp (84 kB for one front, more with more), under Kubernetes a size-limited
    emptyDir that outlives restarts: the next server removes it; a live server's, and a directory that
    is not a run directory, stay."""
    env = {"TMPDIR": str(tmp_path)}
    with serving(env=env) as first:
        (left,) = tmp_path.glob("embed-*")
        children = [first.engine_pid, *first.front_pids()]
        first.proc.kill()
        first.proc.wait(10)
        assert wait_for(lambda: not [pid for pid in children if Path(f"/proc/{pid}").exists()], timeout=10)
        assert wait_for(lambda: any("the supervisor is gone" in line for line in first.lines), timeout=5)
    said = [line for line in first.lines if "the supervisor is gone" in line]
    assert "front 0: the supervisor is gone (killed?): stopping at once" in said[0], said
    with socket.socket() as sock:  # as a server started again binds it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", int(first.address.rpartition(":")[2])))
    assert (left / "metrics").is_dir(), "the killed server's directory is there to be removed"
    live, other = tmp_path / "embed-live", tmp_path / "embed-other"
    live.mkdir()
    other.mkdir()
    held = os.open(live / "supervisor.lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with serving(env=env) as second:
            assert not left.exists()
            assert any(f"removed {left}, left by a server that was killed" in line for line in second.lines)
            assert live.is_dir() and other.is_dir()
            (own,) = set(tmp_path.glob("embed-*")) - {live, other}
        assert not own.exists(), "a server that stops removes its own"
    finally:
        os.close(held)


def test_the_server_leaves_no_onnx_runtime_telemetry_behind(tmp_path, monkeypatch):
    """onnxruntime 1.31 keeps a device id and an event database under ~/.cache and uploads them to
    Microsoft unless ORT_DISABLE_TELEMETRY is set before it starts: the server sets it."""
    monkeypatch.delenv("ORT_DISABLE_TELEMETRY", raising=False)  # importing minilm_embed.export sets it
    env = {"HOME": str(tmp_path)}
    with serving(env=env) as server, EmbeddingClient(server.address) as c:
        c.embed(["hello"])
        time.sleep(3)  # without the setting, the files were there 2 s after an answer, not always at once
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], sorted(tmp_path.rglob("*"))
