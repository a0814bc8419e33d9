"""Helpers shared by tests: prompt frames and resources bound to a simulated fleet."""

import asyncio
import dataclasses
import collections
import gzip
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import polars as pl

from expansion_dag.config import (
    GenerationConfig,
    LeaseSettings,
    budget_config,
    engine_config,
    sampling_settings,
    training_set_config,
)
from expansion_dag.core import (
    DEFAULT_MODE,
    Identity,
    ModeIdentities,
    ModeMix,
    SamplingSettings,
    base_prompt_id,
)
from expansion_dag.defs.resources import FleetResource, GenerationSettings, ParquetIOManager, StorageResource
from expansion_dag.generation import EngineConfig
from expansion_dag.prompts import BudgetConfig
from expansion_dag.servers import LoopThresholds, async_client
from expansion_dag.training import DEFAULT_MAX_LENGTH, TrainingSetConfig
from expansion_dag_tests.data.make_repetitive_corpus import CORPUS_PATH

MESSAGES = pl.List(pl.Struct({"role": pl.String, "content": pl.String}))
#: The shard lease's timeout a run gets by default (storage.lease_timeout_s).
LEASE_TIMEOUT_S = LeaseSettings().lease_timeout_s


# The layers below the configuration state no defaults of their own: a test takes a run's (the
# schema's, as expansion_dag.config derives them) and changes what it is about.
def default_engine(**changes: Any) -> EngineConfig:
    return engine_config(GenerationConfig(), **changes)


def default_sampling(**changes: Any) -> SamplingSettings:
    return sampling_settings(GenerationConfig(), **changes)


def default_budget(**changes: Any) -> BudgetConfig:
    return budget_config(GenerationConfig(), **changes)


def default_training(**changes: Any) -> TrainingSetConfig:
    """For a context of ``DEFAULT_MAX_LENGTH`` unless ``max_length`` says otherwise."""
    return training_set_config(GenerationConfig(), DEFAULT_MAX_LENGTH, **changes)


def prompt_frame(texts: list[str], sources: list[str] | None = None) -> pl.DataFrame:
    """Prompt records as extraction produces them, for tests that start at the budget stage."""
    return pl.DataFrame(
        {
            "prompt_id": [f"p{i:05d}" for i in range(len(texts))],
            "source": sources or ["sample"] * len(texts),
            "messages": [[{"role": "user", "content": t}] for t in texts],
        },
        schema={"prompt_id": pl.String, "source": pl.String, "messages": MESSAGES},
    )


def prompts_asset(frame: pl.DataFrame) -> dg.AssetsDefinition:
    """The ``prompts`` asset as ``frame``: a pipeline that starts at the budget stage."""

    @dg.asset(name="prompts", io_manager_key="parquet_io")
    def prompts() -> pl.DataFrame:
        return frame

    return prompts


def resources(urls: list[str], root, *, fleet: dict | None = None, **settings) -> dict:
    """Resources attached to running (simulated) servers; ``fleet`` and ``settings`` override fields."""
    fast_retries = {"backoff_initial_s": 0.01, "progress_interval_s": 1.0}
    return {
        "fleet": FleetResource(mode="attach", urls=urls, **(fleet or {})),
        "settings": GenerationSettings(**{**fast_retries, **settings}),
        "storage": StorageResource(root=str(root)),
        "parquet_io": ParquetIOManager(root=str(root)),
    }


def prompts_answered(stats: Mapping[str, Any]) -> int:
    """The prompts a simulated server answered (``stats``: its ``/sim/stats``): its completed requests
    less the greedy ones, which the pipeline sends only as the weights probe (``FleetResource.weights_probe``:
    one a server in a night's budget, and one to its own server in each shard's run)."""
    return stats["completed"] - stats["greedy_requests"]


def assert_the_demo_runs_succeeded(instance: dg.DagsterInstance) -> None:
    """``instance`` holds the runs of one `expansion-dag run` of the demo: all four succeeded, and
    each shard's completions were materialized with more than a handful of answers."""
    runs = instance.get_runs()
    assert sorted(r.job_name for r in runs) == ["generate_job", "generate_job", "prepare_job", "training_set_job"]
    assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
    for shard in ("shard-00", "shard-01"):
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[shard]), limit=1
        ).records
        assert records, shard
        assert records[0].asset_materialization.metadata["completions_total"].value > 40


def command_lines_holding(secret: str, session: int | None = None) -> list[str]:
    """The command lines that hold ``secret``, as ``ps`` shows them: of every process on this
    machine, or of those in ``session`` (a launched server's: its pid, the leader)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            # "pid (name) state ppid pgrp session ...": the name may hold spaces and parentheses.
            sid = int((proc / "stat").read_text().rpartition(")")[2].split()[3])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        if (session is None or sid == session) and any(secret.encode() in arg for arg in argv):
            found.append(b" ".join(argv).decode(errors="replace"))
    return found


def wait_for(predicate: Callable[[], Any], what: str = "the condition", timeout_s: float = 60.0) -> Any:
    """Poll ``predicate`` until it returns a true value, and return it. The deadline is for a hang
    only: generous enough that no loaded machine reaches it, so a test waits on the event itself."""
    for value in _polled(predicate, what, timeout_s):
        if value:
            return value
        time.sleep(0.01)


async def until(predicate: Callable[[], Any], what: str = "the condition", timeout_s: float = 60.0) -> Any:
    """:func:`wait_for` in a coroutine: the event loop that brings the condition about keeps running."""
    for value in _polled(predicate, what, timeout_s):
        if value:
            return value
        await asyncio.sleep(0.01)


def _polled(predicate: Callable[[], Any], what: str, timeout_s: float) -> Iterator[Any]:
    """``predicate``'s values, one a poll, until the deadline fails the test."""
    deadline = time.monotonic() + timeout_s
    while True:
        yield predicate()
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:.0f} s"


def mock_client(handler) -> httpx.AsyncClient:
    """A generation client whose requests ``handler`` answers in-process (httpx's MockTransport)."""
    return async_client(timeout_s=10.0, connect_timeout_s=2.0, transport=httpx.MockTransport(handler))


def loop_thresholds(**changes: Any) -> LoopThresholds:
    """The loop detector's thresholds as a run configures them by default, with ``changes``."""
    loop = default_engine().loop
    assert loop is not None  # answers are streamed and loops stopped by default
    return dataclasses.replace(loop, **changes)


def repetitive_answers() -> list[dict[str, str]]:
    """The corpus of legitimate answers that repeat a shape (``data/make_repetitive_corpus.py``)."""
    with gzip.open(CORPUS_PATH, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def one_mode(identity: Identity, chat_template_kwargs: dict | None = None) -> ModeIdentities:
    """A run without modes whose one identity is ``identity`` (the tests' own, fingerprint and all),
    its answers rendered with ``chat_template_kwargs``."""
    sampling = default_sampling(chat_template_kwargs_json=json.dumps(chat_template_kwargs or {}))
    identities = ModeIdentities(ModeMix.single(sampling), identity.model, identity.simulated)
    identities.by_mode[DEFAULT_MODE] = identity
    return identities


#: A tool as the client sends it (``servers.request_tools``), for the tests of tool-using requests.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def answered_prompts(records: Iterable[Mapping[str, Any]]) -> collections.Counter[str]:
    """Each prompt's answered requests in ``records``: one for a prompt, one a turn for a conversation
    (counted under the conversation's id, the id its budgeted row has)."""
    return collections.Counter(base_prompt_id(r) for r in records if r["status"] == "ok")


def requests_per_prompt(budgeted: pl.DataFrame) -> dict[str, int]:
    """Each budgeted prompt's requests when all are answered: its conversation's turns, or one."""
    conversations = budgeted["conversation"].to_list() if "conversation" in budgeted.columns else [None] * budgeted.height
    return {
        pid: 1 if turns is None else sum(m["role"] == "assistant" for m in turns)
        for pid, turns in zip(budgeted["prompt_id"].to_list(), conversations)
    }


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """A training row's masked spans of ids, in order: the assistant turns it trains on."""
    runs: list[list[int]] = []
    for token, bit, before in zip(ids, mask, [0, *mask]):
        if bit and not before:
            runs.append([])
        if bit:
            runs[-1].append(token)
    return runs


def closed_turn(sampled: list[int], special_ids: Iterable[int], end_of_turn: int) -> list[int]:
    """The ids a row trains on for one sampled answer: the server's own, closed by the template's
    end of turn where the answer stopped at no special token (cut at its max_tokens)."""
    return sampled if sampled and sampled[-1] in set(special_ids) else [*sampled, end_of_turn]
