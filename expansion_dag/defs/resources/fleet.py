"""The fleet resource: provisions (launch mode) or attaches to SGLang servers, then probes them:
what they serve (context, slots, model) and which weights (their names where known, and a probe of
what they answer: ``expansion_dag.servers.weights``)."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import replace
from collections.abc import Callable
from typing import Any, Optional

import dagster as dg
from pydantic import PrivateAttr

from expansion_dag.config import FleetSettings
from expansion_dag.core import FleetError, WeightsProbe, server_url
from expansion_dag.servers import (
    FleetInfo,
    Launcher,
    LaunchSpec,
    folder_weights,
    is_healthy,
    probe_fleet,
    probe_fleet_weights,
    dialect_for,
    weights_label,
)


class FleetResource(dg.ConfigurableResource, FleetSettings):
    """SGLang servers, one per GPU: launched (``launch``) or already running (``attach``).

    A run that uses the fleet provisions it when the run starts (``setup_for_execution``: servers
    launched if need be, then every one probed) and its assets read what was probed (``info``).
    Servers a run launched for itself alone (``launch_scope: run``, a GPU pod per shard run) stop
    when it ends, unless another run uses them; a fleet launched for all shards (``fleet``) is
    shared by their runs and outlives each, stopped by the ``expansion-dag`` command that launched
    it when it ends, or by ``expansion-dag fleet stop`` (docs/operations.md: who owns the fleet).
    """

    _info: Optional[FleetInfo] = PrivateAttr(default=None)
    _launched_here: bool = PrivateAttr(default=False)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._info = self.provision(context.log)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self.mode != "launch":
            return
        stopped, left_to = self.launcher().release(keep=not (self._launched_here and self.launch_scope == "run"))
        if context.log is not None and stopped:
            context.log.info(f"stopped the {len(stopped)} server(s) this run launched")
        if context.log is not None and left_to:
            context.log.info(f"left the server(s) this run launched running for {'; '.join(left_to)}")

    @property
    def info(self) -> FleetInfo:
        """The fleet as probed when this run started."""
        if self._info is None:
            raise FleetError("the fleet was not provisioned: the resource is read outside a Dagster run")
        return self._info

    def api_key(self) -> Optional[str]:
        return os.environ.get(self.api_key_env) or None

    def command(self) -> str:
        """The launch command template; a keyed fleet's servers get the key off their command line
        (the dialect's ``key_flags``: SGLang by ``--config {api_key_file}``, vLLM in its
        environment), and the tool-call parser by the backend's flags."""
        command, dialect = self.launch_command, dialect_for(self.backend)
        if self.tool_call_parser and "{tool_call_parser}" not in command:
            command += " " + dialect.tool_call_flags.format(tool_call_parser=shlex.quote(self.tool_call_parser))
        if self.api_key() and dialect.key_flags and "{api_key_file}" not in command:
            command += " " + dialect.key_flags
        return command

    def launcher(self) -> Launcher:
        gpus = self.gpus or list(range(self.num_servers))
        if self.launch_scope == "run":
            gpus = gpus[:1]  # the one GPU this run's pod was given
        return Launcher(
            state_dir=os.path.abspath(self.state_dir),
            command=self.command(),
            host=self.host,
            specs=[LaunchSpec(gpu=g, port=self.base_port + i) for i, g in enumerate(gpus)],
            values={
                "model_path": self.model_path,
                "context_length": self.context_length,
                "max_running_requests": self.max_running_requests,
                "stream_interval": self.stream_interval,
                "tool_call_parser": self.tool_call_parser or "",
                "python": sys.executable,
            },
            api_key=self.api_key(),
            key_env=dialect_for(self.backend).key_env,
        )

    def _configured_urls(self) -> list[str]:
        if self.mode == "attach":
            if not self.urls:
                raise FleetError("attach mode needs `urls`")
            return [u.rstrip("/") for u in self.urls]
        return self.launcher().urls

    def server_urls(self) -> list[str]:
        """The servers as records, logs and metadata name them: without credentials (sent apart)."""
        return [server_url(u) for u in self._configured_urls()]

    def provision(self, log: Any = None) -> FleetInfo:
        """Ensure every server runs and is ready, then probe them all."""
        if self.mode == "launch":
            launcher = self.launcher()
            try:
                started = launcher.ensure_running(timeout_s=self.startup_timeout_s)
            finally:
                for note in launcher.notes if log is not None else []:
                    log.warning(note)
            self._launched_here = self._launched_here or bool(started)
            if started and log is not None:
                log.info(f"launched {len(started)} server(s): {', '.join(started)}")
        return self.probe()

    def probe(self) -> FleetInfo:
        """What the servers say of themselves, and the weights' names (no generation request)."""
        info = probe_fleet(
            self._configured_urls(),
            backend=self.backend,  # type: ignore[arg-type]
            api_key=self.api_key(),
            slots_override=self.slots_override,
            # Servers this project launches: the slots their command passed, where they say none.
            launched_slots=self.launcher().launched_slots() if self.mode == "launch" else None,
            stream_interval=self.stream_interval,
            tool_call_parser=self.tool_call_parser,
            allow_unreachable=self.fallback_to_healthy,
        )
        return replace(info, weights=self.weights(info))

    def weights_probe(self, urls: Optional[list[str]] = None, log: Any = None) -> Optional[WeightsProbe]:
        """What the weights of the servers at ``urls`` (default: the whole fleet) answer the probe,
        asked now (``probe_fleet_weights``: one short greedy request each, FleetMismatchError where
        they disagree). A night's budget asks every server, so that one serving other weights stops
        it at once; a shard's run asks its own, to register with its identity before it sends
        anything. None if no server answered."""
        fleet = self.info
        if urls is not None:
            fleet = replace(fleet, servers=tuple(fleet.server(u) for u in urls))
        info = probe_fleet_weights(fleet, api_key=self.api_key())
        for server in info.servers:
            if server.probe_error is not None and log is not None:
                log.warning(f"{server.url} did not answer the weights probe ({server.probe_error}): its weights "
                            "are not compared with the store's this run")
        return info.probe

    def weights(self, fleet: FleetInfo) -> str:
        """What is known of the weights ``fleet`` serves: in launch mode the model folder's commit or
        digest (``folder_weights``; a simulator serves none), then ``model_revision`` and the
        version the servers report. Probed again by every run: a folder changed since is new weights."""
        folder = None
        if self.mode == "launch" and not self.launcher().launches_simulator:
            folder = folder_weights(self.model_path, self.model_revision)
        reported = fleet.servers[0].weight_version  # the servers agree (probe_fleet)
        return weights_label(
            folder,
            f"revision {self.model_revision}" if self.model_revision else None,
            f"weight_version {reported}" if reported else None,
        )

    def server_for_shard(self, shard_index: int) -> tuple[str, bool]:
        """The shard's own server, or a healthy one when it is down and fallback is allowed.

        Returns the URL and whether it is a fallback.
        """
        urls = self.server_urls()
        if self.mode == "launch" and self.launch_scope == "run":
            return urls[0], False  # the run's own server serves whichever shard the run is for
        if shard_index >= len(urls):
            raise FleetError(f"shard {shard_index} has no server: the fleet has {len(urls)}")
        own = urls[shard_index]
        if is_healthy(own) or not self.fallback_to_healthy:
            return own, False
        for offset in range(1, len(urls)):
            candidate = urls[(shard_index + offset) % len(urls)]
            if is_healthy(candidate):
                return candidate, True
        raise FleetError(f"no healthy server: {own} (the shard's own) and every other server are down")

    def stop(self, say: Optional[Callable[[str], None]] = None) -> list[int]:
        """Stop the whole fleet, which no command or run may be using (``expansion-dag fleet stop``);
        ``say``: what was found that a person should know (a record that is not ours)."""
        if self.mode != "launch":
            return []
        launcher = self.launcher()
        try:
            return launcher.stop()
        finally:
            for note in launcher.notes if say is not None else []:
                say(note)

    def use(self) -> None:
        """Count this process among the fleet's users (an ``expansion-dag`` command, for its whole life)."""
        if self.mode == "launch":
            self.launcher().use()

    def release(self, keep: bool = False) -> tuple[list[int], list[str]]:
        """This process's use ends: what its command launched stops, unless ``keep`` or another
        command or run uses it (``Launcher.release``). The pids stopped, the users it was left to."""
        return self.launcher().release(keep=keep) if self.mode == "launch" else ([], [])

    def effective_config(self, fleet: FleetInfo, url: str) -> dict[str, Any]:
        """What this shard ran with, as compared between materializations (no secrets)."""
        info = fleet.server(url)
        return {
            "backend": info.backend,
            "model": info.model,
            "model_path": info.model_path,
            "weights": fleet.weights,
            "server_version": info.version,
            "server_dialect": info.dialect.name,
            "context_length": info.context_length,
            "max_req_input_len": info.max_req_input_len,
            "slots": info.slots,
            "slots_source": info.slots_source,
            "stream_interval": info.stream_interval,
            "tool_call_parser": info.tool_call_parser,
            "simulator": info.simulator,
            "launch_command": self.command() if self.mode == "launch" else None,
        }
