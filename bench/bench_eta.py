"""The end a run foretells, against when it ends (issue 50): at 10%, 25% and 50% of the prompts
done, the end said from the tokens the answers teach are left (``PromptQueue.work_left``: learned
lengths, running answers as lower bounds) beside the baseline, the end said from the plan's tokens
(the configured prior) less those made (``outlook`` without the tokens left, as before issue 50),
and the prompts' rate. Every figure is a SIMULATOR figure, never a GPU one.

One simulated server (a process of its own, ``--slots`` slots), answer lengths lognormal by source
(``--sigma``, a long tail), a cap of ``--cap``; a fresh store, so nothing is learned before the run.
The configured prior is wrong by ``--prior-factors`` (each a run: 0.5 says half the true mean of
every source, 2 twice it). Both estimates are computed from the same progress reports of the same
run, side by side.

    .venv/bin/python bench/bench_eta.py                 # ~5 min on 2 shared cores
    .venv/bin/python bench/bench_eta.py --prompts 600   # a smoke run
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import harness

from expansion_dag.config import GenerationConfig, engine_config, sampling_settings
from expansion_dag.core import Identity
from expansion_dag.generation import Progress, Server, ShardPlan, WorkItem, generate_shard, outlook
from expansion_dag.sim import FleetProcess, SimServerConfig
from expansion_dag.store import CompletionStore

#: Median answer length by source: short answers, maths, code, long chat.
MEDIANS = {"alpaca": 150, "math": 300, "code": 500, "chat": 700}
SHARES = (0.10, 0.25, 0.50)
SHARD = "shard-00"


def true_mean(median: int, sigma: float, cap: int) -> float:
    """A lognormal's mean cut at ``cap``: what the prior would say if it were right."""
    mu = math.log(median)
    z = (math.log(cap) - mu) / sigma
    normal = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    return math.exp(mu + sigma**2 / 2) * normal(z - sigma) + cap * (1 - normal(z))


def items(identity: Identity, n: int, cap: int, priors: dict[str, int]) -> list[WorkItem]:
    sources = list(MEDIANS)
    out = []
    for i in range(n):
        source = sources[i % len(sources)]
        pid = f"p{i:06d}"
        out.append(WorkItem(
            key=identity.key(pid), prompt_id=pid, source=source,
            messages=[{"role": "user", "content": f"[{source}] Question {i}: say something about topic {i}."}],
            prompt_tokens=20, max_tokens=cap, expected_output_tokens=priors[source],
        ))
    return out


def said(progress: Progress, plan: ShardPlan, *, learned: bool) -> float | None:
    """The end said at this report (seconds from the start): now + the time to finish."""
    if progress.speed is None:
        return None
    ahead = outlook(progress.speed, plan, answered_tokens=progress.answered_tokens,
                    answers=progress.done - progress.failed, left=progress.total - progress.done,
                    tokens_left=progress.work.tokens if learned and progress.work is not None else None,
                    drain_tokens=progress.work.drain_tokens if learned and progress.work is not None else 0.0)
    return progress.elapsed_s + ahead.finish_s if ahead is not None else None


def one_run(
    url: str, model: str, work: list[WorkItem], interval_s: float, slots: int
) -> tuple[list[Progress], float, int]:
    reports: list[Progress] = []
    config = engine_config(GenerationConfig(), progress_interval_s=interval_s, canary=False)
    with tempfile.TemporaryDirectory() as root:
        store = CompletionStore(Path(root))
        with store.writer(SHARD) as writer:
            report = generate_shard(work, [Server(url, slots)], writer=writer, model=model,
                                    sampling=sampling_settings(GenerationConfig()), config=config,
                                    on_progress=reports.append)
    return reports, report.elapsed_s, report.generated_output_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4000)
    parser.add_argument("--slots", type=int, default=72)
    parser.add_argument("--cap", type=int, default=4096)
    parser.add_argument("--sigma", type=float, default=1.2, help="spread of answer lengths (lognormal)")
    parser.add_argument("--token-latency-ms", type=float, default=1.5)
    parser.add_argument("--prior-factors", type=float, nargs="+", default=[0.5, 2.0])
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between progress reports")
    args = parser.parse_args()
    document = harness.header("eta", simulator=True)
    sim = SimServerConfig(
        port=0, max_running_requests=args.slots, ttft_s=0.0, token_latency_s=args.token_latency_ms / 1000,
        output_sigma=args.sigma, output_median_by_marker=tuple((f"[{s}]", m) for s, m in MEDIANS.items()),
    )
    identity = Identity(model=sim.model_name, simulated=True, fingerprint="bench-eta")
    means = {s: true_mean(m, args.sigma, args.cap) for s, m in MEDIANS.items()}
    runs = []
    with FleetProcess([sim]) as fleet:
        for factor in args.prior_factors:
            priors = {s: max(1, round(m * factor)) for s, m in means.items()}
            work = items(identity, args.prompts, args.cap, priors)
            # The baseline's plan: the configured prior per prompt (its mean, as the plan's is).
            plan = ShardPlan(float(sum(min(args.cap, w.expected_output_tokens) for w in work)))
            reports, ended, tokens = one_run(fleet.urls[0], sim.model_name, work, args.interval_s, args.slots)
            rows = {}
            for share in SHARES:
                report = next(p for p in reports if p.done >= share * p.total)
                new, old = said(report, plan, learned=True), said(report, plan, learned=False)
                rate = report.elapsed_s + report.eta_s if report.eta_s is not None else None
                # The run's output tokens said then: made, decoding, left (the baseline: the plan's).
                made = report.answered_tokens + (report.speed.in_flight_tokens if report.speed else 0.0)
                total = made + report.work.tokens if report.work is not None else None
                rows[f"{share:.0%}"] = {
                    "at_s": round(report.elapsed_s, 1),
                    "learned_end_s": new and round(new, 1), "baseline_end_s": old and round(old, 1),
                    "rate_end_s": rate and round(rate, 1),
                    "learned_error": new and round(new / ended - 1, 4),
                    "baseline_error": old and round(old / ended - 1, 4),
                    "rate_error": rate and round(rate / ended - 1, 4),
                    "learned_tokens_error": total and round(total / tokens - 1, 4),
                    "baseline_tokens_error": round(max(plan.output_tokens, made) / tokens - 1, 4),
                    "tokens_left_basis": report.work.basis() if report.work else None,
                }
            runs.append({"prior_factor": factor, "priors": priors, "ended_s": round(ended, 1), "output_tokens": tokens,
                         "at": rows})
            print(f"prior x{factor:g} (configured {priors}); the run ended at {ended:,.1f} s, {tokens:,} output tokens")
            print(f"  {'done':>5} {'at, s':>8} {'learned: end, error':>22} {'baseline: end, error':>22} {'rate: error':>12}"
                  f" {'tokens error: learned':>22} {'baseline':>9}")
            for share, row in rows.items():
                learned = f"{row['learned_end_s'] or 0:,.1f} {row['learned_error'] or 0:+.1%}"
                baseline = f"{row['baseline_end_s'] or 0:,.1f} {row['baseline_error'] or 0:+.1%}"
                print(f"  {share:>5} {row['at_s']:>8,.1f} {learned:>22} {baseline:>22} {row['rate_error'] or 0:>+12.1%}"
                      f" {row['learned_tokens_error'] or 0:>+22.1%} {row['baseline_tokens_error']:>+9.1%}")
    document |= {"prompts": args.prompts, "slots": args.slots, "cap": args.cap, "sigma": args.sigma,
                 "medians": MEDIANS, "true_means": {s: round(m) for s, m in means.items()}, "runs": runs}
    print(f"result: {harness.write_result('eta', document)}")


if __name__ == "__main__":
    main()
