"""Probing a fleet of SGLang (or vLLM) servers, with no Dagster in sight (launching: ``launcher.py``).

- ``probe_fleet`` reads what requests depend on from the servers themselves: the context length
  (``/v1/models`` ``max_model_len``, cross-checked with ``/server_info``), the running-request
  slots, the model and the version. Servers that disagree are an error naming them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import httpx

from expansion_dag.errors import FleetError, FleetMismatchError, ServerUnreachableError

Backend = Literal["sglang", "vllm"]

#: vLLM exposes no slot count; its default ``--max-num-seqs`` is the best guess without an override.
VLLM_DEFAULT_SLOTS = 256


@dataclass(frozen=True)
class ServerInfo:
    url: str
    backend: str
    model: str
    model_path: str
    context_length: int
    slots: int
    version: str | None
    simulator: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FleetInfo:
    servers: tuple[ServerInfo, ...]
    #: Servers that did not answer the probe, when the caller tolerates some being down.
    unreachable: tuple[str, ...] = ()

    @property
    def context_length(self) -> int:
        return self.servers[0].context_length

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
        """The model as part of a completion's identity; a simulated answer never passes for a real one."""
        return self.model_path + (" (simulator)" if self.simulated else "")

    def server(self, url: str) -> ServerInfo:
        for info in self.servers:
            if info.url == url:
                return info
        raise KeyError(url)


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _get_json(client: httpx.Client, url: str, path: str) -> Any:
    try:
        response = client.get(url + path)
    except httpx.HTTPError as exc:
        raise ServerUnreachableError(f"{url}{path}: cannot reach the server ({type(exc).__name__}: {exc})") from exc
    if response.status_code == 401:
        raise FleetError(f"{url}{path}: 401 Unauthorized: set the API key environment variable the fleet names")
    if response.status_code != 200:
        raise FleetError(f"{url}{path}: HTTP {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError as exc:
        raise FleetError(f"{url}{path}: not JSON: {response.text[:200]}") from exc


def probe_server(
    url: str,
    *,
    backend: Backend = "sglang",
    api_key: str | None = None,
    slots_override: int | None = None,
    timeout_s: float = 30.0,
) -> ServerInfo:
    """What one server says about itself."""
    url = url.rstrip("/")
    with httpx.Client(timeout=timeout_s, headers=_auth(api_key)) as client:
        models = _get_json(client, url, "/v1/models")
        try:
            entry = models["data"][0]
            model = str(entry["id"])
            context_length = int(entry["max_model_len"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise FleetError(f"{url}/v1/models: no served model with max_model_len in {models!r:.300}") from exc
        if backend == "vllm":
            # vLLM has no /server_info; its /version is optional across releases.
            version = None
            with contextlib.suppress(FleetError):
                version = _get_json(client, url, "/version").get("version")
            return ServerInfo(
                url=url,
                backend=backend,
                model=model,
                model_path=str(entry.get("root") or model),
                context_length=context_length,
                slots=slots_override or VLLM_DEFAULT_SLOTS,
                version=version,
                simulator=bool(entry.get("simulator", False)),
            )
        info = _get_json(client, url, "/server_info")
    declared = info.get("context_length")
    if declared is not None and int(declared) != context_length:
        raise FleetMismatchError(
            f"{url}: /v1/models says max_model_len {context_length} but /server_info says "
            f"context_length {declared}"
        )
    return ServerInfo(
        url=url,
        backend=backend,
        model=model,
        model_path=str(info.get("model_path") or model),
        context_length=context_length,
        slots=slots_override or _sglang_slots(url, info),
        version=info.get("version"),
        simulator=bool(info.get("simulator", False)),
    )


def _sglang_slots(url: str, info: Mapping[str, Any]) -> int:
    """Running-request slots: the scheduler's effective figure per DP rank, else the launch flag."""
    states = info.get("internal_states") or []
    effective = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
    if effective and all(isinstance(n, int) and n > 0 for n in effective):
        return sum(effective)
    declared = info.get("max_running_requests")
    if isinstance(declared, int) and declared > 0:
        return declared
    raise FleetError(
        f"{url}/server_info reports no running-request slots (no internal_states and "
        "max_running_requests is null): set slots_override on the fleet"
    )


def probe_fleet(
    urls: Sequence[str],
    *,
    backend: Backend = "sglang",
    api_key: str | None = None,
    slots_override: int | None = None,
    timeout_s: float = 30.0,
    allow_unreachable: bool = False,
) -> FleetInfo:
    """Probe every server; with ``allow_unreachable`` a dead one is listed, not fatal, while one answers."""
    if not urls:
        raise FleetError("the fleet has no servers")
    probed: list[ServerInfo] = []
    unreachable: list[str] = []
    for url in urls:
        try:
            probed.append(
                probe_server(url, backend=backend, api_key=api_key, slots_override=slots_override, timeout_s=timeout_s)
            )
        except ServerUnreachableError:
            if not allow_unreachable:
                raise
            unreachable.append(url.rstrip("/"))
    if not probed:
        raise ServerUnreachableError(f"no server of the fleet answers: {', '.join(unreachable)}")
    servers = tuple(probed)
    for field_name in ("model", "context_length"):
        values: dict[Any, list[str]] = {}
        for s in servers:
            values.setdefault(getattr(s, field_name), []).append(s.url)
        if len(values) > 1:
            described = "; ".join(f"{value!r} on {', '.join(where)}" for value, where in values.items())
            raise FleetMismatchError(f"servers disagree on {field_name}: {described}")
    return FleetInfo(servers, tuple(unreachable))
