"""One real vLLM server for the session, serving a tiny random Qwen3 built at test time.

The server is keyed (``--api-key``), has a short context (so some bundled sample prompts do not
fit) and as many sequences as the fleet's configured slots. The figures the tests measure (server
start, prompts, drift, set-aside prompts, kill and resume) are written to
``test-artifacts/real_engine/figures.json`` for a person to read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from expansion_dag.resources.fleet import FleetResource
from expansion_dag.tokenizer import bundled_qwen3_path
from expansion_dag_tests.real_engine.support import ROOT, Deployment, VllmServer, build_tiny_model, require_vllm_env

#: Short enough that the longer sample prompts do not fit, long enough for most.
CONTEXT_LENGTH = 256
SLOTS = 4
API_KEY = "real-engine-test-key"
#: The run configuration a user would give for this fleet: only the fields that differ from the
#: deployment's environment. A random model's answers run to max_tokens, so answers are short and
#: truncated ones are kept (they are nearly the only kind it writes). Plain sampling from the whole
#: distribution: greedy decoding of a random model collapses to newlines (answers left out as
#: empty), and top-k/top-p over a 151k vocabulary doubles the time on these CPUs.
RUN_CONFIG: dict[str, Any] = {
    "resources": {
        "fleet": {"config": {"slots_override": SLOTS}},
        "settings": {
            "config": {
                "max_output_tokens": 16,
                "min_output_tokens": 8,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": -1,
                "drop_truncated": False,
            }
        },
    }
}


@pytest.fixture(scope="session")
def figures() -> Iterator[dict[str, Any]]:
    measured: dict[str, Any] = {}
    yield measured
    out = ROOT / "test-artifacts" / "real_engine"
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.json").write_text(json.dumps(measured, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, figures) -> Iterator[VllmServer]:
    require_vllm_env()
    tmp = tmp_path_factory.mktemp("vllm")
    started = time.monotonic()
    model = build_tiny_model(tmp / "tiny-qwen3", bundled_qwen3_path())
    figures["model_build_s"] = round(time.monotonic() - started, 1)
    server = VllmServer(model, tmp / "vllm.log", context_length=CONTEXT_LENGTH, slots=SLOTS, api_key=API_KEY)
    try:
        server.start()
        figures["server_start_s"] = round(server.startup_s or 0.0, 1)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def attach(vllm_server) -> Callable[[Path], Deployment]:
    """Makes a fresh Dagster instance and storage in a folder, attached to the server."""
    api_key_env = FleetResource().api_key_env
    return lambda tmp: Deployment.create(tmp, vllm_server, RUN_CONFIG, api_key_env)
