"""httpcore's network layer on asyncio's own transports, for the generation clients.

httpx's default async network layer goes through anyio. Per network read that costs a cancel scope
for the timeout, two ``sniffio`` lookups and a pause and a resume of the socket's reader (two
``epoll_ctl`` calls). A streamed answer is one read per event, so that layer was the largest part of
the client's own CPU per event (BENCHMARKS.md, "Client CPU of a streamed event, layer by layer":
187 us above a bare socket's, 110 us here). Here a read is a buffer slice when data is waiting,
else one future and, with a timeout, one timer handle.

Only the network layer changes: httpx builds the request, httpcore runs the connection pool and
h11 parses HTTP, exactly as before, and their exceptions are the ones the callers already map.
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
    """TCP only: :func:`asyncio_transport` builds its pool without ``uds`` or ``retries``, so
    httpcore never asks it for a unix socket or a sleep."""

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


def asyncio_transport(*, tls: ssl.SSLContext, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's own transport, its connection pool on :class:`AsyncioBackend`.

    httpx takes no network backend, so the pool it built is replaced by the same pool with one:
    ``AsyncHTTPTransport._pool`` (httpx 0.27 and 0.28; a test checks the backend is the one used).
    """
    transport = httpx.AsyncHTTPTransport(verify=tls, limits=limits)
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=tls,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=AsyncioBackend(),
    )
    return transport
