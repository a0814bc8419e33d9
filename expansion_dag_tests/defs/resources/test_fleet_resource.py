"""The fleet resource's launch scopes, with the simulator launched as a real process."""

import ssl
import sys

from expansion_dag.config import SGLANG_LAUNCH_COMMAND, SIMULATOR_LAUNCH_COMMAND
from expansion_dag.defs.resources import FleetResource
from expansion_dag.servers import SLOTS_FROM_SERVER, SLOTS_LAUNCHED, tls_context
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
    assert config["stream_interval"] == 256
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
