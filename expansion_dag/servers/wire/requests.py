"""Requests: the client's settings for one prompt as the :class:`.protocol.ChatRequest` a server reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from expansion_dag.servers.wire.protocol import ChatRequest
from expansion_dag.servers.wire.tools import request_tools

if TYPE_CHECKING:
    from expansion_dag.core import SamplingSettings


def chat_request(
    model: str,
    messages: Sequence[Mapping[str, Any]],
    max_tokens: int,
    sampling: SamplingSettings,
    *,
    stream: bool = False,
    stream_interval: int | None = None,
    continuous_usage: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str = "auto",
    token_ids: Literal["sglext", "return_token_ids"] | None = None,
) -> ChatRequest:
    """The request for ``messages``, sampled as ``sampling`` says (the fields SGLang and vLLM both read).

    ``stream``: server-sent events, with the usage in a last chunk (``include_usage``: both SGLang's
    and vLLM's ``should_include_usage`` read it from ``stream_options``). ``stream_interval``: tokens
    per event, for a dialect that takes it per request (``Dialect.stream_interval_per_request``;
    1, the servers' own, is not sent); ``continuous_usage``: the tokens so far in every chunk
    (``Dialect.continuous_usage``).
    ``tools``: tool definitions the chat template renders into the prompt (:func:`request_tools`),
    with ``tool_choice`` as :func:`tool_choice_for` picks it for the server; none, or an empty
    list, sends neither field (vLLM refuses ``tools: []``, ``check_tool_usage``).
    ``token_ids``: ask for the prompt's and the sampled token ids as the dialect returns them
    (``Dialect.token_ids``): SGLang's ``return_input_ids_in_sglext`` and
    ``return_output_ids_in_sglext`` (its ``return_token_ids`` is refused on a streamed chat),
    vLLM's ``return_token_ids``.
    """
    return ChatRequest(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        sampling=sampling,
        stream=stream,
        continuous_usage=stream and continuous_usage,
        stream_interval=stream_interval if stream and stream_interval is not None and stream_interval > 1 else None,
        tools=tuple(request_tools(tools or ())),
        tool_choice=tool_choice if tools else None,
        token_ids=token_ids,
    )
