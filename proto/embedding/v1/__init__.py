"""embedding.v1, the API. The modules beside this file are generated from embedding.proto by `make proto`.

SERVICE_NAME is read from the proto's descriptor, so the server (health, auth), the client (its
service config) and the tests all use the name the proto declares.
"""

import re

from minilm_embed.proto.embedding.v1 import embedding_pb2 as _pb

SERVICE_NAME: str = _pb.DESCRIPTOR.services_by_name["EmbeddingService"].full_name
# What the token in `authorization: Bearer <token>` may be: an HTTP/2 header value (RFC 9113 8.2.1),
# printable ASCII with spaces only inside. The server refuses another at start, the client at once.
BEARER_TOKEN = re.compile(r"[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?")
