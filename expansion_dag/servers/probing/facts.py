"""What a server says it is: :func:`read_server_facts` reads ``/v1/models`` and the server's own
description (``/server_info``, or ``/get_server_info`` before SGLang 0.5.6), checks the version
floor and picks the dialect; :func:`serves_without_key` tells whether a keyed server really wants
its key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx

from expansion_dag.core import FleetError, FleetMismatchError, ServerUnreachableError
from expansion_dag.servers.dialects import DIALECTS, SGLANG_MIN_VERSION, Dialect, dialect_for
from expansion_dag.servers.transport import client
from expansion_dag.servers.wire import quote


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
    #: SGLang's ``--weight-version`` (a ServerArgs field); None: unsaid, or "default" (not set).
    weight_version: str | None = None


def parse_server_facts(models: object, server_info: object | None, dialect: Dialect) -> ServerFacts:
    """Read ``/v1/models`` and the server's description; FleetError naming what is missing."""
    try:
        entry = models["data"][0]  # type: ignore[index]
        model = str(entry["id"])
        context_length = int(entry["max_model_len"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise FleetError(f"/v1/models: no served model with max_model_len in {quote(models, 300)}") from exc
    info: Mapping[str, Any] = server_info if isinstance(server_info, Mapping) else {}
    declared = info.get("context_length")
    if declared is not None and (not isinstance(declared, int) or isinstance(declared, bool)):
        raise FleetError(f"{dialect.server_info_path} says context_length {quote(declared, 80)}, not a number of tokens")
    if declared is not None and declared != context_length:
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
        weight_version=_weight_version(info.get("weight_version")),
    )


#: What SGLang reports for weights whose version nobody set (``ServerArgs.weight_version``).
UNSET_WEIGHT_VERSION = "default"


def _weight_version(value: object) -> str | None:
    return str(value) if value not in (None, "", UNSET_WEIGHT_VERSION) else None


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
        raise FleetError(
            f"{url}{path}: 401 Unauthorized: set the API key environment variable the fleet names (or, for a server "
            "behind a proxy that asks for a password, the user:password@ of its URL)"
        )
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
        with client(timeout_s=timeout_s) as http:
            return http.get(url + PROTECTED_PATH).status_code == 200
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"{url}{PROTECTED_PATH}: cannot reach the server ({exc})") from exc
