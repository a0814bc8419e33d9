"""The run's own speed against its time (issue 44): the time to finish a run prints in its first
minute, against when it ended, on a real model served by a real engine (a CPU engine here); and
(issue 50) the end it foretold at 10%, 25% and 50% of its prompts.

What it runs is the CLI, as a user does: ``expansion-dag plan`` then ``expansion-dag run``, attached
(``backend: vllm``, one shard) to a server you start, on a catalog of ``--per-source`` prompts of
each of four single-turn sample sources (or those ``--sources`` names), in a fresh folder. Then it reads back what the run
recorded: the first speed it said, the time to finish it gave, the actual end, the plan's tokens
and the tokens made; and, beside them at the same moment, the ETA the progress showed before this
measurement (prompts left over the rate of prompts answered) and the obvious speed (output tokens
of the answers ended over the time elapsed).

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \\
        --model /work/models/smollm2-135m-instruct --served-model-name smollm2 --max-model-len 8192 \\
        --max-num-seqs 16 --host 127.0.0.1 --port 20525 --kv-cache-memory-bytes 2147483648 --enforce-eager
    .venv/bin/python bench/bench_speed.py --url http://127.0.0.1:20525                       # no throughput planned
    .venv/bin/python bench/bench_speed.py --url http://127.0.0.1:20525 --plan-tokens-per-s 90
    .venv/bin/python bench/bench_speed.py --url ... --per-source 2                            # a smoke run
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import dagster as dg
import harness
import yaml

SOURCES = ("infinity_instruct", "webinstructsub", "codefeedback", "metamathqa")
EXPANSION_DAG = str(Path(sys.executable).parent / "expansion-dag")


def write_inputs(work: Path, args: argparse.Namespace) -> Path:
    catalog = yaml.safe_load((harness.ROOT / "expansion_dag" / "catalogs" / "samples.yaml").read_text())
    catalog["sources"] = [{**s, "quota": args.per_source} for s in catalog["sources"] if s["name"] in args.sources]
    (work / "catalog.yaml").write_text(yaml.safe_dump(catalog, sort_keys=False))
    generation = {"max_output_tokens": args.cap, "min_output_tokens": 64, "expected_output_tokens": args.expected_output,
                  "temperature": 0.7, "top_p": 0.9, "min_yield": 0.0}
    if args.plan_tokens_per_s is not None:
        generation["plan_output_tokens_per_s"] = args.plan_tokens_per_s
    config = {
        "fleet": {"mode": "attach", "shards": 1, "urls": [args.url], "backend": "vllm", "slots": args.slots},
        "model": {"path": args.model, "tokenizer": args.model},
        "catalog": str(work / "catalog.yaml"),
        "storage": {"root": str(work / "storage")},
        "generation": generation,
    }
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def cli(work: Path, *command: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_", "EXPANSION_"))}
    result = subprocess.run([EXPANSION_DAG, *command], cwd=work, env=env, capture_output=True, text=True, timeout=3600)
    (work / f"{command[0]}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"expansion-dag {command[0]} failed ({result.returncode}): see {work / (command[0] + '.log')}")
    return result.stdout.splitlines()


def recorded(work: Path) -> dict:
    """The shard's metadata, and its progress observation that first carried a measured speed."""
    with dg.DagsterInstance.from_config(str(work / ".dagster_home")) as instance:
        shard = dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=["shard-00"])
        [record] = instance.fetch_materializations(shard, limit=1).records
        metadata = {k: v.value for k, v in record.asset_materialization.metadata.items()}
        observed = [{k: v.value for k, v in r.asset_observation.metadata.items()}
                    for r in instance.fetch_observations(shard, limit=10_000).records]
        plan = instance.get_latest_materialization_event(dg.AssetKey("budgeted_prompts")).asset_materialization
        planned_tokens = plan.metadata["plan_output_tokens"].value
    measured = [o for o in observed if o.get("speed_tokens_per_s") is not None]
    if not measured:
        raise SystemExit(f"the run never said its speed (no answer?): see {work / 'run.log'}")
    first = min(measured, key=lambda o: o["elapsed_s"])
    elapsed = metadata["elapsed_s"]
    old_end = first["elapsed_s"] + first["eta_s"]
    # The end said (time to finish from the tokens left, issue 50) at a tenth, a quarter and half of
    # the prompts, beside the prompts' rate's: from the first observation past each share.
    foretold = {}
    for share in (0.10, 0.25, 0.50):
        past = [o for o in measured if o["finish_s"] is not None and o["done"] >= share * o["total"]]
        if past:
            o = min(past, key=lambda o: o["elapsed_s"])
            end, rate_end = o["elapsed_s"] + o["finish_s"], o["elapsed_s"] + (o["eta_s"] or 0.0)
            foretold[f"{share:.0%}"] = {
                "at_s": o["elapsed_s"], "end_said_s": round(end, 1), "error": round(end / elapsed - 1, 4),
                "rate_error": round(rate_end / elapsed - 1, 4), "tokens_left_basis": o.get("tokens_left_basis"),
            }
    return {
        "foretold": foretold,
        "said_at_s": first["elapsed_s"],
        "speed_said": first["speed_tokens_per_s"],
        "speed_obvious_then": first["output_tokens_per_s"],
        "end_said_s": metadata["speed_first_wall_estimate_s"],
        "end_old_eta_s": round(old_end, 1),
        "ended_s": elapsed,
        "error": metadata["speed_first_wall_estimate_error"],
        "error_old_eta": round(old_end / elapsed - 1, 4),
        "speed_over_run": round(metadata["output_tokens_generated"] / elapsed, 1),
        "tokens_planned": planned_tokens,
        "tokens_made": metadata["output_tokens_generated"],
        "plan_against_actual": metadata["plan_against_actual"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the attached vLLM server")
    parser.add_argument("--model", default="/work/models/smollm2-135m-instruct", help="its model folder (the tokenizer)")
    parser.add_argument("--slots", type=int, default=16, help="its --max-num-seqs")
    parser.add_argument("--per-source", type=int, default=16, help="prompts of each source")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES), help="the mix: which sample sources")
    parser.add_argument("--cap", type=int, default=1024, help="max_output_tokens")
    parser.add_argument("--expected-output", type=int, default=250, help="expected_output_tokens (the plan's prior)")
    parser.add_argument("--plan-tokens-per-s", type=float, help="plan_output_tokens_per_s (default: none)")
    args = parser.parse_args()
    document = harness.header("speed", simulator=False)
    document["engine"] = "vLLM CPU build: not a GPU figure"
    work = Path(tempfile.mkdtemp(prefix="bench-speed-"))  # kept on a failure, for its logs
    config = write_inputs(work, args)
    document["plan_time_line"] = next(line for line in cli(work, "plan", "--config", str(config)) if "  time:" in line)
    lines = cli(work, "run", "--config", str(config))
    document["speed_lines"] = [line for line in lines if line.startswith("speed: ")]
    document |= recorded(work)
    shutil.rmtree(work)
    for key in ("plan_time_line", "said_at_s", "speed_said", "speed_obvious_then", "speed_over_run", "end_said_s",
                "end_old_eta_s", "ended_s", "error", "error_old_eta", "tokens_planned", "tokens_made"):
        print(f"{key}: {document[key]}")
    for share, row in document["foretold"].items():
        print(f"at {share} of the prompts ({row['at_s']} s): end said {row['end_said_s']} s, error {row['error']:+.1%}"
              f" (prompts' rate: {row['rate_error']:+.1%})")
    print(f"result: {harness.write_result('speed', document)}")


if __name__ == "__main__":
    main()
