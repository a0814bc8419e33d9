"""A lean HTTP/1.1 server protocol: asyncio transports with h11 doing the parsing.

Chosen over uvicorn + starlette by measurement (see the package docstring): one request costs a
fraction of the CPU, which matters when one process simulates a whole fleet. h11 (a dependency of
httpx) keeps the protocol correct: keep-alive, Content-Length and chunked bodies, pipelining.

A handler receives each complete request with its connection and answers with
:meth:`HttpConnection.respond`, at once or later. Until it answers, it may set
:attr:`HttpConnection.on_abort`, which is called if the client goes away first. A streamed answer
is :meth:`HttpConnection.start_stream`, any number of :meth:`HttpConnection.send_event`, then
:meth:`HttpConnection.end_stream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
from collections.abc import Callable

import h11

logger = logging.getLogger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_INTERNAL_ERROR = b'{"detail":"Internal Server Error"}'


class HttpRequest:
    __slots__ = ("method", "path", "headers", "body")

    def __init__(self, method: str, path: str, headers: dict[bytes, bytes], body: bytes) -> None:
        self.method = method
        self.path = path  # without the query string
        self.headers = headers  # lower-cased names
        self.body = body


Handler = Callable[[HttpRequest, "HttpConnection"], None]


class HttpConnection(asyncio.Protocol):
    """One client connection; registers itself in ``connections`` while open."""

    def __init__(self, handler: Handler, connections: set[HttpConnection]) -> None:
        self._handler = handler
        self._connections = connections
        self._h11 = h11.Connection(h11.SERVER)
        self._transport: asyncio.Transport | None = None
        self._request: h11.Request | None = None
        self._body: list[bytes] = []
        self._awaiting_response = False
        self._processing = False
        self.on_abort: Callable[[], None] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._connections.add(self)

    def data_received(self, data: bytes) -> None:
        self._h11.receive_data(data)
        self._process()

    def eof_received(self) -> None:
        # A client that half-closes has gone away: returning None closes the transport, and
        # connection_lost aborts whatever it was waiting for.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self._transport = None
        on_abort, self.on_abort = self.on_abort, None
        if on_abort is not None:
            on_abort()

    # for handlers and the server

    def respond(self, status: int, body: bytes = b"") -> None:
        """Send the answer (JSON, or empty) to the current request; a no-op once the client is gone."""
        self.on_abort = None
        if self._transport is None:
            return
        headers = [("content-length", str(len(body)))]
        if body:
            headers.append(("content-type", "application/json"))
        conn = self._h11
        data = conn.send(h11.Response(status_code=status, headers=headers, reason=_REASONS.get(status, b"")))
        if body:
            data += conn.send(h11.Data(data=body))
        data += conn.send(h11.EndOfMessage())
        self._transport.write(data)
        self._next_cycle()

    def start_stream(self, status: int = 200) -> None:
        """Send the head of a streamed answer (server-sent events, chunked); events follow."""
        if self._transport is None:
            return
        head = h11.Response(
            status_code=status, headers=[("content-type", "text/event-stream")], reason=_REASONS.get(status, b"")
        )
        self._transport.write(self._h11.send(head))

    def send_event(self, data: bytes) -> None:
        """One piece of a streamed answer; a no-op once the client is gone."""
        if self._transport is not None:
            self._transport.write(self._h11.send(h11.Data(data=data)))

    def end_stream(self) -> None:
        """End a streamed answer."""
        self.on_abort = None
        if self._transport is None:
            return
        self._transport.write(self._h11.send(h11.EndOfMessage()))
        self._next_cycle()

    def _next_cycle(self) -> None:
        conn = self._h11
        self._awaiting_response = False
        if conn.our_state is h11.MUST_CLOSE:
            self._transport.close()
            return
        conn.start_next_cycle()
        if not self._processing:
            self._process()  # a pipelined request may already be buffered

    def drop(self) -> None:
        """Cut the connection like a dying server: reset, unless an answer is still being flushed."""
        if self._transport is None:
            return
        if self._transport.get_write_buffer_size():
            self._transport.close()
        else:
            self._transport.abort()

    # internals

    def _process(self) -> None:
        self._processing = True
        try:
            while self._transport is not None and not self._awaiting_response:
                try:
                    event = self._h11.next_event()
                except h11.RemoteProtocolError as exc:
                    self._reject(exc)
                    return
                kind = type(event)
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return
                if kind is h11.Request:
                    self._request = event
                    self._body = []
                elif kind is h11.Data:
                    self._body.append(event.data)
                elif kind is h11.EndOfMessage:
                    self._awaiting_response = True
                    self._dispatch()
                elif kind is h11.ConnectionClosed:
                    self._transport.close()
                    return
        finally:
            self._processing = False

    def _dispatch(self) -> None:
        event = self._request
        target = event.target
        query = target.find(b"?")
        path = (target if query < 0 else target[:query]).decode("latin-1")
        request = HttpRequest(event.method.decode("ascii"), path, dict(event.headers), b"".join(self._body))
        self._request = None
        self._body = []
        try:
            self._handler(request, self)
        except Exception:
            logger.exception("simulator handler failed on %s %s", request.method, path)
            if self._awaiting_response:
                self.respond(500, _INTERNAL_ERROR)

    def _reject(self, exc: h11.RemoteProtocolError) -> None:
        if self._h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            status = exc.error_status_hint
            # The connection state may no longer allow an answer; closing is all that is left then.
            with contextlib.suppress(h11.LocalProtocolError):
                head = h11.Response(
                    status_code=status, headers=[("content-length", "0")], reason=_REASONS.get(status, b"")
                )
                self._transport.write(self._h11.send(head) + self._h11.send(h11.EndOfMessage()))
        self._transport.close()
