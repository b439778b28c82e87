"""The HTTP API end to end, through the clients people use: OpenAI's Python package and LangChain's
OpenAIEmbeddings, against real `minilm-embed-serve` processes with the real model.

What each test holds true: the same vectors as gRPC from the same server (one engine, one queue),
OpenAI's request and response shapes, errors in OpenAI's shape with the HTTP status matching gRPC's
and a message naming the limit and the value, /health following the drain, and the same metrics.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import orjson
import pytest
import uvicorn
from langchain_openai import OpenAIEmbeddings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from minilm_embed.client.client import EmbeddingClient, Security
from minilm_embed.server.errors import InvalidInput
from minilm_embed.server.http import BoundedH11, parse_input
from minilm_embed.server.place import reuseport_socket
from tests.server_process import ServerProcess, fault_entry, flags, serving
from tests.stand_in_server import HOLD_TEXT
from tests.test_server import DIMENSIONS, LONG, SHORT, assert_close, metric

TOKEN = "http-test-token"
MAX_INPUTS = 64
MAX_BODY = 1_000_000
MAIN_FLAGS = {
    "auth_token": TOKEN,
    "max_inputs_per_request": MAX_INPUTS,
    "max_message_bytes": MAX_BODY,
    "max_batch_size": 16,
}
TEXTS = [*SHORT[:12], LONG]  # LONG is truncated at 256 tokens, on both protocols


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serving(*flags(MAIN_FLAGS)) as process:
        yield process


@pytest.fixture(scope="module")
def grpc_client(server: ServerProcess) -> Iterator[EmbeddingClient]:
    with EmbeddingClient(server.address, timeout=60, security=Security(token=TOKEN)) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_vectors(grpc_client: EmbeddingClient) -> np.ndarray:
    return grpc_client.embed(TEXTS)


def openai_client(server: ServerProcess, key: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key=key, max_retries=0, timeout=60)


def create(server: ServerProcess, **kwargs: object) -> openai.types.CreateEmbeddingResponse:
    return openai_client(server).embeddings.create(model="all-MiniLM-L6-v2", **kwargs)  # type:
    # ignore[arg-type]


# Vectors: the same as gRPC's ----------------------------------------------------------------------


def test_openai_float_vectors_equal_grpc_and_usage_counts_the_tokens(server, grpc_client, grpc_vectors):
    response = create(server, input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    assert_close(got, grpc_vectors)
    grpc_tokens = sum(len(t.ids) for t in grpc_client.tokenize(TEXTS).tokens)
    assert response.usage.prompt_tokens == response.usage.total_tokens == grpc_tokens
    assert response.model == "sentence-transformers/all-MiniLM-L6-v2"
    assert response.object == "list" and response.data[0].object == "embedding"


def test_openai_base64_vectors_are_little_endian_float32_equal_to_grpc(server, grpc_vectors):
    response = create(server, input=TEXTS, encoding_format="base64")
    raw = [base64.b64decode(d.embedding) for d in response.data]  # type: ignore[arg-type]
    got = np.stack([np.frombuffer(r, dtype="<f4") for r in raw])
    assert got.shape == (len(TEXTS), DIMENSIONS)
    assert_close(got, grpc_vectors)


def test_openai_default_format_is_decoded_by_the_client_to_the_same_vectors(server, grpc_vectors):
    response = create(server, input=TEXTS[0])  # the client asks for base64 and decodes it itself
    assert_close(np.array([response.data[0].embedding]), grpc_vectors[:1])


def test_token_id_inputs_equal_text_inputs(server, grpc_client, grpc_vectors):
    ids = [list(t.ids) for t in grpc_client.tokenize(TEXTS[:3]).tokens]
    many = create(server, input=ids, encoding_format="float")
    one = create(server, input=ids[0], encoding_format="float")
    assert_close(np.array([d.embedding for d in many.data]), grpc_vectors[:3])
    assert_close(np.array([one.data[0].embedding]), grpc_vectors[:1])
    assert many.usage.total_tokens == sum(map(len, ids))


def test_a_long_id_list_is_cut_as_a_long_text_is(server, grpc_client):
    """30,002 ids (a 150 kB body, checked off the event loop) embed as their first 255 and [SEP]."""
    ids = [101, *(2000 + i % 28_000 for i in range(30_000)), 102]
    long = create(server, input=ids, encoding_format="float")
    cut = grpc_client.embed_ids([[*ids[:255], 102]])
    assert_close(np.array([long.data[0].embedding]), cut)
    assert long.usage.total_tokens == 256


def test_dimensions_equal_to_the_models_is_accepted(server, grpc_vectors):
    response = create(server, input=TEXTS[:1], dimensions=DIMENSIONS, encoding_format="float")
    assert_close(np.array([response.data[0].embedding]), grpc_vectors[:1])


def test_langchain_openai_embeddings_equal_grpc(server, grpc_vectors):
    # check_embedding_ctx_length=False: send the texts, not tiktoken's token arrays (another vocabulary).
    embeddings = OpenAIEmbeddings(
        model="all-MiniLM-L6-v2",
        base_url=server.http_url + "/v1",
        api_key=TOKEN,  # type: ignore[arg-type]
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents = np.array(embeddings.embed_documents(TEXTS))
    query = np.array([embeddings.embed_query(TEXTS[1])])
    assert_close(documents, grpc_vectors)
    assert_close(query, grpc_vectors[1:2])


def test_langchain_as_the_readme_sets_it_up_embeds_more_documents_than_one_request_holds(server, grpc_client):
    """LangChain sends 1,000 texts a request by default; README's chunk_size keeps each request within
    the server's limit, and the rows come back in order."""
    texts = [f"{i}: {SHORT[i % len(SHORT)]}" for i in range(2 * MAX_INPUTS + 5)]
    settings = dict(
        model="m", base_url=server.http_url + "/v1", api_key=TOKEN, check_embedding_ctx_length=False
    )
    with pytest.raises(openai.BadRequestError, match=f"max_inputs_per_request={MAX_INPUTS}"):
        OpenAIEmbeddings(**settings, max_retries=0).embed_documents(texts)  # type: ignore[arg-type]
    chunked = OpenAIEmbeddings(**settings, chunk_size=MAX_INPUTS, max_retries=0)  # type: ignore[arg-type]
    want = np.concatenate(
        [grpc_client.embed(texts[i : i + MAX_INPUTS]) for i in range(0, len(texts), MAX_INPUTS)]
    )
    assert_close(np.array(chunked.embed_documents(texts)), want)


def test_the_listening_socket_gets_tcp_nodelay_on_every_connection():
    """Without TCP_NODELAY on the front's connections, every HTTP call waited ~40 ms for a delayed
    ACK between the response's header and body writes. asyncio (which uvicorn serves through) sets it
    only on connections whose listening socket says IPPROTO_TCP: checked on the socket the front
    makes, as asyncio accepts from it."""
    sock = reuseport_socket("127.0.0.1:0")
    sock.listen()
    port = sock.getsockname()[1]

    async def accepted_option() -> int:
        got: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                option = transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                got.set_result(option)
                transport.close()

        server = await asyncio.get_running_loop().create_server(Protocol, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            option = await asyncio.wait_for(got, 10)
            writer.close()
        return option

    assert asyncio.run(accepted_option()) != 0


def test_models_lists_the_served_model(server):
    models = openai_client(server).models.list().data
    assert [m.id for m in models] == ["sentence-transformers/all-MiniLM-L6-v2"]
    assert models[0].owned_by == "sentence-transformers"
    assert 1_600_000_000 < models[0].created <= time.time()
    assert openai_client(server).models.retrieve(models[0].id) == models[0]
    with pytest.raises(openai.NotFoundError) as e:
        openai_client(server).models.retrieve("text-embedding-3-small")
    assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert "`text-embedding-3-small` does not exist" in e.value.message
    # The name README's examples embed with: the id's last part.
    assert openai_client(server).models.retrieve("all-MiniLM-L6-v2") == models[0]


# mtime 0: the same bytes, so the same test id, in every pytest-xdist worker.
GZIPPED = gzip.compress(b'{"input": "hello"}', mtime=0)


@pytest.mark.parametrize(
    ("body", "headers", "named"),
    [
        (GZIPPED, {"Content-Encoding": "gzip"}, "Content-Encoding: gzip"),
        (b'{"input": "caf\xe9"}', {}, "not UTF-8 (byte 0xe9 at offset 14)"),
    ],
)
def test_a_body_that_cannot_be_read_as_sent_is_refused_saying_why(server, body, headers, named):
    """Not orjson's "surrogates not allowed" for a Latin-1 or a compressed body."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json", **headers}
    response = httpx.post(server.http_url + "/v1/embeddings", content=body, headers=headers)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"], response.text


# Errors: OpenAI's shape, the status matching gRPC's, the limit and the value named ------------------


@pytest.mark.parametrize(
    ("body", "param", "code", "named"),
    [
        (
            {"input": ["a"] * (MAX_INPUTS + 1)},
            "input",
            "too_many_inputs",
            ["65 inputs", f"max_inputs_per_request={MAX_INPUTS}"],
        ),
        ({"input": []}, "input", "no_inputs", ["empty list"]),
        ({"input": [""]}, "input", "empty_input", ["input 0 is an empty string"]),
        (
            {"input": ["a", 7]},
            "input",
            "invalid_request",
            ["mixes kinds of items: input 0 is a string, input 1 is an integer"],
        ),
        (
            {"input": ["a", "b", None]},
            "input",
            "invalid_request",
            ["mixes kinds of items: input 0 is a string, input 2 is null"],
        ),
        # A list that starts with a number is one input of token ids: its odd item is named by position
        # (was "`input` mixes kinds of items: input 0 is an integer, input 1 is a string").
        (
            {"input": [101, 1.0, [102]]},
            "input",
            "token_id_not_an_integer",
            ["input 0: token id at position 1 is a number 1.0, not an integer"],
        ),
        (
            {"input": [101, "a", 102]},
            "input",
            "token_id_not_an_integer",
            ['input 0: token id at position 1 is a string "a", not an integer'],
        ),
        (
            {"input": [[101, None, 102]]},
            "input",
            "token_id_not_an_integer",
            ["input 0: token id at position 1 is null, not an integer"],
        ),
        ({"input": [None]}, "input", "invalid_request", ["input 0 is null; send a list of strings"]),
        (
            {"input": [[101, "x"]]},
            "input",
            "token_id_not_an_integer",
            ["input 0", 'position 1 is a string "x", not an integer'],
        ),
        (
            {"input": [101, 1.0]},
            "input",
            "token_id_not_an_integer",
            ["input 0", "position 1 is a number 1.0, not an integer"],
        ),
        (
            {"input": [[101], [True]]},
            "input",
            "token_id_not_an_integer",
            ["input 1", "position 0 is a boolean true"],
        ),
        (
            {"input": [[101, 2**63]]},
            "input",
            "token_id_out_of_range",
            ["token id 9223372036854775808 at position 1", "vocabulary [0, 30522)"],
        ),
        # Past 64 bits JSON's parser gives a float: still a number outside the vocabulary, not "not an
        # integer" (the caller sent an integer), and the range is named (it was not).
        (
            {"input": [[101, 2**64]]},
            "input",
            "token_id_out_of_range",
            ["token id 1.8446744073709552e+19 at position 1 is outside the vocabulary [0, 30522)"],
        ),
        (
            {"input": [101, -(10**30)]},
            "input",
            "token_id_out_of_range",
            ["token id -1e+30 at position 1 is outside the vocabulary [0, 30522)"],
        ),
        # One below int64 arrives as the float -2**63, which int64 holds: it was "is a number
        # -9.223372036854776e+18, not an integer".
        (
            {"input": [101, -(2**63) - 1, 102]},
            "input",
            "token_id_out_of_range",
            ["token id -9.223372036854776e+18 at position 1 is outside the vocabulary [0, 30522)"],
        ),
        ({"input": [[101, 999_999, 102]]}, "input", "token_id_out_of_range", ["999999", "[0, 30522)"]),
        # Bodies past 64 KiB and past 16,384 ids are parsed and checked off the event loop: the same
        # answers, the fault named where it is.
        (
            {"input": [101, *[1000] * 30_000, 1.5]},
            "input",
            "token_id_not_an_integer",
            ["input 0", "position 30001 is a number 1.5"],
        ),
        (
            {"input": [[101, *[1000] * 30_000, 102], [101, 999_999, 102]]},
            "input",
            "token_id_out_of_range",
            ["input 1: token id 999999 at position 1", "[0, 30522)"],
        ),
        (
            {"input": [[101, *[1000] * 30_000, 102]], "truncate": False},
            "input",
            "too_many_tokens",
            ["input 0 has 30002 tokens, over the limit max_input_tokens=256"],
        ),
        # What LangChain's OpenAIEmbeddings sends by default: tiktoken's ids, valid ids of this vocabulary.
        (
            {"input": [[15339, 1917]]},
            "input",
            "token_ids_not_framed",
            ["must start with [CLS] (101)", "check_embedding_ctx_length=False"],
        ),
        # tiktoken's ids run to 100,256: one past this vocabulary is still named as another tokenizer's.
        (
            {"input": [[32, 893, 374, 13, 66694, 13]]},
            "input",
            "token_ids_not_framed",
            ["must start with [CLS] (101)", "check_embedding_ctx_length=False"],
        ),
        ({"input": {"text": "a"}}, "input", "invalid_request", ["an object"]),
        ({"input": "a", "dimensions": 128}, "dimensions", "unsupported_dimensions", ["128", f"{DIMENSIONS}"]),
        # Not "`dimensions` is 384.0, but ... send 384": a number that is not an integer says so.
        (
            {"input": "a", "dimensions": 384.0},
            "dimensions",
            "invalid_request",
            ["must be an integer, not a number 384.0"],
        ),
        (
            {"input": "a", "dimensions": "384"},
            "dimensions",
            "invalid_request",
            ['must be an integer, not a string "384"'],
        ),
        (
            {"input": "a", "dimensions": True},
            "dimensions",
            "invalid_request",
            ["must be an integer, not a boolean true"],
        ),
        (
            {"input": "a", "truncate": "no"},
            "truncate",
            "invalid_request",
            ['`truncate` must be a boolean, not a string "no"'],
        ),
        (
            {"input": "a", "truncate": 0},
            "truncate",
            "invalid_request",
            ["must be a boolean, not an integer 0"],
        ),
        # As gRPC's truncate=false: refused naming the input, its tokens and the limit.
        (
            {"input": [SHORT[0], LONG], "truncate": False},
            "input",
            "too_many_tokens",
            ["input 1 has 414 tokens, over the limit max_input_tokens=256"],
        ),
        (
            {"input": [[101, *[1000] * 298, 102]], "truncate": False},
            "input",
            "too_many_tokens",
            ["input 0 has 300 tokens, over the limit max_input_tokens=256"],
        ),
        (
            {"input": "a", "encoding_format": "hex"},
            "encoding_format",
            "unknown_format",
            ['"hex"', "float or base64"],
        ),
        ({"model": "m"}, "input", "no_inputs", ["`input` is required"]),
        (
            {"input": "a", "priority": "urgent"},
            "priority",
            "unknown_priority",
            ['`priority` is "urgent"', "interactive or bulk"],
        ),
    ],
)
def test_invalid_requests_get_400_in_openais_shape_naming_the_limit(server, body, param, code, named):
    response = httpx.post(
        server.http_url + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # `code`: the reason gRPC's ErrorInfo gives, lower-cased (OpenAI's codes name the case too).
    assert error["type"] == "invalid_request_error" and error["code"] == code
    assert error["param"] == param
    for part in named:
        assert part in error["message"], error["message"]


def test_openai_raises_bad_request_naming_the_limit(server):
    with pytest.raises(openai.BadRequestError) as e:
        create(server, input=["a"] * (MAX_INPUTS + 1))
    assert e.value.status_code == 400
    assert f"max_inputs_per_request={MAX_INPUTS}" in e.value.message


def test_a_body_over_the_limit_is_refused_with_413(server):
    with pytest.raises(openai.APIStatusError) as e:
        create(server, input="word " * (MAX_BODY // 5))
    assert e.value.status_code == 413
    assert f"max_message_bytes={MAX_BODY}" in e.value.message
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        yield b'{"input": "'
        yield from [b"x" * 100_000] * 11

    response = httpx.post(server.http_url + "/v1/embeddings", content=chunks(), headers=headers)
    assert response.status_code == 413
    assert f"more than {MAX_BODY} bytes" in response.json()["error"]["message"]


# Short HTTP timeouts and a small byte budget, without a token: one server for the stalled upload's test
# and the unread answers' (each start costs model load and warm-up). Each test closes its connections
# by its end; were the unread answers' last request (2 kB) still being computed as the stalled upload
# begins, its bytes held fit beside the 101 kB that test needs held at once (200,000 bytes).
TIMEOUTS_FLAGS = {
    "http_body_timeout_s": 2.5,
    "http_header_timeout_s": 1.0,
    "max_message_bytes": 200_000,
    "max_request_bytes_in_flight": 200_000,
    "max_request_bytes_held": 200_000,
    "max_inputs_per_request": 64,
}


@pytest.fixture(scope="module")
def timeouts_server() -> Iterator[ServerProcess]:
    with serving(*flags(TIMEOUTS_FLAGS)) as process:
        yield process


def test_a_stalled_upload_holds_the_bytes_it_sent_and_is_ended_with_408(timeouts_server):
    """400 uploads stalled one byte short of their Content-Length held 1 GB of a front, unaccounted and
    for good; holding each body's declared size from the start instead let 4 connections that sent
    600 bytes in all refuse every call for 30 s (an adversarial pass). A body's bytes are held as they
    come (one that does not fit beside them is refused), and the upload is ended after
    --http-body-timeout-s."""
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    process = timeouts_server
    host, port = process.http_url.removeprefix("http://").rsplit(":", 1)
    url = process.http_url + "/v1/embeddings"
    with (
        socket.create_connection((host, int(port)), timeout=30) as small,
        socket.create_connection((host, int(port)), timeout=30) as large,
    ):
        small.sendall(head + b"Content-Length: 150000\r\n\r\n" + b'{"input": "' + b"x" * 1000)
        time.sleep(0.3)  # read up to where it stops
        beside_small = httpx.post(url, json={"input": "y" * 100_000})
        large.sendall(head + b"Content-Length: 150000\r\n\r\n" + b'{"input": "' + b"x" * 120_000)
        time.sleep(0.3)
        beside_large = httpx.post(url, json={"input": "y" * 100_000})
        answer = _until_answered(small)
        # The rest of the body, still trickling in, is not taken for a next request's headers
        # (which got a second 408 at the header timeout): the connection was closed.
        later = b""
        with contextlib.suppress(OSError):
            for _ in range(6):
                small.sendall(b"x" * 100)
                time.sleep(0.3)
            while chunk := small.recv(65536):
                later += chunk
    assert beside_small.status_code == 200, beside_small.text  # 1,011 bytes held, not 150,000
    assert beside_large.status_code == 429, beside_large.text  # 120,011 held: 100 kB more do not fit
    assert "front busy" in beside_large.json()["error"]["message"]
    assert answer.startswith("HTTP/1.1 408"), answer
    assert "http_body_timeout_s=2.5" in answer and "sent 1011 bytes" in answer, answer
    assert "\r\nconnection: close\r\n" in answer and b"408" not in later, (answer, later)
    after = httpx.post(url, json={"input": "y" * 100_000})
    assert after.status_code == 200, after.text


def _until_answered(sock: socket.socket) -> str:
    received = b""
    while not received.endswith(b"}}") and (chunk := sock.recv(65536)):  # head and body
        received += chunk  # may come in two reads
    return received.decode()


@pytest.mark.parametrize(
    "body",
    [
        {"input": "a", "dimensions": "D" * 900_000},
        {"input": "a", "truncate": ["T"] * 150_000},
        {"input": "a", "encoding_format": "E" * 900_000},
        {"input": [[101, "I" * 900_000]]},
    ],
    ids=["dimensions", "truncate", "encoding_format", "token_id"],
)
def test_an_error_shows_a_bad_value_cut_short_not_echoed_whole(server, body):
    """A 900 kB bad value came back whole in the error's message (a message-sized answer to any
    request, and a message-sized line wherever a caller logs its errors)."""
    response = httpx.post(
        server.http_url + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert response.status_code == 400, response.text[:300]
    message = response.json()["error"]["message"]
    assert len(message) < 300, message[:300]
    assert "..." in message  # says it was cut


def test_a_model_not_served_is_named_cut_short(server):
    response = httpx.get(
        server.http_url + "/v1/models/" + "m" * 30_000, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert response.status_code == 404
    assert len(response.content) < 1000, response.content[:300]


def test_a_client_that_never_reads_its_answers_is_cut_off_after_the_body_timeout(timeouts_server):
    """A client that pipelines requests and never reads held its connection (one of
    --http-max-connections), an answer task and a response body in the front for good, since uvicorn
    waits without limit for a socket to drain. It is now cut off once its socket has stayed full
    for --http-body-timeout-s (2.5 s on timeouts_server)."""
    process = timeouts_server
    host, port = process.http_url.removeprefix("http://").rsplit(":", 1)
    body = orjson.dumps({"input": ["a sentence of a few words"] * 64})  # ~300 kB answers
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    sent = 30  # ~9 MB of answers: more than the kernel's socket buffers hold
    with socket.socket() as reader:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect((host, int(port)))
        reader.sendall((head.encode() + body) * sent)
        time.sleep(10)  # answers computed, the socket full, and the timeout passed
        reader.settimeout(15)
        received = bytearray()
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            while chunk := reader.recv(1 << 20):
                received += chunk
    assert received.count(b"HTTP/1.1 200") < sent
    assert httpx.get(process.http_url + "/health").status_code == 200


def test_a_client_reading_its_answer_slowly_but_steadily_gets_all_of_it():
    """uvicorn writes an answer in one write and asyncio resumes writing only once it has nearly all
    gone out, so the unread-answer timer ran for the answer's whole delivery: a client reading 1.2 MB
    steadily at 100 kB/s was cut after --http-body-timeout-s. Only a window without progress cuts
    now. Here 400 kB read at 200 kB/s (2 s) through small socket buffers, the timeout 0.7 s."""
    size, rate = 400_000, 200_000

    async def big(request: Request) -> Response:
        return Response(b"x" * size, media_type="application/octet-stream")

    limits = {"send_timeout_s": 0.7, "header_timeout_s": 10.0, "max_connections": 10, "metrics": None}
    protocol = type("Bounded", (BoundedH11,), limits)
    app = Starlette(routes=[Route("/big", big)])
    server = uvicorn.Server(uvicorn.Config(app, http=protocol, log_level="warning", lifespan="off"))
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # accepted sockets inherit it
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.02)
            with socket.socket() as reader:
                reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
                reader.settimeout(10)
                reader.connect(sock.getsockname())
                reader.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
                received = bytearray()
                with contextlib.suppress(ConnectionResetError):
                    while chunk := reader.recv(8192):
                        received += chunk
                        time.sleep(len(chunk) / rate)  # reading steadily
                        end = received.find(b"\r\n\r\n")
                        if end >= 0 and len(received) >= end + 4 + size:
                            break  # the whole answer (keep-alive: the server does not close)
        finally:
            server.should_exit = True
            thread.join(10)
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and len(body) == size, (head[:100], len(body))


def test_a_wrong_or_missing_token_gets_401_and_health_stays_open(server):
    with pytest.raises(openai.AuthenticationError) as e:
        openai_client(server, key="wrong").embeddings.create(model="m", input="a")
    assert e.value.status_code == 401
    assert "bearer token" in e.value.message
    for path in ("/v1/embeddings", "/v1/models"):
        response = httpx.request(
            "POST" if "emb" in path else "GET", server.http_url + path, json={"input": "a"}
        )
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"  # RFC 6750
    assert httpx.get(server.http_url + "/health").status_code == 200


def test_every_answer_carries_the_request_id_given_or_made_up(server):
    auth = {"authorization": f"Bearer {TOKEN}"}
    url = server.http_url + "/v1/embeddings"
    given = httpx.post(url, json={"input": "a"}, headers={**auth, "x-request-id": "job-42/row-7"})
    assert given.status_code == 200 and given.headers["x-request-id"] == "job-42/row-7"
    refused = httpx.post(url, json={"input": []}, headers={**auth, "x-request-id": "bad-one"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "bad-one"
    made_up = httpx.post(url, json={"input": "a"}, headers={**auth, "x-request-id": "x" * 129})
    assert len(made_up.headers["x-request-id"]) == 32  # a uuid4's hex: the given one was too long
    unauthenticated = httpx.post(url, json={"input": "a"})
    assert unauthenticated.status_code == 401 and unauthenticated.headers["x-request-id"]
    health = httpx.get(server.http_url + "/health", headers={"x-request-id": "probe-1"})
    assert health.status_code == 200 and health.headers["x-request-id"] == "probe-1"


def test_unknown_paths_and_methods_answer_in_openais_shape_with_allow_and_the_request_id(server):
    """Starlette's own refusals as every other answer: gRPC's code lower-cased (NOT_FOUND; UNIMPLEMENTED,
    as gRPC answers an unknown method), an x-request-id, and for 405 the Allow header RFC 9110 asks."""
    missing = httpx.get(server.http_url + "/v1/nothing", headers={"x-request-id": "lost-1"})
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "Not Found",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }
    assert missing.headers["x-request-id"] == "lost-1"
    wrong = httpx.get(server.http_url + "/v1/embeddings")
    assert wrong.status_code == 405
    assert wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "unimplemented"
    assert len(wrong.headers["x-request-id"]) == 32  # none given: a uuid4's hex
    # Not Starlette's bare 307 to the path without the slash.
    slash = httpx.post(
        server.http_url + "/v1/embeddings/", json={"input": "a"}, headers={"x-request-id": "s"}
    )
    assert slash.status_code == 404 and slash.json()["error"]["code"] == "not_found"
    assert "send /v1/embeddings" in slash.json()["error"]["message"]
    assert slash.headers["x-request-id"] == "s"


@pytest.mark.parametrize("header", [b"Content-Length: abc", b"Content-Length: 2\r\nContent-Length: 3"])
def test_a_request_h11_cannot_parse_gets_400_in_openais_shape(server, header):
    """Not uvicorn's plain-text "Invalid HTTP request received.": JSON, a code, an x-request-id."""
    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n{}")
        answer = b"".join(iter(lambda: sock.recv(65536), b""))  # then closed
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), head
    assert b"x-request-id: " in head.lower()
    error = orjson.loads(body)["error"]
    assert error["code"] == "malformed_request" and "malformed HTTP request" in error["message"]


UPGRADE = (
    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)


def answer_line(server: ServerProcess, request: bytes) -> bytes:
    """The first line of the answer to `request`, sent on a connection of its own."""
    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        return sock.recv(65536).partition(b"\r\n")[0]


def test_a_websocket_upgrade_leaves_neither_its_token_nor_its_query_in_the_log(server):
    """The API serves no WebSocket. With the `websockets` package importable (this environment has
    it), uvicorn took an `Upgrade: websocket` request to its WebSocket protocol: it answered 403 and
    logged at INFO the client's address, path and query string (a call's text), uncut, and at DEBUG
    the request's headers, the bearer token among them. It is answered as any other request now, and
    the log holds nothing of it."""
    secret = b"my%20private%20query%20" + str(time.time_ns()).encode()
    target = b"/v1/models?text=" + secret
    auth = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
    head = b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n" + UPGRADE + auth + b"\r\n"
    status = answer_line(server, head)
    time.sleep(1.0)  # the front's lines reach server.lines
    logged = "".join(server.lines)
    assert secret.decode() not in logged and "my private query" not in logged
    assert TOKEN not in logged
    assert status.startswith(b"HTTP/1.1 200 "), status  # GET /v1/models, with the right token


def test_requests_that_make_uvicorn_warn_are_logged_once_a_minute_not_once_each(server):
    """uvicorn logs a WARNING for each request with an `Upgrade` header ("Unsupported upgrade
    request.", then advice to install a WebSocket library) and each it cannot parse ("Invalid HTTP
    request received."): any client could flood the log. Each message is logged at most once a
    minute in a front, saying so; the advice, wrong for an API that serves no WebSocket, not at all."""
    before = len(server.lines)
    for _ in range(8):
        answer_line(
            server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n" + UPGRADE + b"\r\n"
        )
        answer_line(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\n" + UPGRADE + b"\r\n")
        answer_line(server, b"BAD REQUEST LINE\r\n\r\n")
    time.sleep(1.0)
    fronts = len(server.front_pids())
    logged, since = list(server.lines), server.lines[before:]
    for message in ("Unsupported upgrade request.", "Invalid HTTP request received."):
        assert any(message in line for line in logged), message  # still told, once
        lines = [line for line in since if message in line]
        assert len(lines) <= fronts and all("rate-limited" in line for line in lines), lines
    assert not any("WebSocket library" in line for line in logged)


def test_truncate_true_or_null_cuts_a_long_input_as_by_default(server, grpc_vectors):
    """TEI's `truncate`; true (the default, as gRPC's) cuts LONG at 256 tokens, on texts and token ids."""
    want = grpc_vectors[-1:]
    whole = [101, *[1000] * 298, 102]
    for truncate in (True, None):
        response = create(server, input=[LONG], encoding_format="float", extra_body={"truncate": truncate})
        assert response.usage.total_tokens == 256
        assert_close(np.array([response.data[0].embedding]), want)
        ids = create(server, input=whole, encoding_format="float", extra_body={"truncate": truncate})
        assert ids.usage.total_tokens == 256


def test_priority_bulk_or_interactive_gives_the_same_vectors(server, grpc_vectors):
    """gRPC's `priority`, an extension to OpenAI's request as `truncate` is."""
    for priority in ("bulk", "interactive", None):
        response = create(server, input=[LONG], encoding_format="float", extra_body={"priority": priority})
        assert_close(np.array([response.data[0].embedding]), grpc_vectors[-1:])


def test_metrics_count_http_calls_beside_grpc(server):
    def count(code: str) -> float:
        return metric(server, "embed_requests_total", method="http_embeddings", code=code)

    before = {code: count(code) for code in ("OK", "INVALID_ARGUMENT", "UNAUTHENTICATED")}
    create(server, input=["a", "b"])
    with pytest.raises(openai.BadRequestError):
        create(server, input=[])
    with pytest.raises(openai.AuthenticationError):
        openai_client(server, key="wrong").embeddings.create(model="m", input="a")
    after = {code: count(code) for code in before}
    assert {code: after[code] - before[code] for code in before} == {
        "OK": 1,
        "INVALID_ARGUMENT": 1,
        "UNAUTHENTICATED": 1,
    }
    sized = metric(server, "embed_request_duration_seconds_count", method="http_embeddings", size="2-8")
    assert sized >= 1
    assert metric(server, "embed_requests_in_flight") == 0


def test_a_client_gone_mid_upload_is_counted_cancelled_not_a_server_error(server):
    def count(code: str) -> float:
        return metric(server, "embed_requests_total", method="http_embeddings", code=code)

    before = {code: count(code) for code in ("CANCELLED", "INTERNAL")}
    host, port = server.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (
            f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 10000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"input": "only part of the body')
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while count("CANCELLED") == before["CANCELLED"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count("CANCELLED") - before["CANCELLED"] == 1
    assert count("INTERNAL") == before["INTERNAL"]  # it paged as a server error before


# Overload and drain: one queue with gRPC, one drain ----------------------------------------------


@pytest.fixture(scope="module")
def held_server() -> Iterator[ServerProcess]:
    """A tiny queue, and HOLD_TEXT holding its batch for seconds (tests/stand_in_server.py)."""
    settings = {"queue_limit": 4, "max_batch_size": 4, "drain_timeout_s": 30}
    with serving(*flags(settings), entry=fault_entry("__fault__")) as process:
        yield process


async def _embed_at_once(url: str, texts: list[str], times: int, **extra: object) -> list[object]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60) as c:
        calls = [c.embeddings.create(model="m", input=texts, extra_body=extra or None) for _ in range(times)]
        return await asyncio.gather(*calls, return_exceptions=True)


def test_a_full_queue_is_refused_with_429_naming_the_limit(held_server, grpc_client):
    texts = [f"{i} {' '.join(SHORT[:8])}" for i in range(3)]  # 3 of the 4 queue places each
    outcomes = asyncio.run(_embed_at_once(held_server.http_url, texts, 30))
    refused = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    answered = [o for o in outcomes if isinstance(o, openai.types.CreateEmbeddingResponse)]
    assert refused and answered and len(refused) + len(answered) == 30, outcomes
    assert all("queue_limit is 4" in e.message and e.status_code == 429 for e in refused)
    assert refused[0].body["code"] == "queue_full"  # type: ignore[index]
    assert all(e.response.headers["retry-after"] == "1" for e in refused)
    want = grpc_client.embed(texts)
    for response in answered:
        assert_close(np.array([d.embedding for d in response.data]), want)
    refusals = metric(
        held_server, "embed_requests_total", method="http_embeddings", code="RESOURCE_EXHAUSTED"
    )
    assert refusals == len(refused)


# After the full-queue test, which counts every 429 the held server has answered.
def test_bulk_calls_are_held_back_at_their_share_of_the_queue(held_server):
    """`"priority": "bulk"` reaches the queue: with 4 places and --bulk-queue-share 0.5, bulk calls
    are admitted only while fewer than 2 inputs wait, and the rest get 429 saying so."""
    texts = [f"{i} {' '.join(SHORT[:8])}" for i in range(2)]
    outcomes = asyncio.run(_embed_at_once(held_server.http_url, texts, 30, priority="bulk"))
    refused = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    assert refused and len(refused) < 30, outcomes
    assert all("queue full for bulk requests" in e.message for e in refused), refused[0].message
    assert refused[0].body["code"] == "queue_full"  # type: ignore[index]


def test_a_client_that_disconnects_has_its_inputs_dropped_before_compute(held_server):
    url = held_server.http_url + "/v1/embeddings"

    def post(text: str, timeout: float) -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(url, json={"input": [text]}, timeout=timeout)

    holds = [threading.Thread(target=post, args=(HOLD_TEXT, 60)) for _ in range(2)]
    for hold in holds:  # one after the other: each takes a model instance for seconds
        hold.start()
        time.sleep(0.5)
    dropped = metric(held_server, "embed_inputs_dropped_total", reason="cancelled")
    post("waits behind the holds, and its caller gives up", timeout=1.0)
    for hold in holds:
        hold.join(60)
    code = "CANCELLED"
    assert metric(held_server, "embed_requests_total", method="http_embeddings", code=code) == 1
    assert metric(held_server, "embed_inputs_dropped_total", reason="cancelled") - dropped == 1


def test_drain_answers_503_at_once_and_finishes_the_request_in_flight(held_server, grpc_client):
    """Last in this module: it stops the held server."""
    url = held_server.http_url
    outcome: dict[str, object] = {}

    def held_call() -> None:
        outcome["response"] = httpx.post(url + "/v1/embeddings", json={"input": [HOLD_TEXT]}, timeout=60)

    caller = threading.Thread(target=held_call)
    caller.start()
    time.sleep(1.0)  # the held input is computing (for seconds)
    held_server.terminate()
    time.sleep(0.2)  # the front has the signal; its listener stays open for its 1 s notice
    health = httpx.get(url + "/health", timeout=5)
    [late] = asyncio.run(_embed_at_once(url, ["after SIGTERM"], 1))
    caller.join(60)
    assert health.status_code == 503
    assert health.json() == {"status": "not serving", "reason": "the server is shutting down"}
    assert isinstance(late, openai.InternalServerError), late
    assert late.status_code == 503 and "shutting down" in late.message
    assert late.response.headers["retry-after"] == "1"
    response = outcome["response"]
    assert isinstance(response, httpx.Response) and response.status_code == 200
    vector = np.array([response.json()["data"][0]["embedding"]])
    assert_close(vector, grpc_client.embed([HOLD_TEXT]))
    assert held_server.wait(60) == 0


def test_too_many_inputs_are_refused_before_any_input_is_examined():
    """400k one-id rows cost the event loop 0.5 s a request when each row was checked first: the count
    comes first, so a request over it is refused for its count whatever its items hold."""
    rows: list[object] = [[101, 102]] * 4 + [["not an id"]]
    with pytest.raises(
        InvalidInput, match="5 inputs in one request, over the limit max_inputs_per_request=4"
    ):
        parse_input(rows, most=4)
    with pytest.raises(InvalidInput, match="position 0 is a string"):
        parse_input(rows, most=5)
    texts, (ids,) = parse_input([101] * 10, most=4)  # one sequence of ids: one input
    assert texts == [] and ids.tolist() == [101] * 10


@pytest.mark.parametrize(
    ("sent", "shown"),
    [
        ("-9223372036854775809", "-9.223372036854776e+18"),  # orjson: the float -2**63, which int64 holds
        ("-100000000000000000000000000000", "-1e+29"),
        ("9223372036854775808", "9223372036854775808"),  # an int still, past int64
        ("18446744073709551615", "18446744073709551615"),
        ("18446744073709551616", "1.8446744073709552e+19"),  # a float from here
        ("100000000000000000000000000000", "1e+29"),
        ("9.3e18", "9.3e+18"),  # written as a float, but a whole number past int64 all the same
    ],
)
@pytest.mark.parametrize("nested", [False, True])
def test_token_ids_past_int64_are_out_of_range_naming_the_value_and_the_range(sent, shown, nested):
    """However orjson delivers an integer past int64 (an int, or a float from past 64 bits), it is
    outside the vocabulary, named with the range as any other id outside it."""
    row = f"[101, {sent}, 102]"
    with pytest.raises(InvalidInput) as e:
        parse_input(orjson.loads(f"[{row}]" if nested else row), most=4, vocab_size=30522)
    assert e.value.reason == "TOKEN_ID_OUT_OF_RANGE"
    assert str(e.value) == f"input 0: token id {shown} at position 1 is outside the vocabulary [0, 30522)"
    assert e.value.metadata["vocabularySize"] == "30522"


@pytest.mark.parametrize("sent", ["1.0", "1.5", "-9.5", "9223372036854774784.0", "-1e18"])
def test_a_float_inside_int64_is_not_an_integer_even_when_whole(sent):
    """A whole float inside int64 can only have been written as a float: "not an integer", as before."""
    with pytest.raises(InvalidInput) as e:
        parse_input(orjson.loads(f"[101, {sent}, 102]"), most=4, vocab_size=30522)
    assert e.value.reason == "TOKEN_ID_NOT_AN_INTEGER", str(e.value)
    assert "not an integer" in str(e.value)


def test_the_ends_of_int64_are_ids_for_the_vocabulary_check():
    """-2**63 and 2**63 - 1 fit int64: parsed as ids, refused later by the vocabulary check, with
    the range."""
    texts, (ids,) = parse_input(orjson.loads("[101, -9223372036854775808, 9223372036854775807]"), most=4)
    assert texts == [] and ids.tolist() == [101, -(2**63), 2**63 - 1]
