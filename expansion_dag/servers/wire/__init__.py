"""The wire format: the typed structures of what is sent to a server and read back (``protocol``),
and their reading: requests, plain answers and errors, streamed answers, tools."""

from expansion_dag.servers.wire.answers import (
    error_from_status,
    finish_error,
    parse_chat_completion,
    parse_context_error,
)
from expansion_dag.servers.wire.protocol import Answer, AnswerIdentity, ChatRequest, as_text, quote, wire_limit
from expansion_dag.servers.wire.requests import chat_request
from expansion_dag.servers.wire.stream import ChatStream, DegenerateError, parse_chat_stream
from expansion_dag.servers.wire.tools import request_tools, template_tools, tool_choice_for

__all__ = [
    "Answer", "ChatRequest", "ChatStream", "DegenerateError", "as_text", "chat_request", "error_from_status",
    "finish_error", "parse_chat_completion", "parse_chat_stream", "parse_context_error", "quote", "request_tools",
    "template_tools", "tool_choice_for", "AnswerIdentity", "wire_limit",
]
