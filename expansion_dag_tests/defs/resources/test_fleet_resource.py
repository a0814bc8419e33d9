"""The fleet resource's launch scopes, with the simulator launched as a real process, and whose servers
they are (docs/operations.md, who owns the fleet) in a Dagster materialization."""

import os
import socket
import ssl
import subprocess
import sys

import dagster as dg
import httpx
import pytest

from expansion_dag.config import DEFAULT_STREAM_INTERVAL, SGLANG_LAUNCH_COMMAND, SIMULATOR_LAUNCH_COMMAND
from expansion_dag.core import FleetError, pid_alive
from expansion_dag.defs.resources import FleetResource
from expansion_dag.servers import OWNER_ENV, SLOTS_FROM_SERVER, SLOTS_LAUNCHED, ServerRecord, tls_context
from expansion_dag_tests.helpers import wait_for
from expansion_dag_tests.ports import free_ports


def test_run_scope_starts_only_this_runs_server_and_serves_any_shard_from_it(tmp_path, monkeypatch):
    built = []
    create = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or create(*a, **k))
    tls_context.cache_clear()  # an earlier test's context would hide whether one is built, and where
    [port] = free_ports(1)
    fleet = FleetResource(
        mode="launch", launch_scope="run", launch_command=SIMULATOR_LAUNCH_COMMAND, num_servers=8,
        base_port=port, state_dir=str(tmp_path), context_length=4096, stream_interval=24, startup_timeout_s=60,
    )
    try:
        info = fleet.provision()
        assert [s.url for s in info.servers] == [f"http://127.0.0.1:{port}"]
        assert info.context_length == 4096
        # Launched with --stream-interval, and the server says so.
        assert info.servers[0].stream_interval == 24
        assert fleet.server_for_shard(5) == (f"http://127.0.0.1:{port}", False)
        # Health checks and probes share the process's TLS context: each costs ~20 ms of CPU to build.
        assert len(built) == 1
    finally:
        assert len(fleet.stop()) == 1


def test_a_keyed_fleet_launches_its_servers_with_the_key_in_a_file_and_records_no_key(tmp_path, monkeypatch):
    # SGLang reads its key only as an argument, here from its --config file: the probe fails if a
    # launched server runs keyless.
    monkeypatch.setenv("SGLANG_API_KEY", "sk-never-in-metadata")
    [port] = free_ports(1)
    fleet = FleetResource(
        mode="launch", launch_command=SIMULATOR_LAUNCH_COMMAND, num_servers=1,
        base_port=port, state_dir=str(tmp_path), startup_timeout_s=60,
    )
    try:
        info = fleet.provision()
        config = fleet.effective_config(info, info.servers[0].url)
    finally:
        fleet.stop()
    assert config["launch_command"].endswith("--config {api_key_file}")
    assert "sk-never-in-metadata" not in repr(config)
    assert config["simulator"] is True and config["slots"] == 16
    assert config["slots_source"] == SLOTS_FROM_SERVER
    assert config["stream_interval"] == DEFAULT_STREAM_INTERVAL  # launched with the configured interval
    assert sys.executable not in repr(config)


def test_the_sglang_command_names_a_key_file_only_when_a_key_is_set(monkeypatch):
    fleet = FleetResource(mode="launch", launch_command=SGLANG_LAUNCH_COMMAND, api_key_env="FLEET_TEST_KEY")
    monkeypatch.delenv("FLEET_TEST_KEY", raising=False)
    assert "--config" not in fleet.command()
    monkeypatch.setenv("FLEET_TEST_KEY", "k")
    assert fleet.command() == SGLANG_LAUNCH_COMMAND + " --config {api_key_file}"
    # A command that places the file itself is left as written; vLLM reads the key from its environment.
    placed = FleetResource(mode="launch", launch_command="serve --args={api_key_file}", api_key_env="FLEET_TEST_KEY")
    assert placed.command() == "serve --args={api_key_file}"
    vllm = FleetResource(mode="launch", backend="vllm", launch_command="vllm serve {model_path}", api_key_env="FLEET_TEST_KEY")
    assert vllm.command() == "vllm serve {model_path}"


def test_a_tool_call_parser_adds_each_backends_flags_to_the_command():
    sglang = FleetResource(mode="launch", launch_command=SGLANG_LAUNCH_COMMAND, tool_call_parser="qwen25")
    assert sglang.command() == SGLANG_LAUNCH_COMMAND + " --tool-call-parser qwen25"
    # vLLM builds its tool parser only with --enable-auto-tool-choice as well.
    vllm = FleetResource(mode="launch", backend="vllm", launch_command="vllm serve {model_path}", tool_call_parser="hermes")
    assert vllm.command() == "vllm serve {model_path} --enable-auto-tool-choice --tool-call-parser hermes"
    placed = FleetResource(mode="launch", launch_command="serve --parser={tool_call_parser}", tool_call_parser="x")
    assert placed.command() == "serve --parser={tool_call_parser}"
    assert "tool" not in FleetResource(mode="launch", launch_command=SGLANG_LAUNCH_COMMAND).command()


def test_a_launched_vllm_simulator_with_a_tool_parser_gets_auto_tool_choice(tmp_path):
    [port] = free_ports(1)
    fleet = FleetResource(
        mode="launch", backend="vllm", launch_command=SIMULATOR_LAUNCH_COMMAND + " --backend vllm",
        num_servers=1, base_port=port, state_dir=str(tmp_path), startup_timeout_s=60,
        slots_override=16, tool_call_parser="hermes",
    )
    try:
        info = fleet.provision()
        config = fleet.effective_config(info, info.servers[0].url)
    finally:
        fleet.stop()
    # vLLM does not say its parser: the configured one is believed, and its requests ask for "auto".
    assert (info.servers[0].tool_call_parser, info.servers[0].tool_choice) == ("hermes", "auto")
    assert config["tool_call_parser"] == "hermes"


def test_a_launched_vllm_runs_with_the_slots_its_command_passed_without_configured_ones(tmp_path):
    # vLLM reports no slots; the simulator's command passes --max-running-requests {max_running_requests}.
    [port] = free_ports(1)
    fleet = FleetResource(
        mode="launch", backend="vllm", launch_command=SIMULATOR_LAUNCH_COMMAND + " --backend vllm",
        num_servers=1, base_port=port, state_dir=str(tmp_path), startup_timeout_s=60, max_running_requests=6,
    )
    try:
        info = fleet.provision()
        config = fleet.effective_config(info, info.servers[0].url)
    finally:
        fleet.stop()
    assert (config["slots"], config["slots_source"]) == (6, SLOTS_LAUNCHED)


@dg.asset
def served(fleet: FleetResource) -> None:
    """An asset that uses the fleet, as a shard's does: the run provisions it as it starts."""
    assert fleet.info.servers


def materialize(fleet: FleetResource) -> dg.ExecuteInProcessResult:
    return dg.materialize([served], resources={"fleet": fleet}, raise_on_error=False)


def run_scope(tmp_path, port: int) -> FleetResource:
    return FleetResource(mode="launch", launch_scope="run", launch_command=SIMULATOR_LAUNCH_COMMAND,
                         base_port=port, state_dir=str(tmp_path), startup_timeout_s=60)


def forge(tmp_path, port: int, pid: int) -> None:
    """A record naming ``pid`` as the server on ``port``, as a pid reused since reads: the process
    it names started at another time than the server did."""
    ServerRecord(port=port, gpu=0, pid=pid, started="another-boot/12345", host=socket.gethostname(),
                 argv=["python", "-m", "expansion_dag.sim"], owner="an-earlier-run",
                 launched_at=0.0).write(tmp_path / f"server-{port}.json")


def test_a_run_never_signals_a_process_its_record_does_not_prove_and_launches_its_own(tmp_path):
    [port] = free_ports(1)
    stranger = subprocess.Popen(["sleep", "900"], start_new_session=True)  # setsid sleep 900
    try:
        forge(tmp_path, port, stranger.pid)
        result = materialize(run_scope(tmp_path, port))
        assert result.success
        # The run launched its own server, and stopped it as it ended (launch.scope: run).
        assert not (tmp_path / f"server-{port}.json").exists()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/health")
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_a_strangers_server_on_the_port_is_refused_at_once_and_left_alone(tmp_path):
    [port] = free_ports(1)
    stranger = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: _answers(port), "the stranger's server listening")
        forge(tmp_path, port, stranger.pid)
        result = materialize(run_scope(tmp_path, port))
        assert not result.success
        [failure] = [e.event_specific_data.error.to_string() for e in result.all_events
                     if e.event_type_value == "RESOURCE_INIT_FAILURE"]
        assert f"http://127.0.0.1:{port} is already served by a process this project did not launch" in failure
        assert "not ready after" not in failure  # refused, not waited for
        assert stranger.poll() is None and _answers(port)
    finally:
        stranger.kill()
        stranger.wait()


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


#: Another command's use of the fleet at argv[1]: it holds its user's lock until it is killed.
USER = """
import sys, time
from expansion_dag.servers import Launcher
Launcher(state_dir=sys.argv[1], command="unused", host="127.0.0.1", specs=[], values={}).use()
print("using", flush=True)
time.sleep(600)
"""


def test_a_run_leaves_the_server_it_launched_to_another_command_that_uses_it(tmp_path):
    [port] = free_ports(1)
    user = subprocess.Popen([sys.executable, "-c", USER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, OWNER_ENV: "another-command"})
    try:
        assert user.stdout.readline() == "using\n"
        fleet = run_scope(tmp_path, port)
        assert materialize(fleet).success
        # Still served, now the other command's: it stops it when it ends, not this run.
        record = ServerRecord.read(tmp_path / f"server-{port}.json")
        assert record.owner == "another-command" and pid_alive(record.pid)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        with pytest.raises(FleetError, match=r"the fleet is in use \(pid \d+: .*\): not stopped"):
            fleet.stop()
    finally:
        user.kill()
        user.wait()
    assert fleet.stop() == [record.pid]  # nobody uses it now
    assert not pid_alive(record.pid)
