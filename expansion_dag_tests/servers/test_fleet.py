"""Provisioning and probing, against the simulator over real sockets and real processes."""

import dataclasses
import http.server
import json
import sys
import threading

import httpx
import pytest

from expansion_dag.core import FleetError, FleetMismatchError, ServerStartError
from expansion_dag.servers import (
    SLOTS_CONFIGURED,
    SLOTS_FROM_SERVER,
    SLOTS_LAUNCHED,
    FleetInfo,
    Launcher,
    LaunchSpec,
    dialect_for,
    parse_server_facts,
    probe_fleet,
    probe_server,
    wait_ready,
)
from expansion_dag.servers.probing.fleet import _slots
from expansion_dag.servers.launching.launcher import _slots_flag_value
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag_tests.contract.shapes import load_fixture
from expansion_dag_tests.ports import free_port, free_ports


def test_probe_reads_context_slots_model_and_version_from_the_server():
    config = SimServerConfig(port=0, context_length=4096, max_running_requests=24, model_path="org/model-x")
    with SimulatedFleet([config]) as fleet:
        info = probe_server(fleet.urls[0], backend="sglang", stream_interval=1)
    assert info.context_length == 4096
    assert info.slots == 24
    assert info.model_path == "org/model-x"
    assert info.version
    assert info.simulator is True
    assert info.slots_source == SLOTS_FROM_SERVER


def test_probe_exposes_the_longest_prompt_the_scheduler_admits():
    with SimulatedFleet([SimServerConfig(port=0, context_length=4096)]) as fleet:
        info = probe_fleet(fleet.urls, backend="sglang", stream_interval=1)
    # SGLang's max_req_input_len = min(context - 1, kv capacity - 1) - 5; a prompt that long is refused.
    assert info.servers[0].max_req_input_len == 4090
    assert info.max_prompt_tokens == 4089
    # A server whose KV cache is smaller than the context admits less: the fleet's limit is the least.
    small = dataclasses.replace(info.servers[0], url="http://gpu-1:30000", max_req_input_len=2994)
    assert FleetInfo((info.servers[0], small)).max_prompt_tokens == 2993
    assert FleetInfo((dataclasses.replace(small, max_req_input_len=None),)).max_prompt_tokens is None


def test_a_fleet_whose_servers_disagree_on_context_length_is_refused_naming_them():
    configs = [SimServerConfig(port=0, context_length=8192), SimServerConfig(port=0, context_length=32768)]
    with SimulatedFleet(configs) as fleet:
        with pytest.raises(FleetMismatchError) as info:
            probe_fleet(fleet.urls, backend="sglang", stream_interval=1)
    message = str(info.value)
    assert "context_length" in message
    assert fleet.urls[0] in message and fleet.urls[1] in message


def test_a_server_info_whose_context_length_is_not_a_number_is_a_probe_error_naming_server_and_field():
    # A real SGLang's recorded answers, served by a small server of its own, with one field spoiled.
    spoiled = {**load_fixture("sglang", "server_info").body, "context_length": "abc"}
    answers = {"/v1/models": load_fixture("sglang", "models").body, "/server_info": spoiled}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            payload = json.dumps(answers.get(self.path, {})).encode()
            self.send_response(200 if self.path in answers else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(FleetError) as error:
            probe_server(url, backend="sglang", stream_interval=1)
    finally:
        server.shutdown()
        server.server_close()
    assert str(error.value) == f'{url}: /server_info says context_length "abc", not a number of tokens'


def test_a_fleet_whose_servers_serve_different_models_is_refused():
    configs = [SimServerConfig(port=0, model_path="org/a"), SimServerConfig(port=0, model_path="org/b")]
    with SimulatedFleet(configs) as fleet:
        with pytest.raises(FleetMismatchError, match="disagree on model: 'org/a' on .*; 'org/b' on"):
            probe_fleet(fleet.urls, backend="sglang", stream_interval=1)


def test_probing_a_keyed_server_without_the_key_says_so_and_with_it_works():
    with SimulatedFleet([SimServerConfig(port=0, api_key="k-123")]) as fleet:
        with pytest.raises(FleetError, match="401 Unauthorized"):
            probe_server(fleet.urls[0], backend="sglang", stream_interval=1)
        assert probe_server(fleet.urls[0], api_key="k-123", backend="sglang", stream_interval=1).context_length == 8192


def test_a_keyed_fleet_whose_server_answers_without_the_key_is_an_error():
    with SimulatedFleet([SimServerConfig(port=0)]) as fleet:
        with pytest.raises(FleetError, match="answers /v1/models without the API key .* runs unauthenticated"):
            probe_server(fleet.urls[0], api_key="k-123", backend="sglang", stream_interval=1)


def test_vllm_backend_probe_uses_models_and_the_slot_override_and_says_so():
    with SimulatedFleet([SimServerConfig(port=0, backend="vllm", context_length=2048)]) as fleet:
        info = probe_server(fleet.urls[0], backend="vllm", slots_override=64, stream_interval=1)
    assert (info.context_length, info.slots, info.backend) == (2048, 64, "vllm")
    assert info.slots_source == SLOTS_CONFIGURED == "configured: fleet.slots"  # the key a user edits
    assert info.dialect.reasoning_fields[0] == "reasoning"


@pytest.mark.parametrize("version", ["0.5.4", None])
def test_an_sglang_server_streams_at_its_own_interval_whatever_the_fleet_is_configured_with(version):
    """SGLang's chat API takes no interval per request: the probe reads the one it was launched with."""
    configs = [SimServerConfig(port=0, version=version, stream_interval=8), SimServerConfig(port=0, version=version)]
    with SimulatedFleet(configs) as fleet:
        infos = probe_fleet(fleet.urls, stream_interval=32, backend="sglang").servers
    assert [i.stream_interval for i in infos] == [8, 1]


def test_a_vllm_server_streams_at_the_interval_its_requests_ask_for():
    with SimulatedFleet([SimServerConfig(port=0, backend="vllm")]) as fleet:
        info = probe_server(fleet.urls[0], backend="vllm", slots_override=8, stream_interval=32)
    assert info.stream_interval == 32 and info.dialect.stream_interval_per_request


def test_vllm_slots_are_never_guessed_and_the_error_names_what_the_user_sets():
    with SimulatedFleet([SimServerConfig(port=0, backend="vllm")]) as fleet:
        with pytest.raises(FleetError) as info:
            probe_server(fleet.urls[0], backend="vllm", stream_interval=1)
    message = str(info.value)
    assert message.startswith(f"{fleet.urls[0]}: the server does not report its running-request slots (--max-num-seqs")
    # The file's key and its variable (config/test_config.py), and the flag a launched server takes.
    assert "set fleet.slots in the run configuration file (or EXPANSION_SLOTS" in message
    assert "pass --max-num-seqs {max_running_requests} in fleet.launch.command" in message


def test_an_sglang_server_reporting_no_slots_is_an_error_naming_what_the_user_sets():
    # SGLang before 0.5.8 launched without --max-running-requests, as its recorded /get_server_info says.
    info = load_fixture("sglang", "get_server_info_0.5.4")
    facts = parse_server_facts(load_fixture("sglang", "models").body, info.body, dialect_for("sglang", info.version))
    assert facts.slots is None
    with pytest.raises(FleetError) as error:
        _slots("http://gpu-0:30000", facts, None, None)
    message = str(error.value)
    assert message.startswith("http://gpu-0:30000/get_server_info reports no running-request slots")
    assert "set fleet.slots in the run configuration file (or EXPANSION_SLOTS" in message
    assert "the --max-running-requests the servers run with" in message
    assert _slots("http://gpu-0:30000", facts, None, 12) == (12, SLOTS_LAUNCHED)


def test_slots_a_server_does_not_report_are_those_its_launch_command_passed():
    configs = [SimServerConfig(port=0, backend="vllm"), SimServerConfig(port=0, max_running_requests=24)]
    with SimulatedFleet(configs) as fleet:
        vllm, sglang = fleet.urls
        launched = probe_server(vllm, backend="vllm", launched_slots=6, stream_interval=1)
        assert (launched.slots, launched.slots_source) == (6, SLOTS_LAUNCHED)
        # The configuration's slots come first; a server that reports its own is believed over its command.
        assert probe_server(vllm, backend="vllm", slots_override=9, launched_slots=6, stream_interval=1).slots == 9
        assert probe_server(sglang, launched_slots=6, backend="sglang", stream_interval=1).slots == 24
        by_url = probe_fleet([vllm], backend="vllm", launched_slots={vllm: 6}, stream_interval=1)
        assert by_url.servers[0].slots == 6


@pytest.mark.parametrize(
    "command, slots",
    [
        ("vllm serve /models/m --max-num-seqs 12 --port 8000", 12),
        ("python -m sglang.launch_server --max-running-requests=8", 8),
        ("serve --max-num-seqs 4 --max-num-seqs 6", 6),  # the last one counts, as argparse reads it
        ("vllm serve /models/m", None),
        ("vllm serve /models/m --max-num-seqs", None),
    ],
)
def test_the_slots_a_launch_command_passes_are_read_from_its_arguments(command, slots):
    assert _slots_flag_value(command.split()) == slots


def test_a_launcher_knows_the_slots_each_server_was_passed(tmp_path):
    ports = free_ports(2)
    launcher = Launcher(
        state_dir=tmp_path, command="vllm serve {model_path} --port {port} --max-num-seqs {max_running_requests}",
        host="127.0.0.1", specs=[LaunchSpec(gpu=i, port=p) for i, p in enumerate(ports)],
        values={"model_path": "/models/m", "max_running_requests": 12},
    )
    assert launcher.launched_slots() == {f"http://127.0.0.1:{p}": 12 for p in ports}
    launcher.command = "vllm serve {model_path} --port {port}"
    assert launcher.launched_slots() == {}


def test_wait_ready_rides_out_loading_and_warmup():
    config = SimServerConfig(port=free_ports(1)[0], startup_delay_s=0.5, warmup_s=0.5)
    with SimulatedFleet([config], wait_ready=False) as fleet:
        url = f"http://127.0.0.1:{config.port}"
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
        wait_ready(url, timeout_s=20, poll_s=0.1)
        assert httpx.get(url + "/health").status_code == 200
        assert fleet.state(0) == "ready"


def test_wait_ready_times_out_quoting_the_servers_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("loading weights\nCUDA out of memory while allocating KV cache\n")
    [port] = free_ports(1)
    with pytest.raises(ServerStartError) as info:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=0.6, poll_s=0.2, log_path=log)
    assert "not ready after" in str(info.value)
    assert "CUDA out of memory" in str(info.value)


def simulator_launcher(tmp_path, ports, extra=""):
    return Launcher(
        state_dir=tmp_path / "fleet",
        command="{python} -m expansion_dag.sim --host {host} --port {port} --context-length {context_length} "
        "--mem-fraction-static 0.85 --warmup-s 0.3 --config {api_key_file} " + extra,
        host="127.0.0.1",
        specs=[LaunchSpec(gpu=i, port=p) for i, p in enumerate(ports)],
        values={"python": sys.executable, "context_length": 8192},
        api_key="launch-secret",
    )


def test_launch_mode_starts_each_server_once_and_stops_them(tmp_path):
    ports = free_ports(2)
    launcher = simulator_launcher(tmp_path, ports)
    try:
        started = launcher.ensure_running(timeout_s=60)
        assert started == launcher.urls
        # A second step setting the resource up finds them running and starts nothing.
        assert launcher.ensure_running(timeout_s=60) == []
        info = probe_fleet(launcher.urls, api_key="launch-secret", backend="sglang", stream_interval=1)
        assert [s.context_length for s in info.servers] == [8192, 8192]
        log = (tmp_path / "fleet" / f"server-{ports[0]}.log").read_text()
        assert "The server is fired up and ready to roll!" in log
        assert "launch-secret" not in log
    finally:
        stopped = launcher.stop()
    assert len(stopped) == 2
    with pytest.raises(httpx.ConnectError):
        httpx.get(launcher.urls[0] + "/health")


def test_a_server_that_exits_at_startup_fails_fast_with_its_log(tmp_path):
    [port] = free_ports(1)
    launcher = simulator_launcher(tmp_path, [port], extra="--context-length -5")
    with pytest.raises(ServerStartError, match="exited before it was ready") as info:
        launcher.ensure_running(timeout_s=60)
    assert "context_length" in str(info.value) or "context-length" in str(info.value)


#: Logs its arguments, the key among them, then runs the rest of the command, as SGLang 0.5.23
#: does at start-up (``server_args=...``: seen in a launched real server's log,
#: real_engine/test_pipeline.py), here read from the file the launcher hands it.
LOGS_ITS_KEY = "sh -c 'echo \"server_args $(cat {api_key_file})\" && exec \"$0\" \"$@\"' "


def test_the_key_a_server_logs_at_startup_is_masked_in_its_log(tmp_path):
    [port] = free_ports(1)
    launcher = simulator_launcher(tmp_path, [port])
    launcher.command = LOGS_ITS_KEY + launcher.command
    try:
        launcher.ensure_running(timeout_s=60)
        log = launcher.log_path(launcher.specs[0]).read_text()
        assert 'server_args api-key: "***"' in log
        assert "launch-secret" not in log
    finally:
        launcher.stop()


def test_a_failed_start_quotes_its_log_without_the_key(tmp_path):
    [port] = free_ports(1)
    launcher = simulator_launcher(tmp_path, [port])
    launcher.command = LOGS_ITS_KEY + "false"  # then exits at once
    with pytest.raises(ServerStartError, match="exited before it was ready") as info:
        launcher.ensure_running(timeout_s=60)
    assert 'server_args api-key: "***"' in str(info.value) and "launch-secret" not in str(info.value)
    assert "launch-secret" not in launcher.log_path(launcher.specs[0]).read_text()


def test_an_unknown_placeholder_in_the_launch_command_is_named(tmp_path):
    launcher = Launcher(
        state_dir=tmp_path, command="serve --gpu-count {gpus}", host="127.0.0.1",
        specs=[LaunchSpec(gpu=0, port=free_ports(1)[0])], values={},
    )
    with pytest.raises(FleetError, match="unknown placeholder 'gpus'"):
        launcher.ensure_running(timeout_s=5)


def test_the_probe_reads_sglangs_tool_call_parser_and_believes_the_configured_one_for_vllm():
    configs = [
        SimServerConfig(port=0, tool_call_parser="qwen25"),
        SimServerConfig(port=0),
        SimServerConfig(port=0, backend="vllm"),
    ]
    with SimulatedFleet(configs) as fleet:
        # An SGLang server says its own parser, whatever the configuration says.
        reported = probe_server(fleet.urls[0], tool_call_parser="other", backend="sglang", stream_interval=1)
        unparsed = probe_server(fleet.urls[1], tool_call_parser="qwen25", backend="sglang", stream_interval=1)
        vllm = probe_server(fleet.urls[2], backend="vllm", slots_override=8, stream_interval=1)
        vllm_parsed = probe_server(
            fleet.urls[2], backend="vllm", slots_override=8, tool_call_parser="hermes", stream_interval=1
        )
    assert (reported.tool_call_parser, reported.tool_choice) == ("qwen25", "auto")
    # SGLang renders the tools only with "auto"; nothing comes back parsed without a parser.
    assert (unparsed.tool_call_parser, unparsed.tool_choice) == (None, "auto")
    # vLLM refuses "auto" without a tool parser, and renders the tools with "none" too.
    assert (vllm.tool_call_parser, vllm.tool_choice) == (None, "none")
    assert (vllm_parsed.tool_call_parser, vllm_parsed.tool_choice) == ("hermes", "auto")
