"""Everything said to an inference server, one folder a job, each with its front door:

- ``dialects/``: the table of differences between servers (SGLang's versions, vLLM), read by all;
- ``transport``: httpx's clients, built one way (TLS context, credentials);
- ``wire/``: the wire format, typed (``wire/protocol.py``): requests, answers plain and streamed,
  tools, and the errors a server's body means;
- ``loops/``: loop detection in a streamed answer;
- ``sending/``: one request, and a prompt's exchange with a server with its retries;
- ``probing/``: what each server is and serves, and its load while a run goes;
- ``launching/``: the server processes the project starts.

A job imports another only through that job's front door (``test_layout.py`` holds it); the other
layers import this one's names from here.
"""

from expansion_dag.servers.dialects import BACKENDS, SGLANG, SGLANG_MIN_VERSION, VLLM, Dialect, dialect_for
from expansion_dag.servers.launching import (
    OWNER_ENV,
    ServerRecord,
    Launcher,
    LaunchSpec,
    is_healthy,
    wait_ready,
)
from expansion_dag.servers.loops import LOOP_RULES, Loop, LoopDetector, LoopThresholds, find_loop, loop_cut
from expansion_dag.servers.probing import (
    PROBE_MESSAGES,
    SLOTS_CONFIGURED,
    SLOTS_FROM_SERVER,
    SLOTS_LAUNCHED,
    FleetInfo,
    ServerFacts,
    ServerInfo,
    folder_weights,
    hub_commit,
    parse_gen_throughput,
    parse_idle_slots,
    parse_server_facts,
    probe_fleet,
    probe_fleet_weights,
    probe_server,
    probe_weights,
    read_idle_slots,
    read_server_facts,
    read_throughputs,
    reprobe_difference,
    weights_label,
)
from expansion_dag.servers.sending import Deadline, Exchange, RetryPolicy, generate, send_chat
from expansion_dag.servers.transport import async_client, tls_context
from expansion_dag.servers.wire import (
    Answer,
    AnswerIdentity,
    ChatRequest,
    ChatStream,
    DegenerateError,
    chat_request,
    error_from_status,
    finish_error,
    parse_chat_completion,
    parse_chat_stream,
    parse_context_error,
    request_tools,
    template_tools,
    tool_choice_for,
)

__all__ = [
    "Answer", "BACKENDS", "ChatRequest", "ChatStream", 
    "DegenerateError", "Dialect", "Exchange", "FleetInfo", "LOOP_RULES", "LaunchSpec", "Launcher", "Loop",
    "LoopDetector", "LoopThresholds", "OWNER_ENV", "PROBE_MESSAGES", "RetryPolicy", "SGLANG",
    "SGLANG_MIN_VERSION", "SLOTS_CONFIGURED", "SLOTS_FROM_SERVER", "SLOTS_LAUNCHED", "ServerFacts", "ServerInfo",
    "ServerRecord", "VLLM", "chat_request", "dialect_for", "error_from_status", "find_loop",
    "finish_error", "loop_cut", "folder_weights", "generate", "hub_commit", "is_healthy",
    "parse_chat_completion", "parse_chat_stream", "parse_context_error", "parse_gen_throughput", "parse_idle_slots",
    "parse_server_facts", "probe_fleet", "probe_fleet_weights", "probe_server", "read_idle_slots", "read_server_facts",
    "read_throughputs", "request_tools", "send_chat", "template_tools", "tls_context",
    "tool_choice_for", "wait_ready", "weights_label", "AnswerIdentity", "Deadline", "probe_weights",
    "reprobe_difference", "async_client",
]
