"""SIGKILL a shard's run mid-generation on a real server (vLLM, SGLang), resume it: each prompt answered once.

"Generated" is counted by the server itself (``EngineServer.generated``: vLLM's finished-request
counters for ``stop`` and ``length``; SGLang's finished requests less its aborted ones), read
from its /metrics before and after each run. The requests in flight when the client dies either
run to their end at the server (short answers finish before it notices the closed connection) or
are aborted; answers that finished are lost with the client and asked for again, the one cost of
a SIGKILL, bounded by the requests in flight.
"""

from __future__ import annotations

import os
import signal
import time

import polars as pl
import pytest

from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import answered_prompts, default_engine, requests_per_prompt
from expansion_dag_tests.real_engine.conftest import SLOTS
from expansion_dag_tests.real_engine.support import Deployment, EngineServer, failure_report

SHARD = "shard-00"
#: The kill lands once this many completions are durable: past the canary, far from the end.
KILL_AFTER_LINES = 20


def lines_in(store_dir) -> int:
    return sum(p.read_bytes().count(b"\n") for p in store_dir.glob("seg-*.jsonl"))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_killed_shard_resumes_asking_the_server_only_for_what_is_missing(engine, request, tmp_path, figures):
    server: EngineServer = request.getfixturevalue(f"{engine}_server")
    deployment: Deployment = request.getfixturevalue(f"{engine}_attach")(tmp_path)
    prepared = deployment.prepare()
    assert prepared.returncode == 0, failure_report(prepared, server)
    prompts = requests_per_prompt(pl.read_parquet(deployment.storage / "assets" / "budgeted_prompts.parquet"))
    store = CompletionStore(deployment.storage / "completions")
    store_dir = deployment.storage / "completions" / SHARD

    before = server.metrics()
    run = deployment.start(*deployment.generate_args(SHARD))
    deadline = time.monotonic() + 180
    while lines_in(store_dir) < KILL_AFTER_LINES and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.poll() is None, "the shard ended before the kill:\n" + run.communicate()[0][-3000:]
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    server.wait_idle()  # the killed client's requests are aborted or finished at the server
    at_kill = server.metrics()
    done_at_kill = len(store.scan(SHARD).done)

    resumed = deployment.run(*deployment.generate_args(SHARD))
    assert resumed.returncode == 0, failure_report(resumed, server)
    after = server.metrics()

    # Answers the engine generated (stop or length) while each run was up.
    generated_by_killed_run = server.generated(before, at_kill)
    generated_by_resume = server.generated(at_kill, after)
    scan = store.scan(SHARD)
    figures[engine]["kill_resume"] = {
        "prompts": len(prompts),
        "requests": sum(prompts.values()),
        "durable_at_kill": done_at_kill,
        "generated_by_killed_run": generated_by_killed_run,
        "requests_at_kill": server.received(before, at_kill),
        "aborted_at_kill": server.aborted(before, at_kill),
        "lost_in_flight_at_kill": generated_by_killed_run - done_at_kill,
        "generated_by_resume": generated_by_resume,
        "duplicate_lines": scan.duplicates,
    }
    assert 0 < done_at_kill < len(prompts)
    # Every answer the killed run wrote was kept. Only answers in flight at the kill can have been
    # generated and lost with the client (and each run's weights probe, before its prompts); the
    # resume asked the server for the rest, once each.
    assert 0 <= generated_by_killed_run - 1 - done_at_kill <= default_engine().workers_for(SLOTS)
    # One request a prompt, or a conversation's turn (at this context, only one-turn ones fit).
    records = list(store.records(SHARD))
    assert answered_prompts(records) == prompts
    assert generated_by_resume == server.received(at_kill, after) == len(records) - done_at_kill + 1  # + the probe
    assert scan.duplicates == 0 and scan.failed == set()
    metadata = deployment.metadata("completions", SHARD)
    assert metadata["completed_before_this_run"] == done_at_kill
    assert metadata["sent_this_run"] == len(records) - done_at_kill
