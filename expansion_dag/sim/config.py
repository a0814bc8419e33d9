"""Configuration of one simulated server: frozen, validated, with named defaults."""

from __future__ import annotations

import dataclasses
import math

from packaging.version import InvalidVersion, Version

from expansion_dag.core import DEFAULT_TOKENIZER

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
DEFAULT_MODEL_PATH = "Qwen/Qwen3-8B"
DEFAULT_CONTEXT_LENGTH = 8192
DEFAULT_MAX_RUNNING_REQUESTS = 16
DEFAULT_TTFT_S = 0.05
DEFAULT_TOKEN_LATENCY_S = 0.01
DEFAULT_OUTPUT_MEDIAN_TOKENS = 256
DEFAULT_OUTPUT_SIGMA = 1.0
DEFAULT_REASONING_SHARE = 0.5
DEFAULT_FAIL_STATUS = 503
DEFAULT_SEED = 0
#: The share of answers to requests with tools that call one.
DEFAULT_TOOL_CALL_SHARE = 0.3

BACKENDS = ("sglang", "vllm")
REASONING_PARSERS = ("qwen3",)
#: Misconfigurations whose answers the training set throws away, as a real fleet can have them:
#: ``no_reasoning`` answers without thinking whatever the template asks (a server whose model or
#: template ignores ``enable_thinking``); ``think_tag_in_content`` takes the reasoning out but leaves
#: ``</think>`` in the content (a reasoning parser that is not the model's); ``empty`` puts the whole
#: answer in ``reasoning_content`` and leaves the content empty (a parser forcing reasoning).
ANSWER_DEFECTS = ("no_reasoning", "think_tag_in_content", "empty")

#: The server versions whose surfaces are simulated, read from their PyPI wheels (see
#: expansion_dag_tests/contract/fixtures). SGLang can be emulated back to OLDEST_SGLANG_VERSION.
SGLANG_VERSION = "0.5.23"
OLDEST_SGLANG_VERSION = "0.5.4"
VLLM_VERSION = "0.33.0"
DEFAULT_VERSIONS = {"sglang": SGLANG_VERSION, "vllm": VLLM_VERSION}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimServerConfig:
    """One simulated inference server. Times are in seconds, lengths in tokens.

    A request holds a slot for ``ttft_s + completion_tokens * token_latency_s``. Output lengths are
    lognormal around ``output_median_tokens`` with ``output_sigma``, drawn deterministically from
    the rendered prompt, the request's ``seed`` and ``seed`` here. Answer lengths depend on the
    prompt as real ones do: ``output_median_by_marker`` gives the median of answers whose rendered
    prompt contains a marker (the first that matches, e.g. a source's instruction text), and the
    median scales as ``(prompt_tokens / 64) ** output_prompt_exponent``. ``output_max_tokens``
    bounds the natural answers (None: the context length): set under the requests' ``max_tokens``,
    no answer but a loop reaches the cap. Fault injection is
    deterministic by request counter: ``fail_rate`` answers that share of generation requests
    with ``fail_status``, ``hang_rate`` leaves that share of the rest unanswered until the client
    disconnects, ``die_after_requests`` kills the server after that many completions, and
    ``prompt_token_skew`` is added to every prompt count the server reports. ``abort_rate`` answers
    that share of generation requests as SGLang answers an aborted one: HTTP 200, partial text,
    ``finish_reason: "abort"``. ``loop_rate`` makes that share of sampled answers degenerate: a few
    words, then one span repeated until the cap (``finish_reason: "length"``), by a counter of the
    sampled requests (an unlucky sample; a greedy one is never). ``looping_prompt_share`` is what real models do: that share of prompts, chosen
    by the prompt's text, loops every time it is asked. ``output_word_sigma`` makes lengths follow
    what the prompt says: each word of the user's instruction (its first and last words) moves the
    log-median by an effect drawn per word (a tenth of words have one, of this spread), as "in
    detail" and "in one word" do. ``output_phrase_sigma`` does the same per pair of adjacent words,
    anywhere in the instruction: a rule that a client learning from single words cannot read off them.

    ``version`` is the server version whose HTTP surface is emulated (None: the newest read,
    :data:`SGLANG_VERSION` or :data:`VLLM_VERSION`). ``max_total_tokens`` is the KV cache in tokens
    (SGLang's ``--max-total-tokens``; None: ``max_running_requests * context_length``); it bounds
    ``max_req_input_len`` as on a real server.

    ``tool_call_share`` of the answers to requests whose prompt renders tools call one of them
    (drawn from the prompt: the same prompt calls again), as raw ``<tool_call>`` text, which a
    ``tool_call_parser`` turns into ``message.tool_calls`` (on vLLM only with
    ``enable_auto_tool_choice`` as well, as there); see :mod:`expansion_dag.sim.tools`.

    ``token_ids``: return the prompt's and the answer's token ids to a request that asks, where the
    emulated version can (SGLang's ``return_*_ids_in_sglext`` from 0.5.20, vLLM's
    ``return_token_ids``); False: a server that ignores those fields, as an older one does.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0 binds an ephemeral port (tests)
    model_path: str = DEFAULT_MODEL_PATH
    served_model_name: str | None = None
    context_length: int = DEFAULT_CONTEXT_LENGTH
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    max_queued_requests: int | None = None
    #: Tokens per streamed event (both servers' ``--stream-interval``).
    stream_interval: int = 1
    tokenizer: str = DEFAULT_TOKENIZER
    api_key: str | None = dataclasses.field(default=None, repr=False)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_share: float = DEFAULT_TOOL_CALL_SHARE
    backend: str = "sglang"
    version: str | None = None
    max_total_tokens: int | None = None
    startup_delay_s: float = 0.0
    warmup_s: float = 0.0
    ttft_s: float = DEFAULT_TTFT_S
    token_latency_s: float = DEFAULT_TOKEN_LATENCY_S
    output_median_tokens: int = DEFAULT_OUTPUT_MEDIAN_TOKENS
    output_sigma: float = DEFAULT_OUTPUT_SIGMA
    output_median_by_marker: tuple[tuple[str, int], ...] = ()
    output_prompt_exponent: float = 0.0
    output_max_tokens: int | None = None
    reasoning_share: float = DEFAULT_REASONING_SHARE
    seed: int = DEFAULT_SEED
    fail_rate: float = 0.0
    fail_status: int = DEFAULT_FAIL_STATUS
    die_after_requests: int | None = None
    hang_rate: float = 0.0
    abort_rate: float = 0.0
    loop_rate: float = 0.0
    looping_prompt_share: float = 0.0
    output_word_sigma: float = 0.0
    output_phrase_sigma: float = 0.0
    prompt_token_skew: int = 0
    answer_defect: str | None = None  # one of ANSWER_DEFECTS: every answer has it
    token_ids: bool = True
    #: SGLang's ``--weight-version``: the label it reports for its weights ("default" when unset).
    weight_version: str = "default"
    #: Keep a record of every load answer and chat request (``expansion_dag.sim.timeline``), for
    #: tests and benchmarks; off by default, since it grows with every request.
    keep_timeline: bool = False

    def __post_init__(self) -> None:
        problems = list(_problems(self))
        if problems:
            raise ValueError("invalid simulator config: " + "; ".join(problems))

    @property
    def model_name(self) -> str:
        """The name served in ``/v1/models`` and echoed by the server."""
        return self.served_model_name or self.model_path

    @property
    def server_version(self) -> str:
        """The emulated server version."""
        return self.version or DEFAULT_VERSIONS[self.backend]

    @property
    def kv_capacity(self) -> int:
        """Tokens the simulated KV cache holds."""
        return self.max_total_tokens or self.max_running_requests * self.context_length

    @property
    def max_req_len(self) -> int:
        """SGLang's longest request, prompt and output (``tp_worker.get_worker_info``)."""
        return min(self.context_length - 1, self.kv_capacity - 1)

    @property
    def max_req_input_len(self) -> int:
        """SGLang's longest prompt the scheduler admits: five tokens under ``max_req_len``."""
        return self.max_req_len - 5


def _problems(c: SimServerConfig):
    if not c.host:
        yield "host must not be empty"
    if not 0 <= c.port <= 65535:
        yield f"port must be in 0..65535, got {c.port}"
    if not c.model_path:
        yield "model_path must not be empty"
    if c.served_model_name == "":
        yield "served_model_name must be None or non-empty"
    if c.context_length < 2:
        yield f"context_length must be >= 2, got {c.context_length}"
    if c.max_running_requests < 1:
        yield f"max_running_requests must be >= 1, got {c.max_running_requests}"
    if c.stream_interval < 1:
        yield f"stream_interval must be >= 1, got {c.stream_interval}"
    if c.max_queued_requests is not None and c.max_queued_requests < 0:
        yield f"max_queued_requests must be None or >= 0, got {c.max_queued_requests}"
    if c.api_key == "":
        yield "api_key must be None or non-empty"
    if not c.weight_version:
        yield "weight_version must not be empty"
    if c.answer_defect is not None and c.answer_defect not in ANSWER_DEFECTS:
        yield f"answer_defect must be None or one of {ANSWER_DEFECTS}, got {c.answer_defect!r}"
    if c.reasoning_parser is not None and c.reasoning_parser not in REASONING_PARSERS:
        yield f"reasoning_parser must be None or one of {REASONING_PARSERS}, got {c.reasoning_parser!r}"
    if c.tool_call_parser == "":
        yield "tool_call_parser must be None or non-empty"
    if c.enable_auto_tool_choice and not c.tool_call_parser:
        # vLLM's cli_args.validate_parsed_serve_args refuses to start so.
        yield "enable_auto_tool_choice requires tool_call_parser (--enable-auto-tool-choice requires --tool-call-parser)"
    if c.backend not in BACKENDS:
        yield f"backend must be one of {BACKENDS}, got {c.backend!r}"
    elif c.version is not None:
        yield from _version_problems(c.backend, c.version)
    if c.max_total_tokens is not None and c.max_total_tokens < 8:
        # Below 8 tokens SGLang's max_req_input_len (capacity - 6) admits no prompt at all.
        yield f"max_total_tokens must be None or >= 8, got {c.max_total_tokens}"
    for name in ("startup_delay_s", "warmup_s", "ttft_s", "token_latency_s", "output_sigma"):
        value = getattr(c, name)
        if not (math.isfinite(value) and value >= 0):
            yield f"{name} must be a finite number >= 0, got {value}"
    if c.output_median_tokens < 1:
        yield f"output_median_tokens must be >= 1, got {c.output_median_tokens}"
    for marker, tokens in c.output_median_by_marker:
        if not marker or type(tokens) is not int or tokens < 1:
            yield f"output_median_by_marker needs non-empty markers and medians >= 1, got {(marker, tokens)!r}"
    if c.output_max_tokens is not None and c.output_max_tokens < 1:
        yield f"output_max_tokens must be None or >= 1, got {c.output_max_tokens}"
    if not (math.isfinite(c.output_prompt_exponent) and abs(c.output_prompt_exponent) <= 4):
        yield f"output_prompt_exponent must be within [-4, 4], got {c.output_prompt_exponent}"
    if not 0 < c.reasoning_share < 1:
        yield f"reasoning_share must be strictly between 0 and 1, got {c.reasoning_share}"
    for name in ("output_word_sigma", "output_phrase_sigma"):
        value = getattr(c, name)
        if not (math.isfinite(value) and 0 <= value <= 3):
            yield f"{name} must be within [0, 3], got {value}"
    for name in ("fail_rate", "hang_rate", "abort_rate", "loop_rate", "looping_prompt_share", "tool_call_share"):
        value = getattr(c, name)
        if not 0 <= value <= 1:
            yield f"{name} must be in [0, 1], got {value}"
    if not 400 <= c.fail_status <= 599:
        yield f"fail_status must be an HTTP error status (400..599), got {c.fail_status}"
    if c.die_after_requests is not None and c.die_after_requests < 1:
        yield f"die_after_requests must be None or >= 1, got {c.die_after_requests}"


def _version_problems(backend: str, version: str):
    if backend == "vllm":
        if version != VLLM_VERSION:
            yield f"version must be None or {VLLM_VERSION!r} for backend 'vllm', got {version!r}"
        return
    try:
        # As pip orders them: a release candidate comes before its release (0.5.10rc1 < 0.5.10).
        emulated = Version(OLDEST_SGLANG_VERSION) <= Version(version) <= Version(SGLANG_VERSION)
    except InvalidVersion:
        emulated = False
    if not emulated:
        yield (
            f"version must be None or an SGLang version from {OLDEST_SGLANG_VERSION} to "
            f"{SGLANG_VERSION}, got {version!r}"
        )
