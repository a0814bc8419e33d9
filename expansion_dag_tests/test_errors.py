"""The one place httpx errors and server answers become the project's errors."""

import httpx
import pytest

from expansion_dag import errors

SGLANG_OVERFLOW = (
    "Requested token count exceeds the model's maximum context length of 8192 tokens. You requested a total "
    "of 8227 tokens: 35 tokens from the input messages and 8192 tokens for the completion. Please reduce the "
    "number of tokens in the input messages or the completion to fit within the limit."
)


def sglang_error(message: str, status: int = 400) -> httpx.Response:
    body = {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": status}
    return httpx.Response(status, json=body)


def test_context_overflow_message_is_parsed_into_its_numbers():
    overflow = errors.parse_context_error(SGLANG_OVERFLOW)
    assert overflow == errors.ContextOverflow(
        context_length=8192, requested_total=8227, prompt_tokens=35, completion_tokens=8192
    )


def test_other_texts_are_not_taken_for_an_overflow():
    assert errors.parse_context_error("The request queue is full.") is None


def test_sglang_overflow_400_becomes_a_context_error_with_numbers():
    error = errors.error_from_response(sglang_error(SGLANG_OVERFLOW))
    assert isinstance(error, errors.ContextLengthError)
    assert not error.retryable
    assert error.overflow.prompt_tokens == 35
    assert error.status == 400


@pytest.mark.parametrize(
    "message",
    [
        "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
        "max_completion_tokens is too large: 9000.This model supports at most 8192 completion tokens.",
    ],
)
def test_context_errors_without_usable_numbers_are_context_errors_not_retried(message):
    error = errors.error_from_response(sglang_error(message))
    assert isinstance(error, errors.ContextLengthError)
    assert error.overflow is None


def test_vllm_nested_error_body_gives_its_message():
    response = httpx.Response(
        400,
        json={"error": {"message": "max_tokens=9000 cannot be greater than max_model_len=8192. x", "code": 400}},
    )
    error = errors.error_from_response(response)
    assert isinstance(error, errors.ContextLengthError)
    assert "max_model_len=8192" in error.message


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_retryable_statuses_are_transient(status):
    error = errors.error_from_response(sglang_error("The request queue is full.", status))
    assert isinstance(error, errors.TransientError) and error.retryable
    assert error.message == "The request queue is full."


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_other_client_errors_are_rejected_and_keep_the_server_message(status):
    error = errors.error_from_response(httpx.Response(status, json={"error": "Unauthorized"}))
    assert isinstance(error, errors.RejectedError) and not error.retryable
    assert error.message == "Unauthorized"
    assert error.status == status


def test_non_json_error_body_is_quoted_raw():
    error = errors.error_from_response(httpx.Response(502, text="<html>bad gateway</html>"))
    assert error.message == "<html>bad gateway</html>"


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
