"""Request bodies of the REST API, and their strict decoding.

Bodies are decoded by msgspec in *strict* mode (``"5"`` is not an int, ``1``
is not a bool, unknown fields are refused) — stricter than the framework's own
conversion, which is why :func:`decode` re-reads the raw body: the framework
still parses the declared ``data`` type first, which is what puts each body's
schema in the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec
from litestar import Request

from maasd.errors import InvalidRequest
from maasd.models import Bytes, Name, NodeId, PoolSpec
from maasd.service import ReserveRequest

T = TypeVar("T")


class TenantBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: Name
    quota_bytes: Bytes


class QuotaBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    quota_bytes: Bytes


class PinBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    numa_node: NodeId


class RenewBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ttl_s: Annotated[int, msgspec.Meta(ge=1, le=2**31)]


LookupKey = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


class LookupBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    keys: Annotated[list[LookupKey], msgspec.Meta(min_length=1, max_length=256)]


class Status(msgspec.Struct, frozen=True):
    status: str


_decoders: dict[type, msgspec.json.Decoder] = {
    t: msgspec.json.Decoder(t)
    for t in (TenantBody, QuotaBody, PinBody, RenewBody, LookupBody, PoolSpec, ReserveRequest)
}


async def decode(request: Request, kind: type[T]) -> T:
    """Strictly decode the JSON body of ``request`` as ``kind``; InvalidRequest otherwise."""
    media = request.content_type[0]
    if media != "application/json":
        raise InvalidRequest(f"expected an application/json body, got {media or 'no content type'}")
    raw = await request.body()
    try:
        return _decoders[kind].decode(raw)
    except msgspec.ValidationError as e:
        raise InvalidRequest(str(e)) from e
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"malformed JSON: {e}") from e
