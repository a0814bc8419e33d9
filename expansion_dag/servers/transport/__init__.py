"""The project's HTTP: httpx's own clients, built in one place so that every request shares the
process's TLS context and carries its server's credentials.

The generation workers send through ``httpx.AsyncClient`` on httpx's own transport: at the reference
rate (8 x 72 slots, ~3.4 requests a second fleet-wide) the client spends a few percent of one core
(BENCHMARKS.md, "Client CPU of a streamed event"), so an HTTP stack of the project's own would buy
nothing a user sees.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Generator

import httpx

from expansion_dag.core import OversizedError, auth_headers

__all__ = ["async_client", "client", "read_body", "tls_context"]


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one TLS context, as httpx builds it by default (``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR`` honoured).

    Building one loads the CA bundle, ~20 ms of CPU, and httpx builds one for every client not given
    ``verify``: a shard's start-up (health checks, probes, a client per worker) would build dozens.
    """
    return httpx.create_ssl_context()


class _ServerAuth(httpx.Auth):
    """Each request's ``Authorization`` as ``core.auth_headers`` gives it for the URL it goes to: the
    credentials its server's configured URL carried, else the API key."""

    def __init__(self, api_key: str | None):
        self._api_key = api_key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.update(auth_headers(str(request.url), self._api_key))
        yield request


def _settings(timeout_s: float, connect_timeout_s: float | None, api_key: str | None, tls: ssl.SSLContext | None):
    return {
        "timeout": httpx.Timeout(timeout_s, connect=timeout_s if connect_timeout_s is None else connect_timeout_s, pool=None),
        "verify": tls or tls_context(),
        "auth": _ServerAuth(api_key),
    }


def async_client(
    *,
    timeout_s: float,
    connect_timeout_s: float | None = None,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """A client for the servers: ``timeout_s`` for each read (an event of a streamed answer),
    ``tls`` the process's context unless given (tests trusting their own certificate), ``transport``
    httpx's own unless given (tests)."""
    return httpx.AsyncClient(transport=transport, **_settings(timeout_s, connect_timeout_s, api_key, tls))


def client(
    *, timeout_s: float, connect_timeout_s: float | None = None, api_key: str | None = None
) -> httpx.Client:
    """:func:`async_client`'s twin for the probes and health checks that block."""
    return httpx.Client(**_settings(timeout_s, connect_timeout_s, api_key, None))


async def read_body(response: httpx.Response, *, limit: int) -> bytes:
    """The whole body, left for the caller to close; OversizedError once it passes ``limit`` bytes
    (the rest left unread: closing the response closes the connection)."""
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise OversizedError(f"the body passed {limit:,} bytes, more than its request allows: stopped", status=200)
        chunks.append(chunk)
    return b"".join(chunks)
