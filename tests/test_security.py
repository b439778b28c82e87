"""Security end to end: TLS and mutual TLS with certificates made at test time, the bearer token
(from a file or the environment; never logged; health and reflection stay open), the metrics
endpoint on its own interface, and the documented limits on message size, inputs per request,
characters per text and concurrent streams per connection. Also the client library and its CLI.

Two servers: `tls_server` (TLS, token from a file, small limits, metrics on 127.0.0.2, DEBUG log)
and `mtls_server` (client certificates required, token from EMBED_AUTH_TOKEN).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from minilm_embed.client.client import EmbeddingClient, Security, embed_request
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.proto.embedding.v1 import embedding_pb2_grpc as pb_grpc
from tests.reliability.probes import metrics_text
from tests.server_process import ROOT, SERVICE_NAME, ServerProcess, flags, serving, start_server
from tests.test_front_restarts import kill_the_front, served_again, wait_for_a_new_front
from tests.test_server import error_details

TOKEN = "tok-" + secrets.token_urlsafe(24)  # new each run, so a hit in a log is this run's leak
WRONG = "tok-" + secrets.token_urlsafe(24)
SERVER_NAME = "embed.internal"
LIMITS = {"max_inputs_per_request": 4, "max_text_chars": 64, "max_message_bytes": 65536}
MAX_STREAMS = 2


# Certificates ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path  # an authority the server does not trust
    rogue_cert: Path
    rogue_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name = issuer[0] if issuer else _name(subject)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _write(directory: Path, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
    (directory / f"{stem}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _authority(directory: Path, stem: str) -> tuple[x509.Name, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = _certificate(f"{stem} test CA", key, None).add_extension(
        x509.BasicConstraints(ca=True, path_length=None), critical=True
    )
    _write(directory, stem, key, builder.sign(key, hashes.SHA256()))
    return _name(f"{stem} test CA"), key


def _leaf(
    directory: Path, stem: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey], server: bool
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = _certificate(stem, key, issuer).add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(SERVER_NAME)]
        names.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    _write(directory, stem, key, builder.sign(issuer[1], hashes.SHA256()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = _authority(d, "ca"), _authority(d, "rogue-ca")
    _leaf(d, "server", ca, server=True)
    _leaf(d, "client", ca, server=False)
    _leaf(d, "rogue", rogue, server=False)
    return Pki(
        d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key",
        d / "rogue-ca.pem", d / "rogue.pem", d / "rogue.key",
    )  # fmt: skip


# Servers --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(TOKEN + "\n")
    with serving(
        *flags({"tls_cert": pki.server_cert, "tls_key": pki.server_key, "auth_token_file": token_file}),
        *flags({**LIMITS, "max_concurrent_streams": MAX_STREAMS}),
        *flags({"metrics_address": "127.0.0.2:0", "log_level": "DEBUG"}),
    ) as process:
        yield process


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[ServerProcess]:
    tls = {"tls_cert": pki.server_cert, "tls_key": pki.server_key, "tls_client_ca": pki.ca}
    with serving(*flags(tls), env={"EMBED_AUTH_TOKEN": TOKEN}) as process:
        yield process


def client(server: ServerProcess, security: Security) -> EmbeddingClient:
    return EmbeddingClient(server.address, timeout=30, security=security)


def code_of(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# TLS ------------------------------------------------------------------------------------------------


def test_a_client_that_trusts_the_ca_embeds_over_tls(tls_server, pki):
    with client(tls_server, Security(ca_cert=pki.ca, token=TOKEN)) as c:
        vectors = c.embed(["over TLS"])
    assert vectors.shape == (1, 384) and np.isfinite(vectors).all()


def https(server: ServerProcess, path: str) -> str:
    return f"https://127.0.0.1:{server.http_port}{path}"


def test_http_is_served_over_the_same_tls_with_the_same_token(tls_server, pki):
    trusting = ssl.create_default_context(cafile=str(pki.ca))
    with httpx.Client(verify=trusting, timeout=30) as c:
        ok = c.post(https(tls_server, "/v1/embeddings"), json={"input": "over TLS"}, headers=bearer(TOKEN))
        wrong = c.post(https(tls_server, "/v1/embeddings"), json={"input": "a"}, headers=bearer(WRONG))
        health = c.get(https(tls_server, "/health"))
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384
    assert wrong.status_code == 401 and WRONG not in wrong.text
    assert health.status_code == 200
    with pytest.raises(httpx.HTTPError):  # an untrusted certificate
        httpx.get(https(tls_server, "/health"), timeout=10)
    with pytest.raises(httpx.HTTPError):  # plaintext to the TLS port
        httpx.get(f"http://127.0.0.1:{tls_server.http_port}/health", timeout=10)


def test_an_http_connection_that_never_starts_tls_is_closed_at_the_header_timeout(tls_server):
    """asyncio gives a TLS handshake 60 s, and the header timeout and the connection cap start only
    once it is done: under TLS, silent connections held a front's file descriptors six times as long
    as --http-header-timeout-s (10 s here, the default) says."""
    with socket.create_connection(("127.0.0.1", tls_server.http_port), timeout=30) as silent:
        started = time.monotonic()
        with contextlib.suppress(ConnectionResetError):
            assert silent.recv(1) == b""  # closed, nothing answered
        waited = time.monotonic() - started
    assert 9 < waited < 15, waited


def test_http_mutual_tls_admits_only_clients_with_a_certificate_from_the_ca(mtls_server, pki):
    def context(cert: Path | None, key: Path | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        if cert is not None and key is not None:
            ctx.load_cert_chain(cert, key)
        return ctx

    body, headers = {"input": "mutual"}, bearer(TOKEN)
    with httpx.Client(verify=context(pki.client_cert, pki.client_key), timeout=30) as c:
        assert c.post(https(mtls_server, "/v1/embeddings"), json=body, headers=headers).status_code == 200
    for cert, key in ((None, None), (pki.rogue_cert, pki.rogue_key)):
        with httpx.Client(verify=context(cert, key), timeout=10) as c, pytest.raises(httpx.HTTPError):
            c.post(https(mtls_server, "/v1/embeddings"), json=body, headers=headers)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_the_certificate_is_checked_against_server_name_when_given(tls_server, pki):
    with client(tls_server, Security(ca_cert=pki.ca, token=TOKEN, server_name=SERVER_NAME)) as c:
        assert c.embed(["by name"]).shape == (1, 384)
    with client(tls_server, Security(ca_cert=pki.ca, token=TOKEN, server_name="other.name")) as c:
        assert code_of(lambda: c.embed(["wrong name"])) == grpc.StatusCode.UNAVAILABLE


def test_plaintext_and_untrusting_clients_cannot_talk_to_the_tls_server(tls_server, pki):
    with client(tls_server, Security(token=TOKEN)) as plaintext:
        assert code_of(lambda: plaintext.embed(["plaintext"])) == grpc.StatusCode.UNAVAILABLE
    with client(tls_server, Security(ca_cert=pki.rogue_ca, token=TOKEN)) as untrusting:
        assert code_of(lambda: untrusting.embed(["other CA"])) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_admits_only_clients_with_a_certificate_from_the_ca(mtls_server, pki):
    good = Security(pki.ca, pki.client_cert, pki.client_key, token=TOKEN)
    with client(mtls_server, good) as c:
        assert c.embed(["mutual TLS"]).shape == (1, 384)
    for security in (
        Security(ca_cert=pki.ca, token=TOKEN),  # no client certificate
        Security(pki.ca, pki.rogue_cert, pki.rogue_key, token=TOKEN),  # signed by an untrusted CA
    ):
        with client(mtls_server, security) as c:
            assert code_of(lambda c=c: c.embed(["refused"])) == grpc.StatusCode.UNAVAILABLE


# Bearer token ---------------------------------------------------------------------------------------


def _all_methods(c: EmbeddingClient) -> dict[str, grpc.StatusCode]:
    def stream() -> None:
        item = pb.EmbedStreamRequest(id="1", request=embed_request(["streamed"]))
        list(c.stub.EmbedStream(iter([item]), timeout=30, metadata=c.metadata))

    return {
        "Embed": code_of(lambda: c.embed(["token"])),
        "Tokenize": code_of(lambda: c.tokenize(["token"])),
        "Info": code_of(c.info),
        "EmbedStream": code_of(stream),
    }


@pytest.mark.parametrize(
    "token", [None, WRONG, TOKEN + "x", TOKEN[:-1]], ids=["none", "wrong", "longer", "shorter"]
)
def test_every_embedding_method_needs_the_token(tls_server, pki, token):
    with client(tls_server, Security(ca_cert=pki.ca, token=token)) as c:
        codes = _all_methods(c)
    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes


def test_the_right_token_opens_every_method_and_no_other_header_value_does(tls_server, pki):
    with client(tls_server, Security(ca_cert=pki.ca, token=TOKEN)) as c:
        assert set(_all_methods(c).values()) == {grpc.StatusCode.OK}
        for value in (TOKEN, f"Basic {TOKEN}", "Bearer ", f"Bearer {WRONG}"):
            metadata = [("authorization", value)]
            refused = code_of(lambda m=metadata: c.stub.Info(pb.InfoRequest(), timeout=10, metadata=m))
            assert refused == grpc.StatusCode.UNAUTHENTICATED, value


def test_a_refusal_does_not_echo_the_token_it_was_given(tls_server, pki):
    with (
        client(tls_server, Security(ca_cert=pki.ca, token=WRONG)) as c,
        pytest.raises(grpc.RpcError) as refused,
    ):
        c.embed(["wrong token"])
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token" in refused.value.details()
    assert WRONG not in refused.value.details()


def test_a_refused_token_still_gets_its_request_id_back(tls_server, pki):
    with client(tls_server, Security(ca_cert=pki.ca, token=WRONG)) as c:
        metadata = [*c.metadata, ("x-request-id", "no-token-1")]
        with pytest.raises(grpc.RpcError) as refused:
            c.stub.Info(pb.InfoRequest(), timeout=10, metadata=metadata)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dict(refused.value.trailing_metadata())["x-request-id"] == "no-token-1"
    assert error_details(refused.value)["ErrorInfo"].reason == "UNAUTHENTICATED"


def test_health_and_reflection_stay_open_without_the_token(tls_server, pki):
    credentials = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    with grpc.secure_channel(tls_server.address, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(reflection.ServerReflectionInfo(iter([request]), timeout=10))
    assert SERVICE_NAME in {s.name for s in answer.list_services_response.service}


def test_the_token_from_the_environment_works_too(mtls_server, pki):
    with_cert = Security(pki.ca, pki.client_cert, pki.client_key)
    with client(mtls_server, with_cert) as anonymous:
        assert code_of(lambda: anonymous.embed(["no token"])) == grpc.StatusCode.UNAUTHENTICATED
    with client(mtls_server, Security(pki.ca, pki.client_cert, pki.client_key, token=TOKEN)) as c:
        assert c.embed(["env token"]).shape == (1, 384)


def test_no_child_inherits_the_token_from_the_environment(mtls_server):
    """The fronts get the token from the supervisor (its spawn arguments), the engine never needs it."""
    for pid in (*mtls_server.front_pids(), mtls_server.engine_pid):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith(b"EMBED_AUTH_TOKEN=")], pid
        assert TOKEN.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_a_restarted_front_serves_the_token_and_certificate_read_at_start(pki, tmp_path):
    """Each front read the token and TLS files as it started: after the token file changed, a front
    started again after a death enforced the new token and the others the old one (an acceptance pass),
    and an emptied file had it die at every start. The supervisor reads them once, for every front."""
    token_file, cert, key = tmp_path / "token", tmp_path / "server.pem", tmp_path / "server.key"
    token_file.write_text(TOKEN + "\n")
    shutil.copy(pki.server_cert, cert)
    shutil.copy(pki.server_key, key)
    settings = {"tls_cert": cert, "tls_key": key, "auth_token_file": token_file, "front_processes": 1}
    with serving(*flags(settings)) as server:
        token_file.write_text(WRONG + "\n")
        shutil.copy(pki.rogue_cert, cert)  # signed by an authority the clients do not trust
        shutil.copy(pki.rogue_key, key)
        first, _ = kill_the_front(server)
        wait_for_a_new_front(server, first)
        assert served_again(server, 1), "".join(server.lines[-10:])
        with client(server, Security(ca_cert=pki.ca, token=TOKEN)) as c:
            assert c.embed(["the token read at start"]).shape == (1, 384)
        with client(server, Security(ca_cert=pki.ca, token=WRONG)) as c:
            assert code_of(lambda: c.embed(["the file's new token"])) == grpc.StatusCode.UNAUTHENTICATED
        trusting = ssl.create_default_context(cafile=str(pki.ca))
        with httpx.Client(verify=trusting, timeout=30) as c:
            url = https(server, "/v1/embeddings")
            ok = c.post(url, json={"input": "the token read at start"}, headers=bearer(TOKEN))
            new = c.post(url, json={"input": "the file's new token"}, headers=bearer(WRONG))
        assert ok.status_code == 200, ok.text
        assert new.status_code == 401, new.text


def test_refusals_are_counted_and_the_metrics_listen_only_on_their_own_interface(tls_server, pki):
    with client(tls_server, Security(ca_cert=pki.ca)) as anonymous:
        code_of(lambda: anonymous.embed(["counted"]))
    text = metrics_text(tls_server, host="127.0.0.2")
    assert 'embed_requests_total{code="UNAUTHENTICATED",method="Embed"}' in text
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_server.metrics_port}/metrics", timeout=5)


# The CLI -------------------------------------------------------------------------------------------


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "minilm_embed.client", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
    )


def test_the_cli_embeds_over_tls_with_a_token_file_and_refuses_without_it(tls_server, pki, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    address = ["--address", tls_server.address, "--ca-cert", str(pki.ca)]
    done = cli(*address, "--token-file", str(token_file), "embed", "hello", "world")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dimensions"] == 384
    refused = cli(*address, "info")
    assert refused.returncode == 1
    assert "UNAUTHENTICATED" in refused.stderr
    # The server's words name the metadata; the CLI says how it sends a token, or whose was refused.
    assert "(this client sends the token from --token-file FILE, or EMBED_TOKEN)" in refused.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    refused_file = cli(*address, "--token-file", str(wrong), "info")
    refused_env = cli(*address, "info", env={"EMBED_TOKEN": "not-the-token"})
    assert refused_file.returncode == refused_env.returncode == 1
    assert f"(the token from --token-file {wrong} was refused)" in refused_file.stderr
    assert "(the token from EMBED_TOKEN was refused)" in refused_env.stderr
    said = done.stdout + done.stderr + refused.stderr + refused_file.stderr + refused_env.stderr
    assert TOKEN not in said and "not-the-token" not in said


def test_the_cli_does_mutual_tls_with_the_token_from_the_environment(mtls_server, pki):
    tls = [
        "--ca-cert",
        str(pki.ca),
        "--client-cert",
        str(pki.client_cert),
        "--client-key",
        str(pki.client_key),
    ]
    done = cli("--address", mtls_server.address, *tls, "info", env={"EMBED_TOKEN": TOKEN})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["dimensions"] == 384
    no_cert = cli(
        "--address", mtls_server.address, "--ca-cert", str(pki.ca), "info", env={"EMBED_TOKEN": TOKEN}
    )
    assert no_cert.returncode == 1
    assert "UNAVAILABLE" in no_cert.stderr


# Secrets stay out of the logs; bad security settings stop the server --------------------------------


def test_the_token_never_appears_in_the_server_log(tls_server, mtls_server, pki):
    # Runs after the calls above: right, wrong and missing tokens, at log level DEBUG.
    with client(tls_server, Security(ca_cert=pki.ca, token=TOKEN)) as c:
        c.embed(["one more"])
    for server in (tls_server, mtls_server):
        log = "".join(server.lines)
        assert "serving" in log
        assert TOKEN not in log and WRONG not in log


MISCONFIGURED = {
    "empty-token-file": ({"auth_token_file": "{empty}"}, "the auth token file is empty"),
    "missing-token-file": ({"auth_token_file": "{missing}"}, "cannot read the auth token file (No such"),
    "token-twice": ({"auth_token": TOKEN, "auth_token_file": "{token}"}, "either directly or as a file"),
    "cert-without-key": ({"tls_cert": "{cert}"}, "TLS needs both --tls-cert and --tls-key: --tls-cert"),
    "client-ca-alone": ({"tls_client_ca": "{ca}"}, "needs --tls-cert (EMBED_TLS_CERT) and --tls-key"),
}


@pytest.fixture(scope="module")
def misconfigured(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ServerProcess]:
    """A server per bad setting, all started at once (each loads the model before it gives up)."""
    d = tmp_path_factory.mktemp("misconfigured")
    (d / "empty").write_text("\n")
    (d / "token").write_text(TOKEN)
    paths = {"empty": d / "empty", "missing": d / "nope", "token": d / "token"}
    paths |= {"cert": pki.server_cert, "ca": pki.ca}
    return {
        name: start_server(*flags({k: str(v).format(**paths) for k, v in settings.items()}))
        for name, (settings, _) in MISCONFIGURED.items()
    }


@pytest.mark.parametrize("case", MISCONFIGURED)
def test_unusable_security_settings_stop_the_server_at_start_without_leaking(misconfigured, case):
    process = misconfigured[case]
    assert process.wait(120) == 2
    log = "".join(process.lines)
    assert MISCONFIGURED[case][1] in log
    assert TOKEN not in log


# Limits ---------------------------------------------------------------------------------------------


def test_info_reports_the_limits_set_by_flags(tls_server, pki):
    with client(tls_server, Security(ca_cert=pki.ca, token=TOKEN)) as c:
        limits = c.info().limits
    assert limits.max_inputs_per_request == LIMITS["max_inputs_per_request"]
    assert limits.max_text_chars == LIMITS["max_text_chars"]
    assert limits.max_message_bytes == LIMITS["max_message_bytes"]


@pytest.mark.parametrize(
    ("at_limit", "over", "phrase"),
    [
        (["a"] * 4, ["a"] * 5, "5 inputs in one request, over the limit max_inputs_per_request=4"),
        # Characters, not bytes or tokens: 64 two-byte characters are fine, 65 are not.
        (["é" * 64], ["é" * 65], "has 65 characters, over the limit max_text_chars=64"),
    ],
    ids=["inputs-per-request", "characters-per-text"],
)
def test_requests_over_a_limit_get_invalid_argument_naming_it(tls_server, pki, at_limit, over, phrase):
    with client(tls_server, Security(ca_cert=pki.ca, token=TOKEN)) as c:
        assert c.embed(at_limit).shape == (len(at_limit), 384)
        with pytest.raises(grpc.RpcError) as refused:
            c.embed(over)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert phrase in refused.value.details()


def test_a_message_over_max_message_bytes_gets_resource_exhausted(tls_server, pki):
    text = "x" * LIMITS["max_message_bytes"]  # characters are checked after the message size
    with client(tls_server, Security(ca_cert=pki.ca, token=TOKEN)) as c:
        with pytest.raises(grpc.RpcError) as refused:
            c.embed([text])
        assert c.embed(["still serving"]).shape == (1, 384)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(LIMITS["max_message_bytes"]) in refused.value.details()


def test_concurrent_streams_per_connection_are_capped_and_other_connections_go_on(tls_server, pki):
    """With MAX_STREAMS streams open on a connection, a further call on it waits; elsewhere it runs.

    Plain channels: the library's channels also hold a stream per connection for their health watch.
    """
    credentials = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    options = [("grpc.use_local_subchannel_pool", 1)]  # each channel its own connection
    metadata = (("authorization", f"Bearer {TOKEN}"),)

    async def scenario() -> tuple[grpc.StatusCode, grpc.StatusCode, grpc.StatusCode]:
        async with (
            grpc.aio.secure_channel(tls_server.address, credentials, options) as busy,
            grpc.aio.secure_channel(tls_server.address, credentials, options) as other,
        ):
            stub, other_stub = pb_grpc.EmbeddingServiceStub(busy), pb_grpc.EmbeddingServiceStub(other)
            streams = [stub.EmbedStream(timeout=60, metadata=metadata) for _ in range(MAX_STREAMS)]
            for i, s in enumerate(streams):  # each open and answered: both streams hold a slot
                await s.write(pb.EmbedStreamRequest(id=str(i), request=embed_request(["open"])))
                assert (await s.read()).id == str(i)
            waiting = await _code(stub.Info(pb.InfoRequest(), timeout=2, metadata=metadata))
            elsewhere = await _code(other_stub.Info(pb.InfoRequest(), timeout=10, metadata=metadata))
            await streams[0].done_writing()
            assert await streams[0].read() == grpc.aio.EOF
            freed = await _code(stub.Info(pb.InfoRequest(), timeout=10, metadata=metadata))
            await streams[1].done_writing()
            return waiting, elsewhere, freed

    waiting, elsewhere, freed = asyncio.run(scenario())
    assert waiting == grpc.StatusCode.DEADLINE_EXCEEDED
    assert elsewhere == grpc.StatusCode.OK
    assert freed == grpc.StatusCode.OK


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK
