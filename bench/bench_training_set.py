"""Training-set benchmark: ``build_training_set`` tokens per second against the raw batched fast
tokenizer and against ``datasets.Dataset.map(batched=True)`` on the same texts and cores, and the
build's peak memory at two input sizes 10x apart.

Completion records (docs/CONTRACTS.md) are generated deterministically: thinking-mode answers as
the bundled Qwen3 template renders them, i.e. every record carries ``reasoning_content`` and
``content``; prompts are one user message, some with a system message, some multi-turn. About
1,360 tokens per sample (lognormal, long-tailed), 1% truncated (``finish_reason`` ``length``,
left out by the build). 16,000 records, about 21.7M tokens, are written once as JSONL under
``--data-dir``.

Throughput (one ``throughput`` process per round): the records are cut into ``--slices``
consecutive slices of 2,000 records (4 build chunks); on each slice the three contenders run back
to back, so that they see the same machine (it is shared, with 2 cores), in an order that rotates
from slice to slice (whoever runs first finds the tokenizer's word cache cold):

* ``build``: ``build_training_set(records, tokenizer, config, out_dir)`` (the run configuration's defaults) on the
  slice's records, held in a list: tokens of the manifest per wall second. Everything the build
  does is inside: rendering both templates, tokenizing, masks, Parquet (zstd) writing, fsync,
  hashing the shards, the manifest.
* ``raw``: the very texts the build tokenizes (its segments, three per assistant turn: what
  precedes the turn, the turn, its trailer; recovered untimed from a build of the slice, each row's
  ids decoded run by run of its loss mask) through ``tokenizer.backend_tokenizer.encode_batch_fast``
  in the build's batches (``chunk_rows`` rows). Taking ``.ids`` out of the encodings, which the
  build needs, is timed apart.
* ``map``: a ``datasets.Dataset`` of the same texts, ``.map(batched=True)`` with the same
  ``encode_batch_fast`` call and batch size, writing ``input_ids`` to an Arrow cache file.

Summed over the slices, each contender handles the whole 21.7M tokens every round. Ratios are
given both from the round totals and paired (slice by slice, same process). Where the build's time
goes: one build of the first slice under cProfile (``profile``, once), its functions by own time.

Memory (``memory`` processes): the build on records streamed from the JSONL (one ``json.loads``
per line, as the completion store streams them) at ``--records / 10`` and ``--records``; the peak
RSS of the build (``VmHWM`` after a reset once the tokenizer is loaded) and the process's peak.
The comparison means something only when the smaller size spans several 512-record chunks (the
build holds up to three): the default gives 1,600 and 16,000; a smoke run's sizes do not.

    .venv/bin/python bench/bench_training_set.py              # 16,000 records (~4 min on quiet cores,
                                                              # ~12 min when busy)
    .venv/bin/python bench/bench_training_set.py --records 2000 --repeat 1 --slices 2   # smoke run (~1 min)

Results are printed and written as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import harness  # (bench/ is on sys.path when run as a script)
from harness import Clock, reset_peak, window_peak_mib

from expansion_dag.config import GenerationConfig, sampling_settings
from expansion_dag.core import DEFAULT_MODE, Identity, ModeIdentities, ModeMix
from expansion_dag_tests.workloads.text_model import TextModel, lognormal_ints

#: The identity the generated records' keys belong to (``completion_key(prompt_id, "settings")``).
BENCH_IDENTITY = Identity(model="bench", simulated=True, fingerprint="settings")


def bench_identities() -> ModeIdentities:
    """A run without modes whose one mode is ``BENCH_IDENTITY``, its answers rendered with the
    template's defaults (thinking on), as every generated record is."""
    identities = ModeIdentities(
        ModeMix.single(sampling_settings(GenerationConfig())), BENCH_IDENTITY.model, BENCH_IDENTITY.simulated
    )
    identities.by_mode[DEFAULT_MODE] = BENCH_IDENTITY
    return identities

DATA_VERSION = 1
DEFAULT_RECORDS = 16_000
DEFAULT_SLICES = 8
CONTENDERS = ("build", "raw", "map")
SYSTEM_SHARE = 0.15
MULTI_TURN_SHARE = 0.10
TRUNCATED_SHARE = 0.01
SYSTEM_WORDS = {"median": 25, "sigma": 0.6, "low": 3, "high": 400}
USER_WORDS = {"median": 60, "sigma": 0.9, "low": 2, "high": 2500}
EARLIER_ANSWER_WORDS = {"median": 150, "sigma": 0.8, "low": 5, "high": 2000}
REASONING_WORDS = {"median": 450, "sigma": 0.7, "low": 10, "high": 6000}
CONTENT_WORDS = {"median": 280, "sigma": 0.8, "low": 1, "high": 5000}
SOURCES = ("infinity_instruct", "webinstructsub", "codefeedback", "metamathqa", "hermes_fc")


# ---------------------------------------------------------------------------------------------
# Completion records


def generate_records(n: int, seed: int, vocab: dict[str, int]) -> Iterator[dict[str, Any]]:
    """``n`` completion records as the store holds them, in blocks of texts generated together."""
    model = TextModel(vocab, seed)
    rng = model.rng
    block = 2000
    for start in range(0, n, block):
        size = min(block, n - start)

        def texts(spec: dict[str, Any], count: int = size) -> list[str]:
            return model.texts(lognormal_ints(rng, count, **spec)).to_pylist()

        system, user, earlier, follow_up = texts(SYSTEM_WORDS), texts(USER_WORDS), texts(EARLIER_ANSWER_WORDS), texts(USER_WORDS)
        reasoning, content = texts(REASONING_WORDS), texts(CONTENT_WORDS)
        has_system = rng.random(size) < SYSTEM_SHARE
        multi = rng.random(size) < MULTI_TURN_SHARE
        truncated = rng.random(size) < TRUNCATED_SHARE
        source = rng.integers(0, len(SOURCES), size)
        for i in range(size):
            messages = [{"role": "system", "content": system[i]}] if has_system[i] else []
            messages.append({"role": "user", "content": user[i]})
            if multi[i]:
                messages += [{"role": "assistant", "content": earlier[i]}, {"role": "user", "content": follow_up[i]}]
            prompt_id = hashlib.sha256(f"{seed}:{start + i}".encode()).hexdigest()[:32]
            completion = len(reasoning[i] + content[i]) // 4
            yield {
                "key": hashlib.sha256(f"{prompt_id}:settings".encode()).hexdigest()[:32],
                "prompt_id": prompt_id,
                "source": SOURCES[source[i]],
                "messages": messages,
                "content": content[i],
                "reasoning_content": reasoning[i],
                "finish_reason": "length" if truncated[i] else "stop",
                "prompt_tokens": sum(len(m["content"]) for m in messages) // 4 + 5,
                "completion_tokens": completion,
                "local_prompt_tokens": sum(len(m["content"]) for m in messages) // 4 + 5,
                "max_tokens": 8192,
                "server": f"http://gpu-{source[i] % 8}:30000",
                "latency_s": round(float(rng.uniform(5, 60)), 3),
                "attempts": 1,
                "status": "ok",
            }


def records_path(args: argparse.Namespace, n: int) -> Path:
    return args.data_dir / f"completions-{n}-s{args.seed}-v{DATA_VERSION}.jsonl"


def ensure_records(args: argparse.Namespace, n: int, *, prefix_of: int | None = None) -> Path:
    """The JSONL of ``n`` records, generated, or cut as the first ``n`` lines of a larger file."""
    path = records_path(args, n)
    if path.exists():
        return path
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    if prefix_of is not None:
        with open(ensure_records(args, prefix_of), encoding="utf-8") as src, open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(itertools.islice(src, n))
    else:
        from expansion_dag.core import load_tokenizer

        vocab = load_tokenizer().backend_tokenizer.get_vocab()
        with open(tmp, "w", encoding="utf-8") as fh:
            for record in generate_records(n, args.seed, vocab):
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def stream_records(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            yield json.loads(line)


def segment_batches(records: list[dict[str, Any]], tokenizer: Any, config: Any, work_dir: Path) -> list[list[str]]:
    """The texts a build of ``records`` tokenizes, batch by batch: recovered from its rows (a build
    of its own, untimed), each row's ids decoded run by run of its loss mask."""
    from expansion_dag.training import build_training_set, data_files

    out_dir = work_dir / f"segments-{os.getpid()}"
    try:
        build_training_set(iter(records), tokenizer, config, out_dir, identities=bench_identities())
        return list(harness.set_texts([Path(f) for f in data_files(out_dir)], tokenizer, config.chunk_rows))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Phases, each in a subprocess of its own


def run_build(records: list[dict[str, Any]], tokenizer: Any, config: Any, work_dir: Path) -> dict[str, Any]:
    from expansion_dag.training import build_training_set

    clock = Clock()
    out_dir = work_dir / f"build-{os.getpid()}"
    reset_peak()
    try:
        with clock.span("build"):
            manifest = build_training_set(iter(records), tokenizer, config, out_dir, identities=bench_identities())
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {
        **clock.report(),
        "samples": manifest.samples,
        "tokens": manifest.tokens,
        "assistant_tokens": manifest.assistant_tokens,
        "left_out": manifest.left_out,
        "tokens_per_sample": manifest.tokens_per_sample,
        "ids_from": manifest.ids_from,
        "retokenization": manifest.retokenization,
        "peak_rss_mib": window_peak_mib(),
    }


def run_raw(batches: list[list[str]], tokenizer: Any) -> dict[str, Any]:
    backend = tokenizer.backend_tokenizer
    clock = Clock()
    reset_peak()
    tokens = 0
    for texts in batches:
        with clock.span("tokenize"):
            encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
        with clock.span("ids"):
            ids = [e.ids for e in encodings]
        tokens += sum(map(len, ids))
    return {**clock.report(), "tokens": tokens, "peak_rss_mib": window_peak_mib()}


def run_map(batches: list[list[str]], tokenizer: Any, config: Any, work_dir: Path) -> dict[str, Any]:
    import datasets
    import pyarrow.compute as pc

    dataset = datasets.Dataset.from_dict({"text": list(itertools.chain.from_iterable(batches))})
    backend = tokenizer.backend_tokenizer

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"input_ids": [e.ids for e in backend.encode_batch_fast(batch["text"], add_special_tokens=False)]}

    cache = work_dir / f"map-{os.getpid()}.arrow"
    clock = Clock()
    reset_peak()
    try:
        with clock.span("map"):
            mapped = dataset.map(
                tokenize,
                batched=True,
                batch_size=3 * config.chunk_rows,
                cache_file_name=str(cache),
                load_from_cache_file=False,
            )
        tokens = int(pc.sum(pc.list_value_length(mapped.data.table.column("input_ids"))).as_py())
        del mapped
    finally:
        cache.unlink(missing_ok=True)
    return {**clock.report(), "tokens": tokens, "peak_rss_mib": window_peak_mib()}


def phase_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """The three contenders slice by slice, back to back on each slice, in an order that rotates."""
    import datasets

    from expansion_dag.config import GenerationConfig, training_set_config
    from expansion_dag.core import load_tokenizer
    from expansion_dag.training import DEFAULT_MAX_LENGTH

    datasets.disable_progress_bars()
    tokenizer, config = load_tokenizer(), training_set_config(GenerationConfig(), DEFAULT_MAX_LENGTH)
    records = list(stream_records(records_path(args, args.records)))
    slices = []
    for index in range(args.slices):
        part = records[index * len(records) // args.slices : (index + 1) * len(records) // args.slices]
        setup = Clock()
        with setup.span("render_segments"):  # untimed for raw and map: their texts come ready
            batches = segment_batches(part, tokenizer, config, args.work_dir)
        shift = (args.round * args.slices + index) % len(CONTENDERS)
        order = CONTENDERS[shift:] + CONTENDERS[:shift]
        results: dict[str, Any] = {}
        for name in order:
            if name == "build":
                results[name] = run_build(part, tokenizer, config, args.work_dir)
            elif name == "raw":
                results[name] = run_raw(batches, tokenizer)
            else:
                results[name] = run_map(batches, tokenizer, config, args.work_dir)
        slices.append({"slice": index, "round": args.round, "records": len(part), "order": list(order),
                       "render_segments_s": round(setup.wall["render_segments"], 3), **results})  # fmt: skip
    return {"round": args.round, "slices": slices}


def phase_memory(args: argparse.Namespace) -> dict[str, Any]:
    from expansion_dag.config import GenerationConfig, training_set_config
    from expansion_dag.core import load_tokenizer
    from expansion_dag.training import DEFAULT_MAX_LENGTH, build_training_set

    tokenizer, config = load_tokenizer(), training_set_config(GenerationConfig(), DEFAULT_MAX_LENGTH)
    out_dir = args.work_dir / f"memory-{os.getpid()}"
    clock = Clock()
    process_peak_before = reset_peak()
    window_start = harness.window_start_rss_mib()
    try:
        with clock.span("build_streamed"):
            manifest = build_training_set(
                stream_records(records_path(args, args.size)), tokenizer, config, out_dir,
                identities=bench_identities(),
            )
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {**clock.report(), "records": args.size, "samples": manifest.samples, "tokens": manifest.tokens,
            "build_peak_rss_mib": window_peak_mib(), "window_start_rss_mib": window_start,
            "setup_peak_mib": process_peak_before}  # fmt: skip


def phase_profile(args: argparse.Namespace) -> dict[str, Any]:
    """Where the build's time goes: one build of the first slice under cProfile."""
    from expansion_dag.config import GenerationConfig, training_set_config
    from expansion_dag.core import load_tokenizer
    from expansion_dag.training import DEFAULT_MAX_LENGTH, build_training_set

    tokenizer, config = load_tokenizer(), training_set_config(GenerationConfig(), DEFAULT_MAX_LENGTH)
    records = list(stream_records(records_path(args, args.records)))
    part = records[: len(records) // args.slices]
    out_dir = args.work_dir / f"profile-{os.getpid()}"
    try:
        manifest, functions = harness.profiled(
            lambda: build_training_set(iter(part), tokenizer, config, out_dir, identities=bench_identities())
        )
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {"records": len(part), "tokens": manifest.tokens, "functions": functions}


PHASES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "throughput": phase_throughput, "memory": phase_memory, "profile": phase_profile,
}


def run_child(args: argparse.Namespace) -> None:
    preload = ("datasets", "polars", "expansion_dag.core.tokenizer", "expansion_dag.training.build")
    harness.run_phase_here(PHASES[args.phase], args, preload=preload)


def spawn(phase: str, args: argparse.Namespace, *, script: str = __file__, **extra: Any) -> dict[str, Any]:
    """One phase of ``script`` (this benchmark, or one that shares its options) in its own process."""
    command = [
        sys.executable, script, "--phase", phase, "--records", str(args.records), "--seed", str(args.seed),
        "--data-dir", str(args.data_dir), "--work-dir", str(args.work_dir), "--slices", str(args.slices),
    ]  # fmt: skip
    for key, value in extra.items():
        command += [f"--{key}", str(value)]
    return harness.run_phase(command, phase, quiet_wait_s=args.quiet_wait)


# ---------------------------------------------------------------------------------------------
# Summary


def summarize(pairs: list[dict[str, Any]], memory: list[dict[str, Any]], profile: dict[str, Any]) -> dict[str, Any]:
    rounds = sorted({p["round"] for p in pairs})
    wall_key = {"build": "build", "raw": "tokenize", "map": "map"}

    def total(name: str, round_: int, *, with_ids: bool = False) -> tuple[int, float]:
        tokens = sum(p[name]["tokens"] for p in pairs if p["round"] == round_)
        wall = sum(p[name]["wall_s"][wall_key[name]] + (p[name]["wall_s"]["ids"] if with_ids else 0.0)
                   for p in pairs if p["round"] == round_)  # fmt: skip
        return tokens, wall

    def throughput(name: str, **kw: bool) -> dict[str, float]:
        values = []
        for r in rounds:
            tokens, wall = total(name, r, **kw)
            values.append(tokens / wall)
        return {"median": round(statistics.median(values)), "best": round(max(values)),
                "worst": round(min(values)), "n": len(values)}  # fmt: skip

    tps = {
        "build": throughput("build"),
        "raw_tokenizer": throughput("raw"),
        "raw_tokenizer_with_ids": throughput("raw", with_ids=True),
        "dataset_map": throughput("map"),
    }

    def round_ratio(num: str, den: str) -> dict[str, float]:
        return {
            "of_medians": round(tps[num]["median"] / tps[den]["median"], 3),
            "of_bests": round(tps[num]["best"] / tps[den]["best"], 3),
        }

    def paired(num: str, den: str, *, den_with_ids: bool = False) -> dict[str, float]:
        # tokens/s ratio on the same slice = the denominator's wall over the numerator's.
        values = []
        for p in pairs:
            den_wall = p[den]["wall_s"][wall_key[den]] + (p[den]["wall_s"]["ids"] if den_with_ids else 0.0)
            values.append(den_wall / p[num]["wall_s"][wall_key[num]])
        return {"median": round(statistics.median(values), 3), "best": round(max(values), 3),
                "worst": round(min(values), 3), "n": len(values)}  # fmt: skip

    def cpu_tps(name: str) -> float:
        tokens = sum(p[name]["tokens"] for p in pairs)
        return round(tokens / sum(p[name]["cpu_s"][wall_key[name]] for p in pairs))

    small, large = memory
    tokens = {p[name]["tokens"] for p in pairs for name in CONTENDERS}
    per_slice_tokens = {p["slice"]: {p[name]["tokens"] for name in CONTENDERS} for p in pairs}
    return {
        "tokens_per_s": tps,
        "ratios_of_round_totals": {
            "build_vs_raw_tokenizer": round_ratio("build", "raw_tokenizer"),
            "build_vs_raw_tokenizer_with_ids": round_ratio("build", "raw_tokenizer_with_ids"),
            "build_vs_dataset_map": round_ratio("build", "dataset_map"),
            "dataset_map_vs_raw_tokenizer": round_ratio("dataset_map", "raw_tokenizer"),
        },
        "paired_ratios": {
            "build_vs_raw_tokenizer": paired("build", "raw"),
            "build_vs_raw_tokenizer_with_ids": paired("build", "raw", den_with_ids=True),
            "build_vs_dataset_map": paired("build", "map"),
            "dataset_map_vs_raw_tokenizer": paired("map", "raw"),
        },
        "tokens_per_cpu_s": {name: cpu_tps(name) for name in CONTENDERS},
        # One profiled build (slower than unprofiled): its functions by own time.
        "build_profile": profile,
        "render_segments_s_per_round": statistics.median(
            [sum(p["render_segments_s"] for p in pairs if p["round"] == r) for r in rounds]
        ),
        "memory": {
            "small": {k: small[k] for k in ("records", "tokens", "build_peak_rss_mib", "window_start_rss_mib", "process_peak_rss_mib")},
            "large": {k: large[k] for k in ("records", "tokens", "build_peak_rss_mib", "window_start_rss_mib", "process_peak_rss_mib")},
            "build_peak_ratio": round(large["build_peak_rss_mib"] / small["build_peak_rss_mib"], 3),
            "process_peak_ratio": round(large["process_peak_rss_mib"] / small["process_peak_rss_mib"], 3),
            # The build's own growth: its peak minus the RSS when its window opened (tokenizer loaded).
            "growth_mib": [round(r["build_peak_rss_mib"] - r["window_start_rss_mib"], 1) for r in (small, large)],
        },
        "peak_rss_mib": {name: max(p[name]["peak_rss_mib"] for p in pairs) for name in CONTENDERS},
        "others_cores": harness.stats([p["others_cores"] for p in pairs if p["slice"] == 0]),
        "targets": {
            "build_at_least_0.8_of_raw": paired("build", "raw")["median"] >= 0.8,
            "peak_memory_within_1.2x_at_10x_input": large["build_peak_rss_mib"] / small["build_peak_rss_mib"] <= 1.2,
        },
        "same_tokens_for_every_contender": all(len(v) == 1 for v in per_slice_tokens.values()),
        "tokens_per_round": sum(p["build"]["tokens"] for p in pairs if p["round"] == rounds[0]),
        "samples_per_round": sum(p["build"]["samples"] for p in pairs if p["round"] == rounds[0]),
        "left_out_per_round": {
            k: sum(p["build"]["left_out"][k] for p in pairs if p["round"] == rounds[0]) for k in pairs[0]["build"]["left_out"]
        },
        "distinct_slice_token_counts": sorted(tokens),
    }  # fmt: skip


def print_table(summary: dict[str, Any]) -> None:
    line = "{:<40} {:>12} {:>12} {:>12}"
    print(line.format("tokens per second (round totals)", "median", "best", "per CPU-s"))
    cpu = summary["tokens_per_cpu_s"]
    for key, value in summary["tokens_per_s"].items():
        per_cpu = {"build": cpu["build"], "raw_tokenizer": cpu["raw"], "dataset_map": cpu["map"]}.get(key)
        print(line.format(key, f"{value['median']:,.0f}", f"{value['best']:,.0f}", f"{per_cpu:,}" if per_cpu else ""))
    print()
    print(line.format("ratios", "of medians", "of bests", ""))
    for key, value in summary["ratios_of_round_totals"].items():
        print(line.format(key, f"{value['of_medians']:.3f}", f"{value['of_bests']:.3f}", ""))
    print(line.format("paired ratios (same slice, same process)", "median", "best", "worst"))
    for key, value in summary["paired_ratios"].items():
        print(line.format(key, f"{value['median']:.3f}", f"{value['best']:.3f}", f"{value['worst']:.3f}"))
    print()
    profile = summary["build_profile"]
    print(f"one build of {profile['records']:,} records under cProfile: its functions by own time (s)")
    for function in profile["functions"]:
        print(f"  {function['own_s']:>8.3f}  {function['function']}")
    print()
    print("memory:", json.dumps(summary["memory"]))
    print("peak RSS MiB:", json.dumps(summary["peak_rss_mib"]))
    print("cores used by other processes:", json.dumps(summary["others_cores"]))
    print("targets:", json.dumps(summary["targets"]))
    print("tokens per round:", f"{summary['tokens_per_round']:,}", "samples:", summary["samples_per_round"],
          "left out:", json.dumps(summary["left_out_per_round"]), "same tokens everywhere:",
          summary["same_tokens_for_every_contender"])  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=DEFAULT_RECORDS,
                   help=f"records of the throughput run and of the larger memory run (default {DEFAULT_RECORDS:,})")
    p.add_argument("--slices", type=int, default=DEFAULT_SLICES, help=f"slices of the records (default {DEFAULT_SLICES})")
    p.add_argument("--repeat", type=int, default=2, help="rounds over all slices, one process each (default 2)")
    p.add_argument("--work-dir", type=Path, default=None, help="where builds write (default: --data-dir)")
    harness.add_phase_options(p, PHASES, quiet_wait_s=5.0)
    p.add_argument("--size", type=int, default=None, help=argparse.SUPPRESS)
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.work_dir = args.work_dir or args.data_dir
    if args.phase:
        run_child(args)
        return 0
    args.data_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    document = harness.header("training_set", *harness.DATA_PACKAGES, simulator=False, argv=argv)
    small = max(1, args.records // 10)
    if not records_path(args, args.records).exists():
        print(f"generating {args.records:,} records into {records_path(args, args.records)} ...", flush=True)
    ensure_records(args, args.records)
    ensure_records(args, small, prefix_of=args.records)
    pairs = []
    for round_index in range(args.repeat):
        result = spawn("throughput", args, round=round_index)
        for part in result["slices"]:
            part["others_cores"] = result["others_cores"]
            pairs.append(part)
            timings = "  ".join(
                f"{name} {part[name]['tokens'] / part[name]['wall_s'][key]:>10,.0f} tok/s"
                for name, key in (("build", "build"), ("raw", "tokenize"), ("map", "map"))
            )
            print(f"round {round_index + 1} slice {part['slice'] + 1}/{args.slices}  {timings}", flush=True)
        print(f"round {round_index + 1}: other processes used {result['others_cores']:.2f} cores meanwhile", flush=True)
    memory = []
    for n in (small, args.records):
        result = spawn("memory", args, size=n)
        memory.append(result)
        print(f"memory {n:>8,} records {result['tokens']:>12,} tokens  build peak RSS {result['build_peak_rss_mib']:8.1f} MiB "
              f"(RSS at its start {result['window_start_rss_mib']:.1f}, process peak {result['process_peak_rss_mib']:.1f})",
              flush=True)  # fmt: skip
    profile = spawn("profile", args)
    summary = summarize(pairs, memory, profile)
    document.update({
        "settings": {"records": args.records, "slices": args.slices, "memory_sizes": [small, args.records],
                     "repeat": args.repeat, "seed": args.seed, "config": "the run configuration's defaults"},
        "summary": summary,
        "pairs": pairs,
        "memory_runs": memory,
    })  # fmt: skip
    print()
    print_table(summary)
    print(f"\nwritten {harness.write_result('training_set', document, out_dir=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
