"""ASGI pieces under the routes: the gate (API key, status counting, no traceback to clients), the event-stream
response, and the race between a request's work and its client hanging up."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from specter.log import get_logger
from specter.server.admission import Ticket
from specter.server.metrics import ServerMetrics
from specter.server.protocol import APIRequestError

log = get_logger(__name__)

T = TypeVar("T")
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
CLIENT_GONE = 499  # nginx's status for "the client closed the request"; never sent, only counted


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


async def send_json(send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw, "more_body": False})


class Gate:
    """Outermost middleware: bearer-token check on /v1/*, responses counted by status, unexpected errors logged
    once and answered with a bare 500 (clients never see a traceback). Pure ASGI, so streams pass untouched."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, api_key: str | None,
                 on_close: Callable[[], None] | None = None) -> None:
        self.app, self.metrics = app, metrics
        if api_key is not None and not api_key.strip():
            raise ValueError("the API key must not be empty or blank; pass None to serve without one")
        self._key = api_key.encode() if api_key is not None else None
        self._on_close = on_close

    def close(self) -> None:
        """Release what the routes hold beyond a request (the prompt encoder's thread); the server has stopped."""
        if self._on_close is not None:
            self._on_close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = "/v1/models" if scope["path"].startswith("/v1/models/") else scope["path"]  # one model's card
        endpoint = path if path in ENDPOINTS else "other"
        status = CLIENT_GONE

        async def counted(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self._key is not None and scope["path"].startswith("/v1/") and not self._authorized(scope):
                error = APIRequestError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                                        type="authentication_error", code="invalid_api_key")
                await send_json(counted, error.status, error.body(), {"www-authenticate": "Bearer"})
            else:
                await self.app(scope, receive, counted)
        except Exception:
            log.exception("server.internal_error", path=scope["path"])
            if status == CLIENT_GONE:  # nothing sent yet: answer, without the traceback
                error = APIRequestError(500, "internal server error; the server logged the cause", type="server_error")
                await send_json(counted, 500, error.body())
        finally:
            self.metrics.response(endpoint, status)

    def _authorized(self, scope: Scope) -> bool:
        # The scheme is case-insensitive (RFC 9110, section 11.1), the key exact.
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._key or b"")


async def until_hangup(receive: Receive) -> None:
    """Returns when the client disconnects. Called after the body is read, so any message left is the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_hangup(work: Awaitable[T], receive: Receive) -> T:
    """`work`'s result, or ClientGone the moment the client hangs up, with `work` cancelled and unwound.

    Plain asyncio cancellation, not an anyio cancel scope: the request's cleanup (giving the engine back)
    awaits, and inside a cancelled anyio scope every such await would be cancelled again.
    """
    job = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(until_hangup(receive))
    try:
        await asyncio.wait({job, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        job.cancel()  # a no-op when it is done
        await asyncio.gather(job, hangup, return_exceptions=True)
    if job.cancelled():
        raise ClientGone()
    return job.result()  # (the engine's OSError is its own failure, not a hang-up: only a write says that, `_write`)


class NoResponse:
    """What a handler returns when the client has gone: there is no one to answer."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return None


class EventStream:
    """A server-sent-event response from an async iterator of encoded events; the ticket is given back at the end
    whatever happens (finished, client gone, shutdown), so the queue never keeps a dead request's place.

    The events are drawn by a task of their own into a buffer the writes drain: the request holds the engine's turn
    while it generates, not while its client reads, so a client that stops reading (a full socket) keeps only its
    connection and its answer's bytes, never the requests behind it. A hang-up still cancels the generation."""

    def __init__(self, events: AsyncIterator[bytes], ticket: Ticket) -> None:
        self.events, self.ticket = events, ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await unless_hangup(self._produce(send), receive)
        except ClientGone:
            log.debug("server.client_gone", path=scope["path"])
        finally:
            self.ticket.close()

    async def _produce(self, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]  # proxies must not hold pieces back
        await _write(send, {"type": "http.response.start", "status": 200, "headers": headers})
        buffer: asyncio.Queue[bytes | None] = asyncio.Queue()  # unbounded: at most one answer's events
        drawing = asyncio.ensure_future(self._draw(buffer))
        try:
            while (event := await buffer.get()) is not None:
                await _write(send, {"type": "http.response.body", "body": event, "more_body": True})
            await drawing  # the events' own error, if they ended on one
        finally:
            drawing.cancel()  # a no-op when done; else the client went or the server stops: the generation ends
            await asyncio.gather(drawing, return_exceptions=True)
        await _write(send, {"type": "http.response.body", "body": b"", "more_body": False})

    async def _draw(self, buffer: asyncio.Queue[bytes | None]) -> None:
        try:
            async with contextlib.aclosing(self.events) as events:
                async for event in events:
                    buffer.put_nowait(event)
        finally:
            buffer.put_nowait(None)


async def _write(send: Send, message: dict[str, Any]) -> None:
    """`send`, where an OSError says the client closed the socket (servers other than uvicorn's HTTP/1.1, which
    drops a write to a closed connection, raise one)."""
    try:
        await send(message)
    except OSError as error:
        raise ClientGone() from error


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
