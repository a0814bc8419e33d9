"""Simulators are only ever the project's own: a server already on a launch port is never adopted."""

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from expansion_dag.config import parse_config
from expansion_dag.core import FleetError, pid_alive
from expansion_dag.definitions import fleet_for
from expansion_dag.servers import ServerRecord
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag_tests.ports import free_ports
from expansion_dag_tests.servers.test_fleet import simulator_launcher


class RealServer(BaseHTTPRequestHandler):
    """Stands in for a real SGLang server on the port: healthy, and no simulator."""

    requests: list[str] = []

    def do_GET(self):
        RealServer.requests.append(self.path)
        body = {"/server_info": {"version": "0.5.23", "model_path": "org/real-model"}}.get(self.path, {})
        payload = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def real_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), RealServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    RealServer.requests = []
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_real_server_on_the_demo_fleets_port_is_an_error_naming_it(tmp_path, real_server):
    config = parse_config({"fleet": {"launch": {"base_port": real_server}}, "storage": {"root": str(tmp_path)}},
                          where="run.yaml", env={})
    fleet = fleet_for(config)
    assert fleet.mode == "launch" and fleet.base_port == real_server
    with pytest.raises(FleetError) as info:
        fleet.provision()
    message = str(info.value)
    assert f"http://127.0.0.1:{real_server} is already served by a process this project did not launch" in message
    assert "server version 0.5.23 serving org/real-model" in message
    assert not list((tmp_path / "fleet").glob("*.json"))  # nothing was launched
    assert all(path in ("/server_info",) for path in RealServer.requests)  # it was asked what it is, nothing else


def test_a_simulator_with_another_pid_is_not_taken_for_the_launched_one(tmp_path):
    # A record of a live process (another one, as if launched with the launcher's command) and,
    # on its port, a simulator that process did not run.
    with SimulatedFleet([SimServerConfig(port=0, api_key="launch-secret")]) as fleet:
        port = int(fleet.urls[0].rsplit(":", 1)[1])
        launcher = simulator_launcher(tmp_path, [port])
        other = subprocess.Popen(["sleep", "60"])
        try:
            (tmp_path / "fleet").mkdir()
            ServerRecord.of(port=port, gpu=0, pid=other.pid, argv=launcher._argv(launcher.specs[0]),
                            owner="another-run").write(tmp_path / "fleet" / f"server-{port}.json")
            with pytest.raises(FleetError, match=rf"127.0.0.1:{port} is not the simulator launched here \(pid {other.pid}\)"):
                launcher.ensure_running(timeout_s=30)
        finally:
            other.kill()
            other.wait()


def test_a_server_launched_otherwise_is_refused_naming_the_difference_while_another_run_uses_it(tmp_path):
    [port] = free_ports(1)
    using = simulator_launcher(tmp_path, [port])
    using.owner = "a-run-generating"
    changed = simulator_launcher(tmp_path, [port])
    changed.owner, changed.values = "a-later-run", {**changed.values, "context_length": 4096}
    try:
        using.ensure_running(timeout_s=60)
        pid = ServerRecord.read(tmp_path / "fleet" / f"server-{port}.json").pid
        with pytest.raises(FleetError, match=r"runs a server launched otherwise than this configuration says "
                                             r"\(--context-length 8192 \(running\) / 4096 \(configured\)\), and "
                                             r"another command or run uses it \(pid \d+: "):
            changed.ensure_running(timeout_s=60)
        assert pid_alive(pid)  # untouched under its user
        # Once its user has left it running (--keep-fleet), the later run restarts it as it
        # configures it, and says so.
        assert using.release(keep=True) == ([], [])
        changed.ensure_running(timeout_s=60)
        assert changed.notes == [f"http://127.0.0.1:{port}: restarted: it was launched otherwise than this "
                                 "configuration says (--context-length 8192 (running) / 4096 (configured))"]
        assert not pid_alive(pid)
        assert ServerRecord.read(tmp_path / "fleet" / f"server-{port}.json").owner == "a-later-run"
    finally:
        changed.release()
        using.release()
