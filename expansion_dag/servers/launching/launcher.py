"""Launching one SGLang (or vLLM) server process per GPU, with no Dagster in sight.

- ``Launcher`` starts one server process per GPU from a command template, idempotently: Dagster
  sets resources up in every step process, and several steps may start at once, so the check and
  the start happen under a file lock, and a server whose record (``records.py``) names a live
  process of this host, started when it was launched, is "already starting". A port served by a
  process it did not start is an error naming that server, never adopted; a launched simulator
  must report the launched pid (``/sim/stats``). A running server launched with another command
  than this configuration's is restarted when no other command or run uses the fleet, else refused
  naming the difference.
- A command stops only what it launched (``release``), and leaves to the others what they still
  use; ``stop`` stops every server of the fleet that nobody uses. No process is signalled that its
  record does not prove the launched one.
- ``Launcher.launched_slots``: the running-request slots each command passes (vLLM's
  ``--max-num-seqs``, SGLang's ``--max-running-requests``), known without asking the server, which
  vLLM could not answer.
- ``wait_ready`` waits for ``GET /health`` 200 (a refused connection or a 503 is "not yet"), and
  quotes the server's last log lines when it gives up.
- The API key stays off the server's command line, which every user of the machine reads (``ps``):
  SGLang gets it in a YAML file of arguments readable by this user alone (``--config
  {api_key_file}``), removed once the server is ready; vLLM in its environment (``VLLM_API_KEY``);
  see ``Dialect.key_flags``. A command that names ``{api_key}`` or ``--api-key`` is refused.
- SGLang 0.5.23 logs its arguments, the key among them, at start-up: a keyed server's output
  reaches its log through ``log_filter.py``, which masks the key as it is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from expansion_dag.core import FleetError, ServerStartError, pid_alive
from expansion_dag.servers.dialects import SLOTS_FLAGS
from expansion_dag.servers.launching import log_filter
from expansion_dag.servers.launching.records import ServerRecord, fleet_owner, running, unuse, use, users
from expansion_dag.servers.transport import client

#: The project's simulator, launched as ``{python} -m expansion_dag.sim``: it reports its pid.
SIMULATOR_MODULE = "expansion_dag.sim"

def _slots_flag_value(argv: Sequence[str]) -> int | None:
    """The running-request slots an argument list passes (the last such flag, as argparse reads it)."""
    found = None
    for i, arg in enumerate(argv):
        name, equals, value = arg.partition("=")
        if name in SLOTS_FLAGS:
            found = value if equals else (argv[i + 1] if i + 1 < len(argv) else None)
    return int(found) if found is not None and found.isdigit() else None


def is_healthy(url: str, *, timeout_s: float = 30.0, attempts: int = 2) -> bool:
    """``/health`` runs a real 1-token generation; a loaded server may answer 503 once, so ask twice."""
    for _ in range(attempts):
        try:
            url = url.rstrip("/")
            with client(timeout_s=timeout_s) as http:
                answer = http.get(url + "/health")
            if answer.status_code == 200:
                return True
        except httpx.HTTPError:
            pass
    return False


#: The filter a keyed server's output goes through to its log, run as a script (see there).
LOG_FILTER = Path(log_filter.__file__)


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
    log_writer: subprocess.Popen[bytes] | None = None,
) -> None:
    """Block until ``/health`` answers 200; refused connections and 503 mean "still starting".

    ``log_writer``: the process that writes the server's log (the key's mask); a server that exited
    is quoted once it has written all the server said, not before.
    """
    url = url.rstrip("/")
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        try:
            with client(timeout_s=max(poll_s, 5.0)) as http:
                status = http.get(url + "/health").status_code
            if status == 200:
                return
            last = f"HTTP {status} (warming up)" if status == 503 else f"HTTP {status}"
        except httpx.ConnectError:
            last = "connection refused (loading)"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}"
        if pid is not None and not pid_alive(pid):
            if log_writer is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    log_writer.wait(timeout=10)  # it ends once the server's output is closed
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


def _get_json(url: str, path: str, api_key: str | None = None) -> object:
    try:
        with client(timeout_s=5.0, api_key=api_key) as http:
            response = http.get(url + path)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _describe(url: str) -> str:
    """What a server says it is, for an error message."""
    info = _get_json(url, "/server_info")
    if not isinstance(info, dict):
        return "it does not answer /server_info"
    kind = "a simulator" if info.get("simulator") else f"server version {info.get('version')}"
    return f"{kind} serving {info.get('model_path')}"


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
        key_env: str | None = None,
        owner: str | None = None,
    ):
        """``api_key``: the servers' key, handed over in ``{api_key_file}`` where the command names
        it, and in the variable ``key_env`` of their environment where one is given. ``owner``: whose
        the servers it launches are (default: ``records.fleet_owner``)."""
        self.state_dir = Path(state_dir)
        self.command = command
        self.host = host
        self.specs = list(specs)
        self.values = dict(values)
        self.env = dict(env or {})
        self._api_key = api_key
        self._key_env = key_env
        self._log_writers: dict[int, subprocess.Popen[bytes]] = {}  # by port: the key's masks
        self.owner = owner or fleet_owner()
        #: What was found and done that a person should know: records not ours, servers restarted.
        self.notes: list[str] = []

    def url(self, spec: LaunchSpec) -> str:
        return f"http://{self.host}:{spec.port}"

    @property
    def urls(self) -> list[str]:
        return [self.url(s) for s in self.specs]

    def log_path(self, spec: LaunchSpec) -> Path:
        return self.state_dir / f"server-{spec.port}.log"

    def _record_path(self, spec: LaunchSpec) -> Path:
        return self.state_dir / f"server-{spec.port}.json"

    def launched_slots(self) -> dict[str, int]:
        """Each server's running-request slots as its command passes them, by URL; a server whose
        command passes none is left out (it says its own, or the configuration must)."""
        passed = {self.url(spec): _slots_flag_value(self._argv(spec)) for spec in self.specs}
        return {url: slots for url, slots in passed.items() if slots is not None}

    def _key_path(self, spec: LaunchSpec) -> Path:
        # SGLang's --config wants a .yaml name.
        return self.state_dir / f"server-{spec.port}.key.yaml"

    def _argv(self, spec: LaunchSpec) -> list[str]:
        return _argv(self.command, {**self.values, "host": self.host, "port": spec.port, "gpu": spec.gpu,
                                    "api_key_file": str(self._key_path(spec))})

    def _running(self, spec: LaunchSpec) -> ServerRecord | None:
        """The server's record while it names the launched process (``records.running``; under the lock)."""
        return running(self._record_path(spec), self.url(spec), self.notes)

    def use(self) -> None:
        """Count this process among the fleet's users (``records.use``) until :meth:`unuse`."""
        with _locked(self.state_dir):
            use(self.state_dir, self.owner)

    def unuse(self) -> None:
        unuse(self.state_dir, self.owner)

    def _others(self) -> dict[str, list[str]]:
        """The fleet's live users other than this launcher's owner: what each process is, by owner."""
        return {owner: what for owner, what in users(self.state_dir).items() if owner != self.owner}

    def _in_use(self) -> str:  # the other users, said; "" when there are none
        return "; ".join(what for found in self._others().values() for what in found)

    def ensure_running(self, *, timeout_s: float) -> list[str]:
        """Start what is not running, then wait until every server is ready. Returns the URLs.

        This process counts among the fleet's users from then on (:meth:`unuse`)."""
        started: list[str] = []
        with _locked(self.state_dir):
            use(self.state_dir, self.owner)
            try:
                for spec in self.specs:
                    record = self._running(spec)
                    if record is not None:
                        changed = record.difference(self._argv(spec), spec.gpu)
                        if changed is None:
                            continue  # launched by an earlier step, or an earlier run
                        self._restart(spec, record, changed)
                    _refuse_foreign(self.host, spec.port)
                    self._start(spec)
                    started.append(self.url(spec))
            except BaseException:
                unuse(self.state_dir, self.owner)  # it uses nothing
                raise
        for spec in self.specs:
            # The recorded pid, alive or not: a server that died at once is then told apart from
            # one still loading, and reported now rather than after the whole timeout.
            record = ServerRecord.read(self._record_path(spec))
            pid = record.pid if record is not None else None
            try:
                wait_ready(self.url(spec), timeout_s=timeout_s, log_path=self.log_path(spec), pid=pid,
                           log_writer=self._log_writers.get(spec.port))
            finally:
                self._key_path(spec).unlink(missing_ok=True)  # read at start-up, needed no more
            if self.launches_simulator:
                _verify_simulator(self.url(spec), pid, self._api_key)
        return started

    def _restart(self, spec: LaunchSpec, record: ServerRecord, changed: str) -> None:
        """Stop a server launched otherwise than this configuration says, unless others use it."""
        who = self._in_use()
        if who:
            raise FleetError(
                f"{self.url(spec)} runs a server launched otherwise than this configuration says ({changed}), "
                f"and another command or run uses it ({who}): it is not restarted under them. Let them end, "
                "then run again; or set fleet.launch.base_port to launch this configuration's servers on other ports"
            )
        self._stop_where(lambda found: found == record, 30.0)
        self.notes.append(f"{self.url(spec)}: restarted: it was launched otherwise than this configuration says "
                          f"({changed})")

    @property
    def launches_simulator(self) -> bool:
        return SIMULATOR_MODULE in shlex.split(self.command)

    def _start(self, spec: LaunchSpec) -> None:
        argv = self._argv(spec)
        env = {**os.environ, **self.env, "CUDA_VISIBLE_DEVICES": str(spec.gpu)}
        if self._api_key and self._key_env:
            env[self._key_env] = self._api_key
        if "{api_key_file}" in self.command:
            _write_key(self._key_path(spec), self._api_key)
        with open(self.log_path(spec), "ab") as log:
            output, masking = _output(self.log_path(spec), log, self._api_key)
            try:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=env,
                    # Its own session: the server outlives the step that started it, and a stop
                    # reaches every process it forked.
                    start_new_session=True,
                )
            except OSError as exc:
                raise ServerStartError(f"{self.url(spec)}: cannot start {argv[0]!r}: {exc}") from exc
            finally:
                if masking is not None:
                    masking.stdin.close()  # type: ignore[union-attr]  # the server holds its own copy
                    self._log_writers[spec.port] = masking
        ServerRecord.of(port=spec.port, gpu=spec.gpu, pid=process.pid, argv=argv, owner=self.owner).write(
            self._record_path(spec)
        )

    def stop(self, *, timeout_s: float = 30.0) -> list[int]:
        """Stop every server of the fleet (SIGTERM, then SIGKILL) while no other command or run uses
        it, else raise ``FleetError`` naming them. Returns the pids."""
        with _locked(self.state_dir):
            who = self._in_use()
            if who:
                raise FleetError(f"the fleet is in use ({who}): not stopped; it stops when they end, if they "
                                 "launched it, else once they have ended run this again")
            return self._stop_where(lambda record: True, timeout_s)

    def release(self, *, keep: bool = False, timeout_s: float = 30.0) -> tuple[list[int], list[str]]:
        """This process's use ends: the servers its owner launched stop, unless ``keep`` or another
        command or run uses them, which then owns them (and stops them when it ends). Returns the
        pids stopped and the users they were left to."""
        self.unuse()
        if keep:
            return [], []
        with _locked(self.state_dir):
            others = self._others()
            if not others:
                return self._stop_where(lambda record: record.owner == self.owner, timeout_s), []
            mine = [(spec, record) for spec in self.specs
                    if (record := self._running(spec)) is not None and record.owner == self.owner]
            for spec, record in mine:
                replace(record, owner=min(others)).write(self._record_path(spec))
            return [], [what for found in others.values() for what in found] if mine else []

    def _stop_where(self, chosen: Callable[[ServerRecord], bool], timeout_s: float) -> list[int]:
        stopped = []
        for spec in self.specs:
            record = self._running(spec)
            if record is None or not chosen(record):
                continue
            self._record_path(spec).unlink(missing_ok=True)
            self._key_path(spec).unlink(missing_ok=True)
            _stop_group(record.pid, timeout_s)
            stopped.append(record.pid)
        return stopped


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "launch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _argv(command: str, values: Mapping[str, Any]) -> list[str]:
    words = shlex.split(command)
    if "{api_key}" in command or any(w == "--api-key" or w.startswith("--api-key=") for w in words):
        raise FleetError(
            "the launch command puts the API key on the server's command line, where every user of "
            "the machine reads it (ps): remove {api_key} and --api-key from it; the launcher hands a "
            "configured key over itself (SGLang: --config {api_key_file}, a file only you can read; "
            "vLLM: VLLM_API_KEY in its environment)"
        )
    try:
        return shlex.split(command.format(**values))
    except KeyError as exc:
        raise FleetError(f"launch command names an unknown placeholder {exc}; known: {sorted(values)}") from exc


def _refuse_foreign(host: str, port: int) -> None:
    """A server this launcher did not start is never adopted: on a GPU node, the simulator's
    port may be a real server's, and generating there while saying "simulated" is a lie."""
    with contextlib.closing(socket.socket()) as probe:
        probe.settimeout(2.0)
        taken = probe.connect_ex((host, port)) == 0
    if taken:
        url = f"http://{host}:{port}"
        raise FleetError(
            f"{url} is already served by a process this project did not launch "
            f"({_describe(url)}); stop it, or set fleet.launch.base_port to free ports"
        )


def _verify_simulator(url: str, pid: int | None, api_key: str | None) -> None:
    """The simulator reports its pid: the server on the port must be the one launched here."""
    info = _get_json(url, "/sim/stats", api_key)
    if not (isinstance(info, dict) and info.get("simulator") is True and pid is not None and info.get("pid") == pid):
        raise FleetError(
            f"{url} is not the simulator launched here (pid {pid}): it is "
            f"{_describe(url)}; stop it, or set fleet.launch.base_port to free ports"
        )


def _write_key(path: Path, api_key: str | None) -> None:
    """The key as SGLang reads an argument from its ``--config`` file, readable by this user
    alone; no key, no argument (an empty mapping)."""
    path.unlink(missing_ok=True)  # created anew, never an older file's looser mode
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"api-key: {json.dumps(api_key)}\n" if api_key else "{}\n")  # JSON text is YAML


def _output(log_path: Path, log: BinaryIO, api_key: str | None) -> tuple[Any, subprocess.Popen[bytes] | None]:
    """Where a server writes: its log, through the filter that masks the key when it has one."""
    if not api_key:
        return log, None
    masking = subprocess.Popen(
        [sys.executable, str(LOG_FILTER), str(log_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=log,
        env={log_filter.SECRET_ENV: api_key},
        start_new_session=True,  # outlives the step, as the server does; ends with its output
    )
    return masking.stdin, masking


def _stop_group(pid: int, timeout_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
