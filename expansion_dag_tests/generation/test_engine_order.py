"""The queue's order learned from answer lengths: from an earlier night's completions in the store,
and from the run's own answers as they return. Against the simulator over real HTTP, one worker,
so the store's order is the dispatch order."""

from expansion_dag.generation import Server, Turn, WorkItem, generate_shard, learn
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import default_sampling, default_engine

MODEL = SimServerConfig().model_name
SAMPLING = default_sampling()
#: Source A's instruction makes long answers, B's short ones (the simulator's per-source medians).
SIM = SimServerConfig(port=0, max_running_requests=1, ttft_s=0.0, token_latency_s=0.00002, output_sigma=0.2,
                      output_median_by_marker=(("[A]", 400), ("[B]", 20)))
#: One request at a time: the order answers are written is the order they were sent.
SEQUENTIAL = default_engine(min_headroom=0, headroom_fraction=0.0, canary=False, backoff_initial_s=0.01,
                          progress_interval_s=3600)


def work(night, n, prior=100):
    """Prompts of sources A and B interleaved, with the same typed prior (none told apart)."""
    items = []
    for i in range(n):
        source = "AB"[i % 2]
        prompt_id = f"n{night}-p{i:03d}"
        items.append(WorkItem(
            key=SAMPLING.key(prompt_id, MODEL), prompt_id=prompt_id, source=source,
            messages=[{"role": "user", "content": f"[{source}] Night {night}, question {i}."}],
            prompt_tokens=20, max_tokens=2000, expected_output_tokens=prior,
        ))
    return items


def run(store, shard, items, lengths=None):
    with SimulatedFleet([SIM]) as fleet, store.writer(shard) as writer:
        report = generate_shard(items, [Server(fleet.urls[0], 1)], writer=writer, model=MODEL, sampling=SAMPLING,
                                config=SEQUENTIAL, lengths=lengths)
    return report, [r["source"] for r in store.records(shard)]


def owned(record):
    return record["key"] == SAMPLING.key(record["prompt_id"], MODEL)


def test_an_earlier_nights_completions_start_the_long_source_first(tmp_path):
    store = CompletionStore(tmp_path)
    run(store, "night-1", work(1, 20))
    lengths = learn((r for shard in store.shards() for r in store.records(shard)), owned)
    assert lengths.estimate("A", 20, prior=100).tokens > 250 > 60 > lengths.estimate("B", 20, prior=100).tokens

    _, order = run(store, "night-2", work(2, 20), lengths)
    assert order == ["A"] * 10 + ["B"] * 10


def test_with_an_empty_store_the_run_learns_the_order_as_answers_return(tmp_path):
    report, order = run(CompletionStore(tmp_path), "shard-00", work(1, 80))
    # The first answers follow the prompt ids (A, B, A, B...); once 16 have returned, the queue is
    # re-ordered and the long source's prompts go first.
    assert order[:16] == ["A", "B"] * 8
    assert order[16:48] == ["A"] * 32
    assert report.reorders >= 1


def test_answers_of_other_settings_teach_nothing(tmp_path):
    store = CompletionStore(tmp_path)
    run(store, "night-1", work(1, 10))
    other = default_sampling(temperature=0.1)
    lengths = learn((r for shard in store.shards() for r in store.records(shard)),
                    lambda r: r["key"] == other.key(r["prompt_id"], MODEL))
    assert lengths.answers == 0


def test_a_long_conversations_first_turn_goes_before_short_single_prompts(tmp_path):
    """A conversation's turns wait on each other: what it holds the fleet is its whole chain, so its
    short first turn starts before single prompts with longer answers (and a short chain after them)."""

    def item(source, prompt_id, prior, turns=None):
        return WorkItem(
            key=SAMPLING.key(prompt_id, MODEL), prompt_id=prompt_id, source=source,
            messages=[{"role": "user", "content": f"[{source}] {prompt_id}"}], prompt_tokens=20, max_tokens=2000,
            expected_output_tokens=prior, turn=None if turns is None else Turn(prompt_id, 1, turns, ()),
        )

    singles = [item("B", f"single-{i}", prior=100) for i in range(6)]
    long_chain = item("L", "long-conversation", prior=60, turns=6)  # 6 x 60 expected: 360 > 100
    short_chain = item("S", "short-conversation", prior=30, turns=2)  # 2 x 30 expected: 60 < 100
    _, order = run(CompletionStore(tmp_path), "shard-00", [*singles, short_chain, long_chain])
    assert order == ["L"] + ["B"] * 6 + ["S"]
