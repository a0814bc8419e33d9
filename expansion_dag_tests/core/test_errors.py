"""The one place httpx exceptions become the project's errors (server answers: test_server_api.py)."""

import httpx
import pytest

from expansion_dag import core


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (httpx.ConnectError("refused"), core.ConnectError),
        (httpx.RemoteProtocolError("server disconnected"), core.ConnectError),
        (httpx.ReadError("reset"), core.ConnectError),
        (httpx.WriteError("broken pipe"), core.ConnectError),
        (httpx.ReadTimeout("read"), core.TimeoutError_),
        (httpx.ConnectTimeout("connect"), core.TimeoutError_),
        (httpx.PoolTimeout("pool"), core.TimeoutError_),
        (httpx.ProxyError("proxy"), core.TransientError),
        (httpx.UnsupportedProtocol("ftp"), core.RejectedError),
        (httpx.LocalProtocolError("bad header"), core.RejectedError),
        (httpx.DecodingError("gzip"), core.RejectedError),
        (httpx.TooManyRedirects("loop"), core.RejectedError),
    ],
)
def test_every_httpx_exception_maps_to_a_specific_error(exc, kind):
    error = core.error_from_exception(exc)
    assert type(error) is kind
    assert type(exc).__name__ in error.message


def test_every_httpx_transport_error_but_our_own_malformed_request_is_retryable():
    # A new httpx transport error class must not silently become a permanent failure.
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    for cls in subclasses(httpx.TransportError):
        if issubclass(cls, (httpx.UnsupportedProtocol, httpx.LocalProtocolError)):
            continue
        assert core.error_from_exception(cls("x")).retryable, cls
