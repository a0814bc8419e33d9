"""Secrets stay out of what others can read: a launched server's command line (any user of the machine
reads it with ``ps``), its log from the first line, the completion records, the run's logs and
metadata, the CLI's errors. Launched SGLang servers read the key from a file only this user can
read, removed once they are ready; vLLM servers from their environment. A fleet URL's
``user:password@`` is sent as basic auth with every request, to a proxy that asks it on each path."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import dagster as dg
import httpx
import pytest

from expansion_dag.config import SIMULATOR_LAUNCH_COMMAND
from expansion_dag.core import FleetError
from expansion_dag.defs import SHARD_KEYS
from expansion_dag.defs.assets import budgeted_prompts, completions, shard_prompts
from expansion_dag.defs.resources import FleetResource
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag_tests.helpers import command_lines_holding, prompt_frame, prompts_asset, resources
from expansion_dag_tests.ports import free_port, free_ports

KEY = "sk-launch-7d1e0c94a2"
#: Shows, in the server's log before it starts, the mode of the file it was handed and what it says.
SHOWS_ITS_KEY_FILE = "sh -c 'stat -c \"key file mode %a\" {api_key_file} && cat {api_key_file} && exec \"$0\" \"$@\"' "


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_a_launched_server_gets_its_key_off_its_command_line_and_out_of_its_log(tmp_path, monkeypatch, backend):
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    [port] = free_ports(1)
    command = SIMULATOR_LAUNCH_COMMAND + (" --backend vllm" if backend == "vllm" else "")
    fleet = FleetResource(
        mode="launch", backend=backend, launch_command=command, num_servers=1, base_port=port,
        state_dir=str(tmp_path), startup_timeout_s=60, slots_override=4 if backend == "vllm" else None,
    )
    if backend == "sglang":
        fleet = FleetResource(**{**fleet.model_dump(), "launch_command": SHOWS_ITS_KEY_FILE + fleet.command()})
    try:
        # The probe fails unless the server wants the key, and answers with the one it was given.
        info = fleet.provision()
        record = (tmp_path / f"server-{port}.json").read_text()
        pid = json.loads(record)["pid"]
        assert KEY not in record  # the launch command it keeps names the key's file, never the key
        assert Path(f"/proc/{pid}").exists() and info.servers[0].backend == backend
        assert command_lines_holding(KEY) == []
        assert not list(tmp_path.glob("*.key.yaml"))  # read at start-up, then removed
    finally:
        assert fleet.stop() == [pid]
    log = (tmp_path / f"server-{port}.log").read_text()
    assert KEY not in log and "fired up and ready to roll" in log
    if backend == "sglang":
        assert log.startswith('key file mode 600\napi-key: "***"\n')  # masked from the first line


def test_a_launch_command_that_puts_the_key_on_the_command_line_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    [port] = free_ports(1)
    for placed in ("--api-key {api_key}", "--api-key=sk-written-in-the-file"):
        fleet = FleetResource(mode="launch", launch_command=f"{SIMULATOR_LAUNCH_COMMAND} {placed}",
                              num_servers=1, base_port=port, state_dir=str(tmp_path))
        with pytest.raises(FleetError, match=r"puts the API key on the server's command line, where every user"):
            fleet.provision()
    assert not list(tmp_path.glob("server-*.json"))  # nothing was started


class BasicAuthProxy:
    """A real HTTP proxy on 127.0.0.1 that answers 401 to any request without the basic auth of
    ``user:password``, on every path, and forwards the others to ``upstream`` (each answer whole)."""

    def __init__(self, upstream: str, user: str, password: str):
        self.upstream = upstream
        self.expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.passed: list[str] = []
        self.refused: list[str] = []
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Authorization") != proxy.expected:
                    proxy.refused.append(self.path)
                    status, content, kind = 401, b'{"error": "unauthorized"}', "application/json"
                else:
                    proxy.passed.append(self.path)
                    answer = httpx.request(self.command, proxy.upstream + self.path, content=body, timeout=60,
                                           headers={"Content-Type": self.headers.get("Content-Type", "")})
                    status, content, kind = answer.status_code, answer.content, answer.headers.get("Content-Type", "")
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = _any

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

    def __enter__(self) -> BasicAuthProxy:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def test_a_servers_password_goes_with_every_request_and_into_no_record_log_or_metadata(tmp_path, instance):
    password = "hunter2-pw"
    frame = prompt_frame([f"Explain idea number {i} in a few words." for i in range(6)])
    sim = SimServerConfig(port=0, max_running_requests=4, ttft_s=0.0, token_latency_s=0.0001, output_median_tokens=20)
    with SimulatedFleet([sim] * len(SHARD_KEYS)) as fleet, contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(BasicAuthProxy(u, "ops", password)) for u in fleet.urls]
        urls = [p.url.replace("http://", f"http://ops:{password}@") for p in proxies]
        res = resources(urls, tmp_path)
        assets = [prompts_asset(frame), budgeted_prompts, shard_prompts, completions]
        runs = [dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"])]
        runs += [dg.materialize(assets, resources=res, instance=instance, partition_key=key,
                                selection=["shard_prompts", "completions"]) for key in SHARD_KEYS]
    assert all(r.success for r in runs)
    # Probes, health checks, loads and chat: each request carried the credentials.
    assert all(p.refused == [] for p in proxies)
    assert any(path.startswith("/v1/chat/completions") for p in proxies for path in p.passed)
    assert any(path == "/health" for p in proxies for path in p.passed)
    servers = [p.url for p in proxies]
    store = res["storage"].completion_store()
    records = [r for key in SHARD_KEYS for r in store.records(key)]
    assert len(records) == frame.height and {r["server"] for r in records} <= set(servers)
    assert password not in "".join(path.read_text() for path in (tmp_path / "completions").rglob("*.jsonl"))
    logs = [entry.user_message for run in runs for entry in instance.all_logs(run.run_id)]
    assert any(servers[0] in message for message in logs) and not any(password in m for m in logs)
    metadata = [m.metadata for run in runs for node in ("budgeted_prompts", "completions")
                for m in run.asset_materializations_for_node(node)]
    assert servers[0] in json.dumps([{k: str(v.value) for k, v in m.items()} for m in metadata], default=str)
    assert password not in json.dumps([{k: str(v.value) for k, v in m.items()} for m in metadata], default=str)


@pytest.mark.parametrize("shards, expected", [
    # The file's two shards, one URL: pydantic's error repeats the whole fleet section.
    ("2", "attach mode needs one URL per shard"),
    # Valid, but nothing listens there.
    ("1", "no server of the fleet answers"),
])
def test_the_cli_never_prints_a_urls_password(tmp_path, shards, expected):
    password = "s3cretpw-77"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))}
    env |= {"EXPANSION_FLEET_URLS": f"http://ops:{password}@127.0.0.1:{free_port()}", "EXPANSION_SHARDS": shards}
    result = subprocess.run([str(Path(sys.executable).parent / "expansion-dag"), "plan"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and expected in result.stderr, result.stderr[-2000:]
    assert password not in result.stdout + result.stderr
