"""The HTTP API, kept thin: OpenAI's embeddings request -> EmbedJob -> Embedder (embedder.py) -> JSON.

    POST /v1/embeddings   OpenAI's shapes: `input` a string, strings, or token ids; float or base64;
                          `truncate` (text-embeddings-inference's; gRPC's): false refuses a long input
    GET  /v1/models       the one model served
    GET  /v1/models/{id}  that model, or 404 model_not_found
    GET  /health          200 while serving; 503 while warming up or draining (never needs the token)

It shares everything with gRPC (one queue, one set of limits, one budget, the same vectors) because
both call the same Embedder. Starlette on uvicorn runs on the front's own event loop beside the
gRPC server; every front binds the same port (SO_REUSEPORT). Errors take OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`), their HTTP status mapped in one place (`STATUS`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import logging
import math
import reprlib
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import h11
import numpy as np
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from minilm_embed.server import logs
from minilm_embed.server.budget import Hold
from minilm_embed.server.config import ServerConfig
from minilm_embed.server.embedder import Embedded, Embedder, EmbedJob
from minilm_embed.server.errors import (
    RETRY_AFTER_S,
    BackendFailure,
    ClientGone,
    Dropped,
    InvalidInput,
    NotReady,
    Overloaded,
    ServiceError,
    SlowBody,
    TooLarge,
    Unauthenticated,
    cut_at_drain,
    internal,
    retry_after_ms,
)
from minilm_embed.server.metrics import HTTP_EMBEDDINGS, HTTP_MODELS, Metrics, size_class
from minilm_embed.server.security import bearer_matches
from minilm_embed.server.tokenization import TokenRow

log = logging.getLogger(__name__)

# The one place where errors become HTTP statuses and OpenAI error types, most specific class first
# (TooLarge is an InvalidInput). The error's reason (server/errors.py), lower-cased, is its `code`
# (`too_many_inputs`, `queue_full`), as OpenAI's codes name the case (`model_not_found`).
STATUS: dict[type[ServiceError], tuple[int, str]] = {
    TooLarge: (413, "invalid_request_error"),
    SlowBody: (408, "invalid_request_error"),
    InvalidInput: (400, "invalid_request_error"),
    Unauthenticated: (401, "authentication_error"),
    Overloaded: (429, "rate_limit_error"),
    NotReady: (503, "service_unavailable_error"),
    Dropped: (504, "timeout_error"),
    ClientGone: (499, "client_closed_request"),  # nginx's status; nobody is left to read it
    BackendFailure: (500, "server_error"),
    ServiceError: (500, "server_error"),
}
# Starlette's own refusals, as gRPC would answer them: no such path, and no such method (gRPC's answer
# to a method it does not serve).
ROUTING_CODES = {404: grpc.StatusCode.NOT_FOUND, 405: grpc.StatusCode.UNIMPLEMENTED}
# The endpoints' route templates (a traced call's span is named by its template, not its path).
EMBEDDINGS_ROUTE, MODELS_ROUTE, MODEL_ROUTE = "/v1/embeddings", "/v1/models", "/v1/models/{model:path}"
UNAUTHENTICATED = "missing or invalid bearer token (send the header `Authorization: Bearer <token>`)"
FORMATS = ("float", "base64")
PRIORITIES = ("interactive", "bulk")
SHAPES = "send a list of strings, a list of token ids (integers), or a list of lists of token ids"
_INT64 = 1 << 63
# How much of a bad value an error message shows: a 900 kB one came back whole (an answer as large as
# the request, and a line that large wherever the caller logs its errors). reprlib cuts while it writes.
SHOWN_CHARS = 64


class _JsonRepr(reprlib.Repr):
    """reprlib's cut, in JSON's spelling: null, true, "text" (not None, True, 'text')."""

    def repr_NoneType(self, value: None, level: int) -> str:  # reprlib dispatches on the type name
        return "null"

    def repr_bool(self, value: bool, level: int) -> str:
        return "true" if value else "false"

    def repr_str(self, value: str, level: int) -> str:
        if len(value) <= self.maxstring:
            return orjson.dumps(value).decode()
        half = max(0, (self.maxstring - 3) // 2)  # cut before it is encoded: no escape split in two
        head, tail = orjson.dumps(value[:half]).decode(), orjson.dumps(value[len(value) - half :]).decode()
        return f"{head[:-1]}...{tail[1:]}"


_SHOWN = _JsonRepr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxlevel = SHOWN_CHARS, 32, 4, 4, 2
KINDS = {
    dict: "an object", list: "a list", str: "a string", type(None): "null",
    bool: "a boolean", int: "an integer", float: "a number",
}  # fmt: skip


class InvalidField(InvalidInput):
    """An invalid request field, which OpenAI's error names in `param`."""

    def __init__(self, param: str, message: str, reason: str = "", **metadata: object) -> None:
        super().__init__(message, reason)
        self.metadata = {key: str(value) for key, value in metadata.items()}
        self.param = param


@dataclass(frozen=True)
class ModelCard:
    """The served model as /v1/models shows it and responses name it."""

    id: str
    created: int  # Unix seconds: when the model repository was written
    dimensions: int

    def named(self, asked: str) -> bool:
        """Its id, or the id's last part ("all-MiniLM-L6-v2" for "sentence-transformers/all-MiniLM-L6-v2"),
        the name clients are shown using."""
        return asked in (self.id, self.id.rpartition("/")[2])

    @property
    def owned_by(self) -> str:
        return self.id.partition("/")[0] if "/" in self.id else "minilm-embed"


@dataclass(frozen=True)
class EmbeddingsRequest:
    job: EmbedJob
    base64: bool


def shown(value: object) -> str:
    """A caller's value as an error message shows it: its repr, long strings and lists cut ("...")."""
    return _SHOWN.repr(value)


def cut(text: str) -> str:
    """A caller's text as an error message shows it: at most SHOWN_CHARS characters, then "..."."""
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def json_response(body: object, status: int = 200) -> Response:
    content = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(content, status, media_type="application/json")


def status_of(error: ServiceError) -> tuple[int, str]:
    return next(STATUS[cls] for cls in type(error).__mro__ if cls in STATUS)


# Refusals after which trying again helps (a full queue, a replica warming up or draining): they say
# when, as RetryInfo does on gRPC.
RETRYABLE = {429, 503}


def retry_headers(seconds: float) -> dict[str, str]:
    """When to try again: Retry-After in whole seconds (RFC 9110, so at least 1 here), and
    retry-after-ms, which OpenAI's clients read first and honour up to two minutes (a full queue on a
    fast engine has room again well within a second)."""
    ms = retry_after_ms(seconds)
    return {"Retry-After": str(math.ceil(ms / 1000)), "retry-after-ms": str(ms)}


def error_response(error: ServiceError) -> Response:
    status, kind = status_of(error)
    param = error.param if isinstance(error, InvalidField) else None
    body = {"message": str(error), "type": kind, "param": param, "code": error.reason.lower()}
    response = json_response({"error": body}, status)
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750
    elif status in RETRYABLE:
        response.headers.update(retry_headers(error.retry_after_s))
    return response


class HttpApi:
    def __init__(
        self,
        embedder: Embedder,
        metrics: Metrics,
        card: ModelCard,
        token: str | None,
        max_body: int,
        body_timeout_s: float = 30.0,
        drain_timeout_s: float = 30.0,
    ) -> None:
        self.embedder = embedder
        self.metrics = metrics
        self.card = card
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s
        self.drain_timeout_s = drain_timeout_s
        # Set by the drain as its timeout passes (front.drain): what uvicorn cancels from then on is
        # answered 503, not its bare 500.
        self.cut_off = False
        self._token = token.encode() if token else None

    def app(self) -> Starlette:
        routes = [
            Route(EMBEDDINGS_ROUTE, self.embeddings, methods=["POST"]),
            Route(MODELS_ROUTE, self.models, methods=["GET"]),
            Route(MODEL_ROUTE, self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        app = Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})
        # "/v1/embeddings/" is a 404 in OpenAI's shape, as any other unknown path, not Starlette's
        # bare 307 to the path without the slash (no body, no x-request-id).
        app.router.redirect_slashes = False
        return app

    async def embeddings(self, request: Request) -> Response:
        inputs = [0]  # for the latency's size class, once the body is read

        async def embed() -> Response:
            check_encoding(request.headers.get("content-encoding", "identity"))
            # Held against the front's budgets as its bytes come, as gRPC's are once read: 400 uploads
            # stalled 1 byte short held 1 GB unaccounted before; holding a body's declared size from
            # the start let 4 connections that sent 600 bytes in all refuse every call for 30 s.
            check_declared_size(request, self.max_body)
            with self.embedder.receiving(0) as held:
                more = functools.partial(self.embedder.received_more, held)
                body = await read_body(request, self.max_body, self.body_timeout_s, more)
                most = self.embedder.tokenizer.limits.max_inputs_per_request
                vocab = self.embedder.tokenizer.vocab_size
                if len(body) <= INLINE_BODY_BYTES:
                    parsed = parse_embeddings(body, self.card, most, vocab)
                else:  # 2 MB of JSON took 20-40 ms to parse and check (one list of ids): not on the loop
                    parsed = await self.embedder.off_loop(parse_embeddings, body, self.card, most, vocab)
                job = dataclasses.replace(parsed.job, request_id=logs.current_request_id.get())
                as_base64 = parsed.base64
                del parsed  # only the job holds the inputs, and lets go of them once tokenized
                inputs[0] = job.count
                try:
                    embedded = await embed_while_connected(self.embedder, job, request, held)
                except InvalidInput as e:  # a limit an input broke: OpenAI names the field
                    raise InvalidField("input", str(e), e.reason, **e.metadata) from None
            return json_response(embeddings_body(embedded, as_base64, self.card.id))

        return await self._serve(HTTP_EMBEDDINGS, EMBEDDINGS_ROUTE, request, embed, inputs)

    async def models(self, request: Request) -> Response:
        async def listing() -> Response:
            return json_response({"object": "list", "data": [self._model()]})

        return await self._serve(HTTP_MODELS, MODELS_ROUTE, request, listing, [0])

    async def model(self, request: Request) -> Response:
        async def one() -> Response:
            asked = request.path_params["model"]
            if not self.card.named(asked):
                return _model_not_found(asked, self.card.id)
            return json_response(self._model())

        return await self._serve(HTTP_MODELS, MODEL_ROUTE, request, one, [0])

    def _model(self) -> dict[str, Any]:
        card = self.card
        return {"id": card.id, "object": "model", "created": card.created, "owned_by": card.owned_by}

    async def health(self, request: Request) -> Response:
        readiness = self.embedder.readiness
        if readiness.ready:
            response = json_response({"status": "serving"})
        else:
            response = json_response({"status": "not serving", "reason": readiness.reason}, 503)
        response.headers[logs.REQUEST_ID_HEADER] = self._request_id(request)
        return response

    async def _serve(
        self,
        method: str,
        route: str,
        request: Request,
        handler: Callable[[], Awaitable[Response]],
        inputs: list[int],
    ) -> Response:
        """Run one call (traced, when tracing is on, as gRPC's interceptor traces a gRPC call). `route`
        is the endpoint's route template, the span's name and `http.route`: passed by each endpoint,
        not read from scope["route"], which not every Starlette that pyproject allows (>=0.47) sets."""
        request_id = self._request_id(request)
        tracer = self.embedder.tracer
        if tracer is None:
            return await self._answer(method, request, request_id, handler, inputs)
        with tracer.http_call(request.method, route, request.headers, request_id) as answered:
            response = await self._answer(method, request, request_id, handler, inputs)
            answered(response.status_code)
            return response

    async def _answer(
        self,
        method: str,
        request: Request,
        request_id: str,
        handler: Callable[[], Awaitable[Response]],
        inputs: list[int],
    ) -> Response:
        """The single place where a call's errors become responses and it is counted."""
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        code = grpc.StatusCode.OK
        try:
            self._authorize(request)
            response = await handler()
        except ServiceError as e:
            code = e.code
            response = error_response(e)
        except Exception:
            log.exception("%s failed", method)
            code = grpc.StatusCode.INTERNAL
            response = error_response(internal())
        except asyncio.CancelledError:
            # uvicorn cancels what is still open once the drain timeout passes (a body still coming):
            # answered as gRPC's calls are then, not with its bare 500, a traceback, and counted OK.
            code = grpc.StatusCode.CANCELLED
            task = asyncio.current_task()
            if not self.cut_off or task is None:
                raise
            task.uncancel()  # answered: the cancellation is taken as uvicorn meant it
            cut = NotReady(cut_at_drain(self.drain_timeout_s), "SHUTTING_DOWN")
            code, response = cut.code, error_response(cut)
        finally:
            self.metrics.requests.labels(method, code.name).inc()  # before leaving in-flight, as gRPC
            self.metrics.in_flight.dec()
            duration = time.perf_counter() - started
            self.metrics.request_duration.labels(method, size_class(inputs[0])).observe(duration)
        response.headers[logs.REQUEST_ID_HEADER] = request_id
        _close_if_body_unread(request, response)
        return response

    @staticmethod
    def _request_id(request: Request) -> str:
        """The call's id, as gRPC's (server/logs.py): the caller's `x-request-id` if usable, else a
        new one; on every log line about the call and in the response's `x-request-id` header."""
        request_id, why = logs.request_id_from(request.headers.get(logs.REQUEST_ID_HEADER))
        logs.current_request_id.set(request_id)
        if why:
            logs.warn_replaced_id("HTTP", request.headers[logs.REQUEST_ID_HEADER], why)
        return request_id

    def _authorize(self, request: Request) -> None:
        if self._token is not None and not bearer_matches(
            request.headers.get("authorization", ""), self._token
        ):
            raise Unauthenticated(UNAUTHENTICATED)


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such path, wrong method) in OpenAI's error shape, as every other
    answer: gRPC's code, the exception's headers (405's Allow) and the call's x-request-id."""
    assert isinstance(exc, HTTPException)
    code = ROUTING_CODES.get(exc.status_code, grpc.StatusCode.INVALID_ARGUMENT).name.lower()
    message, path = exc.detail, request.url.path
    if exc.status_code == 404 and path.endswith("/") and path.rstrip("/") in SLASHLESS:
        message = f"Not Found: {path} has no trailing slash here; send {path.rstrip('/')}"
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    response = json_response({"error": error}, exc.status_code)
    response.headers.update(exc.headers or {})
    response.headers[logs.REQUEST_ID_HEADER] = HttpApi._request_id(request)
    _close_if_body_unread(request, response)
    return response


SLASHLESS = {EMBEDDINGS_ROUTE, MODELS_ROUTE, "/health"}  # said, when asked with a slash


def _model_not_found(asked: str, served: str) -> Response:
    """OpenAI's answer for a model it does not have (a 404 the caller asked for, counted as OK)."""
    message = f"The model `{cut(asked)}` does not exist; this server serves `{served}`"
    error = {"message": message, "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    return json_response({"error": error}, 404)


def check_declared_size(request: Request, limit: int) -> None:
    """A body declared (Content-Length) past `limit`: 413 before a byte of it is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body has {declared} bytes, over the limit max_message_bytes={limit}")


def _close_if_body_unread(request: Request, response: Response) -> None:
    """Connection: close on an answer given before the request's body (a Content-Length above 0, or
    chunks) was all read (408 at the body timeout, 413, a refusal before reading, 404, 405): the rest
    of the body would come in on a connection kept alive, be taken for the next request's headers and
    get a 408 of its own. Closed, as RFC 9112 9.6 advises (BoundedH11 closes such a connection too)."""
    headers = request.headers
    has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
    if has_body and not getattr(request.state, "body_read", False):
        response.headers["connection"] = "close"


async def read_body(request: Request, limit: int, timeout_s: float, received: Callable[[int], None]) -> bytes:
    """The body, refused (413) as soon as the bytes read pass `limit`, and (408) if it has not all
    arrived after `timeout_s`; `received(size)` is told of each chunk's bytes as it comes (and may
    refuse them)."""
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                if len(body) + len(chunk) > limit:
                    raise TooLarge(
                        f"the request body has more than {limit} bytes, over the limit "
                        f"max_message_bytes={limit}"
                    )
                received(len(chunk))
                body += chunk
    except ClientDisconnect:  # gone mid-upload: the caller's doing, not a server failure
        raise ClientGone("the client disconnected while sending its request") from None
    except TimeoutError:
        raise SlowBody(
            f"the request body had sent {len(body)} bytes after {timeout_s:g} s, over the limit "
            f"http_body_timeout_s={timeout_s:g}"
        ) from None
    request.state.body_read = True
    return bytes(body)


def check_encoding(encoding: str) -> None:
    """Bodies are read as sent: a compressed one would only fail as "not JSON", which hides why."""
    if encoding.strip().lower() != "identity":
        raise InvalidInput(
            f"the request body has Content-Encoding: {cut(encoding)}, which this server does not decode; "
            "send it uncompressed",
            "UNSUPPORTED_CONTENT_ENCODING",
        )


def parse_embeddings(body: bytes, card: ModelCard, most: int, vocab_size: int) -> EmbeddingsRequest:
    """The request, or InvalidInput; past `most` inputs refused before any input is looked at
    (`vocab_size`: the range a token id past int64 is named outside of)."""
    try:
        fields = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise InvalidInput(
            f"the request body is not valid JSON: {_json_error(body, e)}", "MALFORMED_REQUEST"
        ) from None
    if not isinstance(fields, dict):
        raise InvalidInput(
            f"the request body must be a JSON object, not {_kind(fields)}", "MALFORMED_REQUEST"
        )
    if "input" not in fields:
        raise InvalidField(
            "input", "`input` is required: a string, a list of strings, or token ids", "NO_INPUTS"
        )
    if not isinstance(fields.get("model", ""), str):
        raise InvalidField("model", f"`model` must be a string, not {_kind(fields['model'])}")
    check_dimensions(fields.get("dimensions"), card)
    truncate = parse_truncate(fields.get("truncate"))
    bulk = parse_priority(fields.get("priority"))
    texts, token_ids = parse_input(fields["input"], most, vocab_size)
    job = EmbedJob(texts, token_ids, truncate=truncate, bulk=bulk)
    return EmbeddingsRequest(job, parse_format(fields.get("encoding_format")))


def _json_error(body: bytes, error: orjson.JSONDecodeError) -> str:
    """orjson's message, unless the body is not UTF-8 at all (orjson then speaks of surrogates)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"it is not UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start})"
    return str(error)


def parse_input(value: object, most: int, vocab_size: int | None = None) -> tuple[list[str], list[TokenRow]]:
    """(texts, token ids), one of them empty: OpenAI's four shapes of `input`. More than `most`
    inputs are refused first: 400k one-id rows took 0.5 s of the event loop each to check. A token id
    past int64 is refused here, named outside [0, `vocab_size`) when that is given; the others are
    held to the vocabulary when tokenized."""
    if isinstance(value, str):
        return [value], []
    if not isinstance(value, list):
        raise InvalidField("input", f"`input` must be a string or a list, not {_kind(value)}")
    if not value:
        raise InvalidField("input", "`input` is an empty list: send at least one input", "NO_INPUTS")
    if len(value) > most and not isinstance(value[0], int | float):  # a list of token ids is one input
        raise InvalidField(
            "input",
            f"{len(value)} inputs in one request, over the limit max_inputs_per_request={most}; "
            "split the request",
            "TOO_MANY_INPUTS",
            setting="max_inputs_per_request",
            limit=most,
            value=len(value),
        )
    # The kinds of the items, counted in C: a Python-level check per item took 90 ms of the event
    # loop for a 2 MB body of one long id list (JSON gives exact types: no subclass but bool's).
    kinds = set(map(type, value))
    if kinds == {str}:
        return value, []
    if kinds <= NUMBERS or type(value[0]) in NUMBERS:  # one sequence of token ids (which names an odd item)
        return [], [_token_ids(value, 0, vocab_size, kinds)]
    if kinds == {list}:
        return [], [_token_ids(row, i, vocab_size) for i, row in enumerate(value)]
    raise InvalidField("input", f"{_mixed(value)}; {SHAPES}")


INLINE_BODY_BYTES = 64 * 1024  # a body parsed on the event loop: at most about 1 ms of JSON and checks
NUMBERS = {int, float, bool}  # the kinds of items a list of token ids may hold before it is checked


def _mixed(items: list[Any]) -> str:
    """Which item's kind breaks the list's shape: the first whose shape differs from input 0's (a
    number among token ids is one shape: `_token_ids` says which is not an integer)."""
    first = _shape(items[0])
    odd = next((i for i, item in enumerate(items) if _shape(item) != first), None)
    if odd is None:  # every item of one kind, not one of the three
        return f"`input` holds items of no kind it takes: input 0 is {_kind(items[0])}"
    return f"`input` mixes kinds of items: input 0 is {_kind(items[0])}, input {odd} is {_kind(items[odd])}"


def _shape(item: object) -> object:
    for shape in (str, int | float, list):
        if isinstance(item, shape):
            return shape
    return type(item)


def _token_ids(row: list[Any], i: int, vocab_size: int | None, kinds: set[type] | None = None) -> TokenRow:
    """The row as an int64 array, if every item is an integer a token id could be; else which item is
    not, and what. Checked in C (the items' kinds, then the conversion, which the tokenizer's check of
    the vocabulary reuses), item by item only to say which."""
    if (kinds or set(map(type, row))) == {int}:
        with contextlib.suppress(OverflowError):  # past int64: named below
            return np.fromiter(row, dtype=np.int64, count=len(row))
    for j, t in enumerate(row):
        # orjson reads an integer outside [-2**63, 2**64) as a float (2**64 arrives as
        # 1.8446744073709552e+19, -2**63 - 1 as -9.223372036854776e+18, which is -2**63): whether it
        # was written as one or not, no such number is in the vocabulary.
        if (type(t) is int and not -_INT64 <= t < _INT64) or (type(t) is float and _past_int64(t)):
            in_range = {} if vocab_size is None else {"vocabularySize": vocab_size}
            raise InvalidField(
                "input",
                f"input {i}: token id {shown(t)} at position {j} is outside the vocabulary"
                + ("" if vocab_size is None else f" [0, {vocab_size})"),
                "TOKEN_ID_OUT_OF_RANGE",
                input=i,
                position=j,
                value=t,
                **in_range,
            )
        if type(t) is not int:
            raise InvalidField(
                "input",
                f"input {i}: token id at position {j} is {_described(t)}, not an integer",
                "TOKEN_ID_NOT_AN_INTEGER",
                input=i,
                position=j,
            )
    return row


def _past_int64(number: float) -> bool:
    """An integral float at least 2**63 in size: what orjson gives for an integer past int64 (it gives
    -2**63 written as an integer as an int: a float -2**63 is a smaller integer, rounded, or was written
    as a float). Smaller ones (1.0) were written as floats."""
    return number.is_integer() and not -_INT64 < number < _INT64


def check_dimensions(value: object, card: ModelCard) -> None:
    if value is None or (type(value) is int and value == card.dimensions):
        return
    if type(value) is not int:  # 384.0 or "384": not "is 384.0, but ... send 384"
        raise InvalidField("dimensions", f"`dimensions` must be an integer, not {_described(value)}")
    raise InvalidField(
        "dimensions",
        f"`dimensions` is {shown(value)}, but {card.id} gives {card.dimensions}-dimensional vectors only; "
        f"send {card.dimensions} or leave it out",
        "UNSUPPORTED_DIMENSIONS",
        value=value,
        dimensions=card.dimensions,
    )


def parse_truncate(value: object) -> bool:
    """text-embeddings-inference's `truncate`, gRPC's: unset (or null) cuts inputs at the model's
    limit; false refuses an input over it."""
    if value is None:
        return True
    if isinstance(value, bool):
        return value
    raise InvalidField("truncate", f"`truncate` must be a boolean, not {_described(value)}")


def parse_priority(value: object) -> bool:
    """gRPC's `priority` (an extension to OpenAI's request, as `truncate` is): `interactive` (also
    unset or null) or `bulk`; whether it is bulk."""
    if value is None or value in PRIORITIES:
        return value == "bulk"
    raise InvalidField(
        "priority", f"`priority` is {shown(value)}; it must be interactive or bulk", "UNKNOWN_PRIORITY"
    )


def parse_format(value: object) -> bool:
    """Whether the vectors go back base64-encoded (little-endian float32), not as lists of floats."""
    if value is None or value in FORMATS:
        return value == "base64"
    raise InvalidField(
        "encoding_format",
        f"`encoding_format` is {shown(value)}; it must be float or base64",
        "UNKNOWN_FORMAT",
    )


def _kind(value: object) -> str:
    return KINDS.get(type(value), type(value).__name__)


def _described(value: object) -> str:
    """What a value is and, unless null, which: "a boolean true", "null"."""
    return "null" if value is None else f"{_kind(value)} {shown(value)}"


async def embed_while_connected(
    embedder: Embedder, job: EmbedJob, request: Request, held: Hold | None = None
) -> Embedded:
    """The job's vectors; if the client disconnects first, the job is cancelled, so that the engine
    drops its inputs before compute (as when a gRPC caller cancels)."""
    work = asyncio.ensure_future(embedder.embed(job, held))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if not work.done() or work.cancelled():
        raise ClientGone("the client disconnected before its answer")
    return work.result()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read: uvicorn's next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def embeddings_body(embedded: Embedded, as_base64: bool, model: str) -> dict[str, Any]:
    """OpenAI's response from the engine's one (n, D) array; orjson writes the float rows itself."""
    vectors = embedded.answer.vectors.astype("<f4", copy=False)
    rows: list[Any] = [_b64(v) for v in vectors] if as_base64 else list(vectors)
    data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
    tokens = int(embedded.prepared.lengths.sum())
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _b64(vector: np.ndarray) -> str:
    return base64.b64encode(vector.tobytes()).decode("ascii")


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers (the front owns SIGTERM and drains both APIs), and
    with a TLS handshake given the header timeout, not asyncio's 60 s: the header timeout and the
    connection cap start once the handshake is done, so silent connections to the TLS port held a
    front's file descriptors six times as long as http_header_timeout_s says. uvicorn passes no
    handshake timeout to `loop.create_server`, so it is added there while uvicorn starts."""

    def __init__(self, config: uvicorn.Config, handshake_timeout_s: float) -> None:
        super().__init__(config)
        self.handshake_timeout_s = handshake_timeout_s

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        timeout = {"ssl_handshake_timeout": self.handshake_timeout_s} if self.config.ssl else {}
        loop.create_server = functools.partial(loop.create_server, **timeout)  # type: ignore[method-assign]
        try:
            await super().startup(sockets)
        finally:
            del loop.create_server  # the loop's own method again


@dataclass
class HttpListener:
    """uvicorn serving the API on a socket bound by the front (SO_REUSEPORT, as gRPC's)."""

    server: uvicorn.Server
    sock: socket.socket
    api: HttpApi
    task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))

    @property
    def calls(self) -> int:
        """Requests being answered now (uvicorn's task per request in flight)."""
        return len(self.server.server_state.tasks)

    async def stop(self) -> None:
        """Stop accepting, close idle connections, let requests in flight finish (within the
        graceful timeout, after which uvicorn cancels them)."""
        self.server.should_exit = True
        if self.task is not None:
            await self.task


class BoundedH11(H11Protocol):
    """uvicorn's h11 connection with the two bounds uvicorn lacks, set per listener (`bounded_h11`):
    at most `max_connections` open (one past it is answered 429 and closed), and `header_timeout_s`
    for a request's headers to arrive, the first or the next after an answer (then 408 and closed;
    closed without an answer if not a byte came).
    Without them 20,000 connections that never sent a byte held a front's file descriptors for good,
    and its gRPC listener could accept nothing more. A body's own time is http_body_timeout_s, each
    way: a connection whose client has read no byte of its answers for `send_timeout_s`, its socket
    full, is cut (uvicorn waits for a socket to drain without limit: a client pipelining requests and
    never reading held its connection, an answer task and an answer's body for good). A client that
    reads, however slowly, is not: the limit is on a window without progress, not on an answer's
    whole delivery (uvicorn writes an answer, 1.2 MB for 256 float vectors, at once)."""

    max_connections = 1024
    header_timeout_s = 10.0
    send_timeout_s = 30.0
    metrics: Metrics | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # the bytes waiting to be sent when the send timer was set
        self._waiting_after: object = None  # the cycle answered last when the timer was set
        if len(self.connections) > self.max_connections:
            if self.metrics is not None:
                self.metrics.refusals.labels("http_connections").inc()
            message = (
                f"front busy: {len(self.connections) - 1} HTTP connections open, http_max_connections "
                f"is {self.max_connections}; retry with backoff"
            )
            self._refuse(429, "Too Many Requests", "rate_limit_error", message, "FRONT_BUSY")
            return
        self._wait_for_headers()

    def _wait_for_headers(self) -> None:
        self._waiting_after = self.cycle
        self._bytes_came = False
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def data_received(self, data: bytes) -> None:
        self._bytes_came = True
        super().data_received(data)

    def _stop_waiting(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.cycle is not self._waiting_after:
            self._stop_waiting()  # a request's headers arrived: its cycle began

    def on_response_complete(self) -> None:
        # Answered before the request's body all came (a 404 or 405 that never reads it; the answers
        # HttpApi gives say Connection: close themselves): what is left of the body would be taken
        # for the next request's headers and get a 408 at the header timeout. Closed instead.
        unread = self.conn.their_state is h11.SEND_BODY
        super().on_response_complete()
        if unread and not self.transport.is_closing():
            self.transport.close()
            return
        if not self.transport.is_closing() and self._header_timer is None and self.cycle.response_complete:
            self._wait_for_headers()  # the next request's, however its bytes come (keep-alive aside)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._set_send_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_timer()

    def _set_send_timer(self) -> None:
        self._unsent = self.transport.get_write_buffer_size()
        self._send_timer = self.loop.call_later(self.send_timeout_s, self._not_reading)

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _not_reading(self) -> None:
        """Cut a connection of which no byte of its answers was read for send_timeout_s (the socket
        still full, the bytes waiting no fewer): closing it would wait for the unread bytes to go out,
        for ever. Fewer waiting, the client is reading: another window, from what waits now (asyncio
        resumes writing only once all but 16 kB went out, so a client reading 1.2 MB at 100 kB/s was
        cut after send_timeout_s, though reading all along)."""
        self._send_timer = None
        if self.transport.get_write_buffer_size() < self._unsent:
            self._set_send_timer()
            return
        log.debug("an HTTP client read no byte of its answers for %g s: connection cut", self.send_timeout_s)
        self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        self._stop_send_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a Content-Length that is not a number, two that differ): 400 in
        OpenAI's shape, as every other answer, not uvicorn's plain "Invalid HTTP request received."."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # an answer is being written
            self.transport.close()
            return
        message = "malformed HTTP request: it is not valid HTTP/1.1 (h11 refused it)"
        self._refuse(400, "Bad Request", "invalid_request_error", message, "MALFORMED_REQUEST")

    def _headers_late(self) -> None:
        """408 to a request begun and not finished; a connection that sent nothing is closed as
        uvicorn closes one idle after an answer (an answer to nothing would be read as the answer
        to the request a client sends next on it)."""
        self._header_timer = None
        if self.cycle is not self._waiting_after or self.transport.is_closing():
            return
        if not self._bytes_came:
            self.transport.close()
        else:
            message = (
                f"the request's headers had not all arrived after {self.header_timeout_s:g} s, the "
                f"limit http_header_timeout_s={self.header_timeout_s:g}"
            )
            self._refuse(408, "Request Timeout", "invalid_request_error", message, "HEADER_TIMEOUT")

    def _refuse(self, status: int, reason: str, kind: str, message: str, code: str) -> None:
        """An answer written before (or instead of) reading a request, then the connection closed: as
        every other answer, its reason lower-cased as `code`, an x-request-id (made up: the request's
        headers were not read) and, for 429, Retry-After."""
        error = {"message": message, "type": kind, "param": None, "code": code.lower()}
        body = orjson.dumps({"error": error})
        waits = retry_headers(RETRY_AFTER_S).items() if status == 429 else ()
        retry = "".join(f"{name.lower()}: {value}\r\n" for name, value in waits)
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{logs.REQUEST_ID_HEADER}: {logs.new_request_id()}\r\n"
            f"{retry}connection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


def bounded_h11(config: ServerConfig, metrics: Metrics | None) -> type[BoundedH11]:
    """BoundedH11 with this server's limits (uvicorn makes one protocol object per connection)."""
    limits = {
        "max_connections": config.http_max_connections,
        "header_timeout_s": config.http_header_timeout_s,
        "send_timeout_s": config.http_body_timeout_s,
        "metrics": metrics,
    }
    return type("BoundedH11", (BoundedH11,), limits)


def http_listener(api: HttpApi, sock: socket.socket, config: ServerConfig) -> HttpListener:
    settings = uvicorn.Config(
        api.app(),
        http=bounded_h11(config, api.metrics),
        # No WebSocket endpoint: with ws="auto" and the `websockets` package importable, an upgrade
        # request went to uvicorn's WebSocket protocol, which logged its headers at DEBUG (the
        # bearer token among them) and its path and query string at INFO. An upgrade is now
        # answered as a plain HTTP request (uvicorn's warning about it: logs.UvicornFilter).
        ws="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=max(1, round(config.drain_timeout_s)),
        **_tls(config),
    )
    return HttpListener(_Server(settings, config.http_header_timeout_s), sock, api)


def _tls(config: ServerConfig) -> dict[str, Any]:
    """The gRPC server's TLS settings, for uvicorn: the same certificate, the same client CA."""
    if not config.tls_cert:
        return {}
    tls: dict[str, Any] = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
    if config.tls_client_ca:
        tls |= {"ssl_ca_certs": config.tls_client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return tls
