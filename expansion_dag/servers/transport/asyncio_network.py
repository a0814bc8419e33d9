"""httpcore's network layer on asyncio's own transports, for the generation clients.

httpx's default async network layer goes through anyio. Per network read that costs a cancel scope
for the timeout, two ``sniffio`` lookups and a pause and a resume of the socket's reader (two
``epoll_ctl`` calls). A streamed answer is one read per event, so that layer was the largest part of
the client's own CPU per event (BENCHMARKS.md, "Client CPU of a streamed event, layer by layer":
187 us above a bare socket's, 110 us here). Here a read is a buffer slice when data is waiting,
else one future and, with a timeout, one timer handle.

A worker's one connection is held by :class:`OneConnection` instead of httpcore's pool, behind
:class:`AsyncioTransport`, an httpx transport of our own. Only public APIs are used: httpx's
``AsyncBaseTransport``, ``Request`` and ``Response``, httpcore's ``AsyncHTTP11Connection`` and
``AsyncNetworkBackend``. httpcore runs the connection and h11 parses HTTP; httpcore's exceptions
become httpx's, the ones the callers map. httpx's ``AsyncHTTPTransport`` takes neither a pool nor a
network backend, and swapping its private ``_pool`` costs no less (BENCHMARKS.md, "The network
layer through public APIs").
"""

from __future__ import annotations

import asyncio
import ssl
import typing
from collections.abc import Iterable

import httpcore
import httpx

#: Past this many unread bytes the socket stops being read until the reader catches up.
_READ_HIGH_WATER = 1 << 20


class _Protocol(asyncio.Protocol):
    """Received bytes wait in a buffer; at most one reader waits for more."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.drained: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _READ_HIGH_WATER and self.transport is not None and self.transport.is_reading():
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = exc
        self._wake()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def _expire(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, transport: asyncio.Transport, protocol: _Protocol):
        self._transport = transport
        self._protocol = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        p = self._protocol
        if not p.buffer and not p.eof:
            loop = asyncio.get_running_loop()
            p.waiter = loop.create_future()
            timer = None if timeout is None else loop.call_later(timeout, _expire, p.waiter)
            try:
                await p.waiter
            except TimeoutError as exc:
                raise httpcore.ReadTimeout(f"no data in {timeout} s") from exc
            finally:
                p.waiter = None
                if timer is not None:
                    timer.cancel()
        if p.buffer:
            data = bytes(p.buffer[:max_bytes])
            del p.buffer[:max_bytes]
            if len(p.buffer) < _READ_HIGH_WATER // 4 and not self._transport.is_reading():
                self._transport.resume_reading()
            return data
        if p.error is not None:
            raise httpcore.ReadError(str(p.error) or type(p.error).__name__) from p.error
        return b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        if self._transport.is_closing():
            raise httpcore.WriteError("the connection is closed")
        self._transport.write(buffer)
        drained = self._protocol.drained
        if drained is not None:
            try:
                await asyncio.wait_for(asyncio.shield(drained), timeout)
            except asyncio.TimeoutError as exc:
                raise httpcore.WriteTimeout(f"could not send in {timeout} s") from exc

    async def aclose(self) -> None:
        self._transport.close()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        try:
            transport = await asyncio.wait_for(
                loop.start_tls(self._transport, self._protocol, ssl_context, server_hostname=server_hostname),
                timeout,
            )
        except asyncio.TimeoutError as exc:
            self._transport.close()
            raise httpcore.ConnectTimeout(f"TLS handshake took over {timeout} s") from exc
        except (OSError, ssl.SSLError) as exc:
            self._transport.close()
            raise httpcore.ConnectError(str(exc)) from exc
        if transport is None:
            raise httpcore.ConnectError("the connection closed during the TLS handshake")
        # The protocol now hears from the TLS transport (start_tls does not call connection_made):
        # its read pauses must go to that one, which the reads resume.
        self._protocol.transport = typing.cast(asyncio.Transport, transport)
        return AsyncioStream(self._protocol.transport, self._protocol)

    def get_extra_info(self, info: str) -> typing.Any:
        # What httpcore asks of a stream: the TLS object (HTTP/2 negotiation) and, of an idle
        # kept-alive connection, whether it is readable: anything received, or the close, means
        # the server is done with it. The protocol has already read what the socket held.
        if info == "ssl_object":
            return self._transport.get_extra_info("ssl_object")
        if info == "is_readable":
            p = self._protocol
            return bool(p.buffer) or p.eof or self._transport.is_closing()
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """TCP only: :class:`OneConnection` asks it for nothing else."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        loop = asyncio.get_running_loop()
        local = None if local_address is None else (local_address, 0)
        try:
            # asyncio sets TCP_NODELAY on its TCP sockets, as anyio does.
            transport, protocol = await asyncio.wait_for(
                loop.create_connection(_Protocol, host, port, local_addr=local), timeout
            )
        except asyncio.TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"could not connect in {timeout} s") from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        for option in socket_options or ():
            transport.get_extra_info("socket").setsockopt(*option)
        return AsyncioStream(transport, protocol)


class OneConnection:
    """A worker's one keep-alive HTTP/1.1 connection, in place of httpcore's connection pool.

    A worker sends one request at a time on one connection, so a pool has nothing to choose; yet
    httpcore's pool takes a lock, shields a cancellation and walks its connections twice on every
    request and again when each response closes: 15-18% of the engine's CPU per streamed request
    (docs/benchmarks-log.md, "The client without AsyncClient"). Here the connection is reused while
    it is idle, unexpired and to the same origin, and replaced otherwise, as the pool does for a pool
    of one: a server that closed it while idle, a body left unread (a stopped loop) or a request to
    another server (the spill loop's load polls) opens a new one.
    """

    def __init__(self, *, tls: ssl.SSLContext, keepalive_expiry: float | None):
        self._tls = tls
        self._keepalive_expiry = keepalive_expiry
        self._backend = AsyncioBackend()
        self._connection: httpcore.AsyncHTTP11Connection | None = None

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        connection = self._connection
        if connection is not None and not (
            connection.is_available()
            and not connection.has_expired()
            and connection.can_handle_request(request.url.origin)
        ):
            self._connection = None
            await connection.aclose()
            connection = None
        if connection is None:
            connection = self._connection = await self._connect(request)
        return await connection.handle_async_request(request)

    async def _connect(self, request: httpcore.Request) -> httpcore.AsyncHTTP11Connection:
        origin = request.url.origin
        host = origin.host.decode("ascii")
        timeout = request.extensions.get("timeout", {}).get("connect")
        stream = await self._backend.connect_tcp(host, origin.port, timeout=timeout)
        if origin.scheme == b"https":
            self._tls.set_alpn_protocols(["http/1.1"])
            stream = await stream.start_tls(self._tls, server_hostname=host, timeout=timeout)
        return httpcore.AsyncHTTP11Connection(origin=origin, stream=stream, keepalive_expiry=self._keepalive_expiry)

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.aclose()


#: httpcore's exceptions and httpx's for each: httpx's own table (``map_httpcore_exceptions``) is private.
_ERRORS: dict[type[Exception], type[httpx.TransportError]] = {
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.TimeoutException: httpx.TimeoutException,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.NetworkError: httpx.NetworkError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
    httpcore.ProtocolError: httpx.ProtocolError,
    httpcore.ProxyError: httpx.ProxyError,
    httpcore.UnsupportedProtocol: httpx.UnsupportedProtocol,
}
_HTTPCORE_ERRORS = tuple(_ERRORS)


def _httpx_error(exc: Exception) -> httpx.TransportError:
    """httpx's exception for one of httpcore's: its nearest mapped ancestor's, the same message."""
    return next(_ERRORS[cls] for cls in type(exc).__mro__ if cls in _ERRORS)(str(exc))


class _Body(httpx.AsyncByteStream):
    """httpcore's response body as httpx's byte stream: a failed read raises httpx's error, and
    closing it closes httpcore's response (a body left unread closes the connection)."""

    def __init__(self, response: httpcore.Response):
        self._response = response

    async def __aiter__(self) -> typing.AsyncIterator[bytes]:
        try:
            async for chunk in typing.cast(typing.AsyncIterable[bytes], self._response.stream):
                yield chunk
        except _HTTPCORE_ERRORS as exc:
            raise _httpx_error(exc) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class AsyncioTransport(httpx.AsyncBaseTransport):
    """An httpx transport that sends each request on ``connection``: :class:`OneConnection` in the
    product, httpcore's ``AsyncConnectionPool`` in the benchmark beside it."""

    def __init__(self, connection: OneConnection | httpcore.AsyncConnectionPool):
        self._connection = connection

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        sent = httpcore.Request(
            request.method,
            httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw,
            content=typing.cast(httpx.AsyncByteStream, request.stream),
            extensions=request.extensions,  # the per-phase timeouts among them
        )
        try:
            response = await self._connection.handle_async_request(sent)
        except _HTTPCORE_ERRORS as exc:
            raise _httpx_error(exc) from exc
        return httpx.Response(
            response.status, headers=response.headers, stream=_Body(response), extensions=response.extensions
        )

    async def aclose(self) -> None:
        await self._connection.aclose()


def asyncio_transport(*, tls: ssl.SSLContext, keepalive_expiry: float | None = 5.0) -> AsyncioTransport:
    """A worker's transport: one connection (:class:`OneConnection`) over asyncio's transports."""
    return AsyncioTransport(OneConnection(tls=tls, keepalive_expiry=keepalive_expiry))
