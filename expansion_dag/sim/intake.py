"""The chat request intake: a request parsed, rendered and counted as the real server does, held
to its context rules, given the configured faults and made a job; and vLLM's /tokenize, which
renders and counts by the same rules.

Apart from the scheduler: what a request may ask is one question, when it runs is another.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

from transformers import PreTrainedTokenizerBase

from expansion_dag.core import render_prompts
from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.dialects import Dialect, RequestError, dumps
from expansion_dag.sim.generation import (
    Completion,
    OutputModel,
    sim_output_ids,
    supports_thinking,
    word_stream,
)
from expansion_dag.sim.http import HttpConnection, HttpRequest
from expansion_dag.sim.job import Job
from expansion_dag.sim.scheduler import Scheduler
from expansion_dag.sim.tools import TOOL_RULES, calls_tool

#: A looping answer (``loop_rate``): this many words, then a span of ``_LOOP_SPAN_WORDS`` repeated.
_LOOP_PREFIX_WORDS = 40
_LOOP_SPAN_WORDS = 12
_TOKEN_PIECES = re.compile(r"\s*\S+|\s+")


def _stream_deltas(fields: Iterable[tuple[str, str | None]], interval: int) -> Iterator[tuple[dict, int]]:
    """A streamed answer's events as (delta, tokens): the first token alone, then ``interval``
    tokens an event, as SGLang's ``OutputStreamer`` and vLLM's ``RequestState`` send them."""
    first = True
    for name, text in fields:
        if not text:
            continue
        pieces = _TOKEN_PIECES.findall(text)
        start = 0
        if first:
            yield {name: pieces[0]}, 1
            start, first = 1, False
        for i in range(start, len(pieces), interval):
            chunk = pieces[i : i + interval]
            yield {name: "".join(chunk)}, len(chunk)


def _last_user_text(messages: object) -> str:
    """The user's last words: what a model's answer follows (its length, whether it loops)."""
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user" and isinstance(message.get("content"), str):
                return message["content"]
    return ""


def _evenly_spaced_hit(n: int, rate: float) -> bool:
    """Whether item ``n`` (0-based) is hit when a ``rate`` share is hit, spread evenly by count."""
    return math.floor((n + 1) * rate + 1e-9) > math.floor(n * rate + 1e-9)


def _with_defect(completion: Completion, defect: str | None) -> Completion:
    """The answer as a misconfigured server returns it (``SimServerConfig.answer_defect``)."""
    if defect == "think_tag_in_content":
        return dataclasses.replace(completion, content="</think>\n\n" + completion.content)
    if defect == "empty":
        text = "\n\n".join(t for t in (completion.reasoning_content, completion.content) if t)
        return dataclasses.replace(completion, content="", reasoning_content=text)
    return completion


def _looping(config: SimServerConfig, rendered: str, cap: int, *, split: bool) -> Completion:
    """A degenerate answer: a few words, then one span repeated until the cap (one token a word)."""
    words = word_stream(config.tokenizer, 4096 + config.context_length)
    start = sum(rendered.encode()) % 4000
    prefix = words.words(start, _LOOP_PREFIX_WORDS).split()
    span = words.words(start + _LOOP_PREFIX_WORDS, _LOOP_SPAN_WORDS).split()
    body = (prefix + span * (cap // _LOOP_SPAN_WORDS + 1))[:cap]
    text = " ".join(body)
    return Completion(
        content="" if split else text,
        reasoning_content=text if split else None,
        completion_tokens=len(body),
        reasoning_tokens=len(body) if split else 0,
        finish_reason="length",
    )


class ChatIntake:
    """Turns a chat request into a job for the scheduler, or answers the error the server would."""

    def __init__(
        self, config: SimServerConfig, dialect: Dialect, tokenizer: PreTrainedTokenizerBase, scheduler: Scheduler
    ) -> None:
        self.config = config
        self._dialect = dialect
        self._tokenizer = tokenizer
        self._scheduler = scheduler
        self._thinking_model = supports_thinking(tokenizer)
        self._tools = TOOL_RULES[config.backend](config, dialect)
        self._output = OutputModel(
            tokenizer_spec=config.tokenizer,
            max_length=min(config.context_length, config.output_max_tokens or config.context_length),
            median_tokens=config.output_median_tokens,
            sigma=config.output_sigma,
            reasoning_share=config.reasoning_share,
            seed=config.seed,
            median_by_marker=config.output_median_by_marker,
            prompt_exponent=config.output_prompt_exponent,
            word_sigma=config.output_word_sigma,
            phrase_sigma=config.output_phrase_sigma,
        )
        self.last_chat_request: dict[str, Any] | None = None  # what a test checks the client sent
        self.max_requested_tokens = 0
        self.context_exceeded = 0
        #: Answers made to loop (``loop_rate``, ``looping_prompt_share``), each counted once, by greedy or not.
        self.loops: collections.Counter[bool] = collections.Counter()
        self.greedy_requests = 0  # decoded greedily (temperature 0): no sampling luck changes them
        self._generation_requests = 0  # fault-injection counters
        self._survivors = 0
        self._samples = 0  # sampled requests: the counter of ``loop_rate``'s unlucky samples

    def chat_completions(self, request: HttpRequest, conn: HttpConnection) -> None:
        try:
            job = self._accept(request, conn)
        except RequestError as exc:
            self._scheduler.reject(conn, exc)
            return
        self._scheduler.submit(job)

    def tokenize(self, request: HttpRequest, conn: HttpConnection) -> None:
        """vLLM's ``/tokenize``: a prompt, or messages rendered as a chat request's, as token ids."""
        try:
            body = self._parse_json(request)
            if "messages" in body:
                text, _ = self._render(body, body.get("tools") or None)
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise self._dialect.validation_error(("body", "prompt"), "Field required: prompt or messages")
        except RequestError as exc:
            conn.respond(exc.status, exc.body)
            return
        # The same encoding as expansion_dag.core.tokenizer.count_tokens, kept for its ids.
        tokens = self._tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        answer = {
            "count": self._reported(len(tokens)),
            "max_model_len": self.config.context_length,
            "tokens": tokens,
            "token_strs": None,
        }
        conn.respond(200, dumps(answer))

    def _parse_json(self, request: HttpRequest) -> dict[str, Any]:
        content_type = request.headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if content_type != b"application/json":
            raise self._dialect.content_type_error()
        try:
            body = json.loads(request.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise self._dialect.validation_error(("body", 0), f"JSON decode error: {exc}") from None
        if not isinstance(body, dict):
            raise self._dialect.validation_error(("body",), "Input should be a valid dictionary")
        return body

    def _render(self, body: dict[str, Any], tools: list[dict[str, Any]] | None) -> tuple[str, dict[str, Any]]:
        """The prompt rendered with the chat template as the server does, with the ``tools`` it
        hands the template (None: none), and the template kwargs."""
        d = self._dialect
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise d.validation_error(("body", "messages"), "Input should be a valid list of message objects")
        if not messages:
            raise d.error("Messages cannot be empty.")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise d.validation_error(("body", "chat_template_kwargs"), "Input should be a valid dictionary")
        messages = self._tools.history(messages)
        try:
            return render_prompts(self._tokenizer, [messages], kwargs, tools=[tools])[0], kwargs
        except Exception as exc:  # the chat template raises jinja and type errors on odd input
            raise d.error(f"cannot apply the chat template: {exc}") from None

    def _reported(self, local_tokens: int) -> int:
        """A prompt count as this server reports it: the local count plus the configured skew."""
        return max(0, local_tokens + self.config.prompt_token_skew)

    def _accept(self, request: HttpRequest, conn: HttpConnection) -> Job:
        """Validate a chat request as the server would and turn it into a job, or raise."""
        d, c = self._dialect, self.config
        body = self._parse_json(request)
        self.last_chat_request = body
        if body.get("n") not in (None, 1):
            raise d.error("The simulator supports only n=1.")
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if value is not None and (type(value) is not int or value < 0):
                raise d.validation_error(("body", field), "Input should be a non-negative integer")
        field, max_tokens = d.max_tokens(body.get("max_tokens"), body.get("max_completion_tokens"))
        d.check_model(body.get("model"))
        request_seed = body.get("seed")
        tools, tool_choice = self._tools.accept(body)
        rendered, kwargs = self._render(body, tools)
        # The model's tokenizer, as a real server runs the prompt: its ids come back when asked.
        encoding = self._tokenizer.backend_tokenizer.encode_batch_fast([rendered], add_special_tokens=False)[0]
        prompt_tokens = self._reported(len(encoding))
        asks_prompt_ids, asks_output_ids = d.asks_token_ids(body)
        instruction = _last_user_text(body.get("messages"))

        requested = prompt_tokens + (max_tokens or 0)
        self.max_requested_tokens = max(self.max_requested_tokens, requested)
        if prompt_tokens >= c.context_length or requested > c.context_length:
            self.context_exceeded += 1
        cap = d.completion_cap(prompt_tokens, field, max_tokens)

        n = self._generation_requests
        self._generation_requests += 1
        if _evenly_spaced_hit(n, c.fail_rate):
            raise d.error(
                f"Simulated failure injected by the simulator (fail_rate={c.fail_rate}).",
                status=c.fail_status,
                err_type=str(c.fail_status),
            )
        if (
            c.max_queued_requests is not None
            and self._scheduler.full
            and self._scheduler.num_waiting >= c.max_queued_requests
        ):
            raise d.error("The request queue is full.", status=503, err_type="503")
        survivor = self._survivors
        self._survivors += 1
        hang = _evenly_spaced_hit(survivor, c.hang_rate)
        # A greedy answer (temperature 0; none given: the servers' 1.0) is no sample, never an unlucky loop.
        greedy = body.get("temperature") == 0
        unlucky = not greedy and _evenly_spaced_hit(self._samples, c.loop_rate)
        self._samples += not greedy
        self.greedy_requests += greedy

        def generate(limit: int) -> Completion:
            return self._output.generate(
                rendered,
                request_seed=request_seed if type(request_seed) is int else None,
                cap=limit,
                thinking=self._thinking_model and kwargs.get("enable_thinking", True) is not False
                and c.answer_defect != "no_reasoning",
                split_reasoning=c.answer_defect is not None
                or (c.reasoning_parser is not None and body.get("separate_reasoning", True) is not False),
                prompt_tokens=prompt_tokens,
                instruction=instruction,
            )

        completion = _with_defect(generate(cap), c.answer_defect)
        if unlucky or self._output.loops(instruction, c.looping_prompt_share):
            completion = _looping(c, rendered, cap, split=c.reasoning_parser is not None)
            self.loops[greedy] += 1
        elif not hang and _evenly_spaced_hit(survivor, c.abort_rate):
            # Aborted halfway (/abort_request, abort_all): SGLang answers 200 with the partial text.
            completion = dataclasses.replace(generate(completion.completion_tokens // 2), finish_reason="abort")
        elif tools and calls_tool(tools, rendered, c.tool_call_share, c.seed):
            completion = self._tools.answer(completion, tools, rendered, cap, tool_choice, self._tokenizer)
        rid = body.get("rid")
        timeline = self._scheduler.timeline
        job = Job(
            conn,
            request_id=rid if isinstance(rid, str) else None,
            model=body.get("model") if isinstance(body.get("model"), str) else "default",
            prompt_tokens=prompt_tokens,
            completion=completion,
            duration_s=None if hang else c.ttft_s + completion.completion_tokens * c.token_latency_s,
        )
        if timeline is not None:
            job.trace = timeline.arrived(instruction)
        if asks_prompt_ids:
            # A skewed count is a server that runs the prompt otherwise: its ids differ at the end.
            ids = encoding.ids[:prompt_tokens]
            job.prompt_ids = ids + ids[-1:] * (prompt_tokens - len(ids))
        if asks_output_ids:
            job.output_ids = sim_output_ids(completion, self._tokenizer)
        if body.get("stream"):
            # Both servers send the usage chunk only when asked (should_include_usage).
            options = body.get("stream_options")
            job.stream_usage = bool(isinstance(options, dict) and options.get("include_usage"))
            job.continuous_usage = job.stream_usage and d.continuous_usage and bool(options.get("continuous_usage_stats"))
            fields = ((d.reasoning_delta, completion.reasoning_content), ("content", completion.content))
            job.pieces = list(_stream_deltas(fields, d.stream_interval(body)))
            if completion.tool_calls:
                job.pieces += self._tools.stream_pieces(completion, job.pieces)
        return job
