"""Rehearsal of the reference run end to end, on the simulator: every stage through Dagster.

The reference run: 193,010 prompts from six sources, completions totalling about 523M output
tokens (about 2,710 per completion), 8 servers with 72 running requests each. This script
rehearses it on this machine, exactly as ``expansion-dag run --config FILE`` runs it: the prepare
run (sources, prompts, budgets; the fleet is launched), one run per shard (8 processes at once),
then the training-set run. Only the servers are simulated (``expansion_dag.sim``, launched by the
pipeline's own launcher), with a time model fast enough (``--token-latency-ms``) that what is
measured is the client and the CPU stages. Every figure it prints is a SIMULATOR figure: the
servers' work is fiction, the client's, the store's and the training set's are real. The default,
1 ms a token, keeps 8 x 72 simulated streams (in events of ``fleet.stream_interval`` tokens) from
starving their simulators of CPU on a 2-core machine (at 0.002 ms and one event a token,
simulators missed the client's 10 s connect timeout and shards failed).

Inputs, generated in a temporary folder (``--work-dir``):

* the six sources, in their real layouts and schemas (those of ``expansion_dag/samples``, see
  docs/sources.md), in the proportions of ``SHARES`` (an assumption: the reference run's split is
  not recorded), with prompt lengths drawn per source (``PROMPT_WORDS``: lognormal word counts of
  English-like text, 1.27 Qwen3 tokens a word) and a few duplicates and non-English rows, so
  deduplication and the ``langdetect`` filter have work;
* a catalog whose quotas add up to ``--prompts`` exactly;
* a run configuration: a simulated fleet of ``--servers`` x ``--slots``, the simulator's output
  lengths lognormal (sigma ``OUTPUT_SIGMA``) with the median calibrated so that the answers, capped
  at ``max_output_tokens``, average ``MEAN_OUTPUT_TOKENS`` (523M / 193,010).

Per stage it prints wall time, CPU time (this process and its children: the shard processes; the
simulators' CPU apart), peak RSS (the largest of any process of the stage) and bytes written (the
growth of the storage root), and it measures the physical limits in the same run: the raw batched
tokenizer (``encode_batch_fast``) on the training set's own texts, and a sequential read and write
of the store's bytes. It also measures the resume scan (``CompletionStore.scan``) on the final store,
against a shard's run time, and a shard run's reads of the records (the whole store for the answer
lengths, its folder for its checks) from each record's whole JSON, against the segments' digests.

The accounting: every prompt selected is completed, failed with a reason, or set aside by the
budget with a reason, and the training set's rows (read back from its files) equal the completions
that pass the policy (counted here from the store, with lengths from the raw tokenizer pass).

    .venv/bin/python bench/bench_rehearsal.py                  # the reference scale
    .venv/bin/python bench/bench_rehearsal.py --prompts 2000   # a smoke run (about a minute)

Writes its JSON under bench/results/ (``--json`` to choose) and exits non-zero when the
accounting does not hold.
"""

from __future__ import annotations

import argparse
import json
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

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from harness import (  # (bench/ is on sys.path when run as a script)
    DATA_PACKAGES,
    ROOT,
    SIMULATOR_LABEL,
    emit,
    free_ports,
    machine,
    process_cpu_s,
    process_peak_mib,
    reset_peak,
    run_child,
    window_peak_mib,
    write_result,
)
from text_model import TextModel, lognormal_ints

from expansion_dag.samples.tool_sources import AGENT_SPLITS, HERMES_CONFIGS

REFERENCE_PROMPTS = 193_010
REFERENCE_OUTPUT_TOKENS = 523_000_000
MEAN_OUTPUT_TOKENS = REFERENCE_OUTPUT_TOKENS / REFERENCE_PROMPTS  # about 2,710
REFERENCE_GPU_HOURS = 15.5  # the reference run's wall time on its 8 GPUs
REFERENCE_SERVERS = 8
OUTPUT_SIGMA = 0.8
CONTEXT_LENGTH = 32_768
MAX_OUTPUT_TOKENS = 16_384
#: Share of the prompts each source gives (an assumption; the catalog's quotas follow it exactly).
SHARES = {
    "infinity_instruct": 0.35,
    "webinstructsub": 0.25,
    "codefeedback": 0.15,
    "metamathqa": 0.19,
    "hermes_fc": 0.05,
    "agentinstruct": 0.01,
}
#: Words in the user's turn, per source: lognormal (median, sigma), clipped to [low, high].
PROMPT_WORDS = {
    "infinity_instruct": (55, 1.0, 2, 3000),
    "webinstructsub": (45, 0.6, 4, 800),
    "codefeedback": (70, 0.8, 4, 2000),
    "metamathqa": (40, 0.5, 4, 400),
    "hermes_fc": (30, 0.6, 3, 400),
    "agentinstruct": (350, 0.5, 60, 2500),
}
DUPLICATES = 0.02  # rows whose prompt repeats an earlier row's
NON_ENGLISH = 0.09  # Infinity-Instruct rows the langdetect filter drops
SAMPLES = ROOT / "expansion_dag" / "samples"
STAGES = ("prepare", "generate", "training_set")


# ---------------------------------------------------------------------------------------------
# Inputs


def quotas(n: int) -> dict[str, int]:
    """``n`` split by ``SHARES``, largest remainder first: the quotas sum to ``n`` exactly."""
    exact = {name: n * share for name, share in SHARES.items()}
    out = {name: math.floor(v) for name, v in exact.items()}
    for name in sorted(exact, key=lambda k: out[k] - exact[k])[: n - sum(out.values())]:
        out[name] += 1
    return out


def _texts(model: TextModel, source: str, count: int) -> list[str]:
    median, sigma, low, high = PROMPT_WORDS[source]
    texts = model.texts(lognormal_ints(model.rng, count, median=median, sigma=sigma, low=low, high=high)).to_pylist()
    # A few prompts repeat an earlier one (exactly): deduplication removes them.
    for i in np.flatnonzero(model.rng.random(count) < DUPLICATES):
        if i:
            texts[i] = texts[int(model.rng.integers(0, i))]
    return texts


def _sample_systems() -> list[str]:
    """The hermes samples' system prompts (tool and JSON-schema definitions), reused as they are."""
    systems = []
    for config in HERMES_CONFIGS:
        for row in json.loads((SAMPLES / "hermes_function_calling" / f"{config}.json").read_text()):
            systems += [t["value"] for t in row.get("conversations") or [] if t.get("from") == "system"]
    return [s for s in systems if isinstance(s, str) and s.strip()]


def write_sources(folder: Path, n: int, seed: int) -> dict[str, Any]:
    """The six sources under ``folder`` in the bundled samples' layouts; returns the catalog path and rows."""
    from expansion_dag.core import load_tokenizer

    model = TextModel(load_tokenizer().get_vocab(), seed)
    rng = model.rng
    want = quotas(n)
    rows: dict[str, int] = {}

    def count(source: str, extra: float = 0.0) -> int:
        # Enough rows that, after duplicates (and the filter), every quota is met.
        rows[source] = math.ceil(want[source] / (1 - DUPLICATES - extra) * 1.02) + 10
        return rows[source]

    def parquet_like(sample: Path, columns: dict[str, Any], path: Path) -> None:
        schema = pq.read_schema(sample).remove_metadata()
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pydict(columns, schema=schema), path, compression="snappy")

    k = count("infinity_instruct", NON_ENGLISH)
    prompts = _texts(model, "infinity_instruct", k)
    answers = model.texts(lognormal_ints(rng, k, median=180, sigma=0.8, low=1, high=4000)).to_pylist()
    english = rng.random(k) >= NON_ENGLISH
    label = {"ability_en": ["logical reasoning"], "ability_zh": ["逻辑推理"],
             "cate_ability_en": ["problem solving"], "cate_ability_zh": ["问题解决"]}  # fmt: skip
    parquet_like(
        SAMPLES / "infinity_instruct" / "0625" / "train-00000-of-00001.parquet",
        {
            "id": list(range(k)),
            "conversations": [[{"from": "human", "value": p}, {"from": "gpt", "value": a}] for p, a in zip(prompts, answers)],
            "label": [label] * k,
            "langdetect": ["en" if e else "fr" for e in english],
            "source": ["rehearsal"] * k,
        },
        folder / "infinity_instruct" / "0625" / "train-00000-of-00001.parquet",
    )
    k = count("webinstructsub")
    questions = _texts(model, "webinstructsub", k)
    parquet_like(
        SAMPLES / "webinstructsub" / "data" / "train-00000-of-00001.parquet",
        {"orig_question": questions, "orig_answer": ["(answer)"] * k, "question": questions,
         "answer": ["(answer)"] * k, "source": ["rehearsal"] * k, "index": list(range(k))},  # fmt: skip
        folder / "webinstructsub" / "data" / "train-00000-of-00001.parquet",
    )
    k = count("codefeedback")
    path = folder / "codefeedback" / "CodeFeedback-Filtered-Instruction.jsonl"
    path.parent.mkdir(parents=True)
    with open(path, "w", encoding="utf-8") as fh:
        for query in _texts(model, "codefeedback", k):
            fh.write(json.dumps({"query": query, "lang": "python", "answer": "(answer)", "resource": "rehearsal"}) + "\n")
    k = count("metamathqa")
    path = folder / "metamathqa" / "MetaMathQA-395K.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps([
        {"type": "MATH_SV", "query": q, "original_question": q, "response": "(solution)"}
        for q in _texts(model, "metamathqa", k)
    ]))  # fmt: skip
    k = count("hermes_fc")
    systems = _sample_systems()
    users = _texts(model, "hermes_fc", k)
    per_config = np.array_split(np.arange(k), len(HERMES_CONFIGS))
    (folder / "hermes_function_calling").mkdir()
    for config, indices in zip(HERMES_CONFIGS, per_config):
        (folder / "hermes_function_calling" / f"{config}.json").write_text(json.dumps([
            {"id": f"{config}-{i}", "conversations": [
                {"from": "system", "value": systems[i % len(systems)]},
                {"from": "human", "value": users[i]},
                {"from": "gpt", "value": "(answer)"},
            ], "category": "rehearsal", "subcategory": "rehearsal", "task": "rehearsal"}
            for i in indices.tolist()
        ]))  # fmt: skip
    k = count("agentinstruct")
    tasks = _texts(model, "agentinstruct", k)
    for split, indices in zip(AGENT_SPLITS, np.array_split(np.arange(k), len(AGENT_SPLITS))):
        parquet_like(
            SAMPLES / "agentinstruct" / "data" / f"{split}-00000-of-00001.parquet",
            {
                "conversations": [[{"from": "human", "loss": False, "value": tasks[i]},
                                   {"from": "gpt", "loss": True, "value": "(action)"}] for i in indices.tolist()],
                "id": [f"{split}_{i}" for i in indices.tolist()],
            },  # fmt: skip
            folder / "agentinstruct" / "data" / f"{split}-00000-of-00001.parquet",
        )
    catalog = yaml.safe_load((ROOT / "expansion_dag" / "catalogs" / "samples.yaml").read_text())
    for source in catalog["sources"]:
        source["quota"] = want[source["name"]]
        source.pop("weight", None)
    catalog.pop("total_prompts", None)
    catalog.pop("local_root", None)  # the files written here, next to the catalog: not the bundled samples
    catalog_path = folder / "catalog.yaml"
    catalog_path.write_text(yaml.safe_dump(catalog, sort_keys=False))
    return {"catalog": str(catalog_path), "rows": rows, "quotas": want}


def output_median(mean: float, sigma: float, cap: int) -> int:
    """The lognormal median whose draws, capped at ``cap``, average ``mean`` (by bisection, exact integrals)."""
    from statistics import NormalDist

    phi = NormalDist().cdf

    def capped_mean(median: float) -> float:
        mu, z = math.log(median), (math.log(cap) - math.log(median)) / sigma
        return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))

    low, high = 1.0, float(cap)
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if capped_mean(mid) < mean else (low, mid)
    return round(low)


def write_config(folder: Path, catalog: str, args: argparse.Namespace) -> Path:
    median = output_median(MEAN_OUTPUT_TOKENS, OUTPUT_SIGMA, MAX_OUTPUT_TOKENS)
    command = (
        "{python} -m expansion_dag.sim --model-path {model_path} --host {host} --port {port} "
        "--context-length {context_length} --max-running-requests {max_running_requests} "
        "--stream-interval {stream_interval} "
        f"--ttft-ms {args.ttft_ms} --token-latency-ms {args.token_latency_ms} "
        f"--output-median-tokens {median} --output-sigma {OUTPUT_SIGMA} --warmup-s 0.2"
    )
    config = {
        "fleet": {
            "mode": "simulate",
            "shards": args.servers,
            "launch": {
                "command": command,
                "host": "127.0.0.1",
                "base_port": free_ports(args.servers, 41_000),  # not 30000: tests use those
                "context_length": CONTEXT_LENGTH,
                "max_running_requests": args.slots,
            },
        },
        "model": {"path": "Qwen/Qwen3-8B", "tokenizer": "qwen3-bundled"},
        "catalog": catalog,
        "storage": {"root": str(folder / "storage")},
        "generation": {
            "max_output_tokens": MAX_OUTPUT_TOKENS,
            "expected_output_tokens": round(MEAN_OUTPUT_TOKENS),
            "max_truncation_rate": 0.2,
            "progress_interval_s": 30.0,
        },
    }
    if args.client_tick_s is not None:
        config["generation"]["client_tick_s"] = args.client_tick_s
    if args.plain:
        config["generation"]["stop_degenerate"] = False
    path = folder / "rehearsal.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------
# The pipeline, in a process of its own (the partitions are read from the configuration at import)


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def run_pipeline(config_path: Path, home: Path) -> dict[str, Any]:
    """prepare, the shards, the training set: ``expansion-dag run``'s steps, each measured."""
    os.environ["DAGSTER_HOME"] = str(home)
    from expansion_dag.cli import commands as cli

    cli.use_config(str(config_path))
    cli.prepare_dagster_home()
    cli.quiet_third_party()
    from expansion_dag.config import current_config
    from expansion_dag.defs import SHARD_KEYS

    storage = Path(current_config().storage_root())
    stages: dict[str, Any] = {}

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
        return result

    try:
        run_id, ok, why = measured("prepare", lambda: cli._execute("prepare_job"))
        if not ok:
            raise SystemExit(f"prepare_job failed: {why}")
        shards = measured("generate", lambda: cli._run_shards(SHARD_KEYS))
        if failed := {k: why for k, (_, ok, why) in shards.items() if not ok}:
            raise SystemExit(f"shard runs failed: {failed}")
        pids = [int(p.read_text()) for p in sorted((storage / "fleet").glob("server-*.pid"))]
        servers = [(process_cpu_s(pid), process_peak_mib(pid)) for pid in pids]
        stages["generate"]["engine"] = _engine_cpu()
        run_id, ok, why = measured("training_set", lambda: cli._execute("training_set_job"))
        if not ok:
            raise SystemExit(f"training_set_job failed: {why}")
    finally:
        cli._stop_fleet(False)
    stages["generate"]["simulators"] = {
        "count": len(servers),
        "cpu_s": round(sum(c for c, _ in servers), 2),
        "peak_rss_mib": round(max((p for _, p in servers), default=0.0), 1),
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


def limits_and_accounting(config_path: Path, home: Path) -> dict[str, Any]:
    """The raw tokenizer on the set's texts, sequential I/O on the store, the resume scan, the accounting."""
    os.environ["DAGSTER_HOME"] = str(home)
    from expansion_dag.cli import commands as cli

    cli.use_config(str(config_path))
    import dataclasses

    import polars as pl

    from expansion_dag.config import current_config
    from expansion_dag.core import ModeIdentities, load_tokenizer
    from expansion_dag.defs import SHARD_KEYS
    from expansion_dag.generation import ShardWork, learn, shard_figures
    from expansion_dag.store import CompletionStore
    from expansion_dag.training import FOLDED, Manifest, TrainingSetConfig
    from expansion_dag.training.mode_rules import _mode_rules
    from expansion_dag.training.rendering import _segments
    from expansion_dag.training.samples import _screen

    run_config = current_config()
    storage = Path(run_config.storage_root())
    store = CompletionStore(storage / "completions")
    manifest = Manifest.read(storage / "training_set")
    # The run's modes (one, "default", without modes) for the model the set was taken from.
    identities = ModeIdentities(run_config.generation.mix(), manifest.identity["model"], bool(manifest.identity["simulated"]))
    if len(identities.by_mode) == 1 and identities.identities[0].fingerprint != manifest.identity["fingerprint"]:
        raise RuntimeError(f"the run configuration's settings ({identities.identities[0].fingerprint}) are not "
                           f"those the training set was taken under ({manifest.identity['fingerprint']})")  # fmt: skip
    # An older manifest may name fields the config no longer has (chat_template_kwargs: now each mode's).
    fields = {f.name for f in dataclasses.fields(TrainingSetConfig)}
    config = TrainingSetConfig(**{k: v for k, v in manifest.config.items() if k in fields})
    tokenizer = load_tokenizer()
    rules = _mode_rules(tokenizer, identities)

    # The raw batched tokenizer on exactly the texts the build tokenizes; the policy recounted.
    encode_s, tokens, passing = 0.0, 0, Counter()
    chunk: list[Any] = []

    def flush() -> None:
        nonlocal encode_s, tokens
        # Each sample's texts, three per assistant turn; None where the render does not split.
        split = _segments(chunk, tokenizer, rules)
        samples = [texts for texts in split if texts is not None]
        passing["render_mismatch"] += len(split) - len(samples)
        start = time.perf_counter()
        encodings = tokenizer.backend_tokenizer.encode_batch_fast(
            [t for texts in samples for t in texts], add_special_tokens=False
        )
        encode_s += time.perf_counter() - start
        position = 0
        for texts in samples:
            length = sum(len(e.ids) for e in encodings[position : position + len(texts)])
            position += len(texts)
            tokens += length
            passing["too_long" if length > config.max_length else "too_short" if length < config.min_length else "rows"] += 1
        chunk.clear()

    outcomes = Counter()
    for record in store.latest_records():
        screened = _screen(record, config, identities, rules)
        if isinstance(screened, str):
            outcomes[screened] += 1  # a reason, or an earlier turn of a conversation (folded into its row)
            continue
        outcomes["screened_in"] += 1
        chunk.append(screened)
        if len(chunk) == config.chunk_rows:
            flush()
    if chunk:
        flush()

    segments = sorted((storage / "completions").rglob("seg-*.jsonl"))
    io = sequential_io(segments, storage / "io-probe.bin")
    start = time.perf_counter()
    scan = store.scan()
    scan_s = time.perf_counter() - start

    rows = sum(pq.read_metadata(storage / "training_set" / f["name"]).num_rows for f in manifest.files)
    prompts = pl.read_parquet(storage / "assets" / "prompts.parquet", columns=["prompt_id"])
    budgeted_path = storage / "assets" / "budgeted_prompts.parquet"
    wanted = ("prompt_id", "shard", "source", "messages", "prompt_tokens", "max_tokens", "expected_tokens",
              "mode", "conversation", "tools")  # fmt: skip
    budgeted = pl.read_parquet(budgeted_path, columns=[c for c in wanted if c in pq.read_schema(budgeted_path).names])
    set_aside = pl.read_parquet(storage / "set_aside" / "budgeted_prompts.parquet")

    def standing_keys(prompts: pl.DataFrame) -> set[str]:
        # Where each prompt stands, as a shard run reports it: its key under its mode, or for a
        # conversation that of its furthest turn (its last when complete).
        return ShardWork(prompts, identities).frontier_keys(store.latest_records(digest=True))

    keys = standing_keys(budgeted)
    failed_by_reason = Counter(
        r.get("error", "unknown") for r in store.latest_records() if r.get("status") != "ok" and r["key"] in keys
    )
    completed = len(keys & scan.done)
    failed = len(keys & scan.failed)

    # What a shard run reads of the records themselves, besides its scans: the whole store to learn
    # answer lengths, its own folder for its checks. The whole JSON of each record, against the
    # segments' digests built from it, then the digests kept from an earlier read.
    shard = SHARD_KEYS[0]
    shard_keys = standing_keys(budgeted.filter(pl.col("shard") == shard))
    store_reads = {}
    for label, digest in (("whole_records", False), ("digests_built", True), ("digests_kept", True)):
        if label == "digests_built":
            for path in (storage / "completions").rglob("seg-*.jsonl.digest"):
                path.unlink()
        start = time.perf_counter()
        learned = learn(store.latest_records(digest=digest), identities.owns)
        figures = shard_figures(store.latest_records(shards=[shard], digest=digest), shard_keys, identities.owns, scan.done)
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
        "training_rows_in_files": rows,
        "manifest_samples": manifest.samples,
        "completions_passing_policy": passing["rows"],
        "left_out_recounted": {**{k: v for k, v in outcomes.items() if k not in ("screened_in", FOLDED)},
                               "too_long": passing["too_long"], "too_short": passing["too_short"],
                               "render_mismatch": passing["render_mismatch"]},  # fmt: skip
        "left_out_manifest": manifest.left_out,
        # Records of earlier turns of conversations: in their conversation's row, not left out.
        "conversation_turns_folded_recounted": outcomes[FOLDED],
        "conversation_turns_folded_manifest": manifest.conversation_turns_folded,
    }
    accounting["every_prompt_accounted_for"] = (
        prompts.height == budgeted.height + set_aside.height and accounting["neither"] == 0
    )
    accounting["rows_equal_passing_completions"] = rows == manifest.samples == passing["rows"]
    return {
        "accounting": accounting,
        "raw_tokenizer": {"tokens": tokens, "encode_s": round(encode_s, 2),
                          "tokens_per_s": round(tokens / encode_s) if encode_s else 0},  # fmt: skip
        "store_io": io,
        "resume_scan": {"s": round(scan_s, 3), "keys": len(scan.done) + len(scan.failed), "shards": len(SHARD_KEYS)},
        "store_reads": store_reads,
        "manifest": {
            "samples": manifest.samples,
            "tokens": manifest.tokens,
            "assistant_tokens": manifest.assistant_tokens,
            "output_tokens": manifest.output_tokens,
            "output_tokens_in_set": manifest.output_tokens_in_set,
            "useful_token_share": manifest.useful_token_share,
            "simulated": manifest.simulated,
        },
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
                   "ttft_ms": args.ttft_ms, "context_length": CONTEXT_LENGTH, "max_output_tokens": MAX_OUTPUT_TOKENS,
                   "output_sigma": OUTPUT_SIGMA, "client_tick_s": args.client_tick_s, "plain": args.plain,
                   "output_median_tokens": output_median(MEAN_OUTPUT_TOKENS, OUTPUT_SIGMA, MAX_OUTPUT_TOKENS)},  # fmt: skip
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
    p.add_argument("--client-tick-s", type=float, default=None,
                   help="generation.client_tick_s (default: the configuration's; 0: a wake-up an event)")
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
        inputs = write_sources(work / "sources", args.prompts, args.seed)
        inputs["generate_s"] = round(time.perf_counter() - start, 1)
        config = write_config(work, inputs.pop("catalog"), args)
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
        return 0 if accounting["every_prompt_accounted_for"] and accounting["rows_equal_passing_completions"] else 1
    finally:
        if not (args.keep or args.work_dir):
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
