"""``expansion-dag``: run the whole expansion on the Dagster instance, and manage the fleet.

``expansion-dag run`` is the main job: the prepare run (sources, prompts, budgets), then one run
per shard, all shards at once as a UI backfill would launch them, then the training-set run.
Every run is recorded in the Dagster instance under ``$DAGSTER_HOME`` (``./.dagster_home`` when
unset, with this repository's ``dagster.yaml``), so ``dagster dev`` shows them afterwards. The run
configuration is ``--config FILE``, else ``$EXPANSION_CONFIG``, else the bundled demo file.
While the shards run, their progress is one live table (one line per interval when the output is
not a terminal). Servers the run launched are stopped at the end, on failure, on Ctrl-C and on
SIGTERM, unless ``--keep-fleet`` or another command or run still uses them (docs/operations.md:
who owns the fleet). An error a user can cause (the configuration, its variables, the
catalog, the fleet, the storage, a busy shard) ends the command as one ``expansion-dag: ...`` line,
exit 2 (``expansion_dag.cli.user_errors``); ``--debug`` or ``$EXPANSION_DEBUG=1`` shows its traceback.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expansion_dag.cli.user_errors import (
    DEBUG_ENV,
    USER_ERRORS,
    check_before_run,
    check_storage,
    debugging,
    hide_stack_traces,
    one_line,
    step_cause,
)
from expansion_dag.config import (
    CONFIG_ENV,
    SIMULATOR_LAUNCH_COMMAND,
    RunConfig,
    current_config,
    load_config,
    storage_settings,
)
from expansion_dag.generation import (
    ProgressDisplay,
    ShardProgress,
    quiet_third_party,
    retry_summary,
)
from expansion_dag.servers import BACKENDS

if TYPE_CHECKING:
    from upath import UPath

    from expansion_dag.servers import FleetInfo

DEFAULT_HOME = ".dagster_home"
#: How often the shard table is redrawn from the instance.
DISPLAY_INTERVAL_S = 1.0
#: After SIGINT, how long shard processes get to record their run's end before they are killed.
SHARD_STOP_GRACE_S = 20.0
#: The steps of ``expansion-dag run``, in order, as :func:`run_expansion` names them to its ``stage``.
STAGES = ("prepare", "generate", "training_set")
#: Runs one step, ``stage(name, step)``, and returns what ``step()`` returns.
Stage = Callable[[str, Callable[[], Any]], Any]


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached ``expansion-dag``: stop what it started, then exit."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def prepare_dagster_home() -> Path:
    """Use $DAGSTER_HOME, else ./.dagster_home seeded with the project's dagster.yaml."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / DEFAULT_HOME).resolve()
    home.mkdir(parents=True, exist_ok=True)
    project_yaml = Path(__file__).resolve().parents[2] / "dagster.yaml"
    if not (home / "dagster.yaml").exists() and project_yaml.exists():
        shutil.copy(project_yaml, home / "dagster.yaml")
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def use_config(path: str | None) -> None:
    """Make ``path`` (or ``$EXPANSION_CONFIG``, or the bundled file) this process's and its children's.

    Validated here, so a bad file stops the command before anything starts, naming the key.
    """
    if path:
        load_config(path)  # a missing file or a bad key is an error now, not in a shard
        os.environ[CONFIG_ENV] = str(Path(path).expanduser().resolve())
    current_config()


def _execute(job_name: str, partition_key: str | None = None, log_level: str = "INFO",
             run_id: str | None = None) -> tuple[str, bool, str]:
    """Run one job in this process against the instance; returns (run id, success, what failed)."""
    import dagster as dg

    from expansion_dag.definitions import defs

    job = defs.resolve_job_def(job_name)
    with dg.DagsterInstance.get() as instance:
        result = job.execute_in_process(
            instance=instance,
            partition_key=partition_key,
            run_id=run_id,
            raise_on_error=False,
            run_config={"loggers": {"console": {"config": {"log_level": log_level}}}},
        )
    failures = [
        f"{e.step_key}: {step_cause(e.event_specific_data.error)}"  # type: ignore[union-attr]
        for e in result.all_events
        if e.is_step_failure and e.event_specific_data is not None
    ]
    return result.run_id, result.success, "; ".join(failures)


def _shard_main(key: str, run_id: str, out: Connection) -> None:
    """One shard's run in its own process, as the daemon launches one run per partition."""
    quiet_third_party()
    hide_stack_traces()
    # SIGTERM ends the run as Ctrl-C does, as Dagster's own run workers map it: the shard's lease
    # is released and the run recorded as ended.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # Warnings and errors only: the parent's table shows the progress.
    out.send(_execute("generate_job", key, log_level="WARNING", run_id=run_id))


class _Signals:
    """While active, SIGINT and SIGTERM raise ``Interrupted`` in the main thread, so ``finally``
    blocks stop what was started; later signals are ignored until the stop is done."""

    def __init__(self) -> None:
        self.received: int | None = None

    def _interrupt(self, signum: int, frame: Any) -> None:
        self.received = signum
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    def check(self) -> None:
        """Raise again a signal that a library caught on its way (Dagster ends a run on it)."""
        if self.received is not None:
            raise Interrupted(self.received)

    @contextmanager
    def active(self) -> Iterator[_Signals]:
        previous = {sig: signal.signal(sig, self._interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


#: Observations of a shard read back at once: its own run's latest is among them, whatever another
#: run of the shard (one this run waits for) observed since.
OBSERVATIONS_READ = 100


def _latest_progress(instance: Any, shard: str, since: float, run_id: str) -> ShardProgress | None:
    """The latest progress that run ``run_id`` of ``shard`` observed; None: none yet (among the latest read)."""
    import dagster as dg

    records = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("completions"), asset_partitions=[shard], after_timestamp=since),
        limit=OBSERVATIONS_READ,
    ).records
    observed = next((r.asset_observation for r in records if r.run_id == run_id and r.asset_observation), None)
    return None if observed is None else ShardProgress.from_metadata({k: v.value for k, v in observed.metadata.items()})


def _run_shards(keys: list[str]) -> dict[str, tuple[str, bool, str]]:
    """Every shard at once, one process each, with their progress shown as one table."""
    import dagster as dg

    context = multiprocessing.get_context("spawn")
    started = time.time()
    processes: dict[str, tuple[multiprocessing.process.BaseProcess, Connection]] = {}
    results: dict[str, tuple[str, bool, str]] = {}
    display = ProgressDisplay()
    figures: dict[str, ShardProgress | None] = {key: None for key in keys}
    # Named here, so that the table shows each shard's own run, not another run of the shard.
    run_ids = {key: str(uuid.uuid4()) for key in keys}
    try:
        for key in keys:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_shard_main, args=(key, run_ids[key], send),
                                      name=f"expansion-dag {key}")
            process.start()
            send.close()
            processes[key] = (process, receive)
        with dg.DagsterInstance.get() as instance:
            while len(results) < len(keys):
                for key, (process, receive) in processes.items():
                    if key in results:
                        continue
                    if receive.poll():
                        results[key] = receive.recv()
                    elif not process.is_alive():
                        results[key] = ("-", False, f"the shard's process exited with {process.exitcode}")
                    figures[key] = _latest_progress(instance, key, started, run_ids[key]) or figures[key]
                states = {
                    key: "running" if key not in results else ("done" if results[key][1] else "FAILED") for key in keys
                }
                display.update(states, figures, final=len(results) == len(keys))
                if len(results) < len(keys):
                    time.sleep(DISPLAY_INTERVAL_S)
        print(retry_summary(figures), flush=True)
        return results
    finally:
        _stop_processes([p for p, _ in processes.values()])


def _stop_processes(processes: list[multiprocessing.process.BaseProcess]) -> None:
    """SIGINT first (the run records its end), then SIGKILL after a grace period."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        os.kill(process.pid, signal.SIGINT)  # type: ignore[arg-type]
    deadline = time.monotonic() + SHARD_STOP_GRACE_S
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


@contextmanager
def _own_fleet(keep: bool) -> Iterator[None]:
    """This command uses the fleet while it runs, and owns the servers it and its runs launch: at
    its end it stops them, unless ``keep`` or another command or run uses them (which then owns
    them). Servers it did not launch it leaves as they are."""
    import secrets

    from expansion_dag.definitions import defs
    from expansion_dag.servers import OWNER_ENV

    os.environ[OWNER_ENV] = secrets.token_hex(8)  # this command's, and its shards' processes'
    fleet = defs.resources["fleet"]
    fleet.use()
    try:
        yield
    finally:
        stopped, left_to = fleet.release(keep)
        if stopped:
            print(f"stopped {len(stopped)} launched server(s)", flush=True)
        if left_to:
            print(f"left the server(s) this command launched running for {'; '.join(left_to)}, which "
                  "stops them when it ends", flush=True)


def run(args: argparse.Namespace) -> int:
    return run_expansion(args.config, keep_fleet=args.keep_fleet, retry_outcomes=args.retry_outcomes)


def run_expansion(
    config: str | None = None,
    *,
    keep_fleet: bool = False,
    retry_outcomes: str | None = None,
    stage: Stage | None = None,
) -> int:
    """``expansion-dag run``: the prepare run, every shard, the training-set run; its exit status.

    ``config`` as ``--config``; ``stage`` runs each of :data:`STAGES` (``stage(name, step)`` returns
    ``step()``), where a benchmark measures them. Call it in a process of its own: the shards'
    partitions are read from the configuration when the definitions are first imported.
    """
    if retry_outcomes is not None:
        # Through the environment, like every single-field override: the shards' processes see it too.
        os.environ["EXPANSION_RETRY_OUTCOMES"] = retry_outcomes
    use_config(config)
    home = prepare_dagster_home()
    quiet_third_party()
    run_config = current_config()
    print(f"Dagster instance: {home}\nrun configuration: {run_config.source} (digest {run_config.digest()})",
          flush=True)  # fmt: skip
    _check_before_run()
    try:
        with _Signals().active() as signals, _own_fleet(keep_fleet):
            return _run_all(signals, stage or (lambda _name, step: step()))
    except Interrupted as exc:
        print(f"interrupted by {exc}; finished completions are kept", flush=True)
        return 128 + exc.signum


def _check_before_run() -> None:
    from expansion_dag.definitions import defs
    from expansion_dag.defs import SHARD_KEYS

    check_before_run(defs.resources["storage"], defs.resources["fleet"], SHARD_KEYS)


def _run_all(signals: _Signals, stage: Stage) -> int:
    from expansion_dag.definitions import defs
    from expansion_dag.defs import SHARD_KEYS

    run_id, ok, why = stage("prepare", lambda: _execute("prepare_job"))
    signals.check()
    print(f"prepare_job run {run_id}: {'success' if ok else 'FAILED ' + why}", flush=True)
    _print_plan(run_id)  # before the first request: what the run will send, cost and yield
    if not ok:
        return 1
    root = current_config().storage_root()
    root_before = _identity(root)
    shard_results = stage("generate", lambda: _run_shards(SHARD_KEYS))
    failed = []
    for key, (run_id, ok, why) in shard_results.items():
        print(f"generate_job[{key}] run {run_id}: {'success' if ok else 'FAILED ' + why}", flush=True)
        if not ok:
            failed.append(key)
    if failed and _identity(root) != root_before:
        # Removed during the run (rm -rf), whatever made a folder there since: nothing it wrote is kept.
        print(f"the storage root {root} was removed during the run: what it wrote went with it. Run again "
              "to start over.", flush=True)
        return 1
    if failed:
        print(
            f"{len(failed)} shard(s) failed; their finished completions are kept. Re-run "
            "`expansion-dag run` (or backfill the failed partitions in the UI) to send only the rest.",
            flush=True,
        )
        return 1
    run_id, ok, why = stage("training_set", lambda: _execute("training_set_job"))
    signals.check()
    print(f"training_set_job run {run_id}: {'success' if ok else 'FAILED ' + why}", flush=True)
    if not ok:
        return 1
    _print_summary(defs.resources["storage"].path("training_set"))
    return 0


def _identity(root: str) -> tuple[int, int] | None:
    """Which folder a local root is (device, inode); None: a remote root, or none there."""
    try:
        found = os.stat(root) if "://" not in root else None
    except FileNotFoundError:
        return None
    return (found.st_dev, found.st_ino) if found is not None else None


def plan(args: argparse.Namespace) -> int:
    """Prepare (sources, prompts, budgets; nothing generated) and print what the run will send, cost and yield."""
    use_config(args.config)
    check_storage(storage_settings(current_config())["root"])
    prepare_dagster_home()
    quiet_third_party()
    with _own_fleet(args.keep_fleet):
        run_id, ok, why = _execute("prepare_job", log_level="WARNING")
        if not ok and not why:
            # No step failed: a resource did as the run started, the fleet's probe when nobody
            # answers. The prompts need no server: prepared alone, they are what can still be printed.
            why = _fleet_problem()
            run_id = _prepare_prompts_only()
    _print_plan(run_id)
    if not ok:
        print(f"plan: incomplete, the prepare run failed: {why}", flush=True)
    return 0 if ok else 1


def _fleet_problem() -> str:
    from expansion_dag.core import FleetError
    from expansion_dag.definitions import defs

    try:
        defs.resources["fleet"].probe()
    except FleetError as exc:
        return f"the fleet: {exc}"
    return "a resource failed as the run started (see the log above)"


def _prepare_prompts_only() -> str:
    """The prepare job's sources and prompts, without the budget (which needs the servers); its run id."""
    import dagster as dg

    from expansion_dag.definitions import defs

    # What budgeted_prompts stands on (the sources, the prompts), from the assets' own specs.
    deps = {spec.key: [dep.asset_key for dep in spec.deps] for spec in defs.resolve_all_asset_specs()}
    keys, todo = set(), list(deps[dg.AssetKey("budgeted_prompts")])
    while todo:
        key = todo.pop()
        if key not in keys:
            keys.add(key)
            todo += deps[key]
    job = defs.resolve_job_def("prepare_job")
    with dg.DagsterInstance.get() as instance:
        result = job.execute_in_process(
            instance=instance, asset_selection=sorted(keys), raise_on_error=False,
            run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
        )
    return result.run_id


def _print_plan(run_id: str) -> None:
    """The plan the budget of run ``run_id`` made; where the budget failed, what its prompts say."""
    import dagster as dg

    found = {}
    with dg.DagsterInstance.get() as instance:
        for name in ("budgeted_prompts", "prompts"):
            event = instance.get_latest_materialization_event(dg.AssetKey(name))
            if event is not None and event.run_id == run_id and event.asset_materialization is not None:
                found[name] = event.asset_materialization.metadata
    if "budgeted_prompts" in found:
        print(str(found["budgeted_prompts"]["plan"].value).strip("`\n"), flush=True)
    elif "prompts" in found:
        by_source = found["prompts"]["prompts_by_source"].value
        print(f"plan: prompts by source after dedup and quotas: {by_source}; not budgeted (see the failure): "
              "no tokens, time or cost", flush=True)
    else:
        print("plan: no prompts were extracted (see the failure): nothing to plan", flush=True)


def _print_summary(out_dir: UPath) -> None:
    from expansion_dag.training import Manifest, current_version

    # The version's own folder, which no later build changes (storage.md: the training set's versions).
    version = current_version(out_dir)
    manifest = Manifest.read(version)
    made_from = " (built from SIMULATED answers: not training data)" if manifest.simulated else ""
    print(
        f"training set{made_from}: {version}\n  {manifest.samples:,} samples, {manifest.tokens:,} tokens "
        f"({manifest.assistant_tokens:,} trained on), mean {manifest.tokens_per_sample['mean']:,.0f} "
        f"tokens per sample; left out: {manifest.left_out}",
        flush=True,
    )
    for source, figures in sorted(manifest.by_source.items()):
        print(f"  {source}: {figures['samples']:,} samples, {figures['tokens']:,} tokens", flush=True)


def mirrored_fleet(config: RunConfig, urls: list[str], *, backend: str | None, api_key: str | None) -> FleetInfo:
    """The real fleet a dry run mirrors, probed as the run would probe it: with the slots the
    configuration gives (vLLM reports none)."""
    from expansion_dag.servers import probe_fleet

    return probe_fleet(
        urls, backend=backend or config.fleet.backend, api_key=api_key, slots_override=config.fleet.slots,
        stream_interval=config.fleet.stream_interval,
    )


def dry_run(args: argparse.Namespace) -> int:
    """Prove a configuration on simulators that mirror a real fleet, before GPU hours are spent."""
    from expansion_dag.servers import dialect_for

    use_config(args.config)
    config = current_config()
    urls = [u.strip() for u in args.mirror.split(",") if u.strip()] if args.mirror else list(config.fleet.urls)
    if not urls:
        print("dry-run: no servers to mirror: pass --mirror URLS or name fleet.urls in the configuration", file=sys.stderr)
        return 2
    api_key = os.environ.get(args.api_key_env or config.fleet.api_key_env) or None
    real = mirrored_fleet(config, urls, backend=args.backend, api_key=api_key)
    slots = {s.slots for s in real.servers}
    # The simulators speak the real servers' dialect (what they return, token ids included), as the
    # oldest version of it, which the simulator emulates.
    server = real.servers[0]
    dialect = dialect_for(server.backend, server.version)
    emulated = f"--backend {server.backend}" + (f" --emulate-version {dialect.since}" if dialect.since else "")
    print(
        f"mirroring {len(urls)} server(s): model {real.model_path}, context {real.context_length}, "
        f"slots {sorted(slots)}, {server.backend} {server.version} (token ids "
        f"{'returned' if dialect.token_ids else 'not returned: rows re-tokenized'}); generating on SIMULATED "
        f"servers with those settings, as {server.backend} {dialect.since or 'of the newest version'}",
        flush=True,
    )
    os.environ.update(
        {
            "EXPANSION_LAUNCH_COMMAND": f"{SIMULATOR_LAUNCH_COMMAND} {emulated}",
            "EXPANSION_BACKEND": server.backend,
            "EXPANSION_PROFILE": "local",
            # Its own storage: simulated answers must never sit beside real ones.
            "EXPANSION_STORAGE": os.environ.get("EXPANSION_DRY_RUN_STORAGE", os.path.abspath("storage-dry-run")),
            "EXPANSION_SHARDS": str(len(urls)),
            "EXPANSION_MODEL_PATH": real.model_path,
            "EXPANSION_SIM_CONTEXT_LENGTH": str(real.context_length),
            "EXPANSION_SIM_SLOTS": str(max(slots)),
        }
    )
    os.environ.pop("EXPANSION_FLEET_URLS", None)  # the mirrored servers are probed, never sent a request
    args.config = None  # already in $EXPANSION_CONFIG
    return run(args)


def fleet(args: argparse.Namespace) -> int:
    use_config(args.config)
    prepare_dagster_home()
    from expansion_dag.definitions import defs

    resource = defs.resources["fleet"]
    if args.action == "stop":
        from expansion_dag.core import FleetError

        try:
            print(f"stopped {len(resource.stop(say=print))} server(s)")
        except FleetError as exc:  # in use: a run still needs it
            print(f"expansion-dag: {exc}", file=sys.stderr)
            return 1
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


def _retry_outcomes_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--retry-outcomes",
        metavar="OUTCOME[,OUTCOME]",
        help="ask again prompts whose final answer had these outcomes (degenerate: stopped as a loop); "
        "default: generation.retry_outcomes",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="expansion-dag", description=__doc__.splitlines()[0],
        epilog=f"An error a user can cause ends as one 'expansion-dag: ...' line, exit 2; --debug (any command) "
        f"or ${DEBUG_ENV}=1 shows its traceback.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    config_help = f"run configuration YAML (default: ${CONFIG_ENV}, else the bundled demo file)"
    run_parser = sub.add_parser("run", help="materialize every asset and every shard")
    run_parser.add_argument("--config", help=config_help)
    run_parser.add_argument("--keep-fleet", action="store_true", help="leave launched servers running")
    _retry_outcomes_option(run_parser)
    run_parser.set_defaults(func=run)
    dry_parser = sub.add_parser("dry-run", help="run everything on simulators mirroring a real fleet")
    dry_parser.add_argument("--config", help=config_help)
    dry_parser.add_argument("--mirror", help="comma-separated URLs of the real servers (default: fleet.urls)")
    dry_parser.add_argument("--backend", choices=BACKENDS, help="default: fleet.backend")
    dry_parser.add_argument("--api-key-env", help="default: fleet.api_key_env")
    dry_parser.add_argument("--keep-fleet", action="store_true", help="leave launched simulators running")
    _retry_outcomes_option(dry_parser)
    dry_parser.set_defaults(func=dry_run)
    plan_parser = sub.add_parser("plan", help="print what a run will send, cost and yield, before any GPU time")
    plan_parser.add_argument("--config", help=config_help)
    plan_parser.add_argument("--keep-fleet", action="store_true", help="leave launched servers running")
    plan_parser.set_defaults(func=plan)
    fleet_parser = sub.add_parser("fleet", help="start, probe or stop the configured fleet")
    fleet_parser.add_argument("action", choices=["start", "status", "stop"])
    fleet_parser.add_argument("--config", help=config_help)
    fleet_parser.set_defaults(func=fleet)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true",
                             help=f"show the traceback of an error a user can cause (also ${DEBUG_ENV}=1)")
    args = parser.parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # the shards' processes too
    hide_stack_traces()
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        if debugging():
            raise
        print(f"expansion-dag: {one_line(str(exc)) or type(exc).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
