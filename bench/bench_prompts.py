"""Prompts benchmark: extraction, dedup and sampling against a polars read; token budgeting
against the raw batched fast tokenizer.

The data is generated, deterministically from a seed, in the schema of BAAI/Infinity-Instruct
(config ``0625``): ``id`` int64, ``conversations`` list of ``{from, value}`` (human/gpt turns),
``label`` struct of four string lists, ``langdetect``, ``source``. 654,676 rows by default, the size
of that config, with realistic turn counts and lengths, a share of non-English rows, duplicate
prompts (exact and whitespace variants) and a few blank prompts. It is cached as one snappy
Parquet file (the codec ``datasets`` writes) under ``--data-dir`` and reused by later runs.

Every phase runs in a subprocess of its own; peak memory is the high-water RSS (``VmHWM``) of
the measured work, reset (``/proc/self/clear_refs``) once imports and inputs are loaded:

* ``read``: ``pl.read_parquet(path, columns=["conversations", "langdetect"])``, the columns that
  extraction needs (the prompt column and the ``langdetect: en`` filter of the production catalog).
  The baseline of the extraction target, with its own peak memory.
* ``extract``: the same read, then ``extract_prompts`` and ``select_prompts`` called exactly as the
  prompts asset calls them (a catalog source with the ``langdetect: en`` filter and a quota of
  193,010, so that the selection is the budgeting input), then the read once more. Extraction is
  compared with the mean of the two reads that bracket it in the same process (A-B-A), which
  cancels most of the drift of a shared machine, and with the ``read`` phase.
* ``read_asset``: what the prompts asset's IO manager really does, ``pl.from_arrow(pq.read_table)``
  of every column. Context only.
* ``tokens``: rendering alone (``to_list`` and ``render_prompts`` in the batches ``budget_prompts``
  uses); then, slice by slice (``--slices``), the raw tokenizer
  (``tokenizer.backend_tokenizer.encode_batch_fast`` on the texts just rendered) and
  ``budget_prompts`` (bundled Qwen3 tokenizer, context 8192, 8 shards) back to back on the same
  prompts, their order alternating; summed over the slices each handles all 193,010 prompts. In
  the first round, one ``budget_prompts`` call on all the prompts follows, for its own time and
  peak memory.
* ``pycalls`` (once): extraction + selection under ``sys.setprofile``, counting Python function
  calls, to show whether any Python runs per row.
* ``profile`` (once): where the time goes, from outside: extraction + selection, then
  ``budget_prompts`` on the first slice, under cProfile, their functions by own time.
* ``extract_asset`` (once): the prompts asset end to end as it runs today, materialized through
  Dagster (each source's raw file read for the columns its extractor and filters need, one source
  at a time, then extraction and selection, the prompts written), for its real peak memory.

The machine is shared (2 cores): the phases run round-robin ``--repeat`` times, each waits up to
``--quiet-wait`` seconds for the other processes to calm down, and each records how many cores the
other processes used meanwhile (from ``/proc/stat``). The summary gives medians and bests, ratios
between medians, between bests, and paired (same process, back to back).

    .venv/bin/python bench/bench_prompts.py                # full size, 3 rounds (~7 min on quiet
                                                           # cores, ~18 min when busy; +1.5 min to
                                                           # generate the data the first time)
    .venv/bin/python bench/bench_prompts.py --rows 50000 --repeat 1   # smoke run (~1 min)

Results are printed and written as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import harness  # noqa: E402  (bench/ is on sys.path when run as a script)
from harness import Clock, reset_peak, stats, window_peak_mib  # noqa: E402

from expansion_dag_tests.workloads.text_model import TextModel, lognormal_ints  # noqa: E402

FULL_ROWS = 654_676  # BAAI/Infinity-Instruct, config 0625
FULL_BUDGET_PROMPTS = 193_010
CONTEXT_LENGTH = 8192
NUM_SHARDS = 8
DATA_VERSION = 1  # bump when the generator changes, so that a stale cache is not reused
READ_COLUMNS = ["conversations", "langdetect"]
SOURCE_NAME = "infinity_instruct"
CHUNK_ROWS = 32_768  # rows generated and written (one row group) at a time


# ---------------------------------------------------------------------------------------------
# Infinity-Instruct-shaped data

#: Conversation length in (human, gpt) pairs: most rows are single-turn, a tail is multi-turn.
TURN_PAIRS = {1: 0.78, 2: 0.12, 3: 0.05, 4: 0.03, 5: 0.01, 6: 0.005, 8: 0.005}
HUMAN_WORDS = {"median": 55, "sigma": 1.0, "low": 2, "high": 3000}  # mean ~90 words, ~550 chars
GPT_WORDS = {"median": 180, "sigma": 0.8, "low": 1, "high": 4000}  # mean ~250 words, ~1,500 chars
EXACT_DUPLICATES = 0.025  # first human turn copied from an earlier row
WHITESPACE_DUPLICATES = 0.01  # ... copied with extra whitespace: the same prompt after normalization
BLANK_PROMPTS = 0.0003  # first human turn empty: quarantined as empty_prompt
NON_ENGLISH = 0.09
LANGUAGES = ("zh-cn", "ko", "ja", "fr", "de", "es", "ru")
SOURCES = (
    "Subjective", "flan", "code_exercises", "OpenHermes-2.5", "MetaMath", "SlimOrca",
    "glaive-code-assistant-v3", "CodeFeedback",
)  # fmt: skip
ABILITIES = (
    ("information retrieval", "信息检索"), ("creative writing", "创意写作"), ("programming", "编程"),
    ("logical reasoning", "逻辑推理"), ("summarization", "总结"), ("mathematical calculation", "数学计算"),
    ("knowledge q&a", "知识问答"), ("text generation", "文本生成"), ("translation", "翻译"),
    ("data analysis", "数据分析"), ("problem solving", "问题解决"), ("code debugging", "代码调试"),
)  # fmt: skip
CATEGORIES = (
    ("information processing and integration", "信息处理与整合"), ("programming and software development", "编程与软件开发"),
    ("mathematical ability", "数学能力"), ("creativity and design", "创意与设计"),
    ("logic and reasoning", "逻辑与推理"), ("natural language processing and understanding", "自然语言处理与理解"),
)  # fmt: skip

INFINITY_SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
        (
            "label",
            pa.struct(
                [
                    ("ability_en", pa.list_(pa.string())),
                    ("ability_zh", pa.list_(pa.string())),
                    ("cate_ability_en", pa.list_(pa.string())),
                    ("cate_ability_zh", pa.list_(pa.string())),
                ]
            ),
        ),
        ("langdetect", pa.string()),
        ("source", pa.string()),
    ]
)


def infinity_batch(model: TextModel, first_id: int, rows: int) -> pa.RecordBatch:
    """``rows`` rows in the Infinity-Instruct schema; duplicates point at earlier rows of the batch."""
    rng = model.rng
    pair_counts = np.array(list(TURN_PAIRS))
    pairs = rng.choice(pair_counts, size=rows, p=np.array(list(TURN_PAIRS.values())) / sum(TURN_PAIRS.values()))
    turns = 2 * pairs
    offsets = np.concatenate([[0], np.cumsum(turns)])
    n_turns = int(offsets[-1])
    is_gpt = (np.arange(n_turns) - np.repeat(offsets[:-1], turns)) % 2 == 1
    words = np.where(
        is_gpt,
        lognormal_ints(rng, n_turns, **GPT_WORDS),
        lognormal_ints(rng, n_turns, **HUMAN_WORDS),
    )
    first = offsets[:-1]
    words[first[rng.random(rows) < BLANK_PROMPTS]] = 0
    values = model.texts(words)

    # Duplicate prompts: the first human turn of some rows is that of an earlier row of the batch.
    take = np.arange(n_turns)
    kind = rng.random(rows)
    dup_rows = np.flatnonzero((kind < EXACT_DUPLICATES + WHITESPACE_DUPLICATES) & (np.arange(rows) > 0))
    take[first[dup_rows]] = first[(rng.random(len(dup_rows)) * dup_rows).astype(np.int64)]
    spaced_rows = dup_rows[kind[dup_rows] >= EXACT_DUPLICATES]
    # A whitespace variant: the copy plus trailing spaces and a newline, appended after the values.
    spaced = pc.binary_join_element_wise(
        values.take(pa.array(take[first[spaced_rows]])), pa.scalar("  \n"), ""
    )
    take[first[spaced_rows]] = n_turns + np.arange(len(spaced_rows))
    values = pa.concat_arrays([values.cast(pa.large_string()), spaced.cast(pa.large_string())]).take(pa.array(take))
    values = values.cast(pa.string())
    roles = pa.array(["human", "gpt"]).take(pa.array(is_gpt.astype(np.int8)))
    conversations = pa.ListArray.from_arrays(
        pa.array(offsets, pa.int32()), pa.StructArray.from_arrays([roles, values], names=["from", "value"])
    )

    def labels(pool: tuple[tuple[str, str], ...], most: int) -> tuple[pa.Array, pa.Array]:
        counts = rng.integers(1, most + 1, rows)
        picks = pa.array(rng.integers(0, len(pool), int(counts.sum())))
        list_offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]), pa.int32())
        return tuple(
            pa.ListArray.from_arrays(list_offsets, pa.array([p[k] for p in pool]).take(picks)) for k in (0, 1)
        )

    ability_en, ability_zh = labels(ABILITIES, 3)
    cate_en, cate_zh = labels(CATEGORIES, 1)
    label = pa.StructArray.from_arrays(
        [ability_en, ability_zh, cate_en, cate_zh],
        names=["ability_en", "ability_zh", "cate_ability_en", "cate_ability_zh"],
    )
    english = rng.random(rows) >= NON_ENGLISH
    language = np.where(english, 0, 1 + rng.integers(0, len(LANGUAGES), rows))
    langdetect = pa.array(("en", *LANGUAGES)).take(pa.array(language))
    source = pa.array(SOURCES).take(pa.array(rng.integers(0, len(SOURCES), rows)))
    ids = pa.array(np.arange(first_id, first_id + rows, dtype=np.int64))
    return pa.RecordBatch.from_arrays([ids, conversations, label, langdetect, source], schema=INFINITY_SCHEMA)


def write_infinity_instruct(path: Path, rows: int, seed: int, vocab: dict[str, int]) -> dict[str, Any]:
    """Write the file through a temporary name, so that an interrupted run leaves no cache behind."""
    model = TextModel(vocab, seed)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with pq.ParquetWriter(tmp, INFINITY_SCHEMA, compression="snappy") as writer:
        for start in range(0, rows, CHUNK_ROWS):
            writer.write_batch(infinity_batch(model, start, min(CHUNK_ROWS, rows - start)))
    os.replace(tmp, path)
    return {"path": str(path), "bytes": path.stat().st_size}


def data_path(args: argparse.Namespace) -> Path:
    return args.data_dir / f"infinity_instruct-{args.rows}-s{args.seed}-v{DATA_VERSION}.parquet"


def prompts_path(args: argparse.Namespace) -> Path:
    return args.data_dir / f"prompts-{args.rows}-s{args.seed}-q{args.budget_prompts}-v{DATA_VERSION}.parquet"


def catalog_for(args: argparse.Namespace):
    from expansion_dag.prompts import Catalog, SourceSpec

    source = SourceSpec(
        name=SOURCE_NAME,
        extractor="infinity_instruct",
        local_path=str(data_path(args)),
        format="parquet",
        quota=args.budget_prompts,
        filters={"langdetect": "en"},
    )
    return Catalog(sources=(source,), seed=0)


def read_columns(path: Path):
    import polars as pl

    return pl.read_parquet(path, columns=READ_COLUMNS)


def extract(raw, spec):
    """``extract_prompts`` on one catalog source, called as the prompts asset calls it."""
    from expansion_dag.prompts import extract_prompts

    return extract_prompts(
        raw, source=spec.name, extractor=spec.extractor, turn=spec.turn, max_chars=spec.max_chars,
        filters=spec.filter_map(),
    )  # fmt: skip


def extract_and_select(raw, catalog):
    """``extract_prompts`` then ``select_prompts``, called as the prompts asset calls them."""
    from expansion_dag.prompts import select_prompts

    results = [extract(raw, s) for s in catalog.sources]
    return results, select_prompts(results, plan=catalog)


# ---------------------------------------------------------------------------------------------
# Phases, each in a subprocess of its own


def phase_generate(args: argparse.Namespace) -> dict[str, Any]:
    from expansion_dag.core import load_tokenizer

    vocab = load_tokenizer().backend_tokenizer.get_vocab()
    start = time.perf_counter()
    info = write_infinity_instruct(data_path(args), args.rows, args.seed, vocab)
    import polars as pl

    lazy = pl.scan_parquet(data_path(args))
    stats = (
        lazy.select(
            rows=pl.len(),
            turns=pl.col("conversations").list.len().sum(),
            text_bytes=pl.col("conversations")
            .list.eval(pl.element().struct.field("value").str.len_bytes())
            .list.sum()
            .sum(),
            first_human_bytes=pl.col("conversations").list.first().struct.field("value").str.len_bytes().sum(),
        )
        .collect()
        .to_dicts()[0]
    )
    return {**info, **stats, "generate_s": round(time.perf_counter() - start, 2)}


def phase_read(args: argparse.Namespace) -> dict[str, Any]:
    clock = Clock()
    before = reset_peak()
    with clock.span("read"):
        raw = read_columns(data_path(args))
    return {**clock.report(), "rows": raw.height, "frame_mib": round(raw.estimated_size("mb"), 1),
            "setup_peak_mib": before}  # fmt: skip


def phase_read_asset(args: argparse.Namespace) -> dict[str, Any]:
    import polars as pl

    clock = Clock()
    before = reset_peak()
    with clock.span("read_asset"):
        raw = pl.from_arrow(pq.read_table(data_path(args)))
    return {**clock.report(), "rows": raw.height, "setup_peak_mib": before}


def phase_extract(args: argparse.Namespace) -> dict[str, Any]:
    catalog = catalog_for(args)
    clock = Clock()
    before = reset_peak()
    with clock.span("read"):
        raw = read_columns(data_path(args))
    read_maxrss = window_peak_mib()
    from expansion_dag.prompts import select_prompts

    with clock.span("extract"):
        result = extract(raw, catalog.sources[0])
    with clock.span("select"):
        selection = select_prompts([result], plan=catalog)
    out = {
        **clock.report(),
        "setup_peak_mib": before,
        "maxrss_after_read_mib": read_maxrss,
        "rows_read": result.rows_read,
        "filtered": result.filtered,
        "extracted": result.prompts.height,
        "quarantined": dict(result.quarantine.group_by("reason").len().iter_rows()),
        **{k: v for k, v in selection.stats[SOURCE_NAME].as_dict().items() if k in ("duplicates", "prompts_out", "not_sampled")},
        "maxrss_mib": window_peak_mib(),  # read + extract + select
    }  # fmt: skip
    target = prompts_path(args)
    if not target.exists():
        tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
        selection.prompts.write_parquet(tmp)
        os.replace(tmp, target)
    # The read once more after the extraction (A-B-A): the pair brackets the extraction in time, so
    # that their mean cancels a steady change of load on the shared machine.
    del raw, result, selection
    with clock.span("read_again"):
        read_columns(data_path(args))
    out["wall_s"]["read_again"] = round(clock.wall["read_again"], 4)
    out["cpu_s"]["read_again"] = round(clock.cpu["read_again"], 4)
    return out


def phase_extract_asset(args: argparse.Namespace) -> dict[str, Any]:
    """The prompts asset end to end as it runs today, materialized through Dagster: each source's raw
    file read for the columns its extractor and filters need, then selection, the prompts written.
    For the real peak memory; run once."""
    import dagster as dg

    from expansion_dag.defs.assets import build_prompts_asset
    from expansion_dag.defs.resources import ASSETS, ParquetIOManager, StorageResource

    asset = build_prompts_asset(catalog_for(args))
    clock = Clock()
    with tempfile.TemporaryDirectory() as root, dg.DagsterInstance.ephemeral() as instance:
        # The raw asset's file where the IO manager keeps it, without a copy.
        (Path(root) / ASSETS).mkdir()
        (Path(root) / ASSETS / f"raw_{SOURCE_NAME}.parquet").symlink_to(data_path(args))
        resources = {"storage": StorageResource(root=root), "parquet_io": ParquetIOManager(root=root)}
        reset_peak()
        with clock.span("extract_select"):
            result = dg.materialize([asset], resources=resources, instance=instance)
    return {**clock.report(), "success": result.success, "maxrss_mib": window_peak_mib()}


def phase_profile(args: argparse.Namespace) -> dict[str, Any]:
    """Where extraction, selection and budgeting spend their time, from outside (cProfile): the
    functions of each by own time, budgeting on the first of the ``tokens`` phase's slices."""
    from expansion_dag.config import GenerationConfig, budget_config
    from expansion_dag.prompts import budget_prompts

    catalog = catalog_for(args)
    raw = read_columns(data_path(args))
    _, extract_select = harness.profiled(lambda: extract_and_select(raw, catalog))
    del raw
    prompts, tokenizer = _load_prompts(args)
    config = budget_config(GenerationConfig())
    first = prompts.head(max(config.batch_size, prompts.height // args.slices))
    _, budget = harness.profiled(
        lambda: budget_prompts(first, tokenizer, context_length=CONTEXT_LENGTH, num_shards=NUM_SHARDS, config=config)
    )
    return {"extract_select": extract_select, "budget_prompts": budget, "budget_prompts_on": first.height}


def phase_pycalls(args: argparse.Namespace) -> dict[str, Any]:
    """Python function calls during extraction and selection: per row, or a constant few?"""
    catalog = catalog_for(args)
    raw = read_columns(data_path(args))
    counts: dict[str, int] = {}
    events = {"call": 0, "c_call": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            events["call"] += 1
            code = frame.f_code
            key = f"{Path(code.co_filename).name}:{code.co_name}"
            counts[key] = counts.get(key, 0) + 1
        elif event == "c_call":
            events["c_call"] += 1

    sys.setprofile(profile)
    try:
        extract_and_select(raw, catalog)
    finally:
        sys.setprofile(None)
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:8]
    return {"rows": raw.height, "python_calls": events["call"], "c_calls_from_python": events["c_call"],
            "most_called": top}  # fmt: skip


def _load_prompts(args: argparse.Namespace):
    import polars as pl

    from expansion_dag.core import load_tokenizer

    return pl.read_parquet(prompts_path(args)), load_tokenizer()


def phase_tokens(args: argparse.Namespace) -> dict[str, Any]:
    """Rendering alone, then the raw tokenizer and ``budget_prompts`` interleaved slice by slice.

    The 193,010 prompts are cut into ``--slices`` slices on ``batch_size`` boundaries; on each slice
    the raw tokenizer (on the texts rendered beforehand) and ``budget_prompts`` run back to back, in
    an order that alternates, so that both see the same machine (it is shared) and neither always
    finds the tokenizer's word cache warm. Summed over the slices, each handles every prompt. In
    the first round one ``budget_prompts`` call on all the prompts follows, for its own wall time and
    peak memory. Each section gets a fresh peak-RSS window.
    """
    from expansion_dag.config import GenerationConfig, budget_config
    from expansion_dag.core import render_prompts
    from expansion_dag.prompts import budget_prompts

    prompts, tokenizer = _load_prompts(args)
    config = budget_config(GenerationConfig())
    backend = tokenizer.backend_tokenizer
    clock = Clock()
    peaks: dict[str, float] = {"raw": 0.0, "budget_slices": 0.0}
    setup_peak = reset_peak()

    # Rendering alone, as budget_prompts does it (to_list, then the chat template); kept for the raw runs.
    texts: list[list[str]] = []
    with clock.span("render_total"):
        for start in range(0, prompts.height, config.batch_size):
            with clock.span("to_list"):
                conversations = prompts["messages"].slice(start, config.batch_size).to_list()
            with clock.span("render"):
                texts.append(render_prompts(tokenizer, conversations, config.chat_template_kwargs))
    peaks["render"] = window_peak_mib()

    def raw(batches: list[list[str]]) -> tuple[int, float]:
        reset_peak()
        tokens, wall = 0, 0.0
        for batch in batches:
            started = time.perf_counter()
            with clock.span("tokenize"):
                encodings = backend.encode_batch_fast(batch, add_special_tokens=False)
            wall += time.perf_counter() - started
            # What count_tokens does with the encodings, and the cheaper len(encoding), apart.
            with clock.span("lengths_via_ids"):
                lengths = [len(e.ids) for e in encodings]
            with clock.span("lengths_via_len"):
                same = [len(e) for e in encodings]
            assert lengths == same
            tokens += sum(lengths)
        peaks["raw"] = max(peaks["raw"], window_peak_mib())
        return tokens, wall

    def budget(frame: Any) -> tuple[int, float]:
        reset_peak()
        started = time.perf_counter()
        with clock.span("budget"):
            result = budget_prompts(frame, tokenizer, context_length=CONTEXT_LENGTH, num_shards=NUM_SHARDS, config=config)
        wall = time.perf_counter() - started
        peaks["budget_slices"] = max(peaks["budget_slices"], window_peak_mib())
        return int(result.prompts["prompt_tokens"].sum() or 0) + int(result.set_aside["prompt_tokens"].sum() or 0), wall

    count = min(args.slices, len(texts))  # a slice holds at least one batch
    bounds = [round(i * len(texts) / count) for i in range(count + 1)]
    slices = []
    for index in range(count):
        first, last = bounds[index], bounds[index + 1]
        frame = prompts.slice(first * config.batch_size, (last - first) * config.batch_size)
        raw_first = (args.round + index) % 2 == 0
        if raw_first:
            raw_tokens, raw_s = raw(texts[first:last])
            budget_tokens, budget_s = budget(frame)
        else:
            budget_tokens, budget_s = budget(frame)
            raw_tokens, raw_s = raw(texts[first:last])
        slices.append({"prompts": frame.height, "raw_first": raw_first, "raw_s": round(raw_s, 4),
                       "budget_s": round(budget_s, 4), "raw_tokens": raw_tokens, "budget_tokens": budget_tokens})  # fmt: skip
    out: dict[str, Any] = {}
    if args.round == 0:
        full = Clock()
        reset_peak()
        with full.span("budget_full"):
            result = budget_prompts(prompts, tokenizer, context_length=CONTEXT_LENGTH, num_shards=NUM_SHARDS, config=config)
        peaks["budget_full"] = window_peak_mib()
        out["budget_full"] = {
            **full.report(),
            "kept": result.prompts.height,
            "set_aside": result.set_aside.height,
            "tokens": int(result.prompts["prompt_tokens"].sum() or 0),
            "balance": round(result.balance(), 5),
        }
    raw_tokens = sum(s["raw_tokens"] for s in slices)
    return {
        **clock.report(),
        **out,
        "prompts": prompts.height,
        "rendered_chars": sum(sum(map(len, batch)) for batch in texts),
        "slices": slices,
        "raw_tokens": raw_tokens,
        "budget_tokens": sum(s["budget_tokens"] for s in slices),
        "peak_rss_mib": peaks,
        "setup_peak_mib": setup_peak,
        "raw_tokens_per_s": round(raw_tokens / clock.wall["tokenize"]),
        "budget_tokens_per_s": round(raw_tokens / clock.wall["budget"]),
    }


PHASES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "generate": phase_generate,
    "read": phase_read,
    "read_asset": phase_read_asset,
    "extract": phase_extract,
    "tokens": phase_tokens,
    "extract_asset": phase_extract_asset,
    "pycalls": phase_pycalls,
    "profile": phase_profile,
}
ROUND = ("read", "extract", "read_asset", "tokens")


def run_child(args: argparse.Namespace) -> None:
    preload = ("polars", "expansion_dag.prompts.budget", "expansion_dag.prompts.catalog", "expansion_dag.prompts.extract", "expansion_dag.core.tokenizer")
    harness.run_phase_here(PHASES[args.phase], args, preload=preload)


def spawn(phase: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--phase", phase, "--rows", str(args.rows), "--seed", str(args.seed),
        "--budget-prompts", str(args.budget_prompts), "--data-dir", str(args.data_dir), "--round", str(args.round),
        "--slices", str(args.slices),
    ]  # fmt: skip
    return harness.run_phase(command, phase, quiet_wait_s=args.quiet_wait)


# ---------------------------------------------------------------------------------------------
# Orchestration and report


def rate_stats(values: list[float]) -> dict[str, float]:
    """Like ``stats`` for a rate, where the best is the highest."""
    return {"median": round(statistics.median(values)), "best": round(max(values)),
            "worst": round(min(values)), "n": len(values)}  # fmt: skip


#: Each figure of the summary: the phase and the span it is read from (wall seconds, or "cpu").
FIGURE_SPANS = {
    "read": "read/read", "read_cpu": "read/read cpu", "read_asset": "read_asset/read_asset",
    "extract_phase_read": "extract/read", "extract_phase_read_again": "extract/read_again",
    "extract": "extract/extract", "extract_cpu": "extract/extract cpu", "select": "extract/select",
    "select_cpu": "extract/select cpu", "to_list": "tokens/to_list", "render": "tokens/render",
    "render_cpu": "tokens/render cpu", "raw_tokenize": "tokens/tokenize", "raw_tokenize_cpu": "tokens/tokenize cpu",
    "lengths_via_ids": "tokens/lengths_via_ids", "lengths_via_len": "tokens/lengths_via_len",
    "budget": "tokens/budget", "budget_cpu": "tokens/budget cpu",
}  # fmt: skip


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def seconds(where: str) -> list[float]:
        phase_span, _, clock = where.partition(" ")
        phase, span = phase_span.split("/")
        return [r["cpu_s" if clock else "wall_s"][span] for r in runs[phase]]

    ext, tok = runs["extract"], runs["tokens"]
    figures = {name: stats(seconds(where)) for name, where in FIGURE_SPANS.items()}
    figures |= {
        "extract_select": stats([r["wall_s"]["extract"] + r["wall_s"]["select"] for r in ext]),
        "extract_select_cpu": stats([r["cpu_s"]["extract"] + r["cpu_s"]["select"] for r in ext]),
        "read_extract_select": stats([sum(r["wall_s"][k] for k in ("read", "extract", "select")) for r in ext]),
    }
    full = [r["budget_full"] for r in tok if "budget_full" in r]
    if full:
        figures["budget_one_call"] = stats([f["wall_s"]["budget_full"] for f in full])
        figures["budget_one_call_cpu"] = stats([f["cpu_s"]["budget_full"] for f in full])

    def ratio(num: str, den: str) -> dict[str, float]:
        return {
            "of_medians": round(figures[num]["median"] / figures[den]["median"], 3),
            "of_bests": round(figures[num]["best"] / figures[den]["best"], 3),
        }

    def paired(values: list[float]) -> dict[str, float]:
        return {"median": round(statistics.median(values), 3), "best": round(min(values), 3),
                "worst": round(max(values), 3), "n": len(values)}  # fmt: skip

    ratios = {
        "extract_select_vs_read": ratio("extract_select", "read"),
        "read_extract_select_vs_read": ratio("read_extract_select", "read"),
        "budget_vs_raw_tokenizer": ratio("budget", "raw_tokenize"),
        "render_vs_raw_tokenizer": ratio("render", "raw_tokenize"),
        # CPU seconds are less disturbed by other processes on a shared machine than wall time.
        "extract_select_vs_read_cpu": ratio("extract_select_cpu", "read_cpu"),
        "budget_vs_raw_tokenizer_cpu": ratio("budget_cpu", "raw_tokenize_cpu"),
    }
    # Paired ratios: numerator and denominator measured back to back in one process.
    paired_ratios = {
        # extraction against the mean of the reads just before and just after it (A-B-A)
        "extract_select_vs_read_same_process": paired(
            [(r["wall_s"]["extract"] + r["wall_s"]["select"]) / ((r["wall_s"]["read"] + r["wall_s"]["read_again"]) / 2)
             for r in ext]  # fmt: skip
        ),
        "read_extract_select_vs_read_same_process": paired(
            [(r["wall_s"]["read"] + r["wall_s"]["extract"] + r["wall_s"]["select"])
             / ((r["wall_s"]["read"] + r["wall_s"]["read_again"]) / 2) for r in ext]  # fmt: skip
        ),
        # budget_prompts against the raw tokenizer on the same slice of prompts, back to back
        "budget_vs_raw_tokenizer_per_slice": paired([s["budget_s"] / s["raw_s"] for r in tok for s in r["slices"]]),
    }
    tokens = {r["raw_tokens"] for r in tok} | {r["budget_tokens"] for r in tok} | {f["tokens"] for f in full}
    return {
        "figures_s": figures,
        "ratios": ratios,
        "paired_ratios": paired_ratios,
        "targets": {
            "extraction_within_2x_of_read": paired_ratios["extract_select_vs_read_same_process"]["median"] <= 2.0,
            "read_extract_select_within_2x_of_read": paired_ratios["read_extract_select_vs_read_same_process"]["median"] <= 2.0,
            "budgeting_within_1.5x_of_raw_tokenizer": paired_ratios["budget_vs_raw_tokenizer_per_slice"]["median"] <= 1.5,
        },
        "peak_rss_mib": {
            "read": max(r["maxrss_mib"] for r in runs["read"]),
            "read_asset": max(r["maxrss_mib"] for r in runs["read_asset"]),
            "extract_after_read": max(r["maxrss_after_read_mib"] for r in ext),
            "read_extract_select": max(r["maxrss_mib"] for r in ext),
            **{k: max(r["peak_rss_mib"].get(k, 0.0) for r in tok) for k in ("render", "raw", "budget_slices", "budget_full")},
        },
        "others_cores": {phase: stats([r["others_cores"] for r in runs[phase]]) for phase in runs if runs[phase]},
        "same_token_total_in_raw_and_budget": len(tokens) == 1,
        "tokens": sorted(tokens),
        "tokens_per_s": {"raw": rate_stats([r["raw_tokens_per_s"] for r in tok]),
                         "budget": rate_stats([r["budget_tokens_per_s"] for r in tok])},  # fmt: skip
        "counts": {k: ext[0][k] for k in ("rows_read", "filtered", "extracted", "duplicates", "prompts_out", "not_sampled", "quarantined")},
        "budget_counts": {"prompts": tok[0]["prompts"], **({k: full[0][k] for k in ("kept", "set_aside", "balance")} if full else {})},
    }  # fmt: skip


def print_table(summary: dict[str, Any], extra: dict[str, Any]) -> None:
    f = summary["figures_s"]
    line = "{:<44} {:>9} {:>9}"
    print(line.format("seconds (wall unless marked)", "median", "best"))
    for key, value in f.items():
        print(line.format(key, f"{value['median']:.3f}", f"{value['best']:.3f}"))
    print()
    print(line.format("ratios", "of medians", "of bests"))
    for key, value in summary["ratios"].items():
        print(f"{key:<44} {value['of_medians']:>9.3f} {value['of_bests']:>9.3f}")
    print(line.format("paired ratios (same process)", "median", "best"))
    for key, value in summary["paired_ratios"].items():
        print(f"{key:<44} {value['median']:>9.3f} {value['best']:>9.3f}   worst {value['worst']:.3f} (n={value['n']})")
    print()
    print("peak RSS MiB:", json.dumps(summary["peak_rss_mib"]))
    print("cores used by other processes (median):", json.dumps({k: v["median"] for k, v in summary["others_cores"].items()}))
    print("targets:", json.dumps(summary["targets"]))
    print("counts:", json.dumps(summary["counts"]), json.dumps(summary["budget_counts"]))
    print("python calls during extract+select:", json.dumps(extra))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=FULL_ROWS, help=f"rows of generated data (default {FULL_ROWS:,})")
    p.add_argument(
        "--budget-prompts",
        type=int,
        default=None,
        help=f"quota of the selection, the budgeting input (default {FULL_BUDGET_PROMPTS:,}, scaled with --rows)",
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds of every phase (default 3)")
    p.add_argument("--slices", type=int, default=8, help="slices of the budgeting input, raw and budget interleaved (default 8)")
    harness.add_phase_options(p, PHASES, quiet_wait_s=30.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.budget_prompts is None:
        args.budget_prompts = max(1, round(FULL_BUDGET_PROMPTS * args.rows / FULL_ROWS))
    if args.phase:
        run_child(args)
        return 0
    args.data_dir.mkdir(parents=True, exist_ok=True)
    document = harness.header("prompts", *harness.DATA_PACKAGES, simulator=False, argv=argv)
    generated = None
    if not data_path(args).exists():
        print(f"generating {args.rows:,} rows into {data_path(args)} ...", flush=True)
        generated = spawn("generate", args)
        print(json.dumps(generated), flush=True)
    # Warm the page cache, so that every read starts alike (a warm read is the harder baseline).
    with open(data_path(args), "rb") as fh:
        while fh.read(1 << 24):
            pass
    runs: dict[str, list[dict[str, Any]]] = {phase: [] for phase in ROUND}
    for round_index in range(args.repeat):
        args.round = round_index
        for phase in ROUND:
            result = spawn(phase, args)
            runs[phase].append(result)
            spans = {"read": ["read"], "read_asset": ["read_asset"], "extract": ["read", "extract", "select", "read_again"],
                     "tokens": ["render_total", "tokenize", "budget"]}[phase]  # fmt: skip
            timings = "  ".join(f"{span} {result['wall_s'][span]:7.3f} s" for span in spans)
            print(f"round {round_index + 1} {phase:<10} {timings}   peak RSS {result['maxrss_mib']:8.1f} MiB   "
                  f"others used {result['others_cores']:.2f} cores", flush=True)  # fmt: skip
    pycalls = spawn("pycalls", args)
    profile = spawn("profile", args)
    asset = spawn("extract_asset", args)
    print(f"prompts asset as it runs today: read needed columns + extract + select "
          f"{asset['wall_s']['extract_select']:.3f} s, peak RSS {asset['maxrss_mib']:.1f} MiB", flush=True)  # fmt: skip
    summary = summarize(runs)
    document.update({
        "settings": {"rows": args.rows, "budget_prompts": args.budget_prompts, "repeat": args.repeat,
                     "seed": args.seed, "context_length": CONTEXT_LENGTH, "num_shards": NUM_SHARDS,
                     "read_columns": READ_COLUMNS, "data": str(data_path(args)),
                     "data_bytes": data_path(args).stat().st_size},
        "generated": generated,
        "summary": summary,
        "pycalls": pycalls,
        "profile": profile,
        "prompts_asset_today": asset,
        "runs": runs,
    })  # fmt: skip
    print()
    print_table(summary, pycalls)
    for name in ("extract_select", "budget_prompts"):
        print(f"{name} under cProfile, its functions by own time (s):")
        for function in profile[name][:6]:
            print(f"  {function['own_s']:>8.3f}  {function['function']}")
    print(f"\nwritten {harness.write_result('prompts', document, out_dir=args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
