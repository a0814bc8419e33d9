"""Generation: the engine that keeps every server's slots full, its queue and borrowing, the
recorder, conversations, learned answer lengths, the yield gate, a shard's plan, report and progress.
"""

from expansion_dag.generation.answer_lengths import (
    AnswerLengths,
    Estimate,
    bucket_label,
    cell_estimates,
    learn,
    prompt_bucket,
    prompt_features,
)
from expansion_dag.generation.answer_yield import AnswerYield, YieldGate
from expansion_dag.generation.borrowing import OWNER_NOT_STARTED
from expansion_dag.generation.conversations import Ended, TurnPlanner, turn_id
from expansion_dag.generation.dispatch import PromptQueue, Turn, WorkItem, WorkLeft, claim_share
from expansion_dag.generation.engine import ShardRun, generate_shard
from expansion_dag.generation.engine_config import EngineConfig, Server, WeightsWatch
from expansion_dag.generation.plan import MIN_OBSERVED, Observed, Plan, Throughput, expected_per_prompt, make_plan
from expansion_dag.generation.progress import (
    ObservationThrottle,
    ProgressDisplay,
    ShardProgress,
    quiet_third_party,
    render_line,
    render_table,
    retry_summary,
    silence_retry_logging,
    speed_line,
)
from expansion_dag.generation.recorder import ended_record
from expansion_dag.generation.shard_figures import ShardFigures, shard_figures
from expansion_dag.generation.shard_report import Progress, ServerStats, ShardReport, spearman
from expansion_dag.generation.shard_work import ShardWork, prompt_keys
from expansion_dag.generation.speed import MIN_ANSWERS, ShardPlan, Speed, SpeedMeter, outlook

__all__ = [
    "AnswerLengths", "AnswerYield", "Ended", "EngineConfig", "Estimate", "MIN_ANSWERS", "MIN_OBSERVED",
    "OWNER_NOT_STARTED", "ObservationThrottle", "Observed", "Plan", "Progress", "ProgressDisplay", "PromptQueue",
    "Server", "ServerStats", "ShardFigures", "ShardPlan", "ShardProgress", "ShardReport", "ShardRun", "ShardWork",
    "Speed", "SpeedMeter", "Throughput", "Turn", "TurnPlanner", "WorkLeft", "WorkItem", "YieldGate", "bucket_label",
    "cell_estimates", "claim_share", "ended_record", "expected_per_prompt", "generate_shard", "learn", "make_plan",
    "outlook", "prompt_bucket", "prompt_features", "prompt_keys", "quiet_third_party", "render_line", "render_table",
    "retry_summary", "shard_figures", "silence_retry_logging", "spearman", "speed_line", "turn_id", "WeightsWatch",
]
