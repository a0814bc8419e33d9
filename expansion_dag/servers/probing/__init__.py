"""Probing and load polling: what each server is and serves (context, slots, model, version,
dialect, weights), checked across the fleet, and its load while a run goes."""

from expansion_dag.servers.probing.facts import ServerFacts, parse_server_facts, read_server_facts
from expansion_dag.servers.probing.fleet import (
    SLOTS_CONFIGURED,
    SLOTS_FROM_SERVER,
    SLOTS_LAUNCHED,
    FleetInfo,
    ServerInfo,
    probe_fleet,
    probe_server,
)
from expansion_dag.servers.probing.loads import (
    parse_gen_throughput,
    parse_idle_slots,
    read_idle_slots,
    read_throughputs,
)
from expansion_dag.servers.probing.weights import (
    PROBE_MESSAGES,
    folder_weights,
    hub_commit,
    probe_fleet_weights,
    probe_weights,
    reprobe_difference,
    weights_label,
)

__all__ = [
    "FleetInfo", "PROBE_MESSAGES", "SLOTS_CONFIGURED", "SLOTS_FROM_SERVER", "SLOTS_LAUNCHED", "ServerFacts",
    "ServerInfo", "folder_weights", "hub_commit", "parse_gen_throughput", "parse_idle_slots", "parse_server_facts",
    "probe_fleet", "probe_fleet_weights", "probe_server", "read_idle_slots", "read_server_facts", "read_throughputs",
    "weights_label", "probe_weights", "reprobe_difference",
]
