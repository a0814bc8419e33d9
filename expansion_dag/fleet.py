"""Provisioning and probing a fleet of SGLang (or vLLM) servers, with no Dagster in sight.

- ``Launcher`` starts one server process per GPU from a command template, idempotently: Dagster
  sets resources up in every step process, and several steps may start at once, so the check and
  the start happen under a file lock and a live pid file means "already starting".
- ``wait_ready`` waits for ``GET /health`` 200, treating refused connections (model loading) and
  503 (warmup) as "not yet", and quotes the server's last log lines when it gives up.
- ``probe_fleet`` reads what requests depend on from the servers themselves: the context length
  (``/v1/models`` ``max_model_len``, cross-checked with ``/server_info``), the running-request
  slots, the model and the version. Servers that disagree are an error naming them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from expansion_dag.errors import FleetError, FleetMismatchError, ServerStartError, ServerUnreachableError

Backend = Literal["sglang", "vllm"]

#: vLLM exposes no slot count; its default ``--max-num-seqs`` is the best guess without an override.
VLLM_DEFAULT_SLOTS = 256
READY_LOG_LINE = "The server is fired up and ready to roll!"


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


def is_healthy(url: str, *, timeout_s: float = 30.0, attempts: int = 2) -> bool:
    """``/health`` runs a real 1-token generation; a loaded server may answer 503 once, so ask twice."""
    for _ in range(attempts):
        try:
            if httpx.get(url.rstrip("/") + "/health", timeout=timeout_s).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
    return False


def tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.exists():
        return "(no log)"
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        fh.seek(max(0, fh.tell() - 16384))
        text = fh.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def wait_ready(
    url: str,
    *,
    timeout_s: float,
    poll_s: float = 0.5,
    log_path: Path | None = None,
    pid: int | None = None,
) -> None:
    """Block until ``/health`` answers 200; refused connections and 503 mean "still starting"."""
    url = url.rstrip("/")
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        try:
            status = httpx.get(url + "/health", timeout=max(poll_s, 5.0)).status_code
            if status == 200:
                return
            last = f"HTTP {status} (warming up)" if status == 503 else f"HTTP {status}"
        except httpx.ConnectError:
            last = "connection refused (loading)"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}"
        if pid is not None and not _alive(pid):
            raise ServerStartError(
                f"{url}: the server process {pid} exited before it was ready. Last log lines "
                f"({log_path}):\n{tail(log_path)}"
            )
        if time.monotonic() >= deadline:
            raise ServerStartError(
                f"{url}: not ready after {timeout_s:.0f} s (last: {last}). Last log lines "
                f"({log_path}):\n{tail(log_path)}"
            )
        time.sleep(poll_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0); reap it to tell.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """One server to launch: which GPU and which port."""

    gpu: int
    port: int


class Launcher:
    """Starts and stops one server process per GPU; safe to call from many processes at once."""

    def __init__(
        self,
        *,
        state_dir: str | os.PathLike[str],
        command: str,
        host: str,
        specs: Sequence[LaunchSpec],
        values: Mapping[str, Any],
        env: Mapping[str, str] | None = None,
        api_key: str | None = None,
    ):
        self.state_dir = Path(state_dir)
        self.command = command
        self.host = host
        self.specs = list(specs)
        self.values = dict(values)
        self.env = dict(env or {})
        self._api_key = api_key

    def url(self, spec: LaunchSpec) -> str:
        return f"http://{self.host}:{spec.port}"

    @property
    def urls(self) -> list[str]:
        return [self.url(s) for s in self.specs]

    def log_path(self, spec: LaunchSpec) -> Path:
        return self.state_dir / f"server-{spec.port}.log"

    def _pid_path(self, spec: LaunchSpec) -> Path:
        return self.state_dir / f"server-{spec.port}.pid"

    def _argv(self, spec: LaunchSpec) -> list[str]:
        # The key fills ``{api_key}`` only in the argv handed to the process, never in a log line.
        values = {**self.values, "host": self.host, "port": spec.port, "gpu": spec.gpu, "api_key": self._api_key or ""}
        try:
            return shlex.split(self.command.format(**values))
        except KeyError as exc:
            raise FleetError(f"launch command names an unknown placeholder {exc}; known: {sorted(values)}") from exc

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / "launch.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _pid(self, spec: LaunchSpec) -> int | None:
        try:
            pid = int(self._pid_path(spec).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _alive(pid) else None

    def ensure_running(self, *, timeout_s: float) -> list[str]:
        """Start what is not running, then wait until every server is ready. Returns the URLs."""
        started: list[str] = []
        with self._locked():
            for spec in self.specs:
                if self._pid(spec) is not None or is_healthy(self.url(spec), timeout_s=5, attempts=1):
                    continue  # launched by an earlier step, or already served
                self._start(spec)
                started.append(self.url(spec))
        for spec in self.specs:
            wait_ready(self.url(spec), timeout_s=timeout_s, log_path=self.log_path(spec), pid=self._pid(spec))
        return started

    def _start(self, spec: LaunchSpec) -> None:
        env = {**os.environ, **self.env, "CUDA_VISIBLE_DEVICES": str(spec.gpu)}
        if self._api_key:
            env["SGLANG_API_KEY"] = self._api_key
        log = open(self.log_path(spec), "ab")
        try:
            process = subprocess.Popen(
                self._argv(spec),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                # Its own session: the server outlives the step that started it, and a stop
                # reaches every process it forked.
                start_new_session=True,
            )
        except OSError as exc:
            raise ServerStartError(f"{self.url(spec)}: cannot start {self._argv(spec)[0]!r}: {exc}") from exc
        finally:
            log.close()
        self._pid_path(spec).write_text(str(process.pid))

    def stop(self, *, timeout_s: float = 30.0) -> list[int]:
        """Stop every server this launcher started (SIGTERM, then SIGKILL). Returns the pids."""
        stopped = []
        with self._locked():
            for spec in self.specs:
                pid = self._pid(spec)
                self._pid_path(spec).unlink(missing_ok=True)
                if pid is None:
                    continue
                _stop_group(pid, timeout_s)
                stopped.append(pid)
        return stopped


def _stop_group(pid: int, timeout_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
