"""Everything said to an inference server: the dialects of SGLang's versions and vLLM, requests,
answers and streamed answers, errors, probing, the HTTP layer, loop detection and the launcher.
"""

from expansion_dag.servers.answers import (
    Answer,
    error_from_status,
    finish_error,
    parse_chat_completion,
    parse_context_error,
)
from expansion_dag.servers.api import (
    PROTECTED_PATH,
    Exchange,
    RetryPolicy,
    ServerFacts,
    chat_request,
    generate,
    parse_gen_throughput,
    parse_idle_slots,
    parse_server_facts,
    read_idle_slots,
    read_server_facts,
    send_chat,
    serves_without_key,
)
from expansion_dag.servers.asyncio_network import AsyncioStream, asyncio_transport
from expansion_dag.servers.degeneration import LOOP_RULES, Loop, LoopDetector, LoopThresholds, find_loop
from expansion_dag.servers.dialects import SGLANG, SGLANG_MIN_VERSION, VLLM, Dialect, dialect_for
from expansion_dag.servers.fleet import (
    SLOTS_CONFIGURED,
    SLOTS_FROM_SERVER,
    SLOTS_LAUNCHED,
    FleetInfo,
    probe_fleet,
    probe_server,
    read_throughputs,
)
from expansion_dag.servers.http_client import HttpClient, make_client, tls_context
from expansion_dag.servers.launcher import (
    KEY_DELIVERY,
    KeyDelivery,
    Launcher,
    LaunchSpec,
    is_healthy,
    key_delivery,
    tool_call_flags,
    wait_ready,
)
from expansion_dag.servers.repetitive_corpus import CORPUS_PATH, corpus_bytes, looping_answers, read_corpus
from expansion_dag.servers.stream import (
    DEFAULT_STREAM_INTERVAL,
    ChatStream,
    DegenerateError,
    parse_chat_stream,
)
from expansion_dag.servers.tools import request_tools, template_tools, tool_choice_for
from expansion_dag.servers.weights import (
    PROBE_MESSAGES,
    PROBE_TOKENS,
    files_digest,
    folder_weights,
    hub_commit,
    probe_fleet_weights,
    weights_label,
)

__all__ = [
    "Answer", "AsyncioStream", "CORPUS_PATH", "ChatStream", "DEFAULT_STREAM_INTERVAL",
    "DegenerateError", "Dialect", "Exchange", "FleetInfo", "HttpClient", "KEY_DELIVERY", "KeyDelivery",
    "LOOP_RULES", "LaunchSpec", "Launcher", "Loop", "LoopDetector", "LoopThresholds", "PROBE_MESSAGES",
    "PROBE_TOKENS", "PROTECTED_PATH", "RetryPolicy", "SGLANG", "SGLANG_MIN_VERSION", "SLOTS_CONFIGURED",
    "SLOTS_FROM_SERVER", "SLOTS_LAUNCHED", "ServerFacts", "VLLM",
    "asyncio_transport", "chat_request", "corpus_bytes", "dialect_for", "error_from_status",
    "files_digest", "find_loop", "finish_error", "folder_weights", "generate", "hub_commit", "is_healthy",
    "key_delivery", "looping_answers", "make_client",
    "parse_chat_completion", "parse_chat_stream", "parse_context_error", "parse_gen_throughput",
    "parse_idle_slots", "parse_server_facts", "probe_fleet", "probe_fleet_weights", "probe_server", "read_corpus",
    "read_idle_slots", "read_server_facts", "read_throughputs", "request_tools", "send_chat",
    "serves_without_key", "template_tools", "tls_context", "tool_call_flags", "tool_choice_for",
    "wait_ready", "weights_label"
]
