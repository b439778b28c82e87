"""What the server must answer to any request, from its documented limits (Info.limits, README).

`Contract.expect(method, body)` decodes the request bytes as the server does and says which status
it must get, a phrase the message must hold (the limit it names) and the reason its google.rpc
ErrorInfo must give (none where gRPC itself refuses); `Contract.check(...)` checks a good answer in
full. Used by the fuzz tests, which send arbitrary bytes as well as valid requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from minilm_embed.model.tokenizer import Tokenizer
from minilm_embed.proto.embedding.v1 import embedding_pb2 as pb
from minilm_embed.server.config import ServerConfig

INVALID = grpc.StatusCode.INVALID_ARGUMENT
FRAME = (101, 102)  # [CLS] ... [SEP]: what every token-id input must start and end with
REQUESTS: dict[str, Any] = {
    "Embed": pb.EmbedRequest,
    "Tokenize": pb.TokenizeRequest,
    "Info": pb.InfoRequest,
    "EmbedStream": pb.EmbedStreamRequest,
}


@dataclass(frozen=True)
class Limits:
    """A server's limits, and the model's (all-MiniLM-L6-v2)."""

    max_inputs_per_request: int
    max_text_chars: int
    max_message_bytes: int
    max_input_tokens: int = 256
    vocab_size: int = 30522
    dimensions: int = 384

    @classmethod
    def defaults(cls) -> Limits:
        """The limits of a server started without flags (server/config.py)."""
        c = ServerConfig()
        return cls(c.max_inputs_per_request, c.max_text_chars, c.max_message_bytes)


@dataclass(frozen=True)
class Expect:
    code: grpc.StatusCode
    phrase: str = ""  # the message must contain it
    reason: str = ""  # the ErrorInfo reason (README, "Errors"); "" for none

    def __str__(self) -> str:
        said = f"{self.code.name} {self.phrase!r}" if self.phrase else self.code.name
        return f"{said} ({self.reason})" if self.reason else said


OK = Expect(grpc.StatusCode.OK)


class Contract:
    def __init__(self, tokenizer: Tokenizer, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits

    def decode(self, method: str, body: bytes) -> Any:
        """The request the server sees, or an Expect when it cannot decode it."""
        kind = REQUESTS[method]
        try:
            return kind.FromString(body)
        except DecodeError:
            return Expect(INVALID, f"not a valid {kind.DESCRIPTOR.full_name}", "MALFORMED_REQUEST")

    def expect(self, method: str, body: bytes) -> Expect:
        if len(body) > self.limits.max_message_bytes:  # gRPC itself refuses it
            return Expect(grpc.StatusCode.RESOURCE_EXHAUSTED, str(self.limits.max_message_bytes))
        request = self.decode(method, body)
        if isinstance(request, Expect):
            return request
        if method == "Embed":
            return self.embed(request)
        if method == "Tokenize":
            return self.texts(request.texts) or OK
        return OK

    def embed(self, r: pb.EmbedRequest) -> Expect:
        if r.format not in pb.EmbeddingFormat.values():  # proto3 keeps a number the enum lacks
            return Expect(INVALID, f"format is {r.format}, not an EmbeddingFormat", "UNKNOWN_FORMAT")
        if r.texts and r.token_ids:
            return Expect(INVALID, "either `texts` or `token_ids`", "TEXTS_AND_TOKEN_IDS")
        truncate = r.truncate if r.HasField("truncate") else True
        if r.token_ids:
            return self.token_ids([list(t.ids) for t in r.token_ids], truncate)
        problem = self.texts(r.texts)
        if problem is None and not truncate and any(self.tokenizer.encode(list(r.texts)).truncated):
            problem = self._too_long()
        return problem or OK

    def count(self, n: int) -> Expect | None:
        if n == 0:
            return Expect(INVALID, "no inputs", "NO_INPUTS")
        if n > self.limits.max_inputs_per_request:
            return Expect(
                INVALID, f"max_inputs_per_request={self.limits.max_inputs_per_request}", "TOO_MANY_INPUTS"
            )
        return None

    def texts(self, texts: Any) -> Expect | None:
        problem = self.count(len(texts))
        for text in texts:
            if problem:
                break
            if not text:
                problem = Expect(INVALID, "is an empty string", "EMPTY_INPUT")
            elif len(text) > self.limits.max_text_chars:
                problem = Expect(INVALID, f"max_text_chars={self.limits.max_text_chars}", "TEXT_TOO_LONG")
        return problem

    def token_ids(self, rows: list[list[int]], truncate: bool) -> Expect:
        problem = self.count(len(rows))
        for ids in rows:
            if problem:
                break
            if not ids:
                problem = Expect(INVALID, "empty token-id sequence", "EMPTY_INPUT")
            elif (ids[0], ids[-1]) != FRAME:  # named first: another tokenizer's ids run past this vocabulary
                framed = "token ids must start with [CLS] (101) and end with [SEP] (102)"
                problem = Expect(INVALID, framed, "TOKEN_IDS_NOT_FRAMED")
            elif any(not 0 <= t < self.limits.vocab_size for t in ids):
                vocabulary = f"outside the vocabulary [0, {self.limits.vocab_size})"
                problem = Expect(INVALID, vocabulary, "TOKEN_ID_OUT_OF_RANGE")
        if problem is None and not truncate and any(len(ids) > self.limits.max_input_tokens for ids in rows):
            problem = self._too_long()
        return problem or OK

    def _too_long(self) -> Expect:
        return Expect(INVALID, f"max_input_tokens={self.limits.max_input_tokens}", "TOO_MANY_TOKENS")

    def check(self, method: str, request: Any, answer: bytes) -> None:
        """A good answer, in full: one vector or token row per input, finite, of the right size."""
        if method == "Embed":
            self.check_embed(request, pb.EmbedResponse.FromString(answer))
        elif method == "Tokenize":
            self.check_tokenize(request, pb.TokenizeResponse.FromString(answer))
        elif method == "Info":
            info = pb.InfoResponse.FromString(answer)
            assert info.dimensions == self.limits.dimensions
            assert info.limits.max_inputs_per_request == self.limits.max_inputs_per_request

    def check_embed(self, r: pb.EmbedRequest, response: pb.EmbedResponse) -> None:
        lengths: list[int | None] = [len(t.ids) for t in r.token_ids] or [None] * len(r.texts)
        assert len(response.embeddings) == len(lengths)
        assert response.dimensions == self.limits.dimensions
        normalize = r.normalize if r.HasField("normalize") else True
        for e, length in zip(response.embeddings, lengths, strict=True):
            vector = self._vector(r.format, e)
            assert np.isfinite(vector).all(), "a vector holds NaN or infinity"
            norm = float(np.linalg.norm(vector))
            assert abs(norm - 1) < 1e-3 if normalize else norm > 0, f"norm {norm}"
            u = e.usage
            assert 0 < u.tokens <= self.limits.max_input_tokens
            assert u.truncated == (u.original_tokens > u.tokens)
            if length is not None:
                assert (u.tokens, u.original_tokens) == (min(length, self.limits.max_input_tokens), length)
        assert response.total_tokens == sum(e.usage.tokens for e in response.embeddings)

    def _vector(self, fmt: int, e: pb.Embedding) -> np.ndarray:
        if fmt == pb.EMBEDDING_FORMAT_FLOAT32_BYTES:
            assert not e.values and len(e.float32_le) == 4 * self.limits.dimensions
            return np.frombuffer(e.float32_le, dtype="<f4")
        assert not e.float32_le and len(e.values) == self.limits.dimensions
        return np.asarray(e.values, dtype=np.float32)

    def check_tokenize(self, r: pb.TokenizeRequest, response: pb.TokenizeResponse) -> None:
        truncate = r.truncate if r.HasField("truncate") else True
        assert len(response.tokens) == len(r.texts)
        encoded = self.tokenizer.encode(list(r.texts))
        for text, row, got in zip(r.texts, encoded.ids, response.tokens, strict=True):
            want = row if truncate else self.tokenizer.encode_full(text)
            assert list(got.ids) == want, f"{text!r}: ids {list(got.ids)[:8]}..., expected {want[:8]}..."
            assert got.usage.tokens == len(want)
