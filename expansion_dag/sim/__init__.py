"""An SGLang-compatible fleet simulator: the HTTP surface of real servers, without a model.

Faithful to SGLang 0.5.23 (back to 0.5.4 with ``version``) and to vLLM 0.33.0: the same endpoints,
JSON shapes, status codes and error texts, held to the servers' recorded source by the contract
suite (``expansion_dag_tests/contract``). Prompt tokens are counted with the model's chat template;
completions are synthetic text whose ``completion_tokens`` is its real token count. What it serves,
its deliberate differences from a real server and its cost: ``docs/simulator.md``.
"""

from expansion_dag.sim.cli import main
from expansion_dag.sim.config import DEFAULT_REASONING_SHARE, SimServerConfig
from expansion_dag.sim.dialects import VllmDialect
from expansion_dag.sim.fleet import SimulatedFleet
from expansion_dag.sim.generation import OutputModel
from expansion_dag.sim.process import FleetProcess
from expansion_dag.sim.server import READY_LINE

__all__ = [
    "DEFAULT_REASONING_SHARE", "FleetProcess", "OutputModel", "READY_LINE", "SimServerConfig", "SimulatedFleet",
    "VllmDialect", "main",
]
