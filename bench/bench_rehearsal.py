"""Rehearsal of the reference run end to end, on the simulator: every stage through Dagster.

The reference run: 193,010 prompts from six sources, completions totalling about 523M output
tokens (about 2,710 per completion), 8 servers with 72 running requests each. This script
rehearses it on this machine, exactly as ``expansion-dag run --config FILE`` runs it: the command's
own sequence (``expansion_dag.cli.run_expansion``): the prepare run (sources, prompts, budgets; the
fleet is launched), one run per shard (8 processes at once), then the training-set run. Only the
servers are simulated (``expansion_dag.sim``, launched by the pipeline's own launcher), with a time
model fast enough (``--token-latency-ms``) that what is measured is the client and the CPU stages.
Every figure it prints is a SIMULATOR figure: the servers' work is fiction, the client's, the
store's and the training set's are real. The default, 1 ms a token, keeps 8 x 72 simulated streams
(in events of ``fleet.stream_interval`` tokens) from starving their simulators of CPU on a 2-core
machine (at 0.002 ms and one event a token, simulators missed the client's 10 s connect timeout and
shards failed).

The inputs are the reference run's, at ``--prompts``, written in a temporary folder (``--work-dir``)
by ``expansion_dag_tests.workloads.rehearsal``: the six sources in their real layouts and schemas, a catalog
whose quotas add up to ``--prompts`` exactly, and a run configuration whose simulated answers
average the reference run's length.

Per stage it prints wall time, CPU time (this process and its children: the shard processes; the
simulators' CPU apart), peak RSS (the largest of any process of the stage) and bytes written (the
growth of the storage root), and it measures the physical limits in the same run: the raw batched
tokenizer (``encode_batch_fast``) on the training set's own texts (its rows decoded run by run of
their loss mask: the pieces the build tokenized), and a sequential read and write of the store's
bytes. It also measures the resume scan (``CompletionStore.scan``) on the final store, against a
shard's run time, and a shard run's reads of the records (the whole store for the answer lengths,
its folder for its checks) from each record's whole JSON, against the segments' digests.

The accounting: every prompt selected is completed, failed with a reason, or set aside by the
budget with a reason, and the training set's rows (read back from its files) are the prompts whose
answer (a conversation's last) is complete, counted from the store.

    .venv/bin/python bench/bench_rehearsal.py                  # the reference scale
    .venv/bin/python bench/bench_rehearsal.py --prompts 2000   # a smoke run (about a minute)

Writes its JSON under bench/results/ (``--json`` to choose) and exits non-zero when the
accounting does not hold.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import yaml
from harness import (  # (bench/ is on sys.path when run as a script)
    DATA_PACKAGES,
    SIMULATOR_LABEL,
    emit,
    free_ports,
    machine,
    process_cpu_s,
    process_peak_mib,
    reset_peak,
    run_child,
    set_texts,
    window_peak_mib,
    write_result,
)

from expansion_dag.cli import STAGES
from expansion_dag_tests.workloads.rehearsal import (
    MAX_OUTPUT_TOKENS,
    MEAN_OUTPUT_TOKENS,
    OUTPUT_SIGMA,
    REFERENCE_PROMPTS,
    output_median,
    write_config,
    write_sources,
)

REFERENCE_GPU_HOURS = 15.5  # the reference run's wall time on its 8 GPUs
REFERENCE_SERVERS = 8
MANIFEST_FIGURES = ("samples", "tokens", "assistant_tokens", "output_tokens", "output_tokens_in_set",
                    "useful_token_share", "simulated")  # fmt: skip


def write_inputs(work: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The sources, the catalog and the run configuration under ``work``; the configuration's path."""
    from expansion_dag.core import load_tokenizer

    start = time.perf_counter()
    inputs = write_sources(work / "sources", args.prompts, args.seed, load_tokenizer().get_vocab())
    generation: dict[str, Any] = {}
    if args.plain:
        generation["stop_degenerate"] = False
    config = write_config(
        work, inputs.pop("catalog"), servers=args.servers, slots=args.slots,
        base_port=free_ports(args.servers, 41_000),  # not 30000: tests use those
        ttft_ms=args.ttft_ms, token_latency_ms=args.token_latency_ms, generation=generation,
    )  # fmt: skip
    inputs["generate_s"] = round(time.perf_counter() - start, 1)
    return config, inputs


# ---------------------------------------------------------------------------------------------
# The pipeline, in a process of its own (the partitions are read from the configuration at import)


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def run_pipeline(config_path: Path, home: Path) -> dict[str, Any]:
    """``expansion-dag run``'s steps, each measured."""
    os.environ["DAGSTER_HOME"] = str(home)
    from expansion_dag.cli import run_expansion

    config = yaml.safe_load(config_path.read_text())
    storage = Path(config["storage"]["root"])
    launch = config["fleet"]["launch"]
    urls = [f"http://{launch['host']}:{launch['base_port'] + i}" for i in range(config["fleet"]["shards"])]
    stages: dict[str, Any] = {}
    simulators: list[tuple[float, float]] = []

    def measured(name: str, step) -> Any:
        reset_peak()  # a fresh peak-RSS window for this stage
        before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        size, wall = _tree_bytes(storage), time.perf_counter()
        result = step()
        after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = [a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before)]
        stages[name] = {
            "wall_s": round(time.perf_counter() - wall, 2),
            "cpu_s": round(sum(cpu), 2),
            "cpu_s_this_process": round(cpu[0], 2),
            "peak_rss_mib_this_process": window_peak_mib(),
            # ru_maxrss of children is the largest of any child reaped so far: the shard processes.
            "peak_rss_mib_children": round(after[1].ru_maxrss / 1024, 1) if name == "generate" else None,
            "bytes_written": _tree_bytes(storage) - size,
        }
        if name == "generate":  # the simulators' own processes, before the run stops them
            with httpx.Client(timeout=10.0) as client:
                pids = [client.get(f"{url}/sim/stats").json()["pid"] for url in urls]
            simulators.extend((process_cpu_s(pid), process_peak_mib(pid)) for pid in pids)
        return result

    status = run_expansion(str(config_path), stage=measured)
    if status != 0:
        raise SystemExit(f"the run failed (exit status {status}): see the log")
    stages["generate"]["engine"] = _engine_cpu()
    stages["generate"]["simulators"] = {
        "count": len(simulators),
        "cpu_s": round(sum(c for c, _ in simulators), 2),
        "peak_rss_mib": round(max((p for _, p in simulators), default=0.0), 1),
    }
    return stages


def _engine_cpu() -> dict[str, Any]:
    """The shard runs' own figure (``client_cpu_s`` in each shard's metadata): the client's CPU while
    its engine ran, without the process's start-up, the probes and the checks."""
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        records = instance.fetch_materializations(dg.AssetKey("completions"), limit=1000).records
    metadata = [r.asset_materialization.metadata for r in records if r.asset_materialization]
    cpu = sum(m["client_cpu_s"].value for m in metadata)
    sent = sum(m["sent_this_run"].value for m in metadata)
    return {"shards": len(metadata), "client_cpu_s": round(cpu, 2), "requests": sent}


# ---------------------------------------------------------------------------------------------
# Limits and accounting, measured after the run on its own outputs


def sequential_io(paths: list[Path], scratch: Path) -> dict[str, float]:
    """A sequential read of ``paths`` (1 MiB blocks), then a write of as many bytes and an fsync."""
    block = 1 << 20
    start, total = time.perf_counter(), 0
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while chunk := fh.read(block):
                total += len(chunk)
    read_s = time.perf_counter() - start
    data = os.urandom(block)
    start = time.perf_counter()
    with open(scratch, "wb", buffering=0) as fh:
        for _ in range(math.ceil(total / block)):
            fh.write(data)
        os.fsync(fh.fileno())
    write_s = time.perf_counter() - start
    scratch.unlink()
    return {"bytes": total, "read_s": round(read_s, 3), "write_s": round(write_s, 3),
            "read_mib_s": round(total / 2**20 / read_s, 1) if read_s else 0.0,
            "write_mib_s": round(total / 2**20 / write_s, 1) if write_s else 0.0}  # fmt: skip


def raw_tokenizer(files: list[Path], tokenizer: Any, batch_rows: int) -> dict[str, Any]:
    """``encode_batch_fast`` on the set's own texts (``set_texts``: decoded untimed), in the build's batches."""
    encode = tokenizer.backend_tokenizer.encode_batch_fast
    tokens, encode_s = 0, 0.0
    for texts in set_texts(files, tokenizer, batch_rows):
        start = time.perf_counter()
        encodings = encode(texts, add_special_tokens=False)
        encode_s += time.perf_counter() - start
        tokens += sum(len(e) for e in encodings)
    return {"tokens": tokens, "encode_s": round(encode_s, 2), "tokens_per_s": round(tokens / encode_s) if encode_s else 0}


def limits_and_accounting(config_path: Path, home: Path) -> dict[str, Any]:
    """The raw tokenizer on the set's texts, sequential I/O on the store, the resume scan, the accounting."""
    os.environ["DAGSTER_HOME"] = str(home)
    import polars as pl

    from expansion_dag.config import load_config, training_set_config
    from expansion_dag.core import OK, ModeIdentities, load_tokenizer
    from expansion_dag.generation import ShardWork, learn, shard_figures
    from expansion_dag.prompts import shard_keys
    from expansion_dag.store import CompletionStore
    from expansion_dag.training import DEFAULT_MAX_LENGTH, Manifest, current_version, data_files

    run_config = load_config(str(config_path))
    storage = Path(run_config.storage_root())
    store = CompletionStore(storage / "completions")
    version = Path(current_version(storage / "training_set"))
    manifest = Manifest.read(version)
    # The run's modes (one, "default", without modes) for the model the set was taken from.
    identities = ModeIdentities(run_config.generation.mix(), manifest.identity["model"], bool(manifest.identity["simulated"]))
    files = [Path(path) for path in data_files(version)]
    raw = raw_tokenizer(files, load_tokenizer(), training_set_config(run_config.generation, DEFAULT_MAX_LENGTH).chunk_rows)

    segments = sorted((storage / "completions").rglob("seg-*.jsonl"))
    io = sequential_io(segments, storage / "io-probe.bin")
    start = time.perf_counter()
    scan = store.scan()
    scan_s = time.perf_counter() - start

    rows = sum(pq.read_metadata(path).num_rows for path in files)
    prompts = pl.read_parquet(storage / "assets" / "prompts.parquet", columns=["prompt_id"])
    budgeted_path = storage / "assets" / "budgeted_prompts.parquet"
    wanted = ("prompt_id", "shard", "source", "messages", "prompt_tokens", "max_tokens", "expected_tokens",
              "mode", "conversation", "tools")  # fmt: skip
    budgeted = pl.read_parquet(budgeted_path, columns=[c for c in wanted if c in pq.read_schema(budgeted_path).names])
    set_aside = pl.read_parquet(storage / "set_aside" / "budgeted_prompts.parquet")

    def standing_keys(prompts: pl.DataFrame) -> set[str]:
        # Where each prompt stands, as a shard run reports it: its key under its mode, or for a
        # conversation that of its furthest turn (its last when complete).
        return ShardWork(prompts, identities, retry_outcomes=run_config.generation.retry_outcomes).frontier_keys(store.latest_records(digest=True))

    keys = standing_keys(budgeted)
    standing = [r for r in store.latest_records(digest=True) if r["key"] in keys]
    failed_by_reason = Counter(r.get("error", "unknown") for r in standing if r["status"] != OK)
    endings = Counter(r["finish_reason"] for r in standing if r["status"] == OK)
    completed = len(keys & scan.done)
    failed = len(keys & scan.failed)

    # What a shard run reads of the records themselves, besides its scans: the whole store to learn
    # answer lengths, its own folder for its checks. The whole JSON of each record, against the
    # segments' digests built from it, then the digests kept from an earlier read.
    shard = shard_keys(run_config.fleet.shards)[0]
    shard_keys_ = standing_keys(budgeted.filter(pl.col("shard") == shard))
    store_reads = {}
    for label, digest in (("whole_records", False), ("digests_built", True), ("digests_kept", True)):
        if label == "digests_built":
            for path in (storage / "completions").rglob("seg-*.jsonl.digest"):
                path.unlink()
        start = time.perf_counter()
        learned = learn(store.latest_records(digest=digest), identities.owns)
        figures = shard_figures(store.latest_records(shards=[shard], digest=digest), shard_keys_, identities.owns, scan.done)
        store_reads[f"{label}_s"] = round(time.perf_counter() - start, 3)
        store_reads["answers_learned"], store_reads["shard_completions"] = learned.answers, figures.ok
    accounting = {
        "prompts_selected": prompts.height,
        "budgeted": budgeted.height,
        "set_aside_by_budget": set_aside.height,
        "set_aside_by_reason": dict(Counter(set_aside["reason"].to_list())) if set_aside.height else {},
        "completed": completed,
        "failed": failed,
        "failed_by_reason": dict(failed_by_reason),
        "neither": len(keys) - completed - failed,
        "completed_by_finish_reason": dict(endings),
        "training_rows_in_files": rows,
        "manifest_samples": manifest.samples,
        "manifest_left_out": {k: v for k, v in manifest.left_out.items() if v},
    }
    accounting["every_prompt_accounted_for"] = (
        prompts.height == budgeted.height + set_aside.height and accounting["neither"] == 0
    )
    # A row is a complete answer: every other answer is left out, counted by the manifest's reasons.
    accounting["rows_equal_complete_answers"] = rows == manifest.samples == endings["stop"]
    return {
        "accounting": accounting,
        "raw_tokenizer": raw,
        "store_io": io,
        "resume_scan": {"s": round(scan_s, 3), "keys": len(scan.done) + len(scan.failed), "shards": run_config.fleet.shards},
        "store_reads": store_reads,
        "manifest": {name: getattr(manifest, name) for name in MANIFEST_FIGURES},
    }


# ---------------------------------------------------------------------------------------------
# Orchestration and report


def child(args: argparse.Namespace) -> None:
    step = run_pipeline if args.child == "pipeline" else limits_and_accounting
    emit(step(Path(args.config), Path(args.home)))


def spawn(kind: str, config: Path, home: Path, log: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A child run of this script; its result, and its wall, CPU and peak RSS as the parent sees them."""
    command = [sys.executable, __file__, "--child", kind, "--config", str(config), "--home", str(home)]
    result, figures = run_child(command, f"the {kind} run", log=log)
    return result, {k: figures[k] for k in ("wall_s", "cpu_s", "peak_rss_mib_any_process")}


def summarize(n: int, inputs: dict[str, Any], stages: dict[str, Any], after: dict[str, Any],
              totals: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    gen, ts = stages["generate"], stages["training_set"]
    raw = after["raw_tokenizer"]
    requests = after["accounting"]["completed"] + after["accounting"]["failed"]
    client_cpu_ms = 1000 * gen["cpu_s"] / requests if requests else 0.0
    engine = gen["engine"]
    # Client-side time on the reference fleet: the stages that are not generation, plus what the
    # client adds to generation when one process serves each server at its CPU cost per request.
    reference_requests_per_s = REFERENCE_PROMPTS / (REFERENCE_GPU_HOURS * 3600) / REFERENCE_SERVERS
    scale = REFERENCE_PROMPTS / n
    return {
        "prompts": n,
        "simulated": True,
        "label": SIMULATOR_LABEL,
        "inputs": inputs,
        "stages": stages,
        **after,
        "totals": totals,
        "ratios": {
            "training_set_wall_over_raw_tokenizer": round(ts["wall_s"] / raw["encode_s"], 3) if raw["encode_s"] else None,
            "generate_bytes_mib_s": round(gen["bytes_written"] / 2**20 / gen["wall_s"], 1),
            "store_sequential_write_mib_s": after["store_io"]["write_mib_s"],
            "training_set_store_read_mib_s": round(after["store_io"]["bytes"] / 2**20 / ts["wall_s"], 1),
            "store_sequential_read_mib_s": after["store_io"]["read_mib_s"],
            "client_cpu_ms_per_request": round(client_cpu_ms, 3),
            # The same, the engine alone (each shard's own measure), as the generation benchmark measures it.
            "engine_client_cpu_ms_per_request": round(1000 * engine["client_cpu_s"] / engine["requests"], 3)
            if engine["requests"] else None,
            # Two whole-store scans per shard run (before and after), at the final store's size: an upper bound.
            "resume_scans_over_shard_run": round(2 * after["resume_scan"]["s"] / gen["wall_s"], 4),
            # A shard run's record reads (lengths and checks), from the digests an earlier read kept.
            "store_reads_over_shard_run": round(after["store_reads"]["digests_kept_s"] / gen["wall_s"], 4),
            "store_reads_whole_records_over_digests_kept": round(
                after["store_reads"]["whole_records_s"] / after["store_reads"]["digests_kept_s"], 1
            ),
        },
        "projection": {
            "note": "to the reference run's prompts, linearly: the fixed costs (process starts, Dagster runs) "
            "scale too, so these are upper bounds; this machine's CPUs",
            "prepare_s": round(stages["prepare"]["wall_s"] * scale, 1),
            "training_set_s": round(ts["wall_s"] * scale, 1),
            "client_cpu_s_per_server_s": round(client_cpu_ms / 1000 * reference_requests_per_s, 5),
            "servers_one_client_process_can_feed": round(1 / (client_cpu_ms / 1000 * reference_requests_per_s))
            if client_cpu_ms else None,
        },
        "config": {"servers": args.servers, "slots": args.slots, "token_latency_ms": args.token_latency_ms,
                   "ttft_ms": args.ttft_ms, "max_output_tokens": MAX_OUTPUT_TOKENS, "output_sigma": OUTPUT_SIGMA,
                   "plain": args.plain,
                   "mean_output_tokens": round(MEAN_OUTPUT_TOKENS), "output_median_tokens": output_median()},  # fmt: skip
    }


def print_table(summary: dict[str, Any]) -> None:
    print(f"\nRehearsal, SIMULATED fleet: {summary['prompts']:,} prompts, "
          f"{summary['config']['servers']} servers x {summary['config']['slots']} slots")  # fmt: skip
    print(f"{'stage':<14}{'wall s':>10}{'CPU s':>10}{'peak RSS MiB':>14}{'MiB written':>13}")
    for name in STAGES:
        s = summary["stages"][name]
        peak = max(s["peak_rss_mib_this_process"], s.get("peak_rss_mib_children") or 0)
        print(f"{name:<14}{s['wall_s']:>10.1f}{s['cpu_s']:>10.1f}{peak:>14.0f}{s['bytes_written'] / 2**20:>13.1f}")
    sim = summary["stages"]["generate"]["simulators"]
    print(f"(simulators: {sim['count']} processes, {sim['cpu_s']:.1f} CPU s, peak {sim['peak_rss_mib']:.0f} MiB each at most)")
    for key, value in summary["ratios"].items():
        print(f"  {key}: {value}")
    for key, value in summary["accounting"].items():
        print(f"  {key}: {value}")
    print(f"  manifest: {summary['manifest']}")
    print(f"  projection: {summary['projection']}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=REFERENCE_PROMPTS, help="prompts to rehearse (default: the reference run's)")
    p.add_argument("--servers", type=int, default=8)
    p.add_argument("--slots", type=int, default=72, help="running requests per server")
    p.add_argument("--token-latency-ms", type=float, default=1.0, help="the simulator's time per output token")
    p.add_argument("--ttft-ms", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    # The simulator here never loops, so both send the same answers: the difference is the stream.
    p.add_argument("--plain", action="store_true",
                   help="plain requests (generation.stop_degenerate: false) instead of streamed ones")
    p.add_argument("--work-dir", type=Path, default=None, help="default: a temporary folder, removed at the end")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--json", type=Path, default=None, help="where to write the result (default: bench/results/)")
    p.add_argument("--child", choices=["pipeline", "after"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--home", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child:
        child(args)
        return 0
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rehearsal-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        config, inputs = write_inputs(work, args)
        home, log = work / "dagster_home", work / "rehearsal.log"
        home.mkdir(exist_ok=True)
        print(f"inputs written in {inputs['generate_s']} s; running the pipeline (log: {log})", flush=True)
        stages, pipeline = spawn("pipeline", config, home, log)
        after, _ = spawn("after", config, home, log)
        totals = {"pipeline": pipeline, "wall_s": round(time.perf_counter() - start, 1), "machine": machine(*DATA_PACKAGES)}
        summary = summarize(args.prompts, inputs, stages, after, totals, args)
        print_table(summary)
        out = write_result(f"rehearsal-{args.prompts}", summary, path=args.json)
        print(f"\nwritten: {out}", flush=True)
        accounting = summary["accounting"]
        return 0 if accounting["every_prompt_accounted_for"] and accounting["rows_equal_complete_answers"] else 1
    finally:
        if not (args.keep or args.work_dir):
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
