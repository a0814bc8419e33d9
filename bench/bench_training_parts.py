"""A second night's training-set rebuild against a full one (issue 38): wall time and peak RSS.

A store of the reference run's size (193,010 records over 8 shards, one segment a shard: a local
root's night) gets a second night of 20,000 records (8 new segments). Each build runs in a process of
its own, side by side in one run:

* ``first``: the first night's set in parts, from no parts (it fills the parts folder);
* ``second``: after the second night, the set in parts with the first night's parts kept: what a
  nightly rebuild costs (only the 8 new parts are built);
* ``full``: the same store in parts from no parts: a full rebuild (a changed setting);
* ``one_pass``: the same store through ``build_training_set``, one pass, no parts: the build before
  parts, the baseline for peak RSS.

The records are ``bench_training_set.py``'s thinking-mode completions with the ids a server returns
(``bench_training_ids.ensure_ids_records``: fabricated once, untimed), so every row is built from
ids, the path of servers that return them; the store is written before anything is timed.

    .venv/bin/python bench/bench_training_parts.py                                # reference size
    .venv/bin/python bench/bench_training_parts.py --records 4000 --night 400     # smoke run

Results are printed and written as JSON under ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from bench_training_ids import ensure_ids_records  # (bench/ is on sys.path when run as a script)
from bench_training_set import bench_identities, stream_records
import harness
from harness import Clock, reset_peak, window_peak_mib

REFERENCE_RECORDS = 193_010
NIGHT_RECORDS = 20_000
SHARDS = 8
BUILDS = ("first", "second", "full", "one_pass")


def write_night(store: Any, records: list[dict[str, Any]], shards: int) -> None:
    """One night: each shard's share of ``records`` in one segment of its own, as a shard run writes it."""
    for shard in range(shards):
        with store.writer(f"shard-{shard:02d}") as writer:
            for record in records[shard::shards]:
                writer.append(record)


def phase_build(args: argparse.Namespace) -> dict[str, Any]:
    from expansion_dag.config import GenerationConfig, training_set_config
    from expansion_dag.core import load_tokenizer
    from expansion_dag.store import CompletionStore
    from expansion_dag.training import DEFAULT_MAX_LENGTH, build_training_set, build_training_set_in_parts

    tokenizer, config = load_tokenizer(), training_set_config(GenerationConfig(), DEFAULT_MAX_LENGTH)
    store = CompletionStore(args.work_dir / "store")
    out_dir = args.work_dir / f"set-{args.build}"
    parts_dir = args.work_dir / ("parts-full" if args.build == "full" else "parts")
    clock = Clock()
    reset_peak()
    with clock.span("build"):
        if args.build == "one_pass":
            manifest = build_training_set(store.latest_records(), tokenizer, config, out_dir, identities=bench_identities())
        else:
            parts, failures = store.parts()
            manifest = build_training_set_in_parts(
                parts, failures, tokenizer, config, out_dir, parts_dir=parts_dir, identities=bench_identities(),
                workers=args.workers,
            )
    return {**clock.report(), "build": args.build, "samples": manifest.samples, "tokens": manifest.tokens,
            "parts": manifest.parts, "build_peak_rss_mib": window_peak_mib()}  # fmt: skip


PHASES = {"build": phase_build}


def spawn(args: argparse.Namespace, build: str) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--phase", "build", "--build", build, "--work-dir", str(args.work_dir),
        "--workers", str(args.workers),
    ]  # fmt: skip
    return harness.run_phase(command, build, quiet_wait_s=args.quiet_wait)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=REFERENCE_RECORDS, help="the first night's records")
    p.add_argument("--night", type=int, default=NIGHT_RECORDS, help="the second night's records")
    p.add_argument("--shards", type=int, default=SHARDS)
    p.add_argument("--workers", type=int, default=1, help="processes that build new parts (default 1)")
    p.add_argument("--work-dir", type=Path, default=None, help="where the store and the builds go (default: --data-dir)")
    p.add_argument("--build", choices=BUILDS, help=argparse.SUPPRESS)  # the child's side
    harness.add_phase_options(p, PHASES, quiet_wait_s=5.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.phase:
        harness.run_phase_here(PHASES[args.phase], args, preload=("polars", "expansion_dag.core.tokenizer", "expansion_dag.training"))
        return 0
    args.data_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir = (args.work_dir or args.data_dir) / f"parts-{args.records}-{args.night}"
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    document = harness.header("training_parts", *harness.DATA_PACKAGES, simulator=False, argv=argv)
    # The records of both nights, with ids (generated and fabricated once, cached under --data-dir).
    args.records, first_night = args.records + args.night, args.records
    records = list(stream_records(ensure_ids_records(args)))
    args.records = first_night
    from expansion_dag.store import CompletionStore

    store = CompletionStore(args.work_dir / "store")
    write_night(store, records[: args.records], args.shards)
    results = {"first": spawn(args, "first")}
    write_night(store, records[args.records :], args.shards)
    del records
    for build in BUILDS[1:]:
        results[build] = spawn(args, build)
    for build, result in results.items():
        print(f"{build:>9}: {result['wall_s']['build']:8.1f} s  {result['samples']:>9,} rows  "
              f"{result['tokens']:>13,} tokens  peak RSS {result['build_peak_rss_mib']:8.1f} MiB  parts {result['parts']}",
              flush=True)  # fmt: skip
    wall = {build: result["wall_s"]["build"] for build, result in results.items()}
    summary = {
        "second_over_full": round(wall["second"] / wall["full"], 4),
        "second_over_one_pass": round(wall["second"] / wall["one_pass"], 4),
        "full_over_one_pass": round(wall["full"] / wall["one_pass"], 4),
        "peak_rss_mib": {build: result["build_peak_rss_mib"] for build, result in results.items()},
    }
    print(json.dumps(summary, indent=2))
    document.update({
        "settings": {"records": args.records, "night": args.night, "shards": args.shards, "workers": args.workers,
                     "seed": args.seed, "config": "the run configuration's defaults"},
        "summary": summary,
        "builds": results,
    })  # fmt: skip
    print(f"\nwritten {harness.write_result('training_parts', document, out_dir=args.out)}")
    shutil.rmtree(args.work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
