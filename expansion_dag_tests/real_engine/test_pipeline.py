"""The whole pipeline through Dagster against real servers: vLLM and SGLang, attached and launched.

Each deployment is what a user writes: the production profile, the API key in the fleet's key
variable, and run configuration naming only the generation settings (and, for vLLM, which
reports none, the slots). Attached, the server's URL is in EXPANSION_FLEET_URLS; launched, a run
configuration file gives the fleet's launch command (``SGLANG_CPU_COMMAND``: the project's own
SGLang command with the CPU path's flags), and the project's launcher starts SGLang on the first
run, the later runs use it, and ``expansion-dag fleet stop`` stops it. The cases:

- vLLM attached, answers streamed;
- SGLang attached, plain requests (``stop_degenerate: false``);
- SGLang launched, answers streamed.

On the bundled sample datasets: probe, budgets, set-aside prompts, generation and the training
set, each checked against what the server itself says (its usage, its /tokenize, its request
counters, its /server_info).
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import polars as pl
import pytest

from expansion_dag.core import OUTPUT_IDS, PROMPT_IDS, base_prompt_id, load_tokenizer, unpack
from expansion_dag.servers import PROBE_MESSAGES
from expansion_dag.store import CompletionStore
from expansion_dag.training import Manifest
from expansion_dag_tests.helpers import closed_turn, command_lines_holding, masked_runs
from expansion_dag_tests.ports import free_port
from expansion_dag_tests.real_engine.conftest import (
    API_KEY_ENV,
    CONTEXT_LENGTH,
    SETTINGS,
    SGLANG_STREAMED,
    SLOTS,
    STREAM_INTERVAL,
    TEMPLATE_KWARGS,
    sglang,
)
from expansion_dag_tests.real_engine.support import (
    PIPELINE_PROBES,
    SGLANG_CPU_COMMAND,
    SGLANG_KV_TOKENS,
    STARTUP_TIMEOUT_S,
    Deployment,
    EngineServer,
    SglangServer,
    run_pipeline,
)

SHARD = "shard-00"
MARGIN = 16  # GenerationSettings' default, left as it is


def first_requests(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each budgeted prompt's first request's record, by the prompt's id: its own, or its conversation's turn 1."""
    return {base_prompt_id(r): r for r in records if r.get("turn", 1) == 1}


@dataclass(frozen=True)
class Case:
    engine: str
    mode: str
    streamed: bool

    def __str__(self) -> str:
        return f"{self.engine}-{self.mode}-{'streamed' if self.streamed else 'plain'}"


CASES = [Case("vllm", "attach", True), Case("sglang", "attach", False), Case("sglang", "launch", True)]


@dataclass
class Pipeline:
    case: Case
    server: EngineServer
    deployment: Deployment
    budgeted: pl.DataFrame
    set_aside: pl.DataFrame
    records: list[dict[str, Any]]
    training_rows: pl.DataFrame
    #: The server's counters before and after the pipeline ran (/metrics).
    before: dict[str, float]
    after: dict[str, float]
    figures: dict[str, Any]


def launching(request: pytest.FixtureRequest, tmp) -> tuple[SglangServer, Deployment]:
    """SGLang as the project launches it: the fleet section of a run configuration file."""
    port = free_port()
    server = sglang(request.getfixturevalue("sglang_model"), Deployment.launched_log(tmp, port), port)
    fleet = {
        "mode": "launch",
        "stream_interval": STREAM_INTERVAL,  # launched servers get it as --stream-interval
        "launch": {
            "command": SGLANG_CPU_COMMAND,
            "base_port": port,
            "context_length": CONTEXT_LENGTH,
            "max_running_requests": SLOTS,
            "startup_timeout_s": STARTUP_TIMEOUT_S,
        },
    }
    return server, Deployment.create(tmp, server, SGLANG_STREAMED, API_KEY_ENV, launch=fleet)


@pytest.fixture(scope="module", params=CASES, ids=str)
def pipeline(request, tmp_path_factory, figures) -> Iterator[Pipeline]:
    case: Case = request.param
    tmp = tmp_path_factory.mktemp(str(case))
    if case.mode == "launch":
        server, deployment = launching(request, tmp)
        before: dict[str, float] = {}  # a server yet to be launched has counted nothing
    else:
        server = request.getfixturevalue(f"{case.engine}_server")
        deployment = request.getfixturevalue(f"{case.engine}_attach")(tmp)
        before = server.metrics()
    measured = figures[str(case)]
    try:
        started = time.monotonic()
        run_pipeline(deployment, server, SHARD)
        measured["pipeline_wall_s"] = round(time.monotonic() - started, 1)
        storage = deployment.storage
        yield Pipeline(
            case=case,
            server=server,
            deployment=deployment,
            budgeted=pl.read_parquet(storage / "assets" / "budgeted_prompts.parquet"),
            set_aside=pl.read_parquet(storage / "set_aside" / "budgeted_prompts.parquet"),
            records=list(CompletionStore(storage / "completions").records(SHARD)),
            training_rows=pl.read_parquet(sorted((storage / "training_set").glob("part-*.parquet"))),
            before=before,
            after=server.metrics(),
            figures=measured,
        )
    finally:
        if case.mode == "launch":
            measured["fleet_stop"] = deployment.fleet("stop").strip()


def test_the_probe_reads_the_context_and_the_slots_from_the_server(pipeline: Pipeline):
    server, deployment = pipeline.server, pipeline.deployment
    budget = deployment.metadata("budgeted_prompts")
    assert budget["context_length"] == server.context_length
    assert "probed" in budget["context_length_source"] and "simulated" not in budget["context_length_source"]
    fleet = deployment.metadata("completions", SHARD)["effective_config"]["fleet"]
    assert fleet["backend"] == pipeline.case.engine
    assert fleet["server_version"] == server.engine.version()
    assert fleet["context_length"] == server.context_length
    assert fleet["slots"] == SLOTS
    assert fleet["simulator"] is False
    if pipeline.case.engine == "vllm":
        # vLLM reports no slot count: the configured one is used, and the metadata says so.
        assert "configured" in fleet["slots_source"]
        return
    # SGLang says its slots (--max-running-requests) in /server_info, and the longest prompt its
    # scheduler admits, from the context and its KV cache; and the stream interval it runs with,
    # its own even where the fleet is configured with another (attached: the default, 256).
    assert fleet["slots_source"] == "server"
    assert fleet["max_req_input_len"] == min(CONTEXT_LENGTH - 1, SGLANG_KV_TOKENS - 1) - 5
    assert fleet["stream_interval"] == STREAM_INTERVAL
    if pipeline.case.mode == "launch":
        # The command as configured, the key by the file SGLang reads its arguments from, and
        # on no process's command line.
        assert fleet["launch_command"] == SGLANG_CPU_COMMAND + " --config {api_key_file}"
        assert server.api_key not in json.dumps(fleet)
        # (The tests' own servers are started with --api-key: only the launched one's session is read.)
        launched = json.loads(server.log.with_suffix(".json").read_text())["pid"]
        assert command_lines_holding(server.api_key, session=launched) == []
        # SGLang logs its arguments at start-up, the key among them: masked before it is written.
        log = server.log.read_text()
        assert "server_args=" in log and "'api_key': '***'" in log and server.api_key not in log


def test_local_prompt_counts_equal_the_servers_usage_on_every_prompt(pipeline: Pipeline):
    drift = collections.Counter(r["prompt_tokens"] - r["local_prompt_tokens"] for r in pipeline.records)
    pipeline.figures["prompts_generated"] = len(pipeline.records)
    pipeline.figures["drift_histogram"] = {str(d): n for d, n in sorted(drift.items())}
    assert len(pipeline.records) == pipeline.budgeted.height
    assert drift == {0: pipeline.budgeted.height}
    # The budgets were those counts: the engine was fed exactly the prompt tokens budgeted, and the
    # weights probes'.
    fed = pipeline.server.prompt_tokens(pipeline.before, pipeline.after)
    probes = PIPELINE_PROBES * len(pipeline.server.tokenize(list(PROBE_MESSAGES)))
    assert fed == pipeline.budgeted["prompt_tokens"].sum() + probes
    passed, metadata = pipeline.deployment.check("budget_drift")
    assert passed
    assert metadata["drift_histogram"] == {"0": pipeline.budgeted.height}
    for row in pipeline.budgeted.iter_rows(named=True):
        assert row["prompt_tokens"] + row["max_tokens"] <= row["context_length"] - MARGIN


def test_prompts_over_the_context_are_set_aside_and_never_sent(pipeline: Pipeline):
    context = pipeline.server.context_length
    set_aside = pipeline.set_aside
    over = set_aside.filter(pl.col("prompt_tokens") > context)
    pipeline.figures["set_aside"] = {
        "total": set_aside.height,
        "over_the_context": over.height,
        "leaving_too_little_room": set_aside.height - over.height,
    }
    assert over.height >= 1
    assert set(set_aside["reason"]) == {"prompt_too_long"}
    # Each left less than the minimum answer; every other prompt fits.
    assert (set_aside["prompt_tokens"] + SETTINGS["min_output_tokens"] + MARGIN > context).all()
    assert set(set_aside["prompt_id"]).isdisjoint(base_prompt_id(r) for r in pipeline.records)
    # The server received one request per budgeted prompt, and the weights probes, and no other,
    # each answered to its end.
    budgeted = pipeline.budgeted.height
    assert pipeline.server.received(pipeline.before, pipeline.after) == budgeted + PIPELINE_PROBES
    assert pipeline.server.generated(pipeline.before, pipeline.after) == budgeted + PIPELINE_PROBES
    assert pipeline.deployment.metadata("budgeted_prompts")["set_aside"] == set_aside.height
    if isinstance(pipeline.server, SglangServer):  # it also counts which were streamed
        assert pipeline.server.streamed(pipeline.before, pipeline.after) == (budgeted if pipeline.case.streamed else 0)


def test_generation_runs_with_the_key_the_server_enforces(pipeline: Pipeline):
    server = pipeline.server
    request = {"model": str(server.model_dir), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert httpx.post(server.url + "/v1/chat/completions", json=request, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert httpx.post(server.url + "/v1/chat/completions", json=request, headers=wrong, timeout=30).status_code == 401
    # With the key every budgeted prompt got its answer, each cut at its own max_tokens or ended.
    assert {r["status"] for r in pipeline.records} == {"ok"}
    by_id = first_requests(pipeline.records)
    for row in pipeline.budgeted.iter_rows(named=True):
        record = by_id[row["prompt_id"]]
        assert record["max_tokens"] == row["max_tokens"] <= SETTINGS["max_output_tokens"]
        assert record["finish_reason"] in ("length", "stop")
        assert 0 < record["completion_tokens"] <= row["max_tokens"]
        assert record["server"] == server.url


def test_training_rows_start_with_the_ids_the_server_fed_the_model(pipeline: Pipeline):
    rows = pipeline.training_rows
    by_id = first_requests(pipeline.records)
    pipeline.figures["training_rows"] = rows.height
    left_out = json.loads((pipeline.deployment.storage / "training_set" / "manifest.json").read_text())["left_out"]
    pipeline.figures["training_left_out"] = left_out
    # Truncated answers are kept (drop_truncated: false); a random model writes little else.
    assert not left_out.get("truncated")
    assert rows.height == len(pipeline.records) - sum(left_out.values())
    assert rows.height > 0.9 * len(pipeline.records)
    for row in rows.iter_rows(named=True):
        mask = row["loss_mask"]
        prompt_ids = row["input_ids"][: mask.index(1)]
        record = by_id[row["id"]]
        if record.get("tools"):
            # A conversation with tools (one turn at this context): the tokens the server says it
            # was fed (its usage), the tools rendered (its /tokenize takes no tools).
            assert len(prompt_ids) == record["prompt_tokens"], row["id"]
        else:
            assert prompt_ids == pipeline.server.tokenize(record["messages"], TEMPLATE_KWARGS), row["id"]


def test_each_rows_answer_is_the_ids_the_server_sampled_and_the_manifest_sees_re_tokenizing_differ(
    pipeline: Pipeline,
):
    """Issue 38: a row trains on the server's own sampled ids, never on a re-tokenization of their
    text; a random model samples far from the canonical split, so the manifest's measurement of
    what re-tokenizing would change must find rows that differ."""
    tokenizer = load_tokenizer(str(pipeline.server.model_dir))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    by_id = first_requests(pipeline.records)
    for row in pipeline.training_rows.iter_rows(named=True):
        sampled = unpack(by_id[row["id"]][OUTPUT_IDS])
        assert row["ids_from"] == "server", row["id"]
        assert masked_runs(row["input_ids"], row["loss_mask"]) == [
            closed_turn(sampled, tokenizer.all_special_ids, end_of_turn)
        ], row["id"]
    manifest = Manifest.read(pipeline.deployment.storage / "training_set")
    pipeline.figures["retokenization"] = manifest.retokenization
    assert manifest.ids_from.get("server") == pipeline.training_rows.height
    assert manifest.retokenization["rows_differing"] > 0


def test_records_keep_the_ids_the_server_ran_and_sampled(pipeline: Pipeline):
    """Every answer's ids, plain and streamed: the prompt's are the server's own rendering, the
    sampled ones as many as its usage counts, and they decode (special tokens skipped, as both
    servers detokenize) to the text the server returned, but for a character the cut at
    max_tokens left incomplete: vLLM's incremental detokenizer holds back the last tokens while
    their text ends in an incomplete character and never sends them, where a decode of the ids
    ends in U+FFFD (seen on vLLM, not on SGLang)."""
    tokenizer = load_tokenizer(str(pipeline.server.model_dir))
    cut_characters = 0
    for record in pipeline.records:
        prompt_ids, output_ids = unpack(record[PROMPT_IDS]), unpack(record[OUTPUT_IDS])
        assert len(prompt_ids) == record["prompt_tokens"], record["key"]
        assert len(output_ids) == record["completion_tokens"], record["key"]
        if not record.get("tools"):
            assert prompt_ids == pipeline.server.tokenize(record["messages"], TEMPLATE_KWARGS), record["key"]
        text = (record["reasoning_content"] or "") + record["content"]
        decoded = tokenizer.decode(output_ids, skip_special_tokens=True)
        if decoded != text:
            assert record["finish_reason"] == "length", record["key"]
            assert decoded.startswith(text) and decoded.endswith("\ufffd"), record["key"]
            cut_characters += 1
    pipeline.figures["answers_whose_text_lacks_a_cut_character"] = cut_characters


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_deployment_without_the_key_is_refused_naming_the_server(engine, request, tmp_path):
    server: EngineServer = request.getfixturevalue(f"{engine}_server")
    deployment: Deployment = request.getfixturevalue(f"{engine}_attach")(tmp_path)
    env = {k: v for k, v in deployment.env.items() if k != API_KEY_ENV}
    result = deployment.prepare(env=env)
    assert result.returncode != 0
    assert "401" in result.stdout and server.url in result.stdout, result.stdout[-3000:]
