"""The app's request class: a client gone before its body was complete is an error of its own.

When the client hangs up (or :mod:`maasd.api.server` closes it at its body deadline)
while litestar reads the body, the ASGI server hands the app an ``http.disconnect``
message, and litestar raises a bare 500 :class:`~litestar.exceptions.InternalServerException`
— the same class as any fault of its own. :class:`BodyRequest` watches the messages
its body is read from and raises :class:`ClientGone` instead, so that the problem
mapping (:mod:`maasd.api.problems`) tells the two apart by type: nobody reads the
answer to a client gone, and it is no bug to log.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from litestar import Request
from litestar.exceptions import InternalServerException
from litestar.types import ReceiveMessage

__all__ = ["BodyRequest", "ClientGone"]


class ClientGone(InternalServerException):
    """The client went away before its request body was complete (a 500 nobody reads)."""

    def __init__(self) -> None:
        super().__init__("client disconnected before its body was complete")


class BodyRequest(Request[Any, Any, Any]):
    """litestar's :class:`~litestar.Request`, whose body stream raises :class:`ClientGone`
    when the read ends at the client's ``http.disconnect``."""

    __slots__ = ()

    async def stream(self) -> AsyncGenerator[bytes, None]:
        receive, gone = self.receive, False

        async def watched() -> ReceiveMessage:
            nonlocal gone
            message = await receive()
            gone = message["type"] == "http.disconnect"
            return message

        self.receive = watched
        try:
            async for chunk in super().stream():
                yield chunk
        except InternalServerException as e:
            if gone:
                raise ClientGone() from e
            raise
        finally:
            self.receive = receive
