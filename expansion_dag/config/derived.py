"""What the layers below are given, from the validated run configuration.

The schema states every default once; the layers below state none and take their values from
here. A value the file does not name is derived here, and said: the fleet as a run uses it
(``simulate`` is ``launch`` with the simulator's command), the engine's waits between attempts,
the margin and floor of a context-length retry, the yield gate's cap, and which finish reasons
let a conversation go on.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from expansion_dag.config.schema import (
    SERVER_STARTUP_TIMEOUT_S,
    SGLANG_LAUNCH_COMMAND,
    SIMULATOR_LAUNCH_COMMAND,
    SIMULATOR_STARTUP_TIMEOUT_S,
    FleetSettings,
    GenerationConfig,
    RunConfig,
)
from expansion_dag.core import ModeIdentities, SamplingSettings, default_local_dir, fleet_state_dir
from expansion_dag.generation import EngineConfig, TurnPlanner, YieldGate
from expansion_dag.prompts import BudgetConfig
from expansion_dag.servers import LoopThresholds, RetryPolicy
from expansion_dag.training import TrainingSetConfig

#: The longest wait between two attempts of a request, unless ``backoff_initial_s`` is longer.
BACKOFF_MAX_S = 30.0
#: How long a prompt may wait in all on its server's full queue (backpressure) before the queue-full
#: answer is its failure; such waits use none of its attempts.
BACKPRESSURE_WAIT_S = 600.0
#: A turn that ended so lets its conversation go on; with ``drop_truncated: false``, a cut one too.
FINISHED = ("stop", "tool_calls")


def fleet_settings(config: RunConfig) -> FleetSettings:
    """The fleet resource's fields: ``simulate`` launches the simulator (its command and its
    startup timeout), and launched servers keep their records and logs on this machine, outside
    the root (``expansion_dag.core.fleet_state_dir``)."""
    fleet, launch = config.fleet, config.fleet.launch
    simulate = fleet.mode == "simulate"
    return FleetSettings(
        mode="attach" if fleet.mode == "attach" else "launch",
        urls=list(fleet.urls) if fleet.mode == "attach" else [],
        backend=fleet.backend,
        launch_command=launch.command or (SIMULATOR_LAUNCH_COMMAND if simulate else SGLANG_LAUNCH_COMMAND),
        model_path=config.model.path,
        model_revision=config.model.revision,
        context_length=launch.context_length,
        max_running_requests=launch.max_running_requests,
        host=launch.host,
        base_port=launch.base_port,
        gpus=list(launch.gpus),
        launch_scope=launch.scope,
        num_servers=fleet.shards,
        api_key_env=fleet.api_key_env,
        startup_timeout_s=launch.startup_timeout_s
        or (SIMULATOR_STARTUP_TIMEOUT_S if simulate else SERVER_STARTUP_TIMEOUT_S),
        slots_override=fleet.slots,
        stream_interval=fleet.stream_interval,
        tool_call_parser=fleet.tool_call_parser,
        fallback_to_healthy=fleet.fallback_to_healthy,
        state_dir=fleet_state_dir(config.storage_root(), local_dir(config)),
    )


def local_dir(config: RunConfig) -> str:
    """This machine's folder for a remote root's spool, caches and staging: ``storage.local_dir``,
    else ``expansion_dag.core.default_local_dir``'s."""
    return config.storage.local_dir or default_local_dir()


def storage_settings(config: RunConfig) -> dict[str, Any]:
    """The storage resource's fields (the root resolved: ``RunConfig.storage_root``)."""
    storage = config.storage
    return {
        "root": config.storage_root(),
        "local_dir": local_dir(config),
        "lease_timeout_s": storage.lease_timeout_s,
        "when_shard_busy": storage.when_shard_busy,
        "shard_busy_wait_s": storage.shard_busy_wait_s,
        "training_set_versions": storage.training_set_versions,
    }


def sampling_settings(generation: GenerationConfig, **changes: Any) -> SamplingSettings:
    """The run's sampling settings (``generation.sampling()``) with ``changes`` (a test's or a
    benchmark's)."""
    return dataclasses.replace(generation.sampling(), **changes)


def engine_config(generation: GenerationConfig, **changes: Any) -> EngineConfig:
    """How hard a shard's engine pushes its servers and when it gives up; ``changes``: settings
    of ``generation`` (what the engine's own objects are built from) or fields of the engine's
    own, set otherwise (a test's or a benchmark's)."""
    g = generation.model_copy(update={k: v for k, v in changes.items() if k in GenerationConfig.model_fields})
    own = {k: v for k, v in changes.items() if k not in GenerationConfig.model_fields}
    retry = RetryPolicy(
        attempts=g.max_attempts,
        # Each wait doubles from the first, up to BACKOFF_MAX_S, with up to the first wait of jitter.
        wait_initial_s=g.backoff_initial_s,
        wait_max_s=max(g.backoff_initial_s, BACKOFF_MAX_S),
        wait_jitter_s=g.backoff_initial_s,
        context_retry=True,
        # A context-length retry recomputes max_tokens as the budget did: with its margin, and
        # never under the budget's floor.
        margin=g.margin,
        min_output_tokens=g.min_output_tokens,
        backpressure_wait_s=BACKPRESSURE_WAIT_S,
    )
    loop = LoopThresholds(
        min_span_chars=g.loop_min_span_chars, min_repeats=g.loop_min_repeats, min_chars=g.loop_min_chars,
        window_chars=g.loop_window_chars,
    )
    derived = dict(
        request_timeout_s=g.request_timeout_s,
        retry=retry,
        first_output_timeout_s=g.first_output_timeout_s,
        deadline_slack=g.deadline_slack,
        # Before a server's speed is measured: the speed at which the longest answer allowed takes one
        # request timeout (4.6 tokens/s at the defaults; a GPU decodes a stream at tens with its slots
        # full). A request's deadline is then at most first_output_timeout_s + deadline_slack x
        # request_timeout_s (2.1 h at the defaults), however it trickles.
        floor_stream_rate=g.max_output_tokens / g.request_timeout_s,
        progress_interval_s=g.progress_interval_s,
        loop=loop if g.stop_degenerate else None,
        loop_retries=g.loop_retries,
        owner_wait_s=g.owner_wait_s,
        # The cap is named in the gate's advice on cut answers.
        yield_gate=YieldGate(g.min_yield, g.yield_gate_answers, g.max_output_tokens),
    )
    return EngineConfig(**{**derived, **own})


def budget_config(generation: GenerationConfig, **changes: Any) -> BudgetConfig:
    """How prompts are budgeted (each mode's template arguments count its prompts' tokens);
    ``changes``: the fields set otherwise."""
    g = generation
    derived = dict(
        max_output_tokens=g.max_output_tokens,
        min_output_tokens=g.min_output_tokens,
        margin=g.margin,
        expected_output_tokens=g.expected_output_tokens,
        expected_output_by_source=dict(g.expected_output_by_source),
        chat_template_kwargs=json.loads(g.chat_template_kwargs),
        chat_template_kwargs_by_mode={m.name: m.chat_template_kwargs for m in g.mix().modes},
    )
    return BudgetConfig(**{**derived, **changes})


def turn_planner(
    generation: GenerationConfig, tokenizer: Any, context_length: int, identities: ModeIdentities
) -> TurnPlanner:
    """Budgets each next turn of a conversation as the budget stage budgets turn 1."""
    return TurnPlanner(
        tokenizer=tokenizer,
        context_length=context_length,
        identities=identities.by_mode,
        continue_on=FINISHED if generation.drop_truncated else (*FINISHED, "length"),
        **generation.model_dump(include={"max_output_tokens", "min_output_tokens", "margin"}),
    )


def training_set_config(generation: GenerationConfig, context_length: int, **changes: Any) -> TrainingSetConfig:
    """How the training set is built (rows as long as the probed context, at most); ``changes``:
    the fields set otherwise."""
    g = generation
    derived = dict(
        drop_truncated=g.drop_truncated,
        reasoning=g.reasoning,
        loop_prefix=g.loop_prefix,
        max_length=context_length,
        min_length=g.min_sample_tokens,
        formats=tuple(g.training_formats),
        train_newline_after_end_of_turn=g.train_newline_after_end_of_turn,
    )
    return TrainingSetConfig(**{**derived, **changes})
