"""Client CPU per request when conversations are regenerated turn by turn, against the same requests
sent as single prompts, side by side (SIMULATOR fleet: no GPU, the client's CPU is what is measured).

A conversation's next turn is built in the client when the previous answer arrives: its messages,
and its exact prompt count through the tokenizer with the tools rendered (``TurnPlanner``). That
work must stay small beside what a request already costs the client, or conversations would starve
the fleet. Both phases send the same turns to one simulated SGLang server in a process of its own:

- ``single prompts`` (the baseline): every turn's request as recorded by the conversation phase,
  sent as independent prompts with their budgets, no planner;
- ``conversations``: the bundled Hermes conversations (tools, tool results, second questions),
  copied ``--copies`` times with distinct ids, each turn asked when the previous one is answered.

    .venv/bin/python bench/bench_conversations.py             # ~1 min
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import polars as pl
from harness import cpu_s, header, stats, write_result  # (bench/ is on sys.path)

from expansion_dag.config import GenerationConfig, engine_config, sampling_settings
from expansion_dag.core import ModeIdentities, ModeMix, count_prompt_tokens, load_tokenizer
from expansion_dag.generation import Server, ShardWork, TurnPlanner, WorkItem, generate_shard
from expansion_dag.prompts import extract_prompts, package_dir
from expansion_dag.servers import SGLANG, template_tools
from expansion_dag.sim import FleetProcess, SimServerConfig
from expansion_dag.store import CompletionStore

MODEL = "Qwen/Qwen3-8B"
CONTEXT, CAP, MARGIN, MIN_OUT = 32_768, 1024, 16, 64
SAMPLING = sampling_settings(GenerationConfig(), chat_template_kwargs_json='{"enable_thinking": false}', max_output_tokens=CAP)
IDENTITIES = ModeIdentities(ModeMix.single(SAMPLING), f"{MODEL} (simulator)", True)


def conversations(copies: int) -> pl.DataFrame:
    """The Hermes sample's conversations, ``copies`` times, each copy's ids and first question its own."""
    raw = pl.read_json(package_dir("samples") / "hermes_function_calling" / "func_calling.json")
    base = extract_prompts(raw, source="hermes_fc", extractor="hermes_function_calling", conversation=True).prompts
    tokenizer = load_tokenizer()
    rows = []
    for copy in range(copies):
        for row in base.iter_rows(named=True):
            tools = template_tools(json.loads(row["tools"]), SGLANG)
            conversation = [dict(m) for m in row["conversation"]]
            first_user = next(i for i, m in enumerate(conversation) if m["role"] == "user")
            conversation[first_user]["content"] += f" (case {copy})"
            messages = conversation[: next(i for i, m in enumerate(conversation) if m["role"] == "assistant")]
            (tokens,) = count_prompt_tokens(tokenizer, [messages], SAMPLING.chat_template_kwargs, tools=[tools])
            rows.append({
                "prompt_id": f"{row['prompt_id']}-{copy}", "source": "hermes_fc", "messages": messages,
                "prompt_tokens": tokens, "max_tokens": min(CAP, CONTEXT - tokens - MARGIN),
                "expected_tokens": tokens + 200, "conversation": conversation, "tools": json.dumps(tools),
            })
    return pl.DataFrame(rows)


def run(items: list[WorkItem], url: str, slots: int, store_dir: Path, planner: TurnPlanner | None) -> dict[str, Any]:
    store = CompletionStore(store_dir)
    config = engine_config(GenerationConfig(), progress_interval_s=3600, stop_degenerate=True, canary=False)
    before, started = cpu_s(), time.monotonic()
    with store.writer("shard-00") as writer:
        report = generate_shard(items, [Server(url, slots, SGLANG, stream_interval=256)], writer=writer,
                                model=MODEL, sampling=SAMPLING, config=config, planner=planner)
    cpu = cpu_s() - before
    return {"requests": report.ok + report.failed, "client_cpu_s": round(cpu, 3),
            "client_cpu_ms_per_request": round(1000 * cpu / max(1, report.ok + report.failed), 3),
            "wall_s": round(time.monotonic() - started, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=60, help="copies of the sample's conversations")
    parser.add_argument("--slots", type=int, default=72)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    frame = conversations(args.copies)
    tokenizer = load_tokenizer()
    server = SimServerConfig(port=0, max_running_requests=args.slots, context_length=CONTEXT, ttft_s=0.005,
                             token_latency_s=0.0005, output_median_tokens=150, stream_interval=256)  # fmt: skip
    phases: dict[str, list[dict[str, Any]]] = {"single prompts": [], "conversations": []}
    with FleetProcess([server]) as fleet, tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            planner = TurnPlanner(tokenizer, CONTEXT, CAP, MIN_OUT, MARGIN, IDENTITIES.by_mode,
                                  ("stop", "tool_calls", "length"))
            work = ShardWork(frame, IDENTITIES, retry_outcomes=(), planner=planner)
            conv_dir = Path(tmp) / f"conv-{round_}"
            todo, _ = work.items(lambda keys: {})
            phases["conversations"].append(run(todo, fleet.urls[0], args.slots, conv_dir, planner))
            # The same turns, as recorded, sent as independent prompts.
            turns = [
                WorkItem(key=f"single-{r['key']}", prompt_id=r["prompt_id"], source=r["source"], messages=r["messages"],
                         prompt_tokens=r["local_prompt_tokens"], max_tokens=r["max_tokens"],
                         expected_output_tokens=200, sampling=SAMPLING, tools=r["tools"])
                for r in CompletionStore(conv_dir).records("shard-00")
            ]
            phases["single prompts"].append(run(turns, fleet.urls[0], args.slots, Path(tmp) / f"single-{round_}", None))
            fleet.wait_idle()
    per_request = {name: stats([r["client_cpu_ms_per_request"] for r in runs]) for name, runs in phases.items()}
    ratio = per_request["conversations"]["median"] / per_request["single prompts"]["median"]
    document = {
        **header("conversations", "transformers", "tokenizers", simulator=True),
        "conversations": frame.height,
        "turns_per_round": phases["conversations"][0]["requests"],
        "phases": phases,
        "client_cpu_ms_per_request": per_request,
        "conversations_over_single_prompts": round(ratio, 3),
    }
    print(json.dumps({k: document[k] for k in ("turns_per_round", "client_cpu_ms_per_request",
                                               "conversations_over_single_prompts")}, indent=2))
    write_result("conversations", document)


if __name__ == "__main__":
    main()
