"""Request ids and log lines, end to end: a real server (the fault-injecting entry, so a batch can fail)
logging JSON; the id comes back in trailing metadata and is in the front's and the engine's lines. Lines
written to stderr past Python's logging (gRPC's C core, ONNX Runtime, a dying child's traceback) come
out as JSON too."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from minilm_embed.server import logs
from tests.server_process import ROOT, ServerProcess, fault_entry, flags, serving, wait_for
from tests.test_security import _authority, _leaf

FAULT = "__fault__ in the log tests"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # gRPC's C core at INFO writes a WARNING line of its own as each process starts gRPC.
    with serving("--log-format", "json", env={"GRPC_VERBOSITY": "INFO"}, entry=fault_entry(FAULT)) as process:
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
    assert wait_for(
        lambda: any("gRPC x-request-id" in str(line.get("message")) for line in json_lines(server)), 10
    )
    # HTTP says so too (it logged the replacement at DEBUG only).
    answer = httpx.post(
        server.http_url + "/v1/embeddings", json={"input": "hello"}, headers={"x-request-id": "x" * 129}
    )
    assert answer.status_code == 200 and len(answer.headers["x-request-id"]) == 32
    assert wait_for(
        lambda: any("HTTP x-request-id" in str(line.get("message")) for line in json_lines(server)), 10
    )


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


def test_grpc_core_lines_come_out_as_json_with_their_level(server):
    """The C core writes absl's format ("W1127 12:00:00.123456  1234 log.cc:102] ...") to fd 2 past
    Python's logging; the supervisor relays every process's fd 2 as JSON."""
    assert wait_for(lambda: any(line["logger"] == "grpc" for line in json_lines(server)), 10), server.lines
    core = [line for line in json_lines(server) if line["logger"] == "grpc"]
    assert core[0]["level"] == "WARNING" and "Log level INFO is not suitable" in str(core[0]["message"])
    assert str(core[0]["message"]).startswith("W")  # the line as the C core wrote it
    assert {line["process"] for line in core} == {"front-0"}  # the front's own pipe names it
    assert all(line.strip().startswith("{") for line in server.lines if line.strip()), "a line is not JSON"


def test_clients_failing_the_tls_handshake_leave_no_line(tmp_path: Path):
    """Each plaintext or HTTP/1 connection to a TLS port made gRPC's C core write an INFO line
    "Handshake failed with error SSL_ERROR_SSL" (any scanner could fill the log with them). The
    server starts gRPC at its documented default, errors only (GRPC_VERBOSITY=ERROR), unless the
    operator set it."""
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
    assert not [line for line in server.lines if "Handshake failed" in line]


# A child that writes to fd 2 directly, then dies of an exception (multiprocessing prints its traceback).
DYING_CHILD = textwrap.dedent(r"""
    import atexit, multiprocessing, os
    from minilm_embed.server import logs

    CHILD = "import os; os.write(2, b'E1127 12:00:00.123456  99 tcp_server.cc:1] raw\\n'); 1 / 0"
    atexit.register(logs.relay_stderr())
    child = multiprocessing.get_context("spawn").Process(target=exec, args=(CHILD,))
    child.start()
    child.join()
    os.write(2, b"the supervisor's last raw line, without its newline")
""")


def test_a_dying_childs_lines_and_the_last_lines_before_exit_come_out_as_json():
    done = subprocess.run(
        [sys.executable, "-c", DYING_CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    assert [(line["level"], line["logger"]) for line in lines] == [
        ("ERROR", "grpc"),
        ("ERROR", "stderr"),
        ("ERROR", "stderr"),
    ], done.stderr
    traceback = str(lines[1]["message"])
    assert traceback.startswith("Process SpawnProcess-1:\nTraceback")
    assert traceback.endswith("ZeroDivisionError: division by zero")
    assert lines[2]["message"] == "the supervisor's last raw line, without its newline"


# Two children started in child_stderr, one of them twice (a front restarted), beside the supervisor's
# own raw line; prints the pipes left open once the children are gone.
NAMED_CHILDREN = textwrap.dedent(r"""
    import atexit, multiprocessing, os, time
    from minilm_embed.server import logs

    atexit.register(logs.relay_stderr())
    context = multiprocessing.get_context("spawn")
    fds = len(os.listdir("/proc/self/fd"))
    for name, code in [("engine", "1 / 0"), ("front-0", "pass"), ("front-0", "pass")]:
        line = f"import os; os.write(2, b'E1127 12:00:00.123456  99 tcp_server.cc:1] from {name}\\n'); {code}"
        child = context.Process(target=exec, args=(line,), name=name)
        with logs.child_stderr(name):
            child.start()
        child.join()
        child.close()
    os.write(2, b"the supervisor's raw line\n")
    deadline = time.monotonic() + 10
    while len(os.listdir("/proc/self/fd")) > fds and time.monotonic() < deadline:
        time.sleep(0.05)
    print(len(os.listdir("/proc/self/fd")) - fds)
""")


def test_a_childs_raw_lines_name_the_child_and_its_pipe_is_closed_when_it_is_gone():
    done = subprocess.run(
        [sys.executable, "-c", NAMED_CHILDREN], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    named = sorted((line["process"], line["logger"], str(line["message"]).split("\n")[-1]) for line in lines)
    assert named == [
        ("MainProcess", "stderr", "the supervisor's raw line"),
        ("engine", "grpc", "E1127 12:00:00.123456  99 tcp_server.cc:1] from engine"),
        ("engine", "stderr", "ZeroDivisionError: division by zero"),
        ("front-0", "grpc", "E1127 12:00:00.123456  99 tcp_server.cc:1] from front-0"),
        ("front-0", "grpc", "E1127 12:00:00.123456  99 tcp_server.cc:1] from front-0"),
    ], done.stderr
    assert done.stdout == "0\n", "a child's pipe was left open after it exited"


def test_a_close_that_comes_while_the_reader_waits_loses_no_line():
    """The drain's last line and its close() may land between the reader's wait timing out and its
    check of closing: it read `closing` twice a pass, broke out at once and left the line in the pipe
    (a reviewer forced this order). Here the wait is made to time out just as the drain does so."""
    out_read, out_write = os.pipe()
    own_read, own_write = os.pipe()
    relay = logs._Relay(own_read, out_write)
    wait = relay.selector.select
    drained = threading.Event()

    def select(timeout: float | None = None) -> list[Any]:
        ready = wait(timeout)
        if not ready and timeout is not None and not drained.is_set():
            drained.set()
            os.write(own_write, b"the supervisor's last line\n")
            relay.close()
        return ready

    relay.selector.select = select  # type: ignore[method-assign]
    reader = threading.Thread(target=relay.run)
    reader.start()
    os.write(own_write, b"held")  # a line begun: the reader waits GROUP_WAIT_S for its end
    reader.join(10)
    os.close(out_write)
    with os.fdopen(out_read) as out:
        messages = [json.loads(line)["message"] for line in out.read().splitlines()]
    os.close(own_write)
    assert drained.is_set() and messages == ["held", "the supervisor's last line"], messages


def test_a_refusal_after_logging_is_set_up_is_a_json_line():
    missing = ["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"]
    command = [sys.executable, "-m", "minilm_embed.server", "--log-format", "json", *missing]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    [line] = [json.loads(line) for line in done.stderr.splitlines()]
    assert line["level"] == "ERROR" and str(line["message"]).startswith("server: error: "), line


@pytest.mark.parametrize(
    ("flags", "environ"),
    [
        (["--log-format", "json", "--max-batch-size", "x"], {}),
        (["--log-format=json", "--no-such-flag"], {}),
        (["--no-such-flag"], {"EMBED_LOG_FORMAT": "json"}),
        ([], {"EMBED_LOG_FORMAT": "json", "EMBED_THREADS": "many"}),
    ],
)
def test_a_setting_that_cannot_be_read_is_refused_in_the_log_format_asked_for(flags, environ):
    """Refused before the settings are read: the format is read leniently first (it was one plain
    line in a JSON log pipeline)."""
    command = [sys.executable, "-m", "minilm_embed.server", *flags]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, **environ}
    )
    assert done.returncode == 2
    [line] = [json.loads(line) for line in done.stderr.splitlines()]
    assert line["level"] == "ERROR" and str(line["message"]).startswith("server: error: "), line
    assert "--help` lists every setting" in str(line["message"]), line


def test_without_json_asked_for_the_refusal_is_one_plain_line():
    command = [sys.executable, "-m", "minilm_embed.server", "--max-batch-size", "x", "--log-format"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("server: error: ") and done.stderr.count("\n") == 1


ABSL = "E1127 12:00:00.123456  1234 ssl_transport_security.cc:1519] Handshake failed with error SSL_ERROR_SSL"
ORT = (
    "2026-11-27 12:00:00.123456789 [W:onnxruntime:, session_state.cc:1166 VerifyEachNodeIsAssignedToAnEp] "
    "Some nodes were not assigned to the preferred execution providers"
)
OURS = json.dumps(
    {
        "ts": "2026-11-27T12:00:00.000+00:00",
        "level": "INFO",
        "process": "engine",
        "logger": "x",
        "message": "é",
    },
    ensure_ascii=False,
)
TRACEBACK = """\
Process front-0:
Traceback (most recent call last):
  File "/app/server/front.py", line 12, in run_front
    raise KeyError("inner")
KeyError: 'inner'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/app/server/front.py", line 14, in run_front
    1 / 0
    ~~^~~
ZeroDivisionError: division by zero
"""
FATAL = """\
Fatal Python error: Segmentation fault

Current thread 0x00007f3a1c5ff740 (most recent call first):
  File "/app/server/backend.py", line 88 in run

Extension modules: numpy.core._multiarray_umath, grpc._cython.cygrpc (total: 2)
"""


def relayed(*chunks: bytes) -> list[str]:
    """What the supervisor writes out for `chunks` read from fd 2's pipe, then a pause in the writing."""
    lines = logs.StderrLines()
    return [out for chunk in chunks for out in lines.feed(chunk)] + lines.idle()


def test_native_lines_get_their_level_and_json_lines_pass_unchanged():
    absl, ort, ours, other = relayed(f"{ABSL}\n{ORT}\n{OURS}\nplain words\n".encode())
    assert json.loads(absl) | {"ts": ""} == {
        "ts": "",
        "level": "ERROR",
        "process": "unknown",
        "logger": "grpc",
        "message": ABSL,
    }
    assert (json.loads(ort)["level"], json.loads(ort)["logger"]) == ("WARNING", "onnxruntime")
    assert ours == OURS
    assert (json.loads(other)["level"], json.loads(other)["message"]) == ("ERROR", "plain words")


def test_a_traceback_and_a_fatal_error_dump_are_one_record_each_though_written_line_by_line():
    written = [line.encode() for line in (TRACEBACK + FATAL + ABSL + "\n").splitlines(keepends=True)]
    traceback, fatal, absl = (json.loads(line) for line in relayed(*written))
    assert traceback["message"] == TRACEBACK.rstrip() and traceback["logger"] == "stderr"
    assert fatal["message"] == FATAL.rstrip() and fatal["level"] == "ERROR"
    assert absl["message"] == ABSL


def test_a_json_line_read_after_a_traceback_does_not_overtake_it():
    """A child's traceback is all in the pipe before the supervisor logs that the child died."""
    out = relayed(TRACEBACK.encode(), f"{OURS}\n".encode())
    assert json.loads(out[0])["message"] == TRACEBACK.rstrip() and out[1] == OURS


def test_partial_lines_wait_for_their_end_or_a_pause_and_bad_bytes_are_replaced():
    lines = logs.StderrLines()
    assert lines.feed(b"half a ") == []
    assert lines.feed(b"line \xff\xfe\n") == []  # held: a traceback's frames could follow
    assert [json.loads(line)["message"] for line in lines.idle()] == ["half a line \ufffd\ufffd"]
    assert lines.feed(b"no newline") == []
    assert [json.loads(line)["message"] for line in lines.idle()] == ["no newline"]


def test_a_line_too_long_is_cut_and_the_next_line_is_whole():
    long = b"x" * (3 * logs.MAX_LINE_BYTES)
    in_pieces = [long[i : i + 4096] for i in range(0, len(long), 4096)]
    for chunks in ([long + b"\nnext\n"], [*in_pieces, b"\nnext\n"]):
        cut, after = (json.loads(line)["message"] for line in relayed(*chunks))
        assert cut.startswith("x" * 1000) and len(cut) < logs.MAX_LINE_BYTES + 100
        assert cut.endswith(f"[cut: the line was longer than {logs.MAX_LINE_BYTES} bytes]")
        assert after == "next"


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


UVICORN_LINES = """
import logging
from minilm_embed.server import logs
logs.configure("DEBUG", "text")
error = logging.getLogger("uvicorn.error")
error.debug("< GET /v1/embeddings HTTP/1.1\\n< authorization: Bearer %s", "secret-token")
error.info('%s - "WebSocket %s" 403', "127.0.0.1:5000", "/v1/x?text=my%20private%20query")
logging.getLogger("uvicorn.access").info('%s - "GET %s HTTP/1.1" 200', "127.0.0.1:5000", "/v1/y?q=private")
for _ in range(5):
    error.warning("Invalid HTTP request received.")
    error.warning("Unsupported upgrade request.")
    error.warning("No supported WebSocket library detected. Please use pip install 'uvicorn[standard]'")
error.error("[Errno 98] address already in use")
logging.getLogger("minilm_embed.server.http").debug("ours at DEBUG")
"""


def test_uvicorn_logs_nothing_of_a_request_at_debug_and_each_warning_once_a_minute():
    """At --log-level DEBUG uvicorn's loggers took the root's level: the websockets library (through
    uvicorn.error) logged an upgrade's headers, a bearer token among them; at INFO uvicorn logged
    a WebSocket request's path and query string; and it logs a WARNING per bad request, which anyone
    can send. Below WARNING nothing of uvicorn's is logged; each warning once a minute, saying so;
    its errors and the server's own DEBUG lines as they are."""
    done = subprocess.run(
        [sys.executable, "-c", UVICORN_LINES], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert not any("secret-token" in line or "private" in line for line in lines), lines
    for message in ("Invalid HTTP request received.", "Unsupported upgrade request."):
        [line] = [line for line in lines if message in line]
        assert " WARNING " in line and "rate-limited: logged at most once every 60 s" in line, line
    assert not any("WebSocket library" in line for line in lines), lines
    assert any(" ERROR " in line and "address already in use" in line for line in lines), lines
    assert any("ours at DEBUG" in line for line in lines), lines


def test_a_uvicorn_warning_logged_again_after_a_minute_says_how_many_were_left_out():
    uvicorn = logs.UvicornFilter()

    def record(message: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, message, args, None)

    first = record("Invalid HTTP request received.")
    assert uvicorn.filter(first) and first.getMessage().startswith("Invalid HTTP request received. [")
    assert not any(uvicorn.filter(record("Invalid HTTP request received.")) for _ in range(3))
    uvicorn.logged_at["Invalid HTTP request received."] -= logs.UVICORN_WARN_EVERY_S
    again = record("Invalid HTTP request received.")
    assert uvicorn.filter(again) and "; 3 more since it was last logged]" in again.getMessage()
    with_args = record("a warning about %s", "GET /v1/x?text=private")
    assert uvicorn.filter(with_args) and "private" not in with_args.getMessage()  # uvicorn's text alone


def test_a_json_line_too_long_for_the_relay_keeps_its_level_and_both_ends_of_its_fields():
    """A line over the relay's limit would be cut and re-wrapped as an ERROR of unknown origin."""
    record = logging.LogRecord(
        "server.x", logging.WARNING, __file__, 1, "start" + "é\n" * 40_000 + "end", (), None
    )
    record.request_id = "r-2"
    record.exc_text = "Traceback (most recent call last):\n" + "  frame\n" * 20_000 + "ValueError: last"
    out = logs.JsonFormatter().format(record)
    assert len(out.encode()) <= logs.MAX_LINE_BYTES
    [line] = relayed(out.encode() + b"\n")
    parsed = json.loads(line)
    assert parsed["level"] == "WARNING" and parsed["request_id"] == "r-2"
    assert parsed["message"].startswith("start") and parsed["message"].endswith("end")
    assert "characters cut" in parsed["exception"] and parsed["exception"].endswith("ValueError: last")


def test_without_a_stderr_the_relay_changes_nothing():
    """A server started with fd 2 closed (`2>&-`) serves with JSON logs as with text ones."""
    code = "from minilm_embed.server import logs; logs.relay_stderr()(); print('relayed nothing')"
    # The shell closes it and execs Python: a preexec_fn would fork this process, gRPC's threads and
    # at-fork handlers with it (see test_bulk's write-error test).
    command = ["sh", "-c", 'exec "$@" 2>&-', "sh", sys.executable, "-c", code]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=60, cwd=ROOT)
    assert (done.returncode, done.stdout) == (0, "relayed nothing\n")
