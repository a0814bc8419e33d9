"""The event loop's lag while a shard streams, with the disk slowed to 200 ms an fsync (issue 45,
item 8), this tree beside a baseline tree (SIMULATOR).

Every figure is a SIMULATOR figure (``expansion_dag.sim``), never a GPU one. One shard of
``--requests`` prompts goes to one simulated SGLang server of ``--slots`` slots (a process of its
own) as ``generate_shard`` sends it: a ``ShardRun`` on its own event loop (streamed, loops
stopped, no canary, so the flood starts at once), its store writer fsyncing every 2 s (the asset's
default) and a progress report every second. ``os.fsync`` on the store's files is slowed by
``--fsync-ms`` (a sleep before the real one): a disk that takes 200 ms to sync. A probe task on the
same loop sleeps ``--probe-ms`` again and again and records how late it wakes: the loop's lag,
which every stream, timer and progress report on it waits out too.

Each tree (``--tree``: the folder whose ``expansion_dag`` a child process imports; this checkout by
default, and ``--baseline``, e.g. a worktree of ca92c16: ``git worktree add /tmp/base ca92c16``)
runs in a child process of its own, rounds alternating. Reported per run: the worst lag, and the
worst among the probes asleep while a slowed fsync ran (the disk's share: on a shared machine other
programs delay a probe at any time), the 99th percentile, the probes later than 50 ms and 200 ms, the fsyncs
slowed, the makespan and the client process's CPU per request (its writer thread's included).

    .venv/bin/python bench/bench_loop_lag.py --baseline /tmp/base     # ~3 min on 2 cores
    .venv/bin/python bench/bench_loop_lag.py --quick --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import RESULT_MARK, ROOT, emit, header, write_result  # (bench/ is on sys.path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--slots", type=int, default=72)
    p.add_argument("--token-latency-ms", type=float, default=2.0, help="simulator time model: per output token")
    p.add_argument("--fsync-ms", type=float, default=200.0, help="added to every fsync of the store's files")
    p.add_argument("--probe-ms", type=float, default=10.0, help="the probe's sleep")
    p.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternating")
    p.add_argument("--baseline", type=Path, help="the tree measured beside this one")
    p.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)  # the child's side
    p.add_argument("--quick", action="store_true", help="a smoke run: 600 requests, one round")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return p


# ---------------------------------------------------------------------------------------------
# The child: one run of the shard on one tree


def slow_fsync(folder: Path, delay_s: float, spans: list[tuple[float, float]]) -> None:
    """Make ``os.fsync`` of the files under ``folder`` take ``delay_s`` more; each one's span goes to ``spans``."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        try:
            store_file = os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder))
        except OSError:
            store_file = False
        start = time.monotonic()
        if store_file:
            time.sleep(delay_s)
        real_fsync(fd)
        if store_file:
            spans.append((start, time.monotonic()))

    os.fsync = fsync


def child(args: argparse.Namespace) -> dict[str, Any]:
    import expansion_dag
    from expansion_dag.config import GenerationConfig, engine_config, sampling_settings
    from expansion_dag.generation import Server, ShardRun, WorkItem
    try:  # a baseline tree from before the client ran on asyncio's own loop
        from expansion_dag.servers import run_ticked
    except ImportError:
        run_ticked = None
    from expansion_dag.store import CompletionStore

    folder = Path(tempfile.mkdtemp(prefix="bench-loop-lag-"))
    fsyncs: list[tuple[float, float]] = []
    slow_fsync(folder, args.fsync_ms / 1000, fsyncs)
    items = [
        WorkItem(key=f"k{i:06d}", prompt_id=f"p{i:06d}", source="s",
                 messages=[{"role": "user", "content": f"Question {i}: tell me about topic {i}."}],
                 prompt_tokens=16, max_tokens=2000, expected_output_tokens=200)
        for i in range(args.requests)
    ]  # fmt: skip
    config = engine_config(GenerationConfig(), canary=False, progress_interval_s=1.0)
    interval = args.probe_ms / 1000
    lags: list[tuple[float, float]] = []  # (when the probe slept, how late it woke)
    reports: list[Any] = []

    async def main() -> Any:
        store = CompletionStore(folder)
        with store.writer("shard-00", fsync_interval_s=2.0) as writer:
            run = ShardRun(items, [Server(args.url, args.slots, stream_interval=256)], writer=writer, model="m",
                           sampling=sampling_settings(GenerationConfig()), config=config, on_progress=reports.append)
            task = asyncio.create_task(run.run())
            while not task.done():
                before = time.monotonic()
                await asyncio.sleep(interval)
                lags.append((before, time.monotonic() - before - interval))
            return await task

    cpu, wall = time.process_time(), time.monotonic()
    report = asyncio.run(main()) if run_ticked is None else run_ticked(main(), tick_s=config.client_tick_s)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    ordered = sorted(lag for _, lag in lags)
    # The probes asleep while a slowed fsync ran: the disk's share of the lag, apart from the
    # machine's (other programs on a shared machine delay a probe at any time).
    during = [lag for at, lag in lags if any(at < end and start < at + interval + lag for start, end in fsyncs)]
    return {
        "package": str(Path(expansion_dag.__file__).parent),
        "requests_ok": report.ok,
        "fsyncs_slowed": len(fsyncs),
        "progress_reports": len(reports),
        "probes": len(lags),
        "worst_lag_ms": round(1000 * ordered[-1], 1),
        "worst_lag_during_an_fsync_ms": round(1000 * max(during, default=0.0), 1),
        "probes_during_an_fsync": len(during),
        "p99_lag_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1),
        "median_lag_ms": round(1000 * statistics.median(ordered), 2),
        "probes_over_50ms": sum(lag > 0.05 for lag in ordered),
        "probes_over_200ms": sum(lag > 0.2 for lag in ordered),
        "makespan_s": round(wall, 2),
        "client_cpu_ms_per_request": round(1000 * cpu / max(1, report.ok), 3),
    }


# ---------------------------------------------------------------------------------------------
# The parent: the fleet, the rounds, the table


def run_tree(tree: Path, url: str, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--url", url, "--tree", str(tree),
               "--requests", str(args.requests), "--slots", str(args.slots), "--fsync-ms", str(args.fsync_ms),
               "--probe-ms", str(args.probe_ms)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"the run on {tree} failed:\n{done.stderr[-4000:]}")
    [line] = [x for x in done.stdout.splitlines() if x.startswith(RESULT_MARK)]
    return json.loads(line[len(RESULT_MARK) :])


def main() -> None:
    args = _parser().parse_args()
    if args.url:
        emit(child(args))
        return
    if args.quick:
        args.requests, args.rounds = 600, 1
    trees = {"this tree": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    document = header("loop_lag", simulator=True) | {"trees": {k: str(v) for k, v in trees.items()}, "runs": []}
    from expansion_dag.sim import FleetProcess, SimServerConfig

    server = SimServerConfig(port=0, max_running_requests=args.slots, ttft_s=0.02,
                             token_latency_s=args.token_latency_ms / 1000, output_median_tokens=200,
                             output_sigma=0.6, stream_interval=256)  # fmt: skip
    with FleetProcess([server]) as fleet:
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                fleet.wait_idle()
                result = run_tree(tree, fleet.urls[0], args) | {"tree": name, "round": round_}
                assert result["package"] == str(tree / "expansion_dag"), result["package"]
                document["runs"].append(result)
                print(json.dumps(result), flush=True)
    path = write_result("loop_lag", document, out_dir=args.out)
    print(f"SIMULATOR figures; result: {path}")
    for name in trees:
        runs = [r for r in document["runs"] if r["tree"] == name]
        print(f"{name}: worst lag ms {[r['worst_lag_ms'] for r in runs]}, during an fsync "
              f"{[r['worst_lag_during_an_fsync_ms'] for r in runs]}, p99 {[r['p99_lag_ms'] for r in runs]}, "
              f"CPU ms/request {[r['client_cpu_ms_per_request'] for r in runs]}")


if __name__ == "__main__":
    main()
