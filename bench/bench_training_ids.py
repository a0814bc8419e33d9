"""Training set built from the servers' token ids against today's re-tokenizing build (issue 38):
tokens per second and peak RSS, side by side in one run.

The records are ``bench_training_set.py``'s (16,000 thinking-mode completions, about 21.8 M tokens
a round, 1% truncated and left out), each kept twice: as it is, without ids (every row rendered and
re-tokenized: today's build), and with the ids a server returns, fabricated once before anything is
timed: the prompt rendered with the template and tokenized whole, as the server does, and the
answer's raw text (``<think>\\n...\\n</think>\\n\\n`` and the content) tokenized and closed by
``<|im_end|>``, the stop token a server's ids end with. These ids are canonical, so they
re-tokenize to themselves: the build's own measurement (``Manifest.retokenization``) must find no
measured row differing, which checks the two paths against each other.

Throughput (one process per round): the records in ``--slices`` slices; on each slice both builds
run back to back, in an order that alternates from slice to slice, each on the slice's records held
in a list (``bench_training_set.run_build``: everything the build does is timed). Memory (one process
per build): each build on the whole file streamed (one ``json.loads`` a line, as the store streams),
the build's peak RSS.

    .venv/bin/python bench/bench_training_ids.py                                        # 16,000 records
    .venv/bin/python bench/bench_training_ids.py --records 2000 --slices 2 --repeat 1   # smoke run

Results are printed and written as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench_training_set import (  # (bench/ is on sys.path when run as a script)
    DEFAULT_RECORDS,
    DEFAULT_SLICES,
    bench_identities,
    ensure_records,
    records_path,
    run_build,
    spawn,
    stream_records,
)
from harness import (
    DATA_PACKAGES,
    Clock,
    add_phase_options,
    header,
    reset_peak,
    run_phase_here,
    window_peak_mib,
    write_result,
)

BUILDS = ("retokenized", "ids")
FABRICATE_BATCH = 512


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


def phase_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from expansion_dag.core import load_tokenizer
    from expansion_dag.training import TrainingSetConfig

    tokenizer, config = load_tokenizer(), TrainingSetConfig()
    records = {"retokenized": list(stream_records(records_path(args, args.records))),
               "ids": list(stream_records(ids_path(args)))}  # fmt: skip
    slices = []
    for index in range(args.slices):
        order = BUILDS if (args.round * args.slices + index) % 2 == 0 else BUILDS[::-1]
        results = {}
        for name in order:
            part = records[name][index * args.records // args.slices : (index + 1) * args.records // args.slices]
            results[name] = run_build(part, tokenizer, config, args.work_dir)
        slices.append({"slice": index, "round": args.round, "order": list(order), **results})
    return {"round": args.round, "slices": slices}


def phase_memory(args: argparse.Namespace) -> dict[str, Any]:
    import shutil

    from expansion_dag.core import load_tokenizer
    from expansion_dag.training import TrainingSetConfig, build_training_set

    tokenizer = load_tokenizer()
    path = ids_path(args) if args.build == "ids" else records_path(args, args.records)
    out_dir = args.work_dir / f"memory-{os.getpid()}"
    clock = Clock()
    reset_peak()
    try:
        with clock.span("build_streamed"):
            manifest = build_training_set(stream_records(path), tokenizer, TrainingSetConfig(), out_dir,
                                          identities=bench_identities())  # fmt: skip
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {**clock.report(), "build": args.build, "tokens": manifest.tokens, "build_peak_rss_mib": window_peak_mib()}


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
    measured = [p["ids"]["retokenization"] for p in pairs if p["round"] == rounds[0]]
    return {
        "tokens_per_s": tps,
        "ids_vs_retokenized": {"of_medians": ratio, "paired_median": round(statistics.median(paired), 3),
                               "paired_best": round(max(paired), 3), "paired_worst": round(min(paired), 3)},
        "build_peak_rss_mib": peaks,
        "ids_from": {name: {k: sum(p[name]["ids_from"][k] for p in pairs if p["round"] == rounds[0])
                            for k in pairs[0][name]["ids_from"]} for name in BUILDS},
        "measured_rows": sum(m["rows_measured"] for m in measured),
        "measured_rows_differing": sum(m["rows_differing"] + m["prompt_rows_differing"] for m in measured),
        "same_tokens": all(p["ids"]["tokens"] == p["retokenized"]["tokens"] for p in pairs),
        "targets": {"ids_at_least_3x": ratio >= 3.0, "peak_rss_not_higher": peaks["ids"] <= peaks["retokenized"]},
        "others_cores": [p["others_cores"] for p in pairs if p["slice"] == 0],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=DEFAULT_RECORDS, help=f"records (default {DEFAULT_RECORDS:,})")
    p.add_argument("--slices", type=int, default=DEFAULT_SLICES, help=f"slices of the records (default {DEFAULT_SLICES})")
    p.add_argument("--repeat", type=int, default=2, help="rounds over all slices, one process each (default 2)")
    p.add_argument("--work-dir", type=Path, default=None, help="where builds write (default: --data-dir)")
    p.add_argument("--build", choices=BUILDS, help=argparse.SUPPRESS)
    add_phase_options(p, PHASES, quiet_wait_s=5.0)
    args = p.parse_args(argv)
    args.work_dir = args.work_dir or args.data_dir
    if args.phase:
        run_phase_here(PHASES[args.phase], args, preload=("polars", "expansion_dag.core.tokenizer", "expansion_dag.training.build"))
        return 0
    args.data_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    document = header("training_ids", *DATA_PACKAGES, simulator=False, argv=argv)
    ensure_ids_records(args)
    pairs = []
    for round_index in range(args.repeat):
        result = spawn("throughput", args, script=__file__, round=round_index)
        for part in result["slices"]:
            part["others_cores"] = result["others_cores"]
            pairs.append(part)
            rates = "  ".join(f"{n} {part[n]['tokens'] / part[n]['wall_s']['build']:>10,.0f} tok/s" for n in BUILDS)
            print(f"round {round_index + 1} slice {part['slice'] + 1}/{args.slices}  {rates}", flush=True)
    memory = {name: spawn("memory", args, script=__file__, build=name) for name in BUILDS}
    summary = summarize(pairs, memory)
    document.update({"settings": {"records": args.records, "slices": args.slices, "repeat": args.repeat, "seed": args.seed},
                     "summary": summary, "pairs": pairs, "memory_runs": memory})  # fmt: skip
    print(json.dumps(summary, indent=2))
    print(f"\nwritten {write_result('training_ids', document, out_dir=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
