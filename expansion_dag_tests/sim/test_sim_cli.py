"""The ``expansion-sim`` command: several ports in one process, sglang launch flags, signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from expansion_dag.sim import READY_LINE, main
from expansion_dag.sim.cli import _configs, _parser
from expansion_dag_tests.ports import free_ports

STARTUP_TIMEOUT_S = 60


class Simulator:
    """``python -m expansion_dag.sim ARGS`` with its output collected line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "expansion_dag.sim", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, servers: int) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while self.output.count(READY_LINE) < servers:
            assert self.proc.poll() is None, f"simulator exited early:\n{self.output}"
            assert time.monotonic() < deadline, f"simulator not ready in time:\n{self.output}"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def simulators():
    started: list[Simulator] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Simulator:
        sim = Simulator(*args, env=env)
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.kill()


def test_one_process_serves_several_ports_with_sglang_flags_and_stops_on_sigterm(simulators):
    first, second, third = free_ports(3)
    sim = simulators(
        "--model-path",
        "Qwen/Qwen3-8B",
        "--port",
        str(first),
        "--ports",
        f"{second}-{third}",
        "--mem-fraction-static",
        "0.9",
        "--attention-backend",
        "fa3",
        "--enable-metrics",
        "--max-running-requests",
        "8",
        "--token-latency-ms",
        "0.1",
        "--api-key",
        "from-flag",
    )
    sim.wait_ready(3)
    ignored = "--mem-fraction-static 0.9 --attention-backend fa3 --enable-metrics"
    assert f"simulator ignores flags it does not model: {ignored}" in sim.output
    assert "SIMULATOR" in sim.output
    key = {"Authorization": "Bearer from-flag"}
    with httpx.Client(timeout=10) as client:
        for port in (first, second, third):
            url = f"http://127.0.0.1:{port}"
            assert client.get(f"{url}/health").status_code == 200
            assert client.get(f"{url}/server_info").status_code == 401
            assert client.get(f"{url}/server_info", headers=key).json()["max_running_requests"] == 8
        answer = client.post(
            f"http://127.0.0.1:{first}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            headers=key,
        )
        assert answer.status_code == 200
        stats = [
            client.get(f"http://127.0.0.1:{p}/sim/stats", headers=key).json()["completed"]
            for p in (first, second, third)
        ]
        assert stats == [1, 0, 0]  # each port has its own state
    sim.proc.send_signal(signal.SIGTERM)
    assert sim.proc.wait(timeout=10) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{first}/health")


def test_like_sglang_no_environment_variable_sets_a_key(simulators):
    (port,) = free_ports(1)
    sim = simulators("--port", str(port), env={"SGLANG_API_KEY": "ignored"})
    sim.wait_ready(1)
    assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200


def test_an_older_sglang_version_serves_only_its_paths(simulators):
    (port,) = free_ports(1)
    sim = simulators("--port", str(port), "--emulate-version", "0.5.4")
    sim.wait_ready(1)
    url = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=10) as client:
        assert [client.get(f"{url}{path}").status_code for path in ("/server_info", "/v1/loads")] == [404, 404]
        assert client.get(f"{url}/get_server_info").json()["version"] == "0.5.4"
        assert client.get(f"{url}/get_load").json()[0]["num_reqs"] == 0


def test_the_process_exits_when_its_only_server_dies(simulators):
    (port,) = free_ports(1)
    sim = simulators("--port", str(port), "--die-after-requests", "1", "--token-latency-ms", "0.1")
    sim.wait_ready(1)
    answer = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=10,
    )
    assert answer.status_code == 200
    assert sim.proc.wait(timeout=10) == 1


def test_help_calls_it_a_simulator_and_lists_sglang_flag_names(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    assert "SIMULATOR" in text
    for flag in (
        "--model-path",
        "--context-length",
        "--max-running-requests",
        "--max-queued-requests",
        "--api-key",
        "--reasoning-parser",
        "--served-model-name",
        "--token-latency-ms",
        "--fail-rate",
    ):
        assert flag in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fail-rate", "2"], "fail_rate must be in [0, 1], got 2.0"),
        (["--ports", "30010-30001"], "empty port range '30010-30001'"),
        (["--backend", "tgi"], "invalid choice: 'tgi'"),
        (["--output-median-by-marker", "[math]"], "expected MARKER=TOKENS, got '[math]'"),
    ],
)
def test_invalid_flags_exit_with_a_clear_message(args, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_answer_length_flags_reach_the_server_config():
    args = _parser().parse_args(["--output-median-by-marker", "[math]=3000", "--output-median-by-marker",
                                 "a=b=20", "--output-prompt-exponent", "0.5", "--output-max-tokens", "900"])
    [config] = _configs(args)
    assert config.output_max_tokens == 900
    assert config.output_median_by_marker == (("[math]", 3000), ("a=b", 20))
    assert config.output_prompt_exponent == 0.5


def test_a_server_returns_token_ids_unless_told_it_is_one_without():
    [default] = _configs(_parser().parse_args([]))
    [without] = _configs(_parser().parse_args(["--no-token-ids"]))
    assert (default.token_ids, without.token_ids) == (True, False)
