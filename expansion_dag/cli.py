"""``expansion-dag``: run the whole expansion on the Dagster instance, and manage the fleet.

``expansion-dag run`` is the main job: the prepare run (sources, prompts, budgets), then one run
per shard, all shards at once as a UI backfill would launch them, then the training-set run.
Every run is recorded in the Dagster instance under ``$DAGSTER_HOME`` (``./.dagster_home`` when
unset, with this repository's ``dagster.yaml``), so ``dagster dev`` shows them afterwards.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from upath import UPath

DEFAULT_HOME = ".dagster_home"


def prepare_dagster_home() -> Path:
    """Use $DAGSTER_HOME, else ./.dagster_home seeded with the project's dagster.yaml."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / DEFAULT_HOME).resolve()
    home.mkdir(parents=True, exist_ok=True)
    project_yaml = Path(__file__).resolve().parent.parent / "dagster.yaml"
    if not (home / "dagster.yaml").exists() and project_yaml.exists():
        shutil.copy(project_yaml, home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def _execute(job_name: str, partition_key: str | None = None) -> tuple[str, bool, str]:
    """Run one job in this process against the instance; returns (run id, success, what failed)."""
    import dagster as dg

    from expansion_dag.definitions import defs

    job = defs.resolve_job_def(job_name)
    with dg.DagsterInstance.get() as instance:
        result = job.execute_in_process(
            instance=instance,
            partition_key=partition_key,
            raise_on_error=False,
            run_config={"loggers": {"console": {"config": {"log_level": "INFO"}}}},
        )
    failures = [
        f"{e.step_key}: {e.event_specific_data.error.message.strip().splitlines()[0]}"  # type: ignore[union-attr]
        for e in result.all_events
        if e.is_step_failure and e.event_specific_data is not None
    ]
    return result.run_id, result.success, "; ".join(failures)


def run(args: argparse.Namespace) -> int:
    home = prepare_dagster_home()
    from expansion_dag.definitions import defs
    from expansion_dag.partitions import SHARD_KEYS

    print(f"Dagster instance: {home}", flush=True)
    run_id, ok, why = _execute("prepare_job")
    print(f"prepare_job run {run_id}: {'success' if ok else 'FAILED ' + why}", flush=True)
    if not ok:
        return 1
    # One process per shard, as the daemon launches one run per partition of a backfill.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=len(SHARD_KEYS), mp_context=context) as pool:
        futures = {key: pool.submit(_execute, "generate_job", key) for key in SHARD_KEYS}
        shard_results = {key: f.result() for key, f in futures.items()}
    failed = []
    for key, (run_id, ok, why) in shard_results.items():
        print(f"generate_job[{key}] run {run_id}: {'success' if ok else 'FAILED ' + why}", flush=True)
        if not ok:
            failed.append(key)
    if failed:
        print(
            f"{len(failed)} shard(s) failed; their finished completions are kept. Re-run "
            "`expansion-dag run` (or backfill the failed partitions in the UI) to send only the rest.",
            flush=True,
        )
    else:
        run_id, ok, why = _execute("training_set_job")
        print(f"training_set_job run {run_id}: {'success' if ok else 'FAILED ' + why}", flush=True)
        if ok:
            _print_summary(defs.resources["storage"].path("training_set"))
        failed = [] if ok else ["training_set"]
    if not args.keep_fleet:
        stopped = defs.resources["fleet"].stop()
        if stopped:
            print(f"stopped {len(stopped)} launched server(s)", flush=True)
    return 1 if failed else 0


def _print_summary(out_dir: UPath) -> None:
    from expansion_dag.training_set import Manifest

    manifest = Manifest.read(out_dir)
    print(
        f"training set: {out_dir}\n  {manifest.samples:,} samples, {manifest.tokens:,} tokens "
        f"({manifest.assistant_tokens:,} trained on), mean {manifest.tokens_per_sample['mean']:,.0f} "
        f"tokens per sample; left out: {manifest.left_out}",
        flush=True,
    )
    for source, figures in sorted(manifest.by_source.items()):
        print(f"  {source}: {figures['samples']:,} samples, {figures['tokens']:,} tokens", flush=True)


def dry_run(args: argparse.Namespace) -> int:
    """Prove a configuration on simulators that mirror a real fleet, before GPU hours are spent."""
    from expansion_dag.fleet import probe_fleet

    urls = [u.strip() for u in args.mirror.split(",") if u.strip()]
    api_key = os.environ.get(args.api_key_env) or None
    real = probe_fleet(urls, backend=args.backend, api_key=api_key)
    slots = {s.slots for s in real.servers}
    print(
        f"mirroring {len(urls)} server(s): model {real.model_path}, context {real.context_length}, "
        f"slots {sorted(slots)}; generating on SIMULATED servers with those settings",
        flush=True,
    )
    prepare_dagster_home()
    os.environ.update(
        {
            "EXPANSION_PROFILE": "local",
            # Its own storage: simulated answers must never sit beside real ones.
            "EXPANSION_STORAGE": os.environ.get("EXPANSION_DRY_RUN_STORAGE", os.path.abspath("storage-dry-run")),
            "EXPANSION_SHARDS": str(len(urls)),
            "EXPANSION_SIM_MODEL_PATH": real.model_path,
            "EXPANSION_SIM_CONTEXT_LENGTH": str(real.context_length),
            "EXPANSION_SIM_SLOTS": str(max(slots)),
        }
    )
    return run(args)


def fleet(args: argparse.Namespace) -> int:
    prepare_dagster_home()
    from expansion_dag.definitions import defs

    resource = defs.resources["fleet"]
    if args.action == "stop":
        print(f"stopped {len(resource.stop())} server(s)")
        return 0
    if args.action == "start":
        info = resource.provision()
    else:
        info = resource.probe()
    for server in info.servers:
        kind = "simulator" if server.simulator else server.backend
        print(
            f"{server.url}: {kind} {server.version}, model {server.model_path}, "
            f"context {server.context_length}, {server.slots} slots"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="expansion-dag", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="materialize every asset and every shard")
    run_parser.add_argument("--keep-fleet", action="store_true", help="leave launched servers running")
    run_parser.set_defaults(func=run)
    dry_parser = sub.add_parser("dry-run", help="run everything on simulators mirroring a real fleet")
    dry_parser.add_argument("--mirror", required=True, help="comma-separated URLs of the real servers to mirror")
    dry_parser.add_argument("--backend", default="sglang", choices=["sglang", "vllm"])
    dry_parser.add_argument("--api-key-env", default="SGLANG_API_KEY")
    dry_parser.add_argument("--keep-fleet", action="store_true", help="leave launched simulators running")
    dry_parser.set_defaults(func=dry_run)
    fleet_parser = sub.add_parser("fleet", help="start, probe or stop the configured fleet")
    fleet_parser.add_argument("action", choices=["start", "status", "stop"])
    fleet_parser.set_defaults(func=fleet)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
