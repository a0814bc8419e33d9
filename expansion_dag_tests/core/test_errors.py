"""The one place httpx exceptions become the project's errors (server answers: test_server_api.py)."""

import httpx
import pytest

from expansion_dag import core


#: The project's error each httpx exception must become.
BECOMES = {
    core.ConnectError: (
        httpx.ConnectError("refused"), httpx.RemoteProtocolError("server disconnected"),
        httpx.ReadError("reset"), httpx.WriteError("broken pipe"),
    ),
    core.TimeoutError_: (httpx.ReadTimeout("read"), httpx.ConnectTimeout("connect"), httpx.PoolTimeout("pool")),
    core.TransientError: (httpx.ProxyError("proxy"),),
    core.RejectedError: (
        httpx.UnsupportedProtocol("ftp"), httpx.LocalProtocolError("bad header"),
        httpx.DecodingError("gzip"), httpx.TooManyRedirects("loop"),
    ),
}


@pytest.mark.parametrize(
    ("exc", "kind"),
    [pytest.param(exc, kind, id=type(exc).__name__) for kind, excs in BECOMES.items() for exc in excs],
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
