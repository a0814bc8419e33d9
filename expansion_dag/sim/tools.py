"""Tools in simulated chat requests: what each server makes of ``tools`` and ``tool_choice``, and
the tool calls a simulated model makes.

Each dialect accepts, refuses and renders the tools as its server does (read in the SGLang 0.5.23
and vLLM 0.32.0 wheels: ``docs/servers.md``, "Tools: what each server takes"), re-serialized
through that server's request model before the template renders them, earlier calls' arguments
parsed from JSON text as that server parses them. Deliberate differences: ``tool_choice``
"required" or a named tool is refused with a 400 saying the simulator does not take it (a real
server constrains the output to a call); every parser name is read as the Hermes format Qwen3
writes (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import uuid
from typing import Any

from transformers import PreTrainedTokenizerBase

from expansion_dag.core import count_tokens
from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.dialects import Dialect
from expansion_dag.sim.generation import THINK_CLOSE, THINK_OPEN, Completion, word_stream

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
#: The most arguments a simulated call fills in, from the tool's declared properties.
_MAX_ARGUMENTS = 3
#: Words string arguments are drawn from.
_WORDS = 64


class ToolRules:
    """SGLang's handling of a request's tools."""

    def __init__(self, config: SimServerConfig, dialect: Dialect) -> None:
        self._config = config
        self._dialect = dialect

    @property
    def parses(self) -> bool:
        """Whether the server runs a tool-call parser."""
        return self._config.tool_call_parser is not None

    def accept(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str]:
        """The tools as the chat template gets them (None: it renders none) and the tool choice,
        or the RequestError the server answers."""
        tools = self._tools(body)
        choice = body.get("tool_choice")
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "required" and not tools:
            raise self._dialect.error("Tools cannot be empty if tool choice is set to required.")
        self._refuse_forced(choice)
        if not tools or choice == "none":
            return None, choice
        return [self.template_tool(t) for t in tools], choice

    def _tools(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        tools = body.get("tools")
        if tools is None:
            return []
        valid = isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools
        )
        if not valid:
            raise self._dialect.validation_error(("body", "tools"), "Input should be a list of function tools")
        return tools

    def _refuse_forced(self, choice: object) -> None:
        if choice not in ("auto", "none"):
            raise self._dialect.error(f"The simulator takes tool_choice 'auto' or 'none' only, got {choice!r}.")

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages with earlier tool calls' ``arguments`` parsed from JSON text into objects,
        as templates want them (``serving_chat.normalize_assistant_tool_call_arguments``): text
        that is no JSON object is a 400."""
        return [self._with_parsed_arguments(m) for m in messages]

    def _with_parsed_arguments(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list):
            return message
        parsed = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                call = {**call, "function": {**function, "arguments": self._arguments(function["arguments"])}}
            parsed.append(call)
        return {**message, "tool_calls": parsed}

    def _arguments(self, text: str) -> Any:
        try:
            arguments = json.loads(text)
        except ValueError:
            raise self._dialect.error("Assistant tool call function.arguments must be valid JSON.") from None
        if not isinstance(arguments, dict):
            raise self._dialect.error("Assistant tool call function.arguments must be a JSON object.")
        return arguments

    @staticmethod
    def template_tool(tool: dict[str, Any]) -> dict[str, Any]:
        """``protocol.Tool.model_dump()``: the client's order, absent fields null, its own defer_loading."""
        function = {k: v for k, v in tool["function"].items() if k in ("name", "description", "parameters", "strict")}
        function.setdefault("description", None)
        function.setdefault("parameters", None)
        if function.get("strict") is None:
            function.pop("strict", None)
        return {"type": tool.get("type", "function"), "function": function, "defer_loading": None}

    def parsed(self, choice: str) -> bool:
        """Whether this request's tool calls come back parsed."""
        return self.parses and choice != "none"

    def message_calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``message.tool_calls`` of a plain answer: SGLang's ``ToolCall`` carries its ordinal."""
        return [{"id": c["id"], "index": i, "type": "function", "function": c["function"]} for i, c in enumerate(calls)]

    def stream_deltas(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The ``delta`` of each streamed tool-call chunk: the id and name first, with empty
        arguments, then the arguments, with null id and name (``_process_tool_call_stream``)."""
        deltas = []
        for i, call in enumerate(calls):
            name, arguments = call["function"]["name"], call["function"]["arguments"]
            opening, rest = {"name": name, "arguments": ""}, {"name": None, "arguments": arguments}
            for call_id, fn in ((call["id"], opening), (None, rest)):
                piece = {"id": call_id, "index": i, "type": "function", "function": fn}
                deltas.append({"role": None, "content": None, "reasoning_content": None, "tool_calls": [piece]})
        return deltas

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def answer(
        self,
        completion: Completion,
        tools: list[dict[str, Any]],
        rendered: str,
        cap: int,
        choice: str,
        tokenizer: PreTrainedTokenizerBase,
    ) -> Completion:
        """The answer with a tool call in place of its text (after the thinking, if any), if it
        still ends before ``cap``; its tokens are the real count of the raw output."""
        if completion.finish_reason != "stop":
            return completion
        words = word_stream(self._config.tokenizer, _WORDS).words(0, _WORDS).split()
        text, call = tool_call_text(tools, rendered, self._config.seed, words)
        if completion.reasoning_content is not None:  # the reasoning parser took the thinking out
            kept, raw = "", f"{THINK_OPEN}\n{completion.reasoning_content}\n{THINK_CLOSE}\n\n"
        else:
            end = completion.content.find(THINK_CLOSE)
            kept = raw = completion.content[: end + len(THINK_CLOSE) + 2] if end >= 0 else ""
        tokens = count_tokens(tokenizer, [raw + text])[0]
        if tokens >= cap:
            return completion
        if not self.parsed(choice):
            return dataclasses.replace(completion, content=kept + text, completion_tokens=tokens)
        calls = tuple(self.message_calls([{"id": self.call_id(), "function": call}]))
        return dataclasses.replace(
            completion,
            content=kept,
            completion_tokens=tokens,
            finish_reason="tool_calls",
            tool_calls=calls,
            call_text=text,
        )

    def stream_pieces(self, completion: Completion, text_pieces: list[tuple[dict, int]]) -> list[tuple[dict, int]]:
        """The parsed calls' stream deltas, holding the tokens the text pieces did not."""
        deltas = self.stream_deltas(list(completion.tool_calls or ()))
        left = max(0, completion.completion_tokens - sum(n for _, n in text_pieces))
        shares = [left // len(deltas)] * len(deltas)
        shares[-1] += left - sum(shares)
        return list(zip(deltas, shares, strict=True))


class VllmToolRules(ToolRules):
    """vLLM's handling of a request's tools."""

    @property
    def parses(self) -> bool:
        # ParserManager.get_tool_parser: a parser only with --enable-auto-tool-choice too.
        return self._config.tool_call_parser is not None and self._config.enable_auto_tool_choice

    def accept(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str]:
        if body.get("tools") == []:
            raise self._dialect.error(
                "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                param="tools",
            )
        tools = self._tools(body)
        choice = body.get("tool_choice", "auto" if tools else "none")
        if choice not in (None, "none") and not tools:
            raise self._dialect.error("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if choice == "auto" and not self.parses:
            raise self._dialect.error(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
            )
        self._refuse_forced(choice or "none")
        if not tools:
            return None, choice or "none"
        return [self.template_tool(t) for t in tools], choice or "none"

    def _arguments(self, text: str) -> Any:
        """``renderers/chat_utils._postprocess_messages``: text that is no JSON object becomes {}."""
        try:
            arguments = json.loads(text) if text else {}
        except ValueError:
            return {}
        return arguments if isinstance(arguments, dict) else {}

    @staticmethod
    def template_tool(tool: dict[str, Any]) -> dict[str, Any]:
        """``ChatCompletionToolsParam.model_dump()``: its own field order, absent fields null."""
        f = tool["function"]
        function = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
        if f.get("strict") is not None:
            function["strict"] = f["strict"]
        return {"type": "function", "function": function}

    def parsed(self, choice: str) -> bool:
        # chat_completion_full_generator parses only for "auto" (null and "none" leave the text).
        return self.parses and choice == "auto"

    def message_calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"id": c["id"], "type": "function", "function": c["function"]} for c in calls]

    def stream_deltas(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The Hermes parser's ``DeltaToolCall``s: index, type, id and name, then the arguments."""
        deltas = []
        for i, call in enumerate(calls):
            first = {"id": call["id"], "type": "function", "index": i, "function": {"name": call["function"]["name"]}}
            rest = {"index": i, "function": {"arguments": call["function"]["arguments"]}}
            deltas += [{"content": None, "tool_calls": [first]}, {"content": None, "tool_calls": [rest]}]
        return deltas

    def call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


TOOL_RULES: dict[str, type[ToolRules]] = {"sglang": ToolRules, "vllm": VllmToolRules}


def calls_tool(tools: list[dict[str, Any]], rendered: str, share: float, seed: int) -> bool:
    """Whether the answer to this prompt is a tool call: ``share`` of prompts with tools, drawn
    from the rendered prompt and the seed, so a prompt asked again calls again."""
    return bool(tools) and share > 0 and _uniform("tool_call", rendered, seed) < share


def tool_call_text(tools: list[dict[str, Any]], rendered: str, seed: int, words: list[str]) -> tuple[str, dict[str, Any]]:
    """A raw Hermes tool call, as Qwen3 writes one, of a tool from the request, and its call.

    The arguments are the tool's first declared properties, filled by their type; strings take
    words of the simulator's word stream.
    """
    digest = _digest("tool", rendered, seed)
    function = tools[digest[0] % len(tools)]["function"]
    parameters = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
    arguments: dict[str, Any] = {}
    for i, (name, schema) in enumerate(list(properties.items())[:_MAX_ARGUMENTS]):
        kind = schema.get("type") if isinstance(schema, dict) else None
        n = digest[1 + i]
        if kind in ("integer", "number"):
            arguments[name] = n
        elif kind == "boolean":
            arguments[name] = n % 2 == 0
        else:
            arguments[name] = " ".join(words[(n + k) % len(words)] for k in range(1 + n % 3))
    call = {"name": function["name"], "arguments": arguments}
    text = f"{TOOL_CALL_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
    return text, {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def _digest(kind: str, rendered: str, seed: int) -> bytes:
    return hashlib.blake2b(f"{kind}\x00{seed}\x00{rendered}".encode(), digest_size=16).digest()


def _uniform(kind: str, rendered: str, seed: int) -> float:
    return (int.from_bytes(_digest(kind, rendered, seed)[:8], "little") + 0.5) / 2.0**64
