"""Request bodies, decoded once and strictly — and documented as they are decoded.

litestar parses a body in two lenient steps (JSON to builtins, then a
``strict=False`` conversion in which ``"5"`` passes as an int). A DTO is the
framework's hook for taking over both: when a handler's ``data`` has a DTO,
litestar hands it the raw bytes (:meth:`StrictBody.decode_bytes`), trusts what
it returns, and asks it for the body's OpenAPI schema
(:meth:`StrictBody.create_openapi_schema`). :class:`StrictBodies` attaches that
DTO to every ``data`` whose type is a ``forbid_unknown_fields`` Struct, so a
handler only declares ``data: ReserveBody``.

The decode is one :class:`msgspec.json.Decoder` call in strict mode: a wrong
type, a bound, an unknown field each give a 400 whose ``detail`` is msgspec's
own message (``Expected `int`, got `str` - at `$.size_bytes```). A body that is
not ``application/json`` is a 400 as well.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Generator, Iterator
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import msgspec
from litestar.dto import AbstractDTO, DTOConfig
from litestar.openapi.spec import Reference, Schema
from litestar.plugins import SerializationPlugin
from litestar.typing import FieldDefinition

from maasd import bounds
from maasd.errors import InvalidRequest

if TYPE_CHECKING:
    from litestar import Request
    from litestar._openapi.schema_generation import SchemaCreator
    from litestar.dto._backend import DTOBackend
    from litestar.dto.data_structures import DTOFieldDefinition

__all__ = ["JSON", "StrictBodies", "StrictBody", "decode", "is_strict_body", "media_type"]

T = TypeVar("T")

JSON = "application/json"

#: msgspec constraint → OpenAPI keyword.
_BOUNDS = (
    ("gt", "exclusive_minimum"),
    ("ge", "minimum"),
    ("lt", "exclusive_maximum"),
    ("le", "maximum"),
)


_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def _decoder(kind: type[Any]) -> msgspec.json.Decoder[Any]:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    return decoder


def decode(raw: bytes, kind: type[T]) -> T:
    """``raw`` strictly decoded as ``kind``; :class:`InvalidRequest` (400) otherwise.

    The decoder is typed all the way down, so a deeply nested document is
    refused at the first value of the wrong type; should a decoder ever run out
    of stack, the ``RecursionError`` here can only mean the nesting of ``raw``.

    >>> from maasd.api.schemas import RenewBody
    >>> decode(b'{"ttl_s": 60}', RenewBody).ttl_s
    60
    >>> decode(b'{"ttl_s": "60"}', RenewBody)
    Traceback (most recent call last):
    ...
    maasd.errors.InvalidRequest: Expected `int`, got `str` - at `$.ttl_s`
    """
    try:
        result: T = _decoder(kind).decode(raw)
    except msgspec.ValidationError as e:
        raise InvalidRequest(bounds.explain(str(e))) from None
    except msgspec.DecodeError as e:
        raise InvalidRequest(f"malformed JSON: {_decode_error(raw, e)}") from None
    except RecursionError:
        raise InvalidRequest("malformed JSON: the body is nested too deeply") from None
    _refuse_repeated_names(raw)
    return result


def _decode_error(raw: bytes, error: msgspec.DecodeError) -> str:
    """What is wrong with ``raw``, which msgspec refused with ``error``.

    msgspec calls a lone high surrogate escape (``"\\ud800"`` not followed by its low
    half) "Input data was truncated", which sends a client looking for a cut body; the
    standard library, which decodes such an escape, tells the two apart.

    >>> _decode_error(b'{"key": "\\ud800"}', msgspec.DecodeError("Input data was truncated"))
    'invalid utf-16 surrogate pair: a \\\\ud800-\\\\udbff escape without its low half'
    >>> _decode_error(b'{"key": "ab', msgspec.DecodeError("Input data was truncated"))
    'Input data was truncated'
    """
    said = str(error)
    if said != "Input data was truncated":
        return said
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return said
    return "invalid utf-16 surrogate pair: a \\ud800-\\udbff escape without its low half"


def media_type(request: Request[Any, Any, Any]) -> str:
    """The media type of ``request``'s one ``Content-Type`` ("" if none);
    :class:`InvalidRequest` if it is given twice, or names a charset other than UTF-8
    (RFC 8259: JSON between systems is UTF-8; another would be decoded as UTF-8 all
    the same, meaning something else to the client than to the daemon)."""
    if len(request.headers.getall("content-type", [])) > 1:
        raise InvalidRequest("the Content-Type header is given more than once")
    media, params = request.content_type
    charset = params.get("charset")
    if charset is not None and charset.strip('"').lower() not in ("utf-8", "utf8"):
        raise InvalidRequest(f"a JSON body is UTF-8 (RFC 8259), got charset={charset}")
    return media


def _repeated_name(pairs: list[tuple[str, Any]]) -> None:
    seen: set[str] = set()
    for name, _ in pairs:
        if name in seen:
            raise InvalidRequest(f"the field {name!r} given more than once")
        seen.add(name)


def _refuse_repeated_names(raw: bytes) -> None:
    """:class:`InvalidRequest` if an object of ``raw`` (a body msgspec decoded) names a
    field twice: msgspec, like most decoders, keeps the last value, so
    ``{"quota_bytes": 1, "quota_bytes": 99}`` meant 99 to the daemon and 1 to a proxy or
    a log that keeps the first (RFC 8259: such a document's meaning is unpredictable).

    A second parse, by the standard library (the body is ≤ 64 KiB, flat, and valid
    JSON by now); ``"`` twice is the least a repeated name needs, so most bodies of
    one field skip it.

    >>> _refuse_repeated_names(b'{"ttl_s": 60, "ttl_s": 1}')
    Traceback (most recent call last):
    ...
    maasd.errors.InvalidRequest: the field 'ttl_s' given more than once
    """
    if raw.count(b'"') < 4:
        return
    json.loads(raw, object_pairs_hook=_repeated_name)


def is_strict_body(kind: object) -> bool:
    """A request body type: a msgspec Struct that refuses unknown fields (or such a Struct
    ``| None``: the body of a route that takes none, :class:`maasd.api.schemas.NoBody`)."""
    members = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    structs = [m for m in members if m is not type(None)]
    return len(structs) == 1 and (
        isinstance(structs[0], type)
        and issubclass(structs[0], msgspec.Struct)
        and structs[0].__struct_config__.forbid_unknown_fields
    )


class StrictBody(AbstractDTO[T]):
    """The DTO of a strict body (``StrictBody[ReserveBody]``); it needs no transfer model.

    litestar's own DTOs build a transfer model and decode leniently through it;
    this one decodes straight into the Struct, so the backend machinery is unused.
    """

    config: ClassVar[DTOConfig] = DTOConfig()

    @classmethod
    def generate_field_definitions(
        cls,
        model_type: type[Any],  # noqa: ARG003 - the framework's signature
    ) -> Generator[DTOFieldDefinition, None, None]:
        yield from ()  # no transfer model

    @classmethod
    def detect_nested_field(cls, field_definition: FieldDefinition) -> bool:  # noqa: ARG003
        return False

    @classmethod
    def create_for_field_definition(
        cls,
        field_definition: FieldDefinition,
        handler_id: str,
        backend_cls: type[DTOBackend] | None = None,
    ) -> None:
        """Nothing to prepare: :func:`decode` works from the Struct type itself."""

    @classmethod
    def create_openapi_schema(
        cls,
        field_definition: FieldDefinition,  # noqa: ARG003 - the framework's signature
        handler_id: str,  # noqa: ARG003
        schema_creator: SchemaCreator,
    ) -> Reference | Schema:
        """The Struct's own schema, plus what the decoder enforces and the generator omits."""
        schema = schema_creator.for_field_definition(
            FieldDefinition.from_annotation(cls.model_type)
        )
        registry = schema_creator.schema_registry
        target = registry.from_reference(schema).schema if isinstance(schema, Reference) else schema
        for member in target.one_of or ():  # ``Body | None``: the Struct's own schema
            if isinstance(member, Reference):
                target = registry.from_reference(member).schema
        declare_strict(target, cls.model_type)
        return schema

    def decode_bytes(self, value: bytes) -> T:
        media = media_type(cast("Request[Any, Any, Any]", self.asgi_connection))
        if media != JSON:
            raise InvalidRequest(f"expected an {JSON} body, got {media or 'no content type'}")
        return decode(value, self.model_type)

    def decode_builtins(self, value: Any) -> T:
        try:
            result: T = msgspec.convert(value, self.model_type, strict=True)
        except msgspec.ValidationError as e:
            raise InvalidRequest(bounds.explain(str(e))) from None
        return result

    def data_to_encodable_type(self, data: Any) -> Any:
        return data


def declare_strict(schema: Schema, kind: type[Any]) -> None:
    """Make ``schema`` say what decoding ``kind`` enforces.

    Two rules of a body Struct are missing from the generated schema: unknown
    fields are refused (``additionalProperties: false``), and a bound of 0 is
    dropped (``gt=0`` on ``size_bytes``, ``ge=0`` on ``numa_node``). Without them a
    client generator or a fuzzer believes ``{"size_bytes": 0, "x": 1}`` valid.
    """
    info = msgspec.inspect.type_info(kind)
    if isinstance(info, msgspec.inspect.UnionType):  # ``Body | None``: a route that takes none
        info = next(t for t in info.types if isinstance(t, msgspec.inspect.StructType))
    assert isinstance(info, msgspec.inspect.StructType)
    schema.additional_properties = False
    for field in info.fields:
        prop = (schema.properties or {}).get(field.encode_name)
        if not isinstance(prop, Schema):
            continue
        for number in _numbers(field.type):
            for constraint, keyword in _BOUNDS:
                bound = getattr(number, constraint)
                if bound is not None and getattr(prop, keyword) is None:
                    setattr(prop, keyword, bound)


def _numbers(
    t: msgspec.inspect.Type,
) -> Iterator[msgspec.inspect.IntType | msgspec.inspect.FloatType]:
    if isinstance(t, msgspec.inspect.UnionType):
        for member in t.types:
            yield from _numbers(member)
    elif isinstance(t, msgspec.inspect.IntType | msgspec.inspect.FloatType):
        yield t


class StrictBodies(SerializationPlugin):
    """Gives every handler whose ``data`` is a strict body (:func:`is_strict_body`) its DTO."""

    def supports_type(self, field_definition: FieldDefinition) -> bool:
        return is_strict_body(field_definition.annotation)

    def create_dto_for_type(self, field_definition: FieldDefinition) -> type[AbstractDTO[Any]]:
        return _dto(field_definition.annotation)


@cache
def _dto(kind: type[Any]) -> type[StrictBody[Any]]:
    return StrictBody[kind]  # type: ignore[valid-type]
