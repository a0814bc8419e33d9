"""The core every layer stands on: errors and whose fault they are, a record's identity and status,
sampling settings and modes, outcomes, token ids, the tokenizer, storage URLs and processes.
"""

from expansion_dag.core.errors import (
    AuthError,
    BadResponseError,
    ConnectError,
    ContextCappedError,
    ContextLengthError,
    ContextMismatchError,
    ContextOverflow,
    DeadlineError,
    FleetError,
    FleetMismatchError,
    InputTooLong,
    OtherModelError,
    OversizedError,
    QueueFullError,
    RejectedError,
    RequestError,
    ServerStartError,
    ServerUnreachableError,
    ShardAborted,
    TimeoutError_,
    TransientError,
    UNWRITABLE,
    UnfinishedError,
    error_from_exception,
    unwritable,
)
from expansion_dag.core.histogram import bar_chart_png, png_data_uri
from expansion_dag.core.modes import DEFAULT_MODE, ModeError, ModeIdentities, ModeMix, base_prompt_id, parse_modes
from expansion_dag.core.outcomes import (
    CANARY_PROMPTS,
    CONTENT,
    CONTEXT_EXHAUSTED,
    ENDINGS,
    RETRYABLE_CONTENT,
    TURN_UNFINISHED,
    Breaker,
    borrowed_verdict,
    canary_verdict,
    describe,
    is_final,
    of_error,
)
from expansion_dag.core.processes import free_port_block, pid_alive, process_start
from expansion_dag.core.records import FAILED, OK, Identity, WeightsProbe, completion_key
from expansion_dag.core.sampling import SamplingSettings
from expansion_dag.core.token_ids import IDS_LEFT_OUT, OUTPUT_IDS, PROMPT_IDS, pack, record_fields, unpack
from expansion_dag.core.tokenizer import (
    DEFAULT_TOKENIZER,
    bundled_qwen3_path,
    count_prompt_tokens,
    count_tokens,
    load_tokenizer,
    render_prompts,
)
from expansion_dag.core.urls import (
    as_upath,
    auth_headers,
    default_local_dir,
    entry_name,
    fleet_state_dir,
    is_local,
    listing,
    local_path,
    server_url,
    upload,
    without_credentials,
    write_atomically,
)

__all__ = [
    "AuthError", "BadResponseError", "Breaker", "CANARY_PROMPTS", "CONTENT", "CONTEXT_EXHAUSTED", "ConnectError",
    "ContextLengthError", "ContextOverflow", "DEFAULT_MODE", "DEFAULT_TOKENIZER", "ENDINGS", "FAILED", "FleetError",
    "FleetMismatchError", "IDS_LEFT_OUT", "Identity", "InputTooLong", "ModeError", "ModeIdentities", "ModeMix", "OK",
    "OUTPUT_IDS", "PROMPT_IDS", "QueueFullError", "RETRYABLE_CONTENT", "RejectedError", "RequestError",
    "SamplingSettings", "ServerStartError", "ServerUnreachableError", "ShardAborted", "TURN_UNFINISHED",
    "TimeoutError_", "TransientError", "UNWRITABLE", "UnfinishedError", "WeightsProbe", "as_upath", "auth_headers",
    "bar_chart_png", "base_prompt_id", "borrowed_verdict", "bundled_qwen3_path", "canary_verdict", "completion_key",
    "count_prompt_tokens", "count_tokens", "default_local_dir", "describe", "entry_name", "error_from_exception",
    "fleet_state_dir", "free_port_block", "is_final", "is_local", "listing", "load_tokenizer", "local_path", "of_error",
    "pack", "parse_modes", "pid_alive", "process_start", "png_data_uri", "record_fields", "render_prompts",
    "server_url", "unpack", "unwritable", "upload", "without_credentials", "write_atomically", "ContextCappedError",
    "ContextMismatchError", "DeadlineError", "OtherModelError", "OversizedError",
]
