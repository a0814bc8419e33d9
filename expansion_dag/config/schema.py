"""The run configuration's schema: one YAML file a user edits (``configs/default.yaml`` documents
every field).

It names the fleet, the model (and the revision of its weights) and tokenizer, the catalog, the
storage root, the generation settings and the nightly schedule. Reading the file and the
environment's overrides is ``loading.py``'s. No Dagster here: the Dagster layer builds its
resources from this.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import re
import urllib.parse
import zoneinfo
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from expansion_dag.core import (
    DEFAULT_TOKENIZER,
    RETRYABLE_CONTENT,
    ModeError,
    ModeMix,
    SamplingSettings,
    fleet_state_dir,
)
from expansion_dag.training import FORMATS

CONFIG_ENV = "EXPANSION_CONFIG"
DEFAULT_CONFIG = "default"
MASK = "***"
#: A streamed event every 64 tokens instead of every token (both servers' default): a network read
#: costs the client far more than the parsing, so its CPU per answer falls with the events, while a
#: loop is stopped only as an event comes. Replayed on the real model's loops, 64 stops them 91
#: tokens sooner than 256, and smaller events hardly sooner (the rules' own copies are the rest),
#: for about 0.5 ms of client CPU an event (BENCHMARKS.md, the stream interval).
DEFAULT_STREAM_INTERVAL = 64


class ConfigError(ValueError):
    """The run configuration is invalid; the message names the file (or variable) and the key."""


def bundled_config_path(name: str = DEFAULT_CONFIG) -> Path:
    return Path(str(importlib.resources.files("expansion_dag") / "configs" / f"{name}.yaml"))


def schema_default(model: type[BaseModel], name: str) -> Any:
    """The default the schema states for ``model``'s field ``name``: for a model that takes a
    schema field under its own name (a resource, a resolved setting), so the value is said once."""
    return model.model_fields[name].get_default(call_default_factory=True)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerationConfig(BaseModel):
    """How prompts are budgeted, sampled, retried and turned into training samples.

    The ``generation`` section of the file; the Dagster ``settings`` resource has these fields too.
    """

    model_config = ConfigDict(extra="forbid")

    max_output_tokens: int = Field(default=8192, ge=1, description="Cap on max_tokens; each prompt's budget is computed.")
    min_output_tokens: int = Field(default=256, ge=1, description="Prompts leaving less room are set aside.")
    margin: int = Field(default=16, ge=0, description="Tokens kept free against tokenizer disagreement.")
    expected_output_tokens: int = Field(
        default=1024, ge=1, description="Prior answer length for balancing and ordering."
    )
    expected_output_by_source: dict[str, int] = Field(
        default={}, description="Per-source prior answer lengths, overriding expected_output_tokens."
    )
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    top_p: float = Field(default=0.8, gt=0.0, le=1.0)
    top_k: int = Field(default=20, ge=-1, description="-1 turns top-k off.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: Optional[int] = None
    chat_template_kwargs: str = Field(
        default="{}",
        description='JSON object passed to the chat template, e.g. {"enable_thinking": false}; '
        "a mapping in the file.",
    )
    modes: str = Field(
        default="[]",
        description="JSON list of generation modes (a list in the file), each {name, weight} and the sampling "
        "fields or chat_template_kwargs it changes; each prompt is drawn into one. Empty: one mode, these settings.",
    )
    mode_seed: int = Field(default=0, description="Seed of each prompt's draw among the modes.")
    request_timeout_s: float = Field(default=1800.0, gt=0)
    max_attempts: int = Field(default=5, ge=1)
    first_output_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="How long the canary (streamed) waits for its first text before its server fails it; also "
        "each request's allowance for waiting and prefill within its deadline (comments and keep-alives count "
        "for nothing).",
    )
    weights_reprobe_s: float = Field(
        default=1800.0,
        ge=0,
        description="How often a shard's run asks its server the weights' probe again; an answer other than at "
        "the run's start (its first tokens) stops the shard. 0: never.",
    )
    deadline_slack: float = Field(
        default=4.0,
        ge=1,
        description="A request's deadline is first_output_timeout_s plus this many times its max_tokens at the "
        "per-stream speed measured on its server (until measured: max_output_tokens / request_timeout_s tokens a "
        "second); past it the request fails as the server's.",
    )
    backoff_initial_s: float = Field(
        default=1.0,
        ge=0,
        description="The first wait before a request is sent again; each next wait doubles, up to 30 s (or this, "
        "if longer), with up to this much jitter (expansion_dag/config/derived.py).",
    )
    # list[str], not of a Literal: Dagster's resource config takes no Literal inside a list.
    retry_outcomes: list[str] = Field(
        default=[],
        description="Final answers a re-run asks again: 'degenerate' (answers stopped as loops, kept for "
        "inspection). Empty: a prompt the model answered, however, is never sent again under the same settings.",
    )
    max_failure_rate: float = Field(default=0.01, ge=0.0, le=1.0, description="A shard fails above this failure rate.")
    max_truncation_rate: float = Field(
        default=0.2, ge=0.0, le=1.0, description="Warn above this rate of finish_reason length."
    )
    min_yield: float = Field(
        default=0.5, ge=0.0, le=1.0,
        description="The yield gate: a shard whose first yield_gate_answers answers give fewer training rows than "
        "this share stops, naming the cause and the fix (a verdict on the answers, never on a server). 0: off.",
    )
    yield_gate_answers: int = Field(
        default=64, ge=1, description="Answers of a shard the yield gate waits for before it judges."
    )
    plan_output_tokens_per_s: Optional[float] = Field(
        default=None, ge=0,
        description="The plan's output tokens a second per server where live servers do not say it "
        "(/v1/loads gen_throughput of a busy SGLang server). null: only what the servers say.",
    )
    progress_interval_s: float = Field(default=5.0, gt=0, description="Seconds between a shard's progress reports.")
    spill_to_idle_servers: bool = Field(
        default=True,
        description="Send queued prompts to other fleet servers while they report idle slots (end-of-run balance).",
    )
    owner_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="Seconds a shard waits for another server's own shard to start before borrowing its idle slots.",
    )
    drop_truncated: bool = Field(default=True, description="Leave answers cut at max_tokens out of the training set.")
    reasoning: Literal["keep", "drop"] = Field(
        default="keep", description="'keep' reasoning in the assistant turn or 'drop' it."
    )
    min_sample_tokens: int = Field(default=16, ge=0, description="Shorter training samples are left out.")
    training_formats: list[str] = Field(
        default=["parquet", "specforge-conversations"],
        description="Outputs of the training set, written in one pass: parquet (always), specforge-pretokenized, "
        "specforge-conversations, speculators-pretokenized.",
    )
    training_build_workers: int = Field(
        default=1,
        ge=1,
        description="Processes that build the training set's new parts side by side (each part once: a "
        "rebuild builds only the parts whose records are new).",
    )
    train_newline_after_end_of_turn: bool = Field(
        default=False,
        description="Train the newline after the end-of-turn token, as SpecForge's and speculators' own "
        "renderers do; false: only what the model writes is trained.",
    )
    stop_degenerate: bool = Field(
        default=True,
        description="Stream each answer and end it as soon as it loops (a 'degenerate' failure, text kept); "
        "false sends plain requests and never stops an answer.",
    )
    loop_prefix: Literal["keep", "drop"] = Field(
        default="keep",
        description="'keep': the text an answer stopped as a loop wrote before its loop is a training row, cut "
        "after the loop's first copy on a token of its own (truncated: loop); 'drop': no row (docs/generation.md).",
    )
    loop_retries: int = Field(
        default=0,
        ge=0,
        le=1,
        description="Ask a prompt whose answer was stopped as a loop once more, with another seed (0: the stop is final).",
    )
    loop_min_span_chars: int = Field(default=1, ge=1, description="Shortest repeated span that counts as a loop.")
    loop_min_repeats: int = Field(default=4, ge=2, description="Back-to-back repeats of the span that make a loop.")
    loop_min_chars: int = Field(default=400, ge=1, description="Characters the repeats must cover together.")
    loop_window_chars: int = Field(default=8192, ge=1, description="How far back from the end a loop is looked for.")

    @pydantic.field_validator("retry_outcomes")
    @classmethod
    def _known_outcomes(cls, outcomes: list[str]) -> list[str]:
        unknown = sorted(set(outcomes) - set(RETRYABLE_CONTENT))
        if unknown:
            raise ValueError(f"unknown outcome(s) {unknown}: retry_outcomes takes {list(RETRYABLE_CONTENT)}")
        return outcomes

    @pydantic.field_validator("training_formats")
    @classmethod
    def _known_formats_parquet_always(cls, formats: list[str]) -> list[str]:
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            raise ValueError(f"unknown {', '.join(map(repr, unknown))}; known: {', '.join(FORMATS)}")
        if "parquet" not in formats:
            raise ValueError("must include 'parquet': the set's checks and its dataset card read it")
        return formats

    @pydantic.field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs_as_json(cls, value: Any) -> str:
        """A mapping (the file) or JSON object text (the launchpad), kept as canonical JSON text."""
        return _canonical_json(value, Mapping, "a mapping (a JSON object)", "{}")

    @pydantic.field_validator("modes", mode="before")
    @classmethod
    def _modes_as_json(cls, value: Any) -> str:
        """A list (the file) or JSON list text (the launchpad), kept as canonical JSON text."""
        return _canonical_json(value, list | tuple, "a list of modes", "[]")

    @pydantic.model_validator(mode="after")
    def _modes_valid(self) -> GenerationConfig:
        try:
            self.mix()
        except ModeError as exc:
            raise ValueError(str(exc)) from None
        return self

    def sampling(self) -> SamplingSettings:
        """The run's sampling settings (the one mode's, without modes)."""
        return SamplingSettings(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            chat_template_kwargs_json=self.chat_template_kwargs,
            max_output_tokens=self.max_output_tokens,
        )

    def mix(self) -> ModeMix:
        """The run's generation modes and each prompt's draw among them."""
        return ModeMix.of(json.loads(self.modes), self.sampling(), self.mode_seed)


def _canonical_json(value: Any, kind: Any, expected: str, empty: str) -> str:
    """``value``, or the JSON text it is, checked to be ``kind`` and written as canonical JSON text:
    settings given as structures in the file and as text on the launchpad compare equal."""
    if isinstance(value, str):
        try:
            value = json.loads(value or empty)
        except ValueError:
            raise ValueError(f"not JSON: {value!r}") from None
    if not isinstance(value, kind):
        raise ValueError(f"must be {expected}, got {value!r}")
    return json.dumps(dict(value) if isinstance(value, Mapping) else list(value), sort_keys=True)


class ModelConfig(_Section):
    path: str = Field(default="Qwen/Qwen3-8B", min_length=1)
    revision: Optional[str] = Field(default=None, min_length=1)
    tokenizer: str = Field(default=DEFAULT_TOKENIZER, min_length=1)


class LeaseSettings(BaseModel):
    """How a run holds a shard's lease (``expansion_dag/store/lease.py``): the ``storage`` section's and
    the storage resource's, validated here once."""

    lease_timeout_s: float = Field(
        default=120.0,
        ge=1.0,
        le=86400.0,
        description="A shard's lease whose holder has not renewed it for this long is taken over.",
    )
    when_shard_busy: Literal["wait", "fail"] = Field(
        default="wait",
        description="When another run holds the shard's lease: wait for it, then send what is still missing, or fail.",
    )
    shard_busy_wait_s: float = Field(
        default=3600.0,
        gt=0.0,
        le=7 * 86400.0,
        description="when_shard_busy: wait gives up after this long (the run fails naming the holder): the "
        "waiting run's servers are up and idle meanwhile.",
    )


class StorageSettings(LeaseSettings):
    """The ``storage`` section's fields that the storage resource has too (its root it is always given)."""

    local_dir: Optional[str] = Field(
        default=None,
        description="This machine's spool, cache and staging for a remote root; it must outlive runs. "
        "None: ~/.cache/expansion_dag (expansion_dag.core.default_local_dir).",
    )
    training_set_versions: int = Field(
        default=3,
        ge=1,
        description="Versions of the training set kept, the current one included; older ones are removed.",
    )


class StorageConfig(_Section, StorageSettings):
    root: str = Field(default="./storage", min_length=1)


class LaunchConfig(_Section):
    command: Optional[str] = None
    host: str = "127.0.0.1"
    base_port: int = Field(default=30000, ge=1, le=65535)
    gpus: list[int] = []
    scope: Literal["fleet", "run"] = "fleet"
    context_length: int = Field(default=8192, ge=2)
    max_running_requests: int = Field(default=16, ge=1)
    #: None: SIMULATOR_STARTUP_TIMEOUT_S for the simulator, else SERVER_STARTUP_TIMEOUT_S.
    startup_timeout_s: Optional[float] = Field(default=None, gt=0)
    run_tags_file: Optional[str] = None


class FleetConfig(_Section):
    mode: Literal["simulate", "attach", "launch"] = "simulate"
    shards: int = Field(default=2, ge=1, le=999)
    urls: list[str] = []
    backend: Literal["sglang", "vllm"] = "sglang"
    slots: Optional[int] = Field(default=None, ge=1)
    stream_interval: int = Field(default=DEFAULT_STREAM_INTERVAL, ge=1)
    tool_call_parser: Optional[str] = Field(default=None, min_length=1)
    api_key_env: str = Field(default="SGLANG_API_KEY", min_length=1)
    fallback_to_healthy: bool = True
    launch: LaunchConfig = LaunchConfig()

    @pydantic.field_validator("urls")
    @classmethod
    def _urls_are_http(cls, urls: list[str]) -> list[str]:
        for url in urls:
            parsed = urllib.parse.urlsplit(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"{mask_url(url)!r} is not an http(s) URL")
        return [u.rstrip("/") for u in urls]

    @pydantic.model_validator(mode="after")
    def _attach_has_a_server_per_shard(self) -> FleetConfig:
        if self.mode == "attach" and len(self.urls) < self.shards:
            raise ValueError(
                f"attach mode needs one URL per shard: {len(self.urls)} URL(s) in urls for {self.shards} shard(s)"
            )
        return self


#: sglang's own launcher; placeholders are filled per server. Flags drift between sglang versions,
#: so the whole command is configuration, not code. With an API key set, ``--api-key {api_key}`` is
#: added (see ``FleetResource.command``): SGLang reads its key from that flag only.
SGLANG_LAUNCH_COMMAND = (
    "python -m sglang.launch_server --model-path {model_path} --host {host} --port {port} "
    "--context-length {context_length} --stream-interval {stream_interval}"
)
#: The simulator takes the same flags, plus its own time model, so launch mode is exercised as is.
SIMULATOR_LAUNCH_COMMAND = (
    "{python} -m expansion_dag.sim --model-path {model_path} --host {host} --port {port} "
    "--context-length {context_length} --max-running-requests {max_running_requests} "
    "--stream-interval {stream_interval} --token-latency-ms 1 "
    "--output-median-tokens 160 --warmup-s 0.5"
)


#: How long a launched server may take to answer /health (``fleet.launch.startup_timeout_s: null``).
SIMULATOR_STARTUP_TIMEOUT_S = 120.0
SERVER_STARTUP_TIMEOUT_S = 900.0


def _fleet(name: str) -> Any:
    return schema_default(FleetConfig, name)


def _launch(name: str) -> Any:
    return schema_default(LaunchConfig, name)


class FleetSettings(BaseModel):
    """The fleet as a run uses it, resolved from the ``fleet`` section (``simulate`` is ``launch``
    with the simulator's command: ``expansion_dag/config/derived.py``): the fields of the Dagster
    fleet resource, validated here; each default is the section's own."""

    mode: Literal["launch", "attach"] = Field(default="launch", description="'launch' starts one server per GPU; 'attach' uses `urls`.")
    urls: list[str] = Field(default=_fleet("urls"), description="Attach mode: base URLs, one per shard, in shard order.")
    backend: Literal["sglang", "vllm"] = Field(
        default=_fleet("backend"), description="'sglang' or 'vllm' (OpenAI-compatible server)."
    )
    launch_command: str = Field(
        default=SGLANG_LAUNCH_COMMAND,
        description="Launch mode: command per server; placeholders {model_path} {host} {port} {gpu} "
        "{context_length} {max_running_requests} {stream_interval} {tool_call_parser} {python} {api_key}. With an API "
        "key set and no {api_key} in it, '--api-key {api_key}' is appended.",
    )
    model_path: str = schema_default(ModelConfig, "path")
    model_revision: Optional[str] = Field(
        default=schema_default(ModelConfig, "revision"),
        description="Names the weights (a commit, a tag, a fine-tune's name) in each answer's identity: change it "
        "when other weights are served at the same path. None: only what the folder and servers tell.",
    )
    context_length: int = Field(
        default=_launch("context_length"),
        description="Launch parameter only; budgets always use the probed context length.",
    )
    max_running_requests: int = Field(
        default=_launch("max_running_requests"),
        description="Launch parameter {max_running_requests}; requests in flight follow the probed slots.",
    )
    stream_interval: int = Field(
        default=_fleet("stream_interval"),
        ge=1,
        description="Tokens per streamed event: vLLM requests ask for it, launched SGLang servers get "
        "it as --stream-interval {stream_interval}; an attached SGLang server streams at its own.",
    )
    tool_call_parser: Optional[str] = Field(
        default=_fleet("tool_call_parser"),
        description="The servers' tool-call parser (e.g. SGLang 'qwen25', vLLM 'hermes' for Qwen3), so that "
        "tool calls come back parsed in message.tool_calls; None: raw <tool_call> text in the content. "
        "Launch mode adds the backend's flags to the command (SGLang --tool-call-parser, vLLM "
        "--enable-auto-tool-choice --tool-call-parser) unless it names {tool_call_parser}; attach mode "
        "states what the vLLM servers were started with (SGLang reports its own).",
    )
    host: str = _launch("host")
    base_port: int = _launch("base_port")
    gpus: list[int] = Field(default=_launch("gpus"), description="Launch mode: one server per GPU; default 0..shards-1.")
    launch_scope: Literal["fleet", "run"] = Field(
        default=_launch("scope"),
        description="Launch mode: 'fleet' starts every server on this machine; 'run' starts one "
        "server on this run's own GPU (a GPU pod per shard run on Kubernetes).",
    )
    num_servers: int = Field(default=_fleet("shards"), description="Launch mode, when `gpus` is empty.")
    api_key_env: str = Field(
        default=_fleet("api_key_env"), description="Name of the environment variable holding the API key, if any."
    )
    startup_timeout_s: float = SERVER_STARTUP_TIMEOUT_S
    slots_override: Optional[int] = Field(
        default=_fleet("slots"),
        description="The file's fleet.slots: running-request slots per server; None: as the server reports "
        "them, or as the launch command passes them (vLLM reports none).",
    )
    fallback_to_healthy: bool = Field(
        default=_fleet("fallback_to_healthy"), description="Run a shard on a healthy server when its own server is down."
    )
    state_dir: str = Field(
        default=fleet_state_dir(os.path.abspath(schema_default(StorageConfig, "root"))),
        description="Records, locks and logs of launched servers: this machine's, under local_dir, one "
        "folder per host and storage root, never in the root (expansion_dag.core.fleet_state_dir).",
    )


class ScheduleConfig(_Section):
    cron: str = "0 2 * * *"
    timezone: str = "UTC"
    quota: int = Field(default=1000, ge=1)

    @pydantic.field_validator("cron")
    @classmethod
    def _five_fields(cls, cron: str) -> str:
        if len(cron.split()) != 5 or not re.fullmatch(r"[\d*/,\-\sA-Za-z]+", cron):
            raise ValueError(f"must be a cron expression of five fields, got {cron!r}")
        return cron

    @pydantic.field_validator("timezone")
    @classmethod
    def _known_timezone(cls, name: str) -> str:
        try:
            zoneinfo.ZoneInfo(name)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {name!r}") from None
        return name


class RunConfig(_Section):
    """The whole file, resolved: every field has its value, from the file, a variable or a default."""

    fleet: FleetConfig = FleetConfig()
    model: ModelConfig = ModelConfig()
    catalog: str = Field(default="samples", min_length=1)
    storage: StorageConfig = StorageConfig()
    generation: GenerationConfig = GenerationConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    #: Where it was read from (not a key of the file).
    source: str = Field(default="", exclude=True)

    def storage_root(self) -> str:
        """The root as an absolute path (relative to the working directory) or a URL as written."""
        root = self.storage.root
        return root if "://" in root else os.path.abspath(os.path.expanduser(root))

    def masked(self) -> dict[str, Any]:
        """The resolved configuration as plain data, with any password in a URL masked."""
        data = self.model_dump(mode="json")
        data["fleet"]["urls"] = [mask_url(u) for u in data["fleet"]["urls"]]
        data["storage"]["root"] = mask_url(data["storage"]["root"])
        data["generation"]["chat_template_kwargs"] = json.loads(data["generation"]["chat_template_kwargs"])
        data["generation"]["modes"] = json.loads(data["generation"]["modes"])
        return data

    def digest(self) -> str:
        """A short hash of the masked configuration: equal digests, equal configurations."""
        canonical = json.dumps(self.masked(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def mask_url(url: str) -> str:
    """``url`` with its password, if it has one, as ``***``. Read as written, not parsed: a URL
    that does not parse (a bad port, a stray bracket) is masked all the same."""
    scheme, sep, rest = url.partition("://")
    end = min([i for i in map(rest.find, "/?#") if i >= 0] or [len(rest)])
    userinfo, at, host = rest[:end].rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.partition(':')[0]}:{MASK}@{host}{rest[end:]}"


def mask_urls(text: str) -> str:
    """``text`` with the password of every URL in it masked (``mask_url``): for messages that quote
    what a user wrote, such as pydantic's, which repeat its input."""
    return re.sub(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+", lambda m: mask_url(m.group()), text)
