"""The generation workers' HTTP client: an httpx transport, without ``httpx.AsyncClient`` around it.

A worker sends one kind of request, a JSON POST, on one keep-alive connection, hundreds of
thousands of times in a run. ``AsyncClient`` spent more of the client's CPU on each than the
connection did: it merges the URL and the default headers, runs the auth, redirect and cookie
machinery, and reads the body through four wrappers (text decoding, content decoding, chunking,
timing), none of which a chat request needs. Here the request is an ``httpx.Request`` with its URL
parsed once per server, handed to the transport (:class:`.asyncio_network.AsyncioTransport`: one
httpcore connection and h11 on asyncio's transports), and the body is read as the transport's own
byte stream. Errors are httpx's, as before (the transport maps httpcore's). The log's "The client
without AsyncClient" (docs/benchmarks-log.md) measures it side by side.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Mapping
from typing import Any

import httpx
import pydantic_core

from expansion_dag.core import OversizedError, auth_headers
from expansion_dag.servers.transport.asyncio_network import asyncio_transport

_JSON = (b"Content-Type", b"application/json")
_Headers = list[tuple[bytes, bytes]]


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one TLS context, as httpx builds it by default (``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR`` honoured).

    Building one loads the CA bundle, ~20 ms of CPU, and httpx builds one for every client or
    ``httpx.get`` not given ``verify``: a shard's start-up (health checks, probes, the engine) built
    dozens, 9% of a shard process's CPU in a 10,000-prompt rehearsal.
    """
    return httpx.create_ssl_context()


class HttpClient:
    """JSON POSTs and GETs over one transport; ``async with`` closes its connections."""

    def __init__(self, transport: httpx.AsyncBaseTransport, *, timeout: httpx.Timeout, api_key: str | None = None):
        self._transport = transport
        self._extensions = {"timeout": timeout.as_dict()}
        self._api_key = api_key
        self._targets: dict[str, tuple[httpx.URL, _Headers, _Headers]] = {}

    def _target(self, url: str) -> tuple[httpx.URL, _Headers, _Headers]:
        """``url`` parsed once per server, the headers every POST to it carries, and its
        authorization (``core.auth_headers``: a URL's credentials, or the API key) alone."""
        target = self._targets.get(url)
        if target is None:
            parsed = httpx.URL(url)
            auth = [(k.encode(), v.encode()) for k, v in auth_headers(url, self._api_key).items()]
            target = self._targets[url] = (parsed, [(b"Host", parsed.netloc), _JSON, *auth], auth)
        return target

    async def post(self, url: str, body: Mapping[str, Any]) -> httpx.Response:
        """POST ``body`` as JSON: the response with its headers read and its body not yet.

        The caller reads the body (``response.stream`` for the raw bytes as they come, or
        :func:`read_body`) and closes it: a body left unread closes the connection.
        """
        # What httpx's ``json=`` sends (compact UTF-8), by pydantic's Rust encoder: a sixth of
        # ``json.dumps``'s CPU on prompts with non-ASCII text.
        content = pydantic_core.to_json(body)
        target, headers, _ = self._target(url)
        # The body as a stream, with the headers httpx would add (Host, Content-Length) given here:
        # with ``content=``, httpx looks each one up in the headers and rebuilds them, CPU a plain
        # request can spare (BENCHMARKS.md, "Plain and streamed requests side by side").
        request = httpx.Request(
            "POST",
            target,
            headers=[*headers, (b"Content-Length", b"%d" % len(content))],
            stream=httpx.ByteStream(content),
            extensions=self._extensions,
        )
        return await self._transport.handle_async_request(request)

    async def get(self, url: str, *, timeout_s: float) -> httpx.Response:
        """GET ``url`` within ``timeout_s``: the response, its body read."""
        target, _, auth = self._target(url)
        request = httpx.Request("GET", target, headers=auth, extensions={"timeout": httpx.Timeout(timeout_s).as_dict()})
        response = await self._transport.handle_async_request(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def read_body(response: httpx.Response, *, limit: int | None = None) -> bytes:
    """The whole body as the transport's byte stream gives it, left for the caller to close;
    OversizedError once it passes ``limit`` bytes (the rest left unread: closing the response
    closes the connection).

    What ``aread`` returns, without its four wrappers: no content decoding is needed, since the
    client sends no ``Accept-Encoding``.
    """
    chunks, size = [], 0
    async for chunk in response.stream:
        size += len(chunk)
        if limit is not None and size > limit:
            raise OversizedError(f"the body passed {limit:,} bytes, more than its request allows: stopped", status=200)
        chunks.append(chunk)
    return b"".join(chunks)


def make_client(
    *,
    timeout_s: float,
    connect_timeout_s: float,
    tls: ssl.SSLContext | None = None,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> HttpClient:
    """One worker's client: a single keep-alive connection (:class:`.asyncio_network.OneConnection`
    behind :class:`.asyncio_network.AsyncioTransport`).

    ``tls``: the process's shared context (:func:`tls_context`) unless given (tests trusting their
    own certificate). The connection runs on asyncio's own transports (:mod:`.asyncio_network`)
    unless ``transport`` is given (tests).
    """
    return HttpClient(
        transport or asyncio_transport(tls=tls or tls_context()),
        timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s, pool=None),
        api_key=api_key,
    )
