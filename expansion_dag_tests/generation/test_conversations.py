"""Conversations regenerated turn by turn by the engine (httpx.MockTransport, the real Qwen3 tokenizer)."""

import json

import httpx
import polars as pl

from expansion_dag.core import (
    CONTEXT_EXHAUSTED,
    FAILED,
    OK,
    TURN_UNFINISHED,
    ModeIdentities,
    ModeMix,
    count_prompt_tokens,
    load_tokenizer,
)
from expansion_dag.generation import ShardWork, TurnPlanner, turn_id
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import default_sampling, default_engine
from expansion_dag_tests.generation.test_engine import FAST, completion, run

SAMPLING = default_sampling(chat_template_kwargs_json='{"enable_thinking": false}')
IDENTITIES = ModeIdentities(ModeMix.single(SAMPLING), "m", False)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONTEXT, CAP, MARGIN, MIN_OUT = 4096, 512, 16, 32


def conversation(i: int) -> list[dict]:
    """System, a question, a tool result, a second question: three answers to regenerate."""
    return [
        {"role": "system", "content": "You help with the weather."},
        {"role": "user", "content": f"Weather in city {i}?"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": json.dumps({"city": i, "sky": "clear"})},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": None},
    ]


def planner(context=CONTEXT, continue_on=("stop", "tool_calls")) -> TurnPlanner:
    return TurnPlanner(load_tokenizer(), context, CAP, MIN_OUT, MARGIN, IDENTITIES.by_mode, continue_on)


def prompts(n: int) -> pl.DataFrame:
    tokenizer = load_tokenizer()
    rows = []
    for i in range(n):
        conv = conversation(i)
        first = conv[:2]
        (tokens,) = count_prompt_tokens(tokenizer, [first], SAMPLING.chat_template_kwargs, tools=[TOOLS])
        rows.append({"prompt_id": f"c{i}", "source": "hermes", "messages": first, "prompt_tokens": tokens,
                     "max_tokens": min(CAP, CONTEXT - tokens - MARGIN), "expected_tokens": tokens + 50,
                     "conversation": conv, "tools": json.dumps(TOOLS)})
    return pl.DataFrame(rows)


def answer_each_turn(requests: list[dict], finish=lambda turn: "stop"):
    def handler(request):
        body = json.loads(request.content)
        requests.append(body)
        turn = sum(m["role"] == "assistant" for m in body["messages"]) + 1
        return httpx.Response(200, json=completion(f"answer {turn}", finish=finish(turn)))

    return handler


def generate(tmp_path, work: ShardWork, handler):
    todo, ended = work.items(lambda keys: {r["key"]: r for r in CompletionStore(tmp_path).latest_records() if r["key"] in keys})
    assert not ended
    return run(tmp_path, todo, handler, sampling=SAMPLING, planner=work.planner)


def test_every_assistant_turn_is_asked_with_the_conversation_so_far_each_budgeted(tmp_path):
    requests: list[dict] = []
    work = ShardWork(prompts(3), IDENTITIES, retry_outcomes=(), planner=planner())
    report, store = generate(tmp_path, work, answer_each_turn(requests))

    assert len(requests) == 9 and report.ok == 9 and report.total == 9
    records = {r["prompt_id"]: r for r in store.records("shard-00")}
    assert sorted(records) == sorted(turn_id(f"c{i}", k) for i in range(3) for k in (1, 2, 3))
    last = records[turn_id("c1", 3)]
    # Earlier answers are the model's own; user and tool turns come from the source.
    assert last["messages"] == [
        {"role": "system", "content": "You help with the weather."},
        {"role": "user", "content": "Weather in city 1?"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "tool", "content": json.dumps({"city": 1, "sky": "clear"})},
        {"role": "assistant", "content": "answer 2"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert (last["conversation_id"], last["turn"], last["turns"]) == ("c1", 3, 3)
    assert last["prior_finish_reasons"] == ["stop", "stop"] and last["tools"] == TOOLS
    # Each turn's budget is its own, from its exact prompt count with the tools rendered.
    for record in records.values():
        (tokens,) = count_prompt_tokens(load_tokenizer(), [record["messages"]], SAMPLING.chat_template_kwargs,
                                        tools=[TOOLS])
        assert record["local_prompt_tokens"] == tokens
        assert record["max_tokens"] == min(CAP, CONTEXT - tokens - MARGIN)
    assert all(body["tools"] == TOOLS for body in requests)
    assert {r["key"] for r in records.values()} == work.frontier_keys(store.latest_records(digest=True)) | {
        IDENTITIES.by_mode["default"].key(turn_id(f"c{i}", k)) for i in range(3) for k in (1, 2)
    }


def test_a_cut_turn_or_a_full_context_ends_its_conversation_for_good_as_the_contents_doing(tmp_path):
    requests: list[dict] = []
    work = ShardWork(prompts(1), IDENTITIES, retry_outcomes=(), planner=planner())
    _, store = generate(tmp_path / "cut", work, answer_each_turn(requests, finish=lambda t: "length" if t == 2 else "stop"))
    ended = {r["prompt_id"]: r for r in store.records("shard-00", status=FAILED)}
    assert list(ended) == [turn_id("c0", 3)] and ended[turn_id("c0", 3)]["error"] == TURN_UNFINISHED
    assert ended[turn_id("c0", 3)]["outcome"] == "content" and len(requests) == 2

    # A context that holds turn 1 but not the conversation after it.
    first_tokens = prompts(1)["prompt_tokens"][0]
    small = ShardWork(prompts(1).with_columns(max_tokens=pl.lit(MIN_OUT)), IDENTITIES,
                      retry_outcomes=(), planner=planner(context=first_tokens + MIN_OUT + MARGIN + 10))
    requests.clear()
    _, store = generate(tmp_path / "full", small, answer_each_turn(requests))
    (record,) = store.records("shard-00", status=FAILED)
    assert record["error"] == CONTEXT_EXHAUSTED and record["prompt_id"] == turn_id("c0", 2) and len(requests) == 1
    # Final: a re-run sends nothing for it.
    again = ShardWork(prompts(1), IDENTITIES, retry_outcomes=(), planner=planner(context=first_tokens + MIN_OUT + MARGIN + 10))
    list(again.reading(store.latest_records(digest=True)))
    assert again.items(lambda keys: {}) == ([], [])


def test_a_resumed_conversation_goes_on_from_its_last_answer_and_asks_nothing_twice(tmp_path):
    requests: list[dict] = []
    work = ShardWork(prompts(2), IDENTITIES, retry_outcomes=(), planner=planner())
    # The first run's server dies after turn 1 of each conversation.
    def dies_after_turn_one(request):
        if any(m["role"] == "assistant" for m in json.loads(request.content)["messages"]):
            return httpx.Response(503, text="gone")
        return answer_each_turn(requests)(request)

    todo, _ = work.items(lambda keys: {})
    run(tmp_path, todo, dies_after_turn_one, sampling=SAMPLING, planner=work.planner,
        config=default_engine(**FAST, max_attempts=1, breaker_window=1000))
    store = CompletionStore(tmp_path)
    assert {r["prompt_id"] for r in store.records("shard-00")} == {"c0.t1", "c1.t1"}

    resumed = ShardWork(prompts(2), IDENTITIES, retry_outcomes=(), planner=planner())
    list(resumed.reading(store.latest_records(digest=True)))
    todo, ended = resumed.items(lambda keys: {r["key"]: r for r in store.latest_records() if r["key"] in keys})
    assert sorted(i.prompt_id for i in todo) == ["c0.t2", "c1.t2"] and not ended
    assert todo[0].messages[2]["content"] == "answer 1"  # built from the stored answer
    requests.clear()
    run(tmp_path, todo, answer_each_turn(requests), sampling=SAMPLING, planner=resumed.planner)
    assert len(requests) == 4  # turns 2 and 3 of each, turn 1 never again
    done = {r["prompt_id"] for r in CompletionStore(tmp_path).latest_records() if r["status"] == OK}
    assert done == {turn_id(f"c{i}", k) for i in range(2) for k in (1, 2, 3)}
