"""Request ids and log lines, end to end: a real server (the fault-injecting entry, so a batch can fail)
logging JSON; the id comes back in trailing metadata and is in the front's and the engine's lines."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from minilm_embed.server import logs
from tests.server_process import ServerProcess, fault_entry, flags, serving, wait_for
from tests.test_security import _authority, _leaf

FAULT = "__fault__ in the log tests"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serving("--log-format", "json", entry=fault_entry(FAULT)) as process:
        yield process


def call(
    server: ServerProcess, texts: list[str], request_id: str | None = None
) -> tuple[grpc.StatusCode, str]:
    """Embed `texts`; the status and the x-request-id the server sent back in trailing metadata."""
    metadata = [(logs.REQUEST_ID_HEADER, request_id)] if request_id is not None else []
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        try:
            _, call = stub.Embed.with_call(pb.EmbedRequest(texts=texts), metadata=metadata, timeout=30)
            code, trailing = call.code(), call.trailing_metadata()
        except grpc.RpcError as e:
            code, trailing = e.code(), e.trailing_metadata()
    echoed = dict(trailing or ())
    return code, echoed.get(logs.REQUEST_ID_HEADER, "")


def json_lines(server: ServerProcess) -> list[dict[str, object]]:
    return [json.loads(line) for line in list(server.lines) if line.startswith("{")]


def test_the_request_id_given_is_returned_on_success_and_on_error(server):
    assert call(server, ["hello"], "ok-call-1") == (grpc.StatusCode.OK, "ok-call-1")
    assert call(server, [], "refused-call-1") == (grpc.StatusCode.INVALID_ARGUMENT, "refused-call-1")
    assert call(server, [FAULT], "failing-call-1") == (grpc.StatusCode.INTERNAL, "failing-call-1")


def test_a_stream_gets_its_request_id_back_at_its_end(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EmbeddingServiceStub(channel)
        items = [pb.EmbedStreamRequest(id="1", request=pb.EmbedRequest(texts=["hello"]))]
        call = stub.EmbedStream(iter(items), metadata=[(logs.REQUEST_ID_HEADER, "stream-1")], timeout=30)
        assert [answer.id for answer in call] == ["1"]
        assert dict(call.trailing_metadata())[logs.REQUEST_ID_HEADER] == "stream-1"


def test_a_request_id_is_made_up_when_absent_or_unusable(server):
    code, made_up = call(server, ["hello"])
    assert code == grpc.StatusCode.OK and len(made_up) == 32 and int(made_up, 16) >= 0
    code, other = call(server, ["hello"])
    assert other != made_up
    code, replaced = call(server, ["hello"], "x" * (logs.MAX_REQUEST_ID_CHARS + 1))
    assert code == grpc.StatusCode.OK and len(replaced) == 32
    assert wait_for(lambda: any("not used" in str(line.get("message")) for line in json_lines(server)), 10)


def test_every_line_is_json_and_the_engines_lines_about_a_failing_batch_name_its_request(server):
    assert call(server, [FAULT], "failing-call-2")[0] == grpc.StatusCode.INTERNAL

    def about_it() -> list[dict[str, object]]:
        return [
            line
            for line in json_lines(server)
            if "failing-call-2" in (line.get("request_id"), *line.get("request_ids", ()))
        ]

    assert wait_for(lambda: len(about_it()) >= 2, 10), server.lines[-20:]
    batch, alone = about_it()[:2]
    assert batch["process"] == alone["process"] == "engine"
    assert batch["level"] == "ERROR" and "a batch of 1 inputs failed" in str(batch["message"])
    assert "injected backend fault" in str(batch["exception"])
    assert alone["level"] == "WARNING" and "failed alone too" in str(alone["message"])
    assert all(line.strip().startswith("{") for line in server.lines if line.strip()), "a line is not JSON"
    for line in json_lines(server):
        assert {"ts", "level", "process", "logger", "message"} <= line.keys()


def test_clients_failing_the_tls_handshake_leave_no_line_that_is_not_json(tmp_path: Path):
    """gRPC's C core logs in a format of its own, to the process's stderr, past Python's logging: each
    plaintext or HTTP/1 connection to a TLS port wrote an INFO line "Handshake failed with error
    SSL_ERROR_SSL" (any scanner could fill the log with them). The server starts gRPC at its
    documented default, errors only (GRPC_VERBOSITY=ERROR), unless the operator set it."""
    _leaf(tmp_path, "server", _authority(tmp_path, "ca"), server=True)
    tls = {"tls_cert": tmp_path / "server.pem", "tls_key": tmp_path / "server.key", "log_format": "json"}
    environment = {"GRPC_VERBOSITY": ""}  # unset in effect: the test's own environment must not decide
    with serving(*flags(tls), env=environment) as server:
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.EmbeddingServiceStub(channel).Info(pb.InfoRequest(), timeout=10)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as http:
            http.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            http.recv(100)  # answered or closed: the handshake has failed by then
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.wait(30) == 0
    foreign = [line for line in server.lines if line.strip() and not line.startswith("{")]
    assert not foreign, foreign


def test_request_id_from_checks_what_the_caller_sent():
    assert logs.request_id_from("abc-123") == ("abc-123", "")
    made, why = logs.request_id_from("tab\there")
    assert made != "tab\there" and why == "not printable ASCII"
    assert logs.request_id_from("é")[1] == "not printable ASCII"
    assert logs.request_id_from("")[1].startswith("0 characters")
    assert logs.request_id_from(None)[1] == ""


def test_text_lines_name_the_request_and_json_lines_carry_the_exception():
    record = logging.LogRecord("server.x", logging.ERROR, __file__, 1, "boom %d", (1,), None)
    record.request_id = "r-1"
    assert logs.TextFormatter().format(record).endswith("server.x [request_id=r-1]: boom 1")
    try:
        raise ValueError("inner")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    line = json.loads(logs.JsonFormatter().format(record))
    assert (
        line["request_id"] == "r-1"
        and line["message"] == "boom 1"
        and "ValueError: inner" in line["exception"]
    )
