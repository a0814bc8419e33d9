"""One real vLLM server and one real SGLang server for the session, each serving a tiny random
Qwen3 built at test time (SGLang is also launched by the project itself, in test_pipeline.py); and,
where a model's behaviour matters, the same engines serving a real trained model
(``real_model_dir``, ``real_vllm_server``, ``real_sglang_server``: the last section).

Each tiny model's server is keyed (``--api-key``), has a short context (so some bundled sample
prompts do not fit) and SLOTS running requests: vLLM as the fleet's configured slots (it reports
none), SGLang by ``--max-running-requests``, which it reports. The figures the tests measure (server start,
prompts, drift, set-aside prompts, kill and resume), per engine, are written to
``test-artifacts/real_engine/figures.json`` for a person to read.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from expansion_dag.core import bundled_qwen3_path
from expansion_dag.defs.resources import FleetResource
from expansion_dag_tests.ports import free_port
from expansion_dag_tests.real_engine.support import (
    ROOT,
    SGLANG_ENV,
    VLLM_ENV,
    Deployment,
    EngineServer,
    SglangServer,
    VllmServer,
    build_tiny_model,
)

S = TypeVar("S", bound=EngineServer)

#: Short enough that the longer sample prompts do not fit, long enough for most.
CONTEXT_LENGTH = 256
SLOTS = 4
API_KEY = "real-engine-test-key"
#: SGLang streams in events of this many tokens (its --stream-interval, which it reports).
STREAM_INTERVAL = 8
API_KEY_ENV = FleetResource().api_key_env
#: The generation settings a user would give for these fleets. A random model's answers run to
#: max_tokens, so answers are short and truncated ones are kept (they are nearly the only kind it
#: writes). Plain sampling from the whole distribution: greedy decoding of a random model
#: collapses to newlines (answers left out as empty), and top-k/top-p over a 151k vocabulary
#: doubles the time on these CPUs.
#: Thinking off: a random model writes no reasoning, and with thinking on the training set leaves
#: out every answer that has none (reasoning_missing).
TEMPLATE_KWARGS = {"enable_thinking": False}
SETTINGS: dict[str, Any] = {
    "chat_template_kwargs": json.dumps(TEMPLATE_KWARGS),
    "max_output_tokens": 16,
    "min_output_tokens": 8,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "drop_truncated": False,
}
#: The run configuration a user would give for the vLLM fleet: only the fields that differ from the
#: deployment's environment.
VLLM_RUN_CONFIG: dict[str, Any] = {
    "resources": {"fleet": {"config": {"slots_override": SLOTS}}, "settings": {"config": SETTINGS}}
}
#: SGLang reports its slots, so none are configured; answers streamed (the default, to stop
#: loops) or, with ``stop_degenerate: false``, sent as plain requests.
SGLANG_STREAMED: dict[str, Any] = {"resources": {"settings": {"config": SETTINGS}}}
SGLANG_PLAIN: dict[str, Any] = {"resources": {"settings": {"config": {**SETTINGS, "stop_degenerate": False}}}}


@pytest.fixture(scope="session")
def figures() -> Iterator[dict[str, Any]]:
    measured: dict[str, Any] = collections.defaultdict(dict)  # per engine
    yield measured
    out = ROOT / "test-artifacts" / "real_engine"
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.json").write_text(json.dumps(measured, indent=2, sort_keys=True) + "\n")


def serve(server: S, figures: dict[str, Any], name: str | None = None) -> Iterator[S]:
    try:
        server.start()
        figures[name or server.backend]["server_start_s"] = round(server.startup_s or 0.0, 1)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, figures) -> Iterator[VllmServer]:
    tmp = tmp_path_factory.mktemp("vllm")
    started = time.monotonic()
    model = build_tiny_model(tmp / "tiny-qwen3", bundled_qwen3_path(), VLLM_ENV)
    figures["vllm"]["model_build_s"] = round(time.monotonic() - started, 1)
    server = VllmServer(model, tmp / "vllm.log", context_length=CONTEXT_LENGTH, slots=SLOTS, api_key=API_KEY)
    yield from serve(server, figures)


#: The roomy server's context: room for loops to run on for many seconds (this CPU engine decodes the
#: tiny model at about 100 tokens a second a request) and for whole conversations with their tools.
#: At the suite's 256 a loop reached its cap within two seconds, before a client sharing two cores
#: with another test worker had read far enough to stop it, and no conversation with tools fits. At
#: 4,096, on two cores busy with other workers, a stopped-stream test's first events came 14-21 s
#: after its requests and three of its four loops had reached their cap by then.
ROOMY_CONTEXT_LENGTH = 16384


@pytest.fixture(scope="session")
def roomy_vllm_server(vllm_server: VllmServer, tmp_path_factory) -> Iterator[VllmServer]:
    """The same model on a second vLLM server, with a context of ``ROOMY_CONTEXT_LENGTH``."""
    log = tmp_path_factory.mktemp("vllm-roomy") / "vllm.log"
    server = VllmServer(vllm_server.model_dir, log, context_length=ROOMY_CONTEXT_LENGTH, slots=SLOTS, api_key=API_KEY)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def sglang_model(tmp_path_factory) -> Path:
    """The tiny model as SGLang's own transformers saves it: served attached and launched."""
    return build_tiny_model(tmp_path_factory.mktemp("sglang") / "tiny-qwen3", bundled_qwen3_path(), SGLANG_ENV)


def sglang(model: Path, log: Path, port: int | None = None) -> SglangServer:
    """The SGLang server of these tests: started by them, or described for the project to launch."""
    return SglangServer(model, log, context_length=CONTEXT_LENGTH, slots=SLOTS, api_key=API_KEY,
                        stream_interval=STREAM_INTERVAL, port=port)


@pytest.fixture(scope="session")
def sglang_server(sglang_model, figures) -> Iterator[SglangServer]:
    yield from serve(sglang(sglang_model, sglang_model.parent / "sglang.log"), figures)


@pytest.fixture(scope="session")
def vllm_attach(vllm_server) -> Callable[[Path], Deployment]:
    """Makes a fresh Dagster instance and storage in a folder, attached to the vLLM server."""
    return lambda tmp: Deployment.create(tmp, vllm_server, VLLM_RUN_CONFIG, API_KEY_ENV)


@pytest.fixture(scope="session")
def sglang_attach(sglang_server) -> Callable[[Path], Deployment]:
    """The same, attached to the SGLang server, sending plain requests."""
    return lambda tmp: Deployment.create(tmp, sglang_server, SGLANG_PLAIN, API_KEY_ENV)


# --- the real trained model -------------------------------------------------------------------------

#: SmolLM2-135M-Instruct (ChatML, eos ``<|im_end|>``, no thinking), built from a pinned PyPI wheel
#: by ``.ci/real-model``; git-ignored.
REAL_MODEL_DIR = ROOT / ".models" / "smollm2-135m-instruct"
#: The model's own context: its answers end far within it.
REAL_CONTEXT_LENGTH = 8192
REAL_SLOTS = 8
#: vLLM's KV cache for it: 23,040 bytes a token (30 layers, 3 KV heads of 64, bf16 keys and values),
#: so about 23k tokens: every slot at once with room for long answers (a loop run to its cap).
REAL_VLLM_KV_CACHE_BYTES = 512 * 2**20
#: A cold start of the real model took 50 to 170 s on a 2-core machine shared with other work, and
#: once more than 180 s: a wait only a hang outlasts.
REAL_STARTUP_TIMEOUT_S = 420.0
#: A user's settings for this model: greedy, so each prompt gets the model's most likely answer and
#: its outcome (ended, cut, stopped as a loop) is the same run to run; a cap most of its answers
#: end well within (median about 170 tokens, p90 about 390); the rest as configured by default
#: (truncated answers left out, answers streamed and loops stopped, the template's own thinking).
REAL_SETTINGS: dict[str, Any] = {
    "max_output_tokens": 512,
    "min_output_tokens": 64,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
}
#: No slots anywhere: vLLM's come from its launch command, SGLang reports its own.
REAL_RUN_CONFIG: dict[str, Any] = {"resources": {"settings": {"config": REAL_SETTINGS}}}
#: Few prompts, of the bundled samples: math word problems, which it answers in a few sentences.
REAL_CATALOG: dict[str, Any] = {
    "seed": 0,
    "local_root": "bundled",  # the package's sample files
    "sources": [{
        "name": "metamathqa",
        "hub_id": "meta-math/MetaMathQA",
        "local_path": "metamathqa/MetaMathQA-395K.json",
        "extractor": "metamathqa",
        "quota": 8,
    }],
}


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    if not (REAL_MODEL_DIR / "config.json").exists():
        pytest.fail(
            f"the real model these tests serve is not built ({REAL_MODEL_DIR} is missing): run "
            "`bash .ci/real-model` (after `bash .ci/vllm-env`; about a minute and 260 MB; `.ci/run` does it)",
            pytrace=False,
        )
    return REAL_MODEL_DIR


def real_deployment(tmp: Path, server: EngineServer, *, launch: dict[str, Any] | None = None) -> Deployment:
    """A deployment of the real model's fleet, on ``REAL_CATALOG``, with ``REAL_SETTINGS``."""
    catalog = tmp / "catalog.yaml"
    catalog.write_text(yaml.safe_dump(REAL_CATALOG))
    deployment = Deployment.create(tmp, server, REAL_RUN_CONFIG, API_KEY_ENV, launch=launch)
    deployment.env["EXPANSION_CATALOG"] = str(catalog)
    return deployment


class RealVllmServer(VllmServer):
    kv_cache_bytes = REAL_VLLM_KV_CACHE_BYTES
    startup_timeout_s = REAL_STARTUP_TIMEOUT_S


class RealSglangServer(SglangServer):
    startup_timeout_s = REAL_STARTUP_TIMEOUT_S


@pytest.fixture(scope="session")
def real_vllm_fleet(real_model_dir, tmp_path_factory, figures) -> Iterator[tuple[VllmServer, Deployment]]:
    """The real model on vLLM, launched by the project as a user's launch-mode fleet is
    (``expansion-dag fleet start``; ``fleet stop`` at the end), with ``REAL_SLOTS`` passed by its
    command's ``--max-num-seqs`` and no slots configured: the server, and the deployment that
    launched it (its runs find the server running and use it)."""
    tmp = tmp_path_factory.mktemp("real-vllm")
    port = free_port()
    server = RealVllmServer(real_model_dir, Deployment.launched_log(tmp, port),
                            context_length=REAL_CONTEXT_LENGTH, slots=REAL_SLOTS, api_key=API_KEY, port=port)
    fleet = {
        "mode": "launch",
        "launch": {
            "command": server.launch_command(),
            "base_port": port,
            "context_length": REAL_CONTEXT_LENGTH,
            "max_running_requests": REAL_SLOTS,
            "startup_timeout_s": server.startup_timeout_s,
        },
    }
    deployment = real_deployment(tmp, server, launch=fleet)
    try:
        started = time.monotonic()
        output = deployment.fleet("start", timeout_s=server.startup_timeout_s + 60)
        figures["vllm-real"]["fleet_start"] = output.strip()
        figures["vllm-real"]["server_start_s"] = round(time.monotonic() - started, 1)
        yield server, deployment
    finally:
        figures["vllm-real"]["fleet_stop"] = deployment.fleet("stop").strip()


@pytest.fixture(scope="session")
def real_vllm_server(real_vllm_fleet) -> VllmServer:
    """The real model on vLLM (``real_vllm_fleet``), for requests of its own or a deployment attached
    by its URL (which then configures the slots: vLLM reports none)."""
    return real_vllm_fleet[0]


@pytest.fixture(scope="session")
def real_sglang_server(real_model_dir, tmp_path_factory, figures) -> Iterator[SglangServer]:
    """The real model on SGLang's CPU path, started by the tests, to attach to by URL."""
    server = RealSglangServer(real_model_dir, tmp_path_factory.mktemp("real-sglang") / "sglang.log",
                              context_length=REAL_CONTEXT_LENGTH, slots=REAL_SLOTS, api_key=API_KEY,
                              stream_interval=STREAM_INTERVAL)
    yield from serve(server, figures, "sglang-real")
