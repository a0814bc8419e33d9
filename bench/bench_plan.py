"""The plan against the run (issue 35): how close the plan's output tokens, truncation share and wall
time come to what a run then produces. Every figure is a SIMULATOR figure, never a GPU one.

One simulated SGLang server (in a process of its own) whose answer lengths depend on the source
(lognormal, a median per source, ``--sigma``), the engine as the completions asset drives it, a cap
of ``--cap`` tokens:

1. an earlier run answers ``--prompts`` prompts of four sources into a fresh store;
2. the plan (``expansion_dag.generation.plan``) for ``--prompts`` other prompts of the same sources is made
   from that store (and, for contrast, from the configured estimate alone, 1,024 tokens a source),
   at the earlier run's own output tokens a second as the throughput;
3. those prompts are run, and the plan's figures are set beside what the run produced.

    .venv/bin/python bench/bench_plan.py               # ~2 min on 2 shared cores
    .venv/bin/python bench/bench_plan.py --prompts 300 # a smoke run
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import harness
import polars as pl

from expansion_dag.config import GenerationConfig, engine_config, sampling_settings
from expansion_dag.core import FAILED, Identity
from expansion_dag.generation import (
    Observed,
    Plan,
    Server,
    ShardReport,
    Throughput,
    WorkItem,
    generate_shard,
    make_plan,
)
from expansion_dag.sim import FleetProcess, SimServerConfig
from expansion_dag.store import CompletionStore

#: Median answer length by source: short answers, code, maths, long chat.
MEDIANS = {"alpaca": 200, "code": 600, "math": 350, "chat": 900}
PRIOR = 1024  # the configured expected_output_tokens, the same for every source
SLOTS = 64
SHARD = "shard-00"


def items(identity: Identity, start: int, n: int, cap: int) -> list[WorkItem]:
    sources = list(MEDIANS)
    out = []
    for i in range(start, start + n):
        source = sources[i % len(sources)]
        pid = f"p{i:06d}"
        out.append(WorkItem(
            key=identity.key(pid), prompt_id=pid, source=source,
            messages=[{"role": "user", "content": f"[{source}] Question {i}: say something about topic {i}."}],
            prompt_tokens=20, max_tokens=cap, expected_output_tokens=PRIOR,
        ))
    return out


def run(url: str, store: CompletionStore, work: list[WorkItem], model: str) -> ShardReport:
    config = engine_config(GenerationConfig(), stop_degenerate=False, progress_interval_s=3600, canary=False)
    with store.writer(SHARD) as writer:
        return generate_shard(work, [Server(url, SLOTS)], writer=writer, model=model,
                              sampling=sampling_settings(GenerationConfig()), config=config)


def disk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def plan_for(work: list[WorkItem], observed: Observed, tokens_per_s: float) -> Plan:
    frame = pl.DataFrame({"source": [w.source for w in work], "prompt_tokens": [w.prompt_tokens for w in work],
                          "max_tokens": [w.max_tokens for w in work]})
    return make_plan(frame, observed, lambda source: PRIOR, servers=1, simulated=True, drop_truncated=True,
                     throughput=Throughput(tokens_per_s, "the earlier run's output tokens/s (simulator)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3000, help="prompts in each of the two runs")
    parser.add_argument("--cap", type=int, default=1500, help="max_output_tokens")
    parser.add_argument("--sigma", type=float, default=0.8, help="spread of answer lengths (lognormal)")
    args = parser.parse_args()
    document = harness.header("plan", "polars", simulator=True)
    sim = SimServerConfig(
        port=0, max_running_requests=SLOTS, ttft_s=0.0, token_latency_s=0.0002, output_sigma=args.sigma,
        output_median_by_marker=tuple((f"[{s}]", m) for s, m in MEDIANS.items()),
    )
    identity = Identity(model=sim.model_name, simulated=True, fingerprint="bench-plan")
    with tempfile.TemporaryDirectory() as root, FleetProcess([sim]) as fleet:
        store = CompletionStore(Path(root))
        earlier = run(fleet.urls[0], store, items(identity, 0, args.prompts, args.cap), sim.model_name)
        rate = earlier.output_tokens / earlier.elapsed_s
        observed = Observed(identity.owns)
        list(observed.reading(store.latest_records(digest=True)))
        work = items(identity, args.prompts, args.prompts, args.cap)
        from_store = plan_for(work, observed, rate)
        from_estimate = plan_for(work, Observed(identity.owns), rate)
        before = disk_bytes(Path(root))
        actual = run(fleet.urls[0], store, work, sim.model_name)
        grown = disk_bytes(Path(root)) - before
        failed = sum(1 for _ in store.records(SHARD, status=FAILED))
    truncated = actual.finish_reasons["length"] / actual.ok
    rows = {
        "output tokens": (from_store.output_tokens, from_estimate.output_tokens, actual.output_tokens),
        "share cut at the cap": (round(from_store.truncated_share, 4), round(from_estimate.truncated_share, 4), round(truncated, 4)),
        "store growth, bytes": (from_store.store_bytes, from_estimate.store_bytes, grown),
        "wall time, s": (round(from_store.wall_s or 0, 1), round(from_estimate.wall_s or 0, 1), round(actual.elapsed_s, 1)),
    }
    document |= {
        "prompts": args.prompts, "cap": args.cap, "sigma": args.sigma, "medians": MEDIANS, "prior": PRIOR,
        "earlier_output_tokens_per_s": round(rate, 1), "failed": failed,
        "figures": {name: {"plan_from_store": a, "plan_from_estimate": b, "actual": c,
                           "store_plan_over_actual": round(a / c, 4) if c else None}
                    for name, (a, b, c) in rows.items()},
        "plan_lines": from_store.lines(),
    }
    print("\n".join(from_store.lines()))
    print(f"{'figure (simulator)':24} {'plan: store':>12} {'plan: estimate':>15} {'actual':>10} {'store/actual':>13}")
    for name, (a, b, c) in rows.items():
        print(f"{name:24} {a:>12,} {b:>15,} {c:>10,} {a / c if c else float('nan'):>13.3f}")
    print(f"result: {harness.write_result('plan', document)}")


if __name__ == "__main__":
    main()
