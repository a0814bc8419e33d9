"""The trainers that read the training set, run by their own code in their own virtualenv.

``.venv-trainers/`` (``bash .ci/trainers-env``) holds SpecForge and speculators; ``consume.py``
runs their data loading there. speculators renders conversations through vLLM's
``/v1/chat/completions/render``: ``RenderServer`` is vLLM's GPU-less render server, from the CPU
build in ``.venv-vllm/``, for the tiny Qwen3 the real-engine tests build (its config and the
project's bundled Qwen3 tokenizer and template are all a render needs).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from expansion_dag.core import bundled_qwen3_path
from expansion_dag_tests.deployment.support import isolated_env
from expansion_dag_tests.real_engine.support import ROOT, VLLM_ENV, EngineServer, build_tiny_model

TRAINERS_PYTHON = ROOT / ".venv-trainers" / "bin" / "python"
HERE = Path(__file__).parent
#: The trainers' load of every job, torch and both trainers imported once, takes about a minute here.
CONSUME_TIMEOUT_S = 600


class RenderServer(EngineServer):
    """``vllm launch render`` (render_server.py): no engine and no key, only the template and tokenizer."""

    backend = "vllm"
    engine = VLLM_ENV

    def command(self) -> list[str]:
        return [
            str(self.engine.require()), str(HERE / "render_server.py"), "--model", str(self.model_dir),
            "--max-model-len", str(self.context_length), "--host", "127.0.0.1", "--port", str(self.port),
        ]


def require_trainers_env() -> Path:
    if not TRAINERS_PYTHON.exists():
        pytest.fail(
            f"the trainers these tests run are not installed ({TRAINERS_PYTHON} is missing): run "
            "`bash .ci/trainers-env` (about 2 minutes and 1.5 GB; `.ci/run` does it)",
            pytrace=False,
        )
    return TRAINERS_PYTHON


@pytest.fixture(scope="session")
def render_server(tmp_path_factory) -> Iterator[RenderServer]:
    tmp = tmp_path_factory.mktemp("render")
    model = build_tiny_model(tmp / "tiny-qwen3", bundled_qwen3_path(), VLLM_ENV)
    server = RenderServer(model, tmp / "render.log", context_length=4096, slots=1, api_key="")
    try:
        server.start()
        yield server
    finally:
        server.stop()


def consume(jobs: list[dict[str, Any]], work: Path) -> list[list[dict[str, Any]]]:
    """Each job's rows as its trainer made them (consume.py, in the trainers' virtualenv)."""
    for i, job in enumerate(jobs):
        job.update(tokenizer=bundled_qwen3_path(), out=str(work / f"rows-{i}.jsonl"), work_dir=str(work / f"work-{i}"))
    (work / "jobs.json").write_text(json.dumps(jobs))
    result = subprocess.run(
        [str(require_trainers_env()), str(HERE / "consume.py"), str(work / "jobs.json")],
        env=isolated_env(HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1, HF_HOME=work / "hf", TOKENIZERS_PARALLELISM="false"),
        capture_output=True, text=True, timeout=CONSUME_TIMEOUT_S,
    )
    if result.returncode != 0:
        pytest.fail(f"the trainers' loading failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return [[json.loads(line) for line in Path(job["out"]).read_text().splitlines()] for job in jobs]
