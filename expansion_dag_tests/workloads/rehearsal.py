"""The reference run's inputs at any size, for a rehearsal on the simulator: the six sources in the
bundled samples' layouts and schemas, a catalog whose quotas add up to the prompts asked, and a run
configuration of a simulated fleet whose answers average the reference run's length.

The reference run: 193,010 prompts from six sources, completions totalling about 523M output tokens
(about 2,710 a completion), 8 servers of 72 running requests each. ``bench/bench_rehearsal.py``
measures it at full size; a test runs it small (``expansion_dag_tests/cli/test_rehearsal.py``).

* The sources, in the proportions of ``SHARES`` (an assumption: the reference run's split is not
  recorded), their prompts' lengths drawn per source (``PROMPT_WORDS``: lognormal word counts of
  English-like text, 1.27 Qwen3 tokens a word), with a few exact duplicates and non-English rows,
  so that deduplication and the ``langdetect`` filter have work.
* The simulated servers' answer lengths are lognormal (sigma ``OUTPUT_SIGMA``) with the median
  that makes the answers, capped at ``MAX_OUTPUT_TOKENS``, average ``MEAN_OUTPUT_TOKENS``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from expansion_dag.prompts import package_dir
from expansion_dag_tests.workloads.text_model import TextModel, lognormal_ints
from expansion_dag_tests.workloads.tool_sources import AGENT_SPLITS, HERMES_CONFIGS

REFERENCE_PROMPTS = 193_010
REFERENCE_OUTPUT_TOKENS = 523_000_000
MEAN_OUTPUT_TOKENS = REFERENCE_OUTPUT_TOKENS / REFERENCE_PROMPTS  # about 2,710
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
SAMPLES = package_dir("samples")
SAMPLES_CATALOG = package_dir("catalogs") / "samples.yaml"


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


def _parquet_like(sample: Path, columns: dict[str, Any], path: Path) -> None:
    schema = pq.read_schema(sample).remove_metadata()
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pydict(columns, schema=schema), path, compression="snappy")


def write_sources(folder: Path, n: int, seed: int, vocab: dict[str, int]) -> dict[str, Any]:
    """The six sources under ``folder`` in the bundled samples' layouts, with a catalog whose quotas
    give ``n`` prompts; the catalog's path, each source's rows and quota. ``vocab``: the tokenizer's
    vocabulary, whose words the text is made of."""
    model = TextModel(vocab, seed)
    rng = model.rng
    want = quotas(n)
    rows: dict[str, int] = {}

    def count(source: str, extra: float = 0.0) -> int:
        # Enough rows that, after duplicates (and the filter), every quota is met.
        rows[source] = math.ceil(want[source] / (1 - DUPLICATES - extra) * 1.02) + 10
        return rows[source]

    k = count("infinity_instruct", NON_ENGLISH)
    prompts = _texts(model, "infinity_instruct", k)
    answers = model.texts(lognormal_ints(rng, k, median=180, sigma=0.8, low=1, high=4000)).to_pylist()
    english = rng.random(k) >= NON_ENGLISH
    label = {"ability_en": ["logical reasoning"], "ability_zh": ["逻辑推理"],
             "cate_ability_en": ["problem solving"], "cate_ability_zh": ["问题解决"]}  # fmt: skip
    _parquet_like(
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
    _parquet_like(
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
    (folder / "hermes_function_calling").mkdir()
    for config, indices in zip(HERMES_CONFIGS, np.array_split(np.arange(k), len(HERMES_CONFIGS))):
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
        _parquet_like(
            SAMPLES / "agentinstruct" / "data" / f"{split}-00000-of-00001.parquet",
            {
                "conversations": [[{"from": "human", "loss": False, "value": tasks[i]},
                                   {"from": "gpt", "loss": True, "value": "(action)"}] for i in indices.tolist()],
                "id": [f"{split}_{i}" for i in indices.tolist()],
            },  # fmt: skip
            folder / "agentinstruct" / "data" / f"{split}-00000-of-00001.parquet",
        )
    catalog = yaml.safe_load(SAMPLES_CATALOG.read_text())
    for source in catalog["sources"]:
        source["quota"] = want[source["name"]]
        source.pop("weight", None)
    catalog.pop("total_prompts", None)
    catalog.pop("local_root", None)  # the files written here, next to the catalog: not the bundled samples
    catalog_path = folder / "catalog.yaml"
    catalog_path.write_text(yaml.safe_dump(catalog, sort_keys=False))
    return {"catalog": str(catalog_path), "rows": rows, "quotas": want}


def output_median(mean: float = MEAN_OUTPUT_TOKENS, sigma: float = OUTPUT_SIGMA, cap: int = MAX_OUTPUT_TOKENS) -> int:
    """The lognormal median whose draws, capped at ``cap``, average ``mean`` (by bisection, exact integrals)."""
    phi = NormalDist().cdf

    def capped_mean(median: float) -> float:
        mu, z = math.log(median), (math.log(cap) - math.log(median)) / sigma
        return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))

    low, high = 1.0, float(cap)
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if capped_mean(mid) < mean else (low, mid)
    return round(low)


def write_config(folder: Path, catalog: str, *, servers: int, slots: int, base_port: int, ttft_ms: float,
                 token_latency_ms: float, generation: dict[str, Any] | None = None) -> Path:  # fmt: skip
    """The run configuration: ``servers`` simulated SGLang servers of ``slots`` running requests,
    launched by the pipeline on ``base_port`` and the ports after it, the storage under ``folder``;
    ``generation``'s fields over the rehearsal's own."""
    command = (
        "{python} -m expansion_dag.sim --model-path {model_path} --host {host} --port {port} "
        "--context-length {context_length} --max-running-requests {max_running_requests} "
        "--stream-interval {stream_interval} "
        f"--ttft-ms {ttft_ms} --token-latency-ms {token_latency_ms} "
        f"--output-median-tokens {output_median()} --output-sigma {OUTPUT_SIGMA} --warmup-s 0.2"
    )
    config = {
        "fleet": {
            "mode": "simulate",
            "shards": servers,
            "launch": {
                "command": command,
                "host": "127.0.0.1",
                "base_port": base_port,
                "context_length": CONTEXT_LENGTH,
                "max_running_requests": slots,
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
            **(generation or {}),
        },
    }
    path = folder / "rehearsal.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
