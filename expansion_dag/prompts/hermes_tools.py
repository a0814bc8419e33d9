"""The Hermes tool-call parser: tool definitions out of a system turn's ``<tools>`` block, and tool
results out of their ``<tool_response>`` wrappers, for sources regenerated as whole conversations.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

# Hermes keeps tool definitions in the system text; the preamble's empty "<tools> </tools>" is prose.
# A block starts at the last "<tools>" before its "</tools>", so prose naming the tag is left out.
_TOOLS_BLOCK = re.compile(r"<tools>((?:(?!<tools>).)*?)</tools>[ \t]*\n?", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)


class ToolsError(ValueError):
    """A ``<tools>`` block, in the turn at ``pos``, that gives no list of tool definitions."""

    def __init__(self, pos: int, problem: str):
        super().__init__(problem)
        self.pos = pos


def take_tools(text: str, tools: list[dict[str, Any]], pos: int) -> str:
    """``text`` without its ``<tools>`` blocks, whose definitions are appended to ``tools``.

    The chat template renders tools passed to it in its own words, so the dataset's copy would be
    a second listing. A block may hold a JSON list, JSON objects one after another, or (as in
    hermes-function-calling-v1's own rows) a Python list literal.
    """

    def take(match: re.Match[str]) -> str:
        body = match.group(1)
        if not body.strip():
            return match.group(0)
        try:
            values = _json_values(body)
        except ValueError as json_error:
            try:
                values = [ast.literal_eval(body.strip())]
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise ToolsError(pos, f"is neither JSON nor a Python literal: {json_error}") from None
        for value in values:
            tools.extend(_openai_tool(item, pos) for item in (value if isinstance(value, list) else [value]))
        return ""

    stripped = _TOOLS_BLOCK.sub(take, text)
    return stripped.strip() if stripped != text else text


def _json_values(text: str) -> list[Any]:
    """The JSON values in ``text``, one after another (whitespace or commas between them)."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position == len(text):
            return values
        value, position = decoder.raw_decode(text, position)
        values.append(value)


def _openai_tool(item: Any, pos: int) -> dict[str, Any]:
    """A tool definition in OpenAI form: ``{"type": "function", "function": {"name": ...}}``."""
    function = item.get("function") if isinstance(item, dict) and item.get("type") == "function" else item
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise ToolsError(pos, f"holds something that is not a named function: {str(item)[:60]}")
    try:  # a Python literal can hold what JSON cannot (a set, NaN)
        json.dumps(function, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ToolsError(pos, f"holds a value JSON cannot represent: {exc}") from None
    return item if function is not item else {"type": "function", "function": item}


def tool_results(text: str) -> list[str]:
    """A tool turn's results without their ``<tool_response>`` wrappers, which the template adds.

    Several wrapped results in one turn (parallel calls) become one tool message each; text that
    is not wholly wrapped stays one message as it is.
    """
    results = _TOOL_RESPONSE.findall(text)
    if results and not _TOOL_RESPONSE.sub("", text).strip():
        return [result.strip() for result in results]
    return [text]

