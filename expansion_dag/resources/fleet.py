"""The fleet resource: provisions (launch mode) or attaches to SGLang servers, then probes them."""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import dagster as dg
from pydantic import Field

from expansion_dag.errors import FleetError
from expansion_dag.fleet import FleetInfo, probe_fleet
from expansion_dag.launcher import Launcher, LaunchSpec, is_healthy, tool_call_flags
from expansion_dag.server_api import DEFAULT_STREAM_INTERVAL

#: sglang's own launcher; placeholders are filled per server. Flags drift between sglang versions,
#: so the whole command is configuration, not code. With an API key set, ``--api-key {api_key}`` is
#: added (see ``FleetResource.command``): SGLang reads its key from that flag only.
SGLANG_LAUNCH_COMMAND = (
    "python -m sglang.launch_server --model-path {model_path} --host {host} --port {port} "
    "--context-length {context_length} --stream-interval {stream_interval}"
)
#: The simulator takes the same flags, plus its own time model, so launch mode is exercised as is.
SIMULATOR_LAUNCH_COMMAND = (
    "{python} -m expansion_dag.sim --model-path {model_path} --host {host} --port {port} "
    "--context-length {context_length} --max-running-requests {max_running_requests} "
    "--stream-interval {stream_interval} --token-latency-ms 1 "
    "--output-median-tokens 160 --warmup-s 0.5"
)


class FleetResource(dg.ConfigurableResource):
    """SGLang servers, one per GPU: launched (``launch``) or already running (``attach``)."""

    mode: str = Field(default="launch", description="'launch' starts one server per GPU; 'attach' uses `urls`.")
    urls: list[str] = Field(default=[], description="Attach mode: base URLs, one per shard, in shard order.")
    backend: str = Field(default="sglang", description="'sglang' or 'vllm' (OpenAI-compatible server).")
    launch_command: str = Field(
        default=SGLANG_LAUNCH_COMMAND,
        description="Launch mode: command per server; placeholders {model_path} {host} {port} {gpu} "
        "{context_length} {max_running_requests} {stream_interval} {tool_call_parser} {python} {api_key}. With an API "
        "key set and no {api_key} in it, '--api-key {api_key}' is appended.",
    )
    model_path: str = "Qwen/Qwen3-8B"
    context_length: int = Field(
        default=8192, description="Launch parameter only; budgets always use the probed context length."
    )
    max_running_requests: int = Field(
        default=16, description="Launch parameter {max_running_requests}; requests in flight follow the probed slots."
    )
    stream_interval: int = Field(
        default=DEFAULT_STREAM_INTERVAL,
        ge=1,
        description="Tokens per streamed event: vLLM requests ask for it, launched SGLang servers get "
        "it as --stream-interval {stream_interval}; an attached SGLang server streams at its own.",
    )
    tool_call_parser: Optional[str] = Field(
        default=None,
        description="The servers' tool-call parser (e.g. SGLang 'qwen25', vLLM 'hermes' for Qwen3), so that "
        "tool calls come back parsed in message.tool_calls; None: raw <tool_call> text in the content. "
        "Launch mode adds the backend's flags to the command (SGLang --tool-call-parser, vLLM "
        "--enable-auto-tool-choice --tool-call-parser) unless it names {tool_call_parser}; attach mode "
        "states what the vLLM servers were started with (SGLang reports its own).",
    )
    host: str = "127.0.0.1"
    base_port: int = 30000
    gpus: list[int] = Field(default=[], description="Launch mode: one server per GPU; default 0..shards-1.")
    launch_scope: str = Field(
        default="fleet",
        description="Launch mode: 'fleet' starts every server on this machine; 'run' starts one "
        "server on this run's own GPU (a GPU pod per shard run on Kubernetes).",
    )
    num_servers: int = Field(default=2, description="Launch mode, when `gpus` is empty.")
    api_key_env: str = Field(
        default="SGLANG_API_KEY", description="Name of the environment variable holding the API key, if any."
    )
    startup_timeout_s: float = 900.0
    slots_override: Optional[int] = None
    fallback_to_healthy: bool = Field(
        default=True, description="Run a shard on a healthy server when its own server is down."
    )
    state_dir: str = Field(default="", description="Logs and pid files of launched servers.")

    def api_key(self) -> Optional[str]:
        return os.environ.get(self.api_key_env) or None

    def command(self) -> str:
        """The launch command template; a keyed fleet's servers get the key by ``--api-key``, and
        the tool-call parser by the backend's flags."""
        command = self.launch_command
        if self.tool_call_parser and "{tool_call_parser}" not in command:
            command += " " + tool_call_flags(self.backend, self.tool_call_parser)
        if self.api_key() and "{api_key}" not in command:
            command += " --api-key {api_key}"
        return command

    def launcher(self) -> Launcher:
        if self.launch_scope not in ("fleet", "run"):
            raise FleetError(f"launch_scope must be 'fleet' or 'run', got {self.launch_scope!r}")
        gpus = self.gpus or list(range(self.num_servers))
        if self.launch_scope == "run":
            gpus = gpus[:1]  # the one GPU this run's pod was given
        return Launcher(
            state_dir=self.state_dir or os.path.join(os.getcwd(), "storage", "fleet"),
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
        )

    def server_urls(self) -> list[str]:
        if self.mode == "attach":
            if not self.urls:
                raise FleetError("attach mode needs `urls`")
            return [u.rstrip("/") for u in self.urls]
        if self.mode == "launch":
            return self.launcher().urls
        raise FleetError(f"fleet mode must be 'launch' or 'attach', got {self.mode!r}")

    def provision(self, log: Any = None) -> FleetInfo:
        """Ensure every server runs and is ready, then probe them all."""
        if self.mode == "launch":
            started = self.launcher().ensure_running(timeout_s=self.startup_timeout_s)
            if started and log is not None:
                log.info(f"launched {len(started)} server(s): {', '.join(started)}")
        return self.probe()

    def probe(self) -> FleetInfo:
        return probe_fleet(
            self.server_urls(),
            backend=self.backend,  # type: ignore[arg-type]
            api_key=self.api_key(),
            slots_override=self.slots_override,
            stream_interval=self.stream_interval,
            tool_call_parser=self.tool_call_parser,
            allow_unreachable=self.fallback_to_healthy,
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

    def stop(self) -> list[int]:
        return self.launcher().stop() if self.mode == "launch" else []

    def effective_config(self, fleet: FleetInfo, url: str) -> dict[str, Any]:
        """What this shard ran with, as compared between materializations (no secrets)."""
        info = fleet.server(url)
        return {
            "backend": info.backend,
            "model": info.model,
            "model_path": info.model_path,
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
