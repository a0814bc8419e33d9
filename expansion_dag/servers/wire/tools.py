"""Tools: the definitions a request sends, the tool choice each server takes, what its chat template
renders of them, and the calls its tool-call parser returns.

A request carries the tools as :func:`request_tools` writes them (both servers re-serialize each
through their request model before the template sees it), with the ``tool_choice``
:func:`tool_choice_for` picks: SGLang renders them under its default "auto" and drops them under
"none"; vLLM refuses "auto" without a tool-call parser and renders them under "none".
:func:`template_tools` is what each server's chat template renders of them; an answer's
``tool_calls`` are read from plain and streamed bodies alike (:func:`tool_call`; streamed,
:func:`tool_call_deltas` put together by :class:`ToolCallDeltas`). Read from the SGLang 0.5.23 and
vLLM 0.32 wheels, with the paths inside them: ``docs/servers.md``, "Tools: what each server takes".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from expansion_dag.servers.dialects import Dialect
from expansion_dag.servers.wire.protocol import FunctionDefinition, Tool, ToolCall, ToolCallDelta


def tool_choice_for(dialect: Dialect, tool_call_parser: str | None) -> str:
    """The ``tool_choice`` that has the server render the tools and refuse nothing: "auto", except
    on a vLLM without a tool parser, which refuses it and renders the tools with "none" as well."""
    return "none" if dialect.auto_tool_choice_needs_parser and not tool_call_parser else "auto"


def request_tools(tools: Sequence[Mapping[str, Any]]) -> list[Tool]:
    """Tool definitions in the one form both servers render alike: ``{"type": "function",
    "function": {"name", "description", "parameters"}}`` in that order, absent fields null.

    vLLM's ``FunctionDefinition`` dumps its fields in that order whatever the client sent (absent
    ones as null, unknown ones dropped); SGLang's ``Function`` keeps the client's order and appends
    absent ``description`` and ``parameters`` as null. ``strict`` is kept only when set, as both drop
    it when null.
    """
    canonical: list[Tool] = []
    for tool in tools:
        function = tool["function"]
        fields: FunctionDefinition = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            fields["strict"] = function["strict"]
        canonical.append({"type": "function", "function": fields})
    return canonical


def template_tools(tools: Sequence[Mapping[str, Any]], dialect: Dialect) -> list[dict[str, Any]]:
    """The tools as the server of ``dialect`` hands them to the chat template when sent as
    :func:`request_tools`: render a prompt with these (``apply_chat_template(..., tools=...)``) to
    count its tokens as the server does. SGLang 0.5.23 adds ``"defer_loading": null`` to each one."""
    return [{**tool, **dict(dialect.tool_template_extras)} for tool in request_tools(tools)]


def tool_call(call_id: object, name: object, arguments: object) -> ToolCall:
    """One call in OpenAI form. SGLang's ``FunctionResponse.arguments`` may be an object: it is
    kept as JSON text, as both servers send it otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool call without a function name: {name!r}")
    if arguments is None:
        arguments = ""
    elif not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    call: ToolCall = {"type": "function", "function": {"name": name, "arguments": arguments}}
    return {"id": call_id, **call} if isinstance(call_id, str) and call_id else call


def tool_call_deltas(deltas: object) -> tuple[ToolCallDelta, ...]:
    """A chunk's ``delta.tool_calls``; TypeError or AttributeError when one is not a call's piece
    (the stream's reader makes it the request's error)."""
    if not isinstance(deltas, list):
        raise TypeError(f"tool_calls is not a list: {deltas!r}")
    pieces = []
    for delta in deltas:
        index, call_id = delta.get("index"), delta.get("id")
        function = delta.get("function") or {}
        name, arguments = function.get("name"), function.get("arguments")
        if not all(v is None or isinstance(v, str) for v in (name, arguments)):
            raise TypeError(f"a tool call's name or arguments is not text: {function!r}")
        pieces.append(ToolCallDelta(
            index=index if isinstance(index, int) else None,
            id=call_id if isinstance(call_id, str) and call_id else None,
            name=name or None,
            arguments=arguments or None,
        ))
    return tuple(pieces)


class ToolCallDeltas:
    """Streamed tool calls put together: each piece names its call by ``index`` (SGLang's
    ``_process_tool_call_stream``, vLLM's tool parsers' ``DeltaToolCall``)."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, pieces: Iterable[ToolCallDelta]) -> None:
        for piece in pieces:
            index = piece.index if piece.index is not None else len(self._calls)
            call = self._calls.setdefault(index, {"arguments": []})
            if piece.id:
                call["id"] = piece.id
            if piece.name:
                call["name"] = piece.name
            if piece.arguments:
                call["arguments"].append(piece.arguments)

    def calls(self) -> list[ToolCall] | None:
        """The calls in index order; None when there were none."""
        if not self._calls:
            return None
        return [tool_call(c.get("id"), c.get("name"), "".join(c["arguments"])) for _, c in sorted(self._calls.items())]
