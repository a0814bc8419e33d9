"""Streamed answers: :class:`ChatStream` reads a streamed chat completion, as its bytes arrive, event
by event (:func:`parse_chunk`: a :class:`.protocol.ChatChunk` each), into the same
:class:`.protocol.Answer` as a plain one, and cuts off one whose text loops
(:class:`DegenerateError`, see ``expansion_dag.servers.loops.degeneration``)."""

from __future__ import annotations

import array
from collections.abc import Iterable

import pydantic_core

from expansion_dag.core import BadResponseError, OversizedError, RequestError
from expansion_dag.servers.dialects import Dialect
from expansion_dag.servers.loops import Loop, LoopDetector, LoopThresholds
from expansion_dag.servers.wire.answers import error_from_status
from expansion_dag.servers.wire.protocol import (
    Answer,
    AnswerIdentity,
    ChatChunk,
    Usage,
    as_text,
    checked_answer,
    id_array,
    quote,
    sglext_ids,
    text_field,
    text_limit,
    wire_limit,
)
from expansion_dag.servers.wire.tools import ToolCallDeltas, tool_call_deltas


class DegenerateError(RequestError):
    """The answer fell into a loop and was stopped: its text is kept for inspection; only the text
    before the loop may become a training row (``generation.loop_prefix``).

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
        in_reasoning: bool = False,
    ):
        super().__init__(message, status=200)
        #: Whether the loop is in the reasoning, not the content.
        self.in_reasoning = in_reasoning
        self.content = content
        self.reasoning = reasoning
        #: The ids received before the stop (vLLM streams them with each delta; SGLang only at
        #: the end, so a stopped SGLang stream has none).
        self.prompt_ids = prompt_ids
        self.output_ids = output_ids
        self.loop = loop
        #: The detector's rule that saw the loop (``degeneration.LOOP_RULES``).
        self.rule = loop.rule
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

    def __init__(
        self, dialect: Dialect, thresholds: LoopThresholds | None = None, *, stream_interval: int,
        max_tokens: int | None = None, identity: AnswerIdentity | None = None,
    ):
        """``stream_interval``: the server's tokens per event, to count a stopped answer's tokens.
        ``max_tokens``: the request's; a stream well past what it allows (:func:`.protocol.text_limit`
        of its text, :func:`.protocol.wire_limit` of its bytes) is stopped there, an
        :class:`OversizedError`. ``identity``: what each chunk must say of itself."""
        self._dialect = dialect
        self._identity = identity
        self._max_text = None if max_tokens is None else text_limit(max_tokens)
        self._max_bytes = None if max_tokens is None else wire_limit(max_tokens)
        self._bytes = 0
        self._text = 0
        self._stream_interval = stream_interval
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls = ToolCallDeltas()
        self._prompt_ids: array.array | None = None
        self._output_ids: array.array | None = None
        self._finish: str | None = None
        self._usage: Usage | None = None
        #: The tokens so far, from a choice chunk's own usage (``continuous_usage``); None: unsaid.
        self._tokens_so_far: int | None = None
        self._done = False
        self.chunks = 0
        self._detectors = (LoopDetector(thresholds), LoopDetector(thresholds)) if thresholds else None
        #: The unfinished last line of the bytes fed so far, in the pieces it came in: joined once
        #: its newline comes, never on each read (an event of megabytes without one).
        self._partial: list[bytes] = []

    def feed(self, data: bytes) -> Loop | None:
        """Feed the stream's bytes as they arrive, cut anywhere; ``end`` once it is over.

        One call per network read rather than per line: a per-line async iterator costs more CPU
        than the parsing. Bytes, not text: a newline byte is never inside a UTF-8 character, and
        each event's JSON is parsed from its bytes, so nothing is decoded twice.
        """
        self._bytes += len(data)
        if self._max_bytes is not None and self._bytes > self._max_bytes:
            raise OversizedError(
                f"the stream passed {self._max_bytes:,} bytes, more than its max_tokens allow: stopped", status=200
            )
        if b"\n" not in data:
            self._partial.append(data)
            return None
        lines = data.split(b"\n")
        if self._partial:
            self._partial.append(lines[0])
            lines[0] = b"".join(self._partial)
        tail = lines.pop()
        self._partial = [tail] if tail else []
        for line in lines:
            if line:
                loop = self.feed_line(line)
                if loop is not None:
                    return loop
        return None

    def end(self) -> Loop | None:
        """Feed the last line if the stream did not end with a newline."""
        line, self._partial = b"".join(self._partial), []
        return self.feed_line(line) if line else None

    def feed_line(self, line: bytes) -> Loop | None:
        if not line.startswith(b"data:"):
            return None  # blank separators, comments, ``event:`` names
        data = line[5:].strip()
        if data == b"[DONE]":
            self._done = True
            return None
        chunk = parse_chunk(data, self._dialect, self._identity)
        if chunk.error_status is not None:
            raise error_from_status(chunk.error_status, as_text(data))
        if chunk.usage is not None:
            self._usage = chunk.usage
        if chunk.tokens_so_far is not None:
            self._tokens_so_far = chunk.tokens_so_far
        if chunk.prompt_ids is not None:
            self._prompt_ids = chunk.prompt_ids
        if chunk.output_ids is not None:
            if self._output_ids is None or self._dialect.token_ids == "sglext":  # SGLang's come whole
                self._output_ids = chunk.output_ids
            else:
                self._output_ids.extend(chunk.output_ids)
        if chunk.tool_calls:
            self._tool_calls.feed(chunk.tool_calls)
            self.chunks += 1
        if chunk.finish_reason:
            self._finish = chunk.finish_reason
        loop = None
        if self._max_text is not None and (chunk.content or chunk.reasoning):
            self._text += len(chunk.content or "") + len(chunk.reasoning or "")
            if self._text > self._max_text:
                raise OversizedError(
                    f"the stream's text passed {self._max_text:,} characters, more than its max_tokens allow: "
                    "stopped",
                    status=200,
                )
        if chunk.content:
            self._content.append(chunk.content)
            self.chunks += 1
            if self._detectors:
                loop = self._detectors[0].feed(chunk.content)
        if chunk.reasoning:
            self._reasoning.append(chunk.reasoning)
            self.chunks += 1
            if self._detectors:
                loop = self._detectors[1].feed(chunk.reasoning) or loop
        return loop

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str | None:
        return "".join(self._reasoning) if self._reasoning else None

    def answer(self) -> Answer:
        """The whole answer; BadResponseError when the stream ended without its usage, or with a
        tool call that never got its name."""
        if self._usage is None:
            ended = "after [DONE]" if self._done else "without [DONE]"
            raise BadResponseError(
                f"the stream ended {ended} and without a usage chunk: the server ignored "
                f"stream_options.include_usage",
                status=200,
            )
        try:
            tool_calls = self._tool_calls.calls()
        except ValueError as exc:
            raise BadResponseError(f"a streamed tool call is incomplete: {exc}", status=200) from exc
        return checked_answer(
            content=self.content,
            reasoning=self.reasoning,
            finish_reason=self._finish,
            usage=self._usage,
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
            f"{self.streamed_tokens} tokens): {loop.describe()} ({quote(loop.span, 80)})",
            content=self.content,
            reasoning=self.reasoning,
            loop=loop,
            chunks=self.chunks,
            tokens=self.streamed_tokens,
            prompt_ids=self._prompt_ids,
            output_ids=self._output_ids,
            in_reasoning=self._detectors is not None and self._detectors[0].loop is None,
        )


def parse_chunk(data: bytes, dialect: Dialect, identity: AnswerIdentity | None = None) -> ChatChunk:
    """One event's JSON (the bytes after ``data:``) as a :class:`.protocol.ChatChunk`;
    BadResponseError when it is not a chat completion chunk, or a piece of text is not text;
    OtherModelError when it names another model than ``identity``'s.

    Chunks carry ``choices[0].delta``; the usage comes in a chunk with no choices, and so do
    SGLang's token ids (``sglext``), while vLLM's come with each choice (``token_ids``) and the
    prompt's in the first chunk (``prompt_token_ids``).
    """
    try:
        # A streamed answer is one chunk per event: pydantic's Rust parser costs a third of
        # json.loads per chunk, and parsing is most of the client's CPU per streamed request.
        chunk = pydantic_core.from_json(data)
    except ValueError as exc:
        raise BadResponseError(f"not a chat completion chunk: {as_text(data[:200])}", status=200) from exc
    if not isinstance(chunk, dict):
        raise BadResponseError(f"not a chat completion chunk: {as_text(data[:200])}", status=200)
    if chunk.get("error") or chunk.get("object") == "error":
        error = chunk["error"] if isinstance(chunk.get("error"), dict) else chunk
        code = error.get("code")
        return ChatChunk(error_status=code if isinstance(code, int) and code >= 400 else 500)
    if identity is not None:
        identity.check(chunk.get("model"), chunk.get("metadata"))
    usage = chunk.get("usage")
    choices = chunk.get("choices")
    if not choices:
        prompt_ids = output_ids = None
        if dialect.token_ids == "sglext" and chunk.get("sglext") is not None:
            try:
                prompt_ids, output_ids = sglext_ids(chunk["sglext"])
            except (AttributeError, IndexError, KeyError, TypeError, OverflowError) as exc:
                raise BadResponseError(f"not token ids: {as_text(data[:200])}", status=200) from exc
        whole = Usage.read(usage) if isinstance(usage, dict) and "completion_tokens" in usage else None
        return ChatChunk(usage=whole, prompt_ids=prompt_ids, output_ids=output_ids)
    try:
        choice = choices[0]
        prompt_ids = output_ids = None
        if dialect.token_ids == "return_token_ids":
            prompt_ids, output_ids = id_array(chunk.get("prompt_token_ids")), id_array(choice.get("token_ids"))
        delta = choice.get("delta") or {}
        content = delta.get("content")
        reasoning = next((delta[f] for f in dialect.reasoning_fields if delta.get(f)), None)
        finish = choice.get("finish_reason")
        tool_calls = tool_call_deltas(delta["tool_calls"]) if delta.get("tool_calls") else ()
    except (AttributeError, IndexError, KeyError, TypeError, OverflowError) as exc:
        raise BadResponseError(f"not a chat completion chunk: {as_text(data[:200])}", status=200) from exc
    # Each piece is text before it is kept: a list or a number here would end the worker when
    # the pieces are joined, or the answer counted by its finish. Tested inline, once a chunk.
    if (
        (content is not None and content.__class__ is not str)
        or (reasoning is not None and reasoning.__class__ is not str)
        or (finish is not None and finish.__class__ is not str)
    ):
        text_field(content, "delta.content")
        text_field(reasoning, "the delta's reasoning")
        text_field(finish, "finish_reason")
    so_far = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return ChatChunk(
        content=content,
        reasoning=reasoning,
        finish_reason=finish,
        tool_calls=tool_calls,
        tokens_so_far=so_far if so_far.__class__ is int else None,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
    )


def parse_chat_stream(lines: Iterable[bytes], dialect: Dialect, thresholds: LoopThresholds | None = None) -> Answer:
    """:class:`ChatStream` over a whole stream's lines: the answer, or the DegenerateError of its loop
    (its tokens counted an event each, as a server streams by default, unless its chunks count them)."""
    stream = ChatStream(dialect, thresholds, stream_interval=1)
    for line in lines:
        loop = stream.feed_line(line)
        if loop is not None:
            raise stream.degenerate(loop)
    return stream.answer()
