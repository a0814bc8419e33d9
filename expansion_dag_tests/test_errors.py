"""The one place httpx exceptions become the project's errors (server answers: test_server_api.py)."""

import httpx
import pytest

from expansion_dag import errors


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (httpx.ConnectError("refused"), errors.ConnectError),
        (httpx.RemoteProtocolError("server disconnected"), errors.ConnectError),
        (httpx.ReadError("reset"), errors.ConnectError),
        (httpx.WriteError("broken pipe"), errors.ConnectError),
        (httpx.ReadTimeout("read"), errors.TimeoutError_),
        (httpx.ConnectTimeout("connect"), errors.TimeoutError_),
        (httpx.PoolTimeout("pool"), errors.TimeoutError_),
        (httpx.ProxyError("proxy"), errors.TransientError),
        (httpx.UnsupportedProtocol("ftp"), errors.RejectedError),
        (httpx.LocalProtocolError("bad header"), errors.RejectedError),
        (httpx.DecodingError("gzip"), errors.RejectedError),
        (httpx.TooManyRedirects("loop"), errors.RejectedError),
    ],
)
def test_every_httpx_exception_maps_to_a_specific_error(exc, kind):
    error = errors.error_from_exception(exc)
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
        assert errors.error_from_exception(cls("x")).retryable, cls
