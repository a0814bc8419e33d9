"""A simulated fleet in a process of its own (``FleetProcess``): what benchmarks start, so that their
own process's CPU is the client's alone."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import textwrap

import httpx
import pytest

from expansion_dag.core import pid_alive
from expansion_dag.sim import FleetProcess
from expansion_dag_tests.helpers import wait_for
from expansion_dag_tests.ports import free_port
from expansion_dag_tests.sim.conftest import FAST, USER


def test_the_fleet_serves_from_its_own_process_and_reports_each_servers_stats():
    with FleetProcess([FAST, FAST]) as fleet:
        assert len(set(fleet.urls)) == 2 and fleet.pid != os.getpid()
        answer = httpx.post(f"{fleet.urls[1]}/v1/chat/completions", json={"model": FAST.model_name, "messages": USER},
                            timeout=30)  # fmt: skip
        assert answer.status_code == 200
        stats = fleet.wait_idle()
        assert [s["completed"] for s in stats] == [0, 1]
        assert {s["pid"] for s in stats} == {fleet.pid}
    assert not pid_alive(fleet.pid)


def test_a_fleet_that_cannot_start_says_why():
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        taken_port = dataclasses.replace(FAST, port=port)
        with pytest.raises(RuntimeError, match="did not start.*OSError"), FleetProcess([taken_port]):
            pass


def test_the_fleet_stops_when_the_process_that_started_it_is_killed(tmp_path):
    """A benchmark killed outright (SIGKILL, no clean-up) leaves no simulator behind."""
    pid_file = tmp_path / "fleet.pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import pathlib, sys, time
            from expansion_dag.sim import FleetProcess, SimServerConfig
            if __name__ == "__main__":
                with FleetProcess([SimServerConfig(port=0)]) as fleet:
                    pathlib.Path(sys.argv[1]).write_text(str(fleet.pid))
                    time.sleep(3600)
        """), str(pid_file)],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        fleet_pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), "the fleet to start"))
        assert pid_alive(fleet_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        wait_for(lambda: not pid_alive(fleet_pid), "the fleet's process to end with its parent")
    finally:
        parent.kill()
        parent.wait(30)
