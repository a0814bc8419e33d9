"""Training set built from the servers' token ids against today's re-tokenizing build (issue 38):
tokens per second and peak RSS, side by side in one run.

The records (``--source``):

* ``simulator`` (the default: the issue asks for the simulator's ids): a real run of the engine
  (``generate_shard``, as the completions asset drives it: streamed answers, ids asked for with
  ``return_input_ids_in_sglext`` and ``return_output_ids_in_sglext``) against simulated SGLang
  0.5.23 servers (``expansion_dag.sim.FleetProcess``: a process of their own, real HTTP, fast simulated time)
  that return the prompt's and the sampled ids as SGLang does, into a ``CompletionStore``; timed
  apart, never in a build's figures. The prompts are ``bench_training_set.py``'s (16,000: one user
  message, some with a system message, some multi-turn), thinking mode with the qwen3 reasoning
  parser (reasoning + content); the answers' lengths are drawn as that benchmark's are (median,
  spread and reasoning share measured on its records), capped so that about 1% are cut (left out
  by the build, as 1% of its records are). The store's records are written out as JSONL in a
  scratch folder of the run. The simulator's ids are the tokenizer's own encoding of its text
  (``sim.generation.sim_output_ids``; the prompt's, the same render tokenized whole): canonical, so
  the build's own measurement (``Manifest.retokenization``) finds no measured row differing, which
  checks the two paths against each other and proves nothing about a real model's ids. Its answers
  are a few hundred words that are each one token, which the re-tokenizing build tokenizes about
  twice as fast as the generated text of ``fabricated``.
* ``fabricated``: ``bench_training_set.py``'s records with the ids a server would return,
  fabricated once, untimed: the prompt rendered with the template and tokenized whole, the answer's
  raw text (``<think>\\n...\\n</think>\\n\\n`` and the content) tokenized and closed by
  ``<|im_end|>``. Canonical too; ``bench_training_parts.py`` builds from these.

Each build gets the same records: with their ids, and with the ids removed (every row rendered and
re-tokenized: today's build).

Throughput (one process per round): the records in ``--slices`` slices; on each slice both builds
run back to back, in an order that alternates from slice to slice, each on the slice's records held
in a list (``bench_training_set.run_build``: everything the build does is timed). Memory (one process
per build): each build on the whole file streamed (one ``json.loads`` a line, as the store streams),
the build's peak RSS, and its manifest's figures on the whole set (the re-tokenization measurement).

    .venv/bin/python bench/bench_training_ids.py                                        # 16,000 records, ~3 min
    .venv/bin/python bench/bench_training_ids.py --records 2000 --slices 2 --repeat 1   # smoke run, ~1 min
    .venv/bin/python bench/bench_training_ids.py --source fabricated                    # generated records

Results are printed and written as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_training_set import (  # (bench/ is on sys.path when run as a script)
    BENCH_IDENTITY,
    DEFAULT_RECORDS,
    DEFAULT_SLICES,
    bench_identities,
    ensure_records,
    records_path,
    run_build,
    spawn,
    stream_records,
)
import harness
from harness import Clock, reset_peak, window_peak_mib

from expansion_dag.sim import FleetProcess, SimServerConfig

BUILDS = ("retokenized", "ids")
SOURCES = ("simulator", "fabricated")
FABRICATE_BATCH = 512

# The simulated fleet. Answers as bench_training_set.py's records are (their answer tokens: median
# 1,028, log-sigma 0.55, 59% reasoning), cut at MAX_TOKENS, above about 1% of them.
SIM_SERVERS = 2
ANSWER_MEDIAN = 1030
MAX_TOKENS = 3700
STREAM_INTERVAL = 256
# Fast simulated time: 1,000 tokens in 20 ms, so the two processes' CPU sets the pace.
SIM_SERVER = SimServerConfig(
    port=0, max_running_requests=64, context_length=32768, reasoning_parser="qwen3", output_median_tokens=ANSWER_MEDIAN,
    output_sigma=0.55, reasoning_share=0.59, ttft_s=0.0, token_latency_s=0.00002, stream_interval=STREAM_INTERVAL,
)  # fmt: skip
SHARD = "shard-00"


def ids_path(args: argparse.Namespace) -> Path:
    path = records_path(args, args.records)
    return path.with_name(path.stem + "-ids.jsonl")


def ensure_ids_records(args: argparse.Namespace) -> Path:
    """The records with the ids a server would return, tokenized once (untimed) and cached."""
    path = ids_path(args)
    if path.exists():
        return path
    from expansion_dag.core import OUTPUT_IDS, PROMPT_IDS, load_tokenizer, pack, render_prompts

    tokenizer = load_tokenizer()
    encode = tokenizer.backend_tokenizer.encode_batch_fast
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    records = list(stream_records(ensure_records(args, args.records)))
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        for start in range(0, len(records), FABRICATE_BATCH):
            block = records[start : start + FABRICATE_BATCH]
            prompts = encode(render_prompts(tokenizer, [r["messages"] for r in block]), add_special_tokens=False)
            raws = [f"<think>\n{r['reasoning_content']}\n</think>\n\n{r['content']}" for r in block]
            for record, prompt, answer in zip(block, prompts, encode(raws, add_special_tokens=False)):
                output = [*answer.ids, end_of_turn]
                record.update({PROMPT_IDS: pack(prompt.ids), OUTPUT_IDS: pack(output), "completion_tokens": len(output)})
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def build_inputs(args: argparse.Namespace) -> dict[str, Path]:
    """Each build's JSONL: the same records without their ids and with them."""
    if args.source == "fabricated":
        return {"retokenized": records_path(args, args.records), "ids": ids_path(args)}
    return {name: args.scratch / f"{name}.jsonl" for name in BUILDS}


def simulate_records(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's run against the simulated fleet, its store written out as ``build_inputs``;
    what the run did."""
    from expansion_dag.core import OUTPUT_IDS, PROMPT_IDS, count_prompt_tokens, load_tokenizer
    from expansion_dag.config import GenerationConfig, engine_config, sampling_settings
    from expansion_dag.generation import Server, WorkItem, generate_shard
    from expansion_dag.store import CompletionStore

    prompts = list(stream_records(ensure_records(args, args.records)))
    counts = count_prompt_tokens(load_tokenizer(), [p["messages"] for p in prompts])
    # Under the key the build takes (bench_identities), as bench_training_set.py's records are.
    items = [WorkItem(key=BENCH_IDENTITY.key(p["prompt_id"]), prompt_id=p["prompt_id"], source=p["source"],
                      messages=p["messages"], prompt_tokens=n, max_tokens=MAX_TOKENS,
                      expected_output_tokens=ANSWER_MEDIAN)
             for p, n in zip(prompts, counts)]  # fmt: skip
    store = CompletionStore(args.scratch / "store")
    config = engine_config(GenerationConfig(), progress_interval_s=3600, canary=False)
    server = dataclasses.replace(SIM_SERVER, seed=args.seed)
    with FleetProcess([server] * SIM_SERVERS) as fleet:
        with store.writer(SHARD) as writer:
            servers = [Server(url, server.max_running_requests, stream_interval=STREAM_INTERVAL) for url in fleet.urls]
            report = generate_shard(items, servers, writer=writer, model=server.model_name, sampling=sampling_settings(GenerationConfig()),
                                    config=config)  # fmt: skip
        server_cpu_s = harness.process_cpu_s(fleet.pid)
    paths = build_inputs(args)
    records = with_ids = 0
    with open(paths["ids"], "w", encoding="utf-8") as ids, open(paths["retokenized"], "w", encoding="utf-8") as text:
        for record in store.records(SHARD):
            records += 1
            with_ids += PROMPT_IDS in record and OUTPUT_IDS in record
            ids.write(json.dumps(record, ensure_ascii=False) + "\n")
            without = {k: v for k, v in record.items() if k not in (PROMPT_IDS, OUTPUT_IDS)}
            text.write(json.dumps(without, ensure_ascii=False) + "\n")
    return {
        "simulator": dataclasses.asdict(server), "servers": SIM_SERVERS, "max_tokens": MAX_TOKENS,
        "stream_interval": STREAM_INTERVAL, "prompts": len(items), "records": records, "records_with_ids": with_ids,
        "ok": report.ok, "failed": report.failed, "finish_reasons": dict(report.finish_reasons),
        "output_tokens": report.output_tokens, "prompt_token_drift": dict(report.prompt_token_drift),
        "wall_s": round(report.elapsed_s, 1), "client_cpu_s": round(report.client_cpu_s, 1),
        "simulator_cpu_s": round(server_cpu_s, 1),
    }  # fmt: skip


def phase_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from expansion_dag.config import GenerationConfig, training_set_config
    from expansion_dag.core import load_tokenizer
    from expansion_dag.training import DEFAULT_MAX_LENGTH

    tokenizer, config = load_tokenizer(), training_set_config(GenerationConfig(), DEFAULT_MAX_LENGTH)
    records = {name: list(stream_records(path)) for name, path in build_inputs(args).items()}
    n = len(records["ids"])
    slices = []
    for index in range(args.slices):
        order = BUILDS if (args.round * args.slices + index) % 2 == 0 else BUILDS[::-1]
        results = {}
        for name in order:
            part = records[name][index * n // args.slices : (index + 1) * n // args.slices]
            results[name] = run_build(part, tokenizer, config, args.work_dir)
        slices.append({"slice": index, "round": args.round, "order": list(order), **results})
    return {"round": args.round, "slices": slices}


def phase_memory(args: argparse.Namespace) -> dict[str, Any]:
    import shutil

    from expansion_dag.config import GenerationConfig, training_set_config
    from expansion_dag.core import load_tokenizer
    from expansion_dag.training import DEFAULT_MAX_LENGTH, build_training_set

    tokenizer = load_tokenizer()
    path = build_inputs(args)[args.build]
    out_dir = args.work_dir / f"memory-{os.getpid()}"
    clock = Clock()
    reset_peak()
    try:
        with clock.span("build_streamed"):
            manifest = build_training_set(stream_records(path), tokenizer, training_set_config(GenerationConfig(), DEFAULT_MAX_LENGTH), out_dir,
                                          identities=bench_identities())  # fmt: skip
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {**clock.report(), "build": args.build, "samples": manifest.samples, "tokens": manifest.tokens,
            "left_out": manifest.left_out, "ids_from": manifest.ids_from,
            "retokenized_because": manifest.retokenized_because, "ids_text_differs": manifest.ids_text_differs,
            "retokenization": manifest.retokenization, "build_peak_rss_mib": window_peak_mib()}  # fmt: skip


PHASES = {"throughput": phase_throughput, "memory": phase_memory}


def summarize(pairs: list[dict[str, Any]], memory: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rounds = sorted({p["round"] for p in pairs})

    def tokens_per_s(name: str) -> dict[str, float]:
        values = [sum(p[name]["tokens"] for p in pairs if p["round"] == r)
                  / sum(p[name]["wall_s"]["build"] for p in pairs if p["round"] == r) for r in rounds]  # fmt: skip
        return {"median": round(statistics.median(values)), "best": round(max(values)), "worst": round(min(values))}

    paired = [p["retokenized"]["wall_s"]["build"] / p["ids"]["wall_s"]["build"] for p in pairs]
    tps = {name: tokens_per_s(name) for name in BUILDS}
    ratio = round(tps["ids"]["median"] / tps["retokenized"]["median"], 3)
    peaks = {name: memory[name]["build_peak_rss_mib"] for name in BUILDS}
    whole = memory["ids"]  # the ids build on every record: the set's own manifest figures
    return {
        "tokens_per_s": tps,
        "ids_vs_retokenized": {"of_medians": ratio, "paired_median": round(statistics.median(paired), 3),
                               "paired_best": round(max(paired), 3), "paired_worst": round(min(paired), 3)},
        "build_peak_rss_mib": peaks,
        "rows": whole["samples"], "tokens": whole["tokens"], "left_out": whole["left_out"],
        "ids_from": {name: memory[name]["ids_from"] for name in BUILDS},
        "retokenized_because": {name: memory[name]["retokenized_because"] for name in BUILDS},
        "ids_text_differs": whole["ids_text_differs"],
        "retokenization": whole["retokenization"],
        "same_tokens": all(p["ids"]["tokens"] == p["retokenized"]["tokens"] for p in pairs)
                       and memory["ids"]["tokens"] == memory["retokenized"]["tokens"],
        "targets": {"ids_at_least_3x": ratio >= 3.0, "peak_rss_not_higher": peaks["ids"] <= peaks["retokenized"]},
        "others_cores": [p["others_cores"] for p in pairs if p["slice"] == 0],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=DEFAULT_RECORDS,
                   help=f"records: the prompts the simulator answers (default {DEFAULT_RECORDS:,})")
    p.add_argument("--source", choices=SOURCES, default=SOURCES[0],
                   help="where the records and their ids come from (default simulator)")
    p.add_argument("--slices", type=int, default=DEFAULT_SLICES, help=f"slices of the records (default {DEFAULT_SLICES})")
    p.add_argument("--repeat", type=int, default=2, help="rounds over all slices, one process each (default 2)")
    p.add_argument("--work-dir", type=Path, default=None, help="where builds write (default: --data-dir)")
    p.add_argument("--build", choices=BUILDS, help=argparse.SUPPRESS)
    p.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)  # this run's folder: its simulated records
    harness.add_phase_options(p, PHASES, quiet_wait_s=5.0)
    args = p.parse_args(argv)
    args.work_dir = args.work_dir or args.data_dir
    if args.phase:
        harness.run_phase_here(PHASES[args.phase], args, preload=("polars", "expansion_dag.core.tokenizer", "expansion_dag.training.build"))
        return 0
    args.data_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    simulated = args.source == "simulator"
    document = harness.header("training_ids", *harness.DATA_PACKAGES, simulator=simulated, argv=argv)
    # The simulated records are this run's own (a scratch folder): the engine's run is part of the result.
    with tempfile.TemporaryDirectory(prefix="training-ids-", dir=args.work_dir) as scratch:
        extra: dict[str, Any] = {"source": args.source}
        if simulated:
            args.scratch = extra["scratch"] = Path(scratch)
            print(f"{args.records:,} prompts through the engine to {SIM_SERVERS} simulated servers ...", flush=True)
            document["simulated_run"] = run = simulate_records(args)
            print(f"{run['records']:,} records ({run['records_with_ids']:,} with ids), {run['output_tokens']:,} output "
                  f"tokens in {run['wall_s']} s", flush=True)  # fmt: skip
        else:
            ensure_ids_records(args)
        pairs = []
        for round_index in range(args.repeat):
            result = spawn("throughput", args, script=__file__, round=round_index, **extra)
            for part in result["slices"]:
                part["others_cores"] = result["others_cores"]
                pairs.append(part)
                rates = "  ".join(f"{n} {part[n]['tokens'] / part[n]['wall_s']['build']:>10,.0f} tok/s" for n in BUILDS)
                print(f"round {round_index + 1} slice {part['slice'] + 1}/{args.slices}  {rates}", flush=True)
        memory = {name: spawn("memory", args, script=__file__, build=name, **extra) for name in BUILDS}
    summary = summarize(pairs, memory)
    document.update({"settings": {"records": args.records, "source": args.source, "slices": args.slices,
                                  "repeat": args.repeat, "seed": args.seed},
                     "summary": summary, "pairs": pairs, "memory_runs": memory})  # fmt: skip
    print(json.dumps(summary, indent=2))
    print(f"\nwritten {harness.write_result('training_ids', document, out_dir=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
