"""Probing a fleet of SGLang (or vLLM) servers, with no Dagster in sight (launching: ``servers/launching/``).

- ``probe_fleet`` reads what requests depend on from the servers themselves (through
  ``facts``, which reads each in its dialect): the context length, the longest prompt the
  scheduler admits, the running-request slots, the model and the version. Servers that disagree
  are an error naming them.
- Slots are never guessed: a server that does not report them (vLLM has no API for
  ``max_num_seqs``) takes them from the configuration (``fleet.slots``, the resource's
  ``slots_override``) or, launched by the project, from the flag its command passed;
  ``ServerInfo.slots_source`` says which it was.
- A fleet configured with an API key must refuse a request without it: one that answers is
  running unauthenticated, and that is an error, not a warning.
- Whether a server parses tool calls decides the ``tool_choice`` its requests carry
  (``ServerInfo.tool_choice``): SGLang says its ``--tool-call-parser``; vLLM says nothing, so the
  configured one is believed.
- A server is named by its URL without credentials (``ServerInfo.url``: what records, logs and
  metadata show); a ``user:password@`` in a configured URL is sent as basic auth with every request
  to it (``core.server_url``), the probe's, the health checks' and the generation's alike.
- Which weights the fleet serves is part of a completion's identity (``FleetInfo.identity``), from
  ``weights.py``: their names where known, and a probe of what they answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


from expansion_dag.core import (
    FleetError,
    FleetMismatchError,
    ServerUnreachableError,
    WeightsProbe,
    server_url,
)
from expansion_dag.servers.dialects import Dialect
from expansion_dag.servers.probing.facts import (
    PROTECTED_PATH,
    UNSET_WEIGHT_VERSION,
    ServerFacts,
    read_server_facts,
    serves_without_key,
)
from expansion_dag.servers.transport import client
from expansion_dag.servers.wire import AnswerIdentity, tool_choice_for


#: Where a server's slot count came from.
SLOTS_FROM_SERVER = "server"
SLOTS_CONFIGURED = "configured: fleet.slots"
SLOTS_LAUNCHED = "launch command"
#: What a user edits to give the slots: the file's key, its variable, and the fleet resource's
#: field on a run's launchpad.
SET_SLOTS = "set fleet.slots in the run configuration file (or EXPANSION_SLOTS; slots_override in a launchpad)"


@dataclass(frozen=True)
class ServerInfo:
    url: str
    backend: str
    model: str
    model_path: str
    context_length: int
    slots: int
    #: ``SLOTS_FROM_SERVER``, ``SLOTS_CONFIGURED`` or ``SLOTS_LAUNCHED``.
    slots_source: str
    #: SGLang's scheduler refuses prompts of this many tokens or more; None when not reported.
    max_req_input_len: int | None
    version: str | None
    simulator: bool
    dialect: Dialect
    #: Tokens per streamed event: SGLang's own ``--stream-interval`` as it reports it (1 when it
    #: does not), or, where requests carry it (vLLM), the configured value each request asks for.
    stream_interval: int = 1
    #: The server's tool-call parser: as SGLang reports it, else as configured; None: none.
    tool_call_parser: str | None = None
    #: The version the server reports for its weights (SGLang's ``weight_version``); None: unsaid.
    weight_version: str | None = None
    #: What its weights answered the probe (``weights.probe_fleet_weights``); None: not taken, or
    #: it did not answer (``probe_error`` says why).
    probe: WeightsProbe | None = None
    probe_error: str | None = None

    @property
    def tool_choice(self) -> str:
        """The ``tool_choice`` of this server's requests with tools (``tool_choice_for``)."""
        return tool_choice_for(self.dialect, self.tool_call_parser)

    @property
    def identity(self) -> AnswerIdentity:
        """What its answers must say of themselves: vLLM's served name; SGLang's weights' version,
        as its answers carry it ("default" when none was set)."""
        if self.dialect.answers_name_model:
            return AnswerIdentity(model=self.model)
        return AnswerIdentity(weight_version=self.weight_version or UNSET_WEIGHT_VERSION)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dialect": self.dialect.name}


@dataclass(frozen=True)
class FleetInfo:
    servers: tuple[ServerInfo, ...]
    #: Servers that did not answer the probe, when the caller tolerates some being down.
    unreachable: tuple[str, ...] = ()
    #: What is known of the weights the fleet serves, as a label (``weights.weights_label``): a
    #: folder's commit or digest, the configured revision, the version the servers report; "" for
    #: nothing (the identity is then the path's alone, as before the weights were named).
    weights: str = ""

    @property
    def context_length(self) -> int:
        return self.servers[0].context_length

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest prompt every server admits (below its ``max_req_input_len``); None if unsaid.

        SGLang sets it from the KV cache too, so it can be well below the context length.
        """
        limits = [s.max_req_input_len - 1 for s in self.servers if s.max_req_input_len is not None]
        return min(limits) if limits else None

    @property
    def model(self) -> str:
        return self.servers[0].model

    @property
    def model_path(self) -> str:
        return self.servers[0].model_path

    @property
    def simulated(self) -> bool:
        return any(s.simulator for s in self.servers)

    @property
    def identity(self) -> str:
        """The model as part of a completion's identity: its path and what is known of its weights;
        a simulated answer never passes for a real one."""
        weights = f" [weights {self.weights}]" if self.weights else ""
        return self.model_path + weights + (" (simulator)" if self.simulated else "")

    @property
    def probe(self) -> WeightsProbe | None:
        """What the fleet's weights answered the probe (its servers agree); None if none answered."""
        return next((s.probe for s in self.servers if s.probe is not None), None)

    def server(self, url: str) -> ServerInfo:
        for info in self.servers:
            if info.url == url:
                return info
        raise KeyError(url)


def probe_server(
    url: str,
    *,
    backend: str,
    api_key: str | None = None,
    slots_override: int | None = None,
    launched_slots: int | None = None,
    stream_interval: int,
    tool_call_parser: str | None = None,
    timeout_s: float = 30.0,
) -> ServerInfo:
    """What one server says about itself, checked against the configuration.

    Slots: ``slots_override`` (configured) first, else the server's own report, else
    ``launched_slots``, the count the project's launch command passed to it.

    ``stream_interval``: the tokens per streamed event the fleet is configured with; a server that
    takes it per request gets it, another one streams at its own launch setting.
    ``tool_call_parser``: the one the fleet is configured with; a server that reports its own
    (SGLang's ``/server_info``) is believed instead.
    """
    url = server_url(url)
    with client(timeout_s=timeout_s, api_key=api_key) as http:
        facts = read_server_facts(http, url, backend)
    if api_key and serves_without_key(url, timeout_s=timeout_s):
        raise FleetError(
            f"{url} answers {PROTECTED_PATH} without the API key although one is configured: "
            "the server runs unauthenticated. Start it with its key (SGLang reads it from --api-key or "
            "a --config file only, vLLM from --api-key or VLLM_API_KEY); a launched fleet's servers are "
            "handed it so, unless the launch command names its own --config."
        )
    slots, source = _slots(url, facts, slots_override, launched_slots)
    return ServerInfo(
        url=url,
        backend=backend,
        model=facts.model,
        model_path=facts.model_path,
        context_length=facts.context_length,
        slots=slots,
        slots_source=source,
        max_req_input_len=facts.max_req_input_len,
        version=facts.version,
        simulator=facts.simulator,
        dialect=facts.dialect,
        stream_interval=stream_interval if facts.dialect.stream_interval_per_request else facts.stream_interval or 1,
        tool_call_parser=facts.tool_call_parser if facts.dialect.server_info_path else tool_call_parser,
        weight_version=facts.weight_version,
    )


def _slots(url: str, facts: ServerFacts, configured: int | None, launched: int | None) -> tuple[int, str]:
    """A server's running-request slots and where they came from: the configuration's, else its
    own report, else what its launch command passed; else an error naming what the user sets."""
    if configured is not None:
        return configured, SLOTS_CONFIGURED
    if facts.slots is not None:
        return facts.slots, SLOTS_FROM_SERVER
    if launched is not None:
        return launched, SLOTS_LAUNCHED
    flag = facts.dialect.slots_flag
    if facts.dialect.server_info_path is None:  # vLLM: nothing describes the server
        raise FleetError(
            f"{url}: the server does not report its running-request slots ({flag}; vLLM's default "
            f"is 1024 on GPUs with 70 GiB or more, 256 otherwise): {SET_SLOTS} to the {flag} the "
            f"servers run with, or, in launch mode, pass {flag} {{max_running_requests}} in "
            "fleet.launch.command"
        )
    raise FleetError(
        f"{url}{facts.dialect.server_info_path} reports no running-request slots (no effective "
        f"slots in internal_states and max_running_requests is null): {SET_SLOTS} to the "
        "--max-running-requests the servers run with"
    )


def probe_fleet(
    urls: Sequence[str],
    *,
    backend: str,
    api_key: str | None = None,
    slots_override: int | None = None,
    launched_slots: Mapping[str, int] | None = None,
    stream_interval: int,
    tool_call_parser: str | None = None,
    timeout_s: float = 30.0,
    allow_unreachable: bool = False,
) -> FleetInfo:
    """Probe every server; with ``allow_unreachable`` a dead one is listed, not fatal, while one answers.

    ``launched_slots``: by URL, the slots the launch command passed to each server the project launched.
    """
    if not urls:
        raise FleetError("the fleet has no servers")
    probed: list[ServerInfo] = []
    unreachable: list[str] = []
    for url in urls:
        try:
            probed.append(
                probe_server(
                    url,
                    backend=backend,
                    api_key=api_key,
                    slots_override=slots_override,
                    launched_slots=(launched_slots or {}).get(url.rstrip("/")),
                    stream_interval=stream_interval,
                    tool_call_parser=tool_call_parser,
                    timeout_s=timeout_s,
                )
            )
        except ServerUnreachableError:
            if not allow_unreachable:
                raise
            unreachable.append(server_url(url))
    if not probed:
        raise ServerUnreachableError(f"no server of the fleet answers: {', '.join(unreachable)}")
    servers = tuple(probed)
    for field_name in ("model", "context_length", "weight_version"):
        values: dict[Any, list[str]] = {}
        for s in servers:
            values.setdefault(getattr(s, field_name), []).append(s.url)
        if len(values) > 1:
            described = "; ".join(f"{value!r} on {', '.join(where)}" for value, where in values.items())
            raise FleetMismatchError(f"servers disagree on {field_name}: {described}")
    return FleetInfo(servers, tuple(unreachable))
