"""Launching: one server process per GPU, started, waited for and stopped by whoever launched it,
its API key kept off its command line and out of its log."""

from expansion_dag.servers.launching.launcher import (
    Launcher,
    LaunchSpec,
    is_healthy,
    wait_ready,
)
from expansion_dag.servers.launching.records import OWNER_ENV, ServerRecord

__all__ = [
    "OWNER_ENV", "LaunchSpec", "Launcher", "ServerRecord", "is_healthy",
    "wait_ready",
]
