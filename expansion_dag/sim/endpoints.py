"""The bodies of a simulated server's probing endpoints: the model card, ``/server_info`` and
``/model_info``, SGLang's two load APIs and vLLM's ``/version``.

Apart from the scheduler whose figures they report, so that the shapes the contract fixtures
pin down read in one place.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

from packaging.version import Version

from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.dialects import Dialect, dumps
from expansion_dag.sim.http import HttpConnection, HttpRequest
from expansion_dag.sim.scheduler import Scheduler

# What the simulated GPU reports; only the shape matters to clients.
_WEIGHT_GB = 16.4
_KV_CACHE_GB = 60.0
_STARTUP_AVAILABLE_GB = 139.8
#: SGLang 0.5.23 reports graph-capture memory per phase (model_executor/graph_memory_usage.py).
_GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")
#: From this version the scheduler reports its effective slots per DP rank, and (as in 0.5.23) the
#: memory usage with graph memory per phase; before it, as 0.5.4 and 0.5.7 do.
_EFFECTIVE_SLOTS_SINCE = Version("0.5.8")
#: /get_load answers carry a timestamp from this version.
_GET_LOAD_TIC_SINCE = Version("0.5.7")


class Endpoints:
    """Answers the probing endpoints from the config and the scheduler's live figures."""

    def __init__(
        self, config: SimServerConfig, dialect: Dialect, scheduler: Scheduler, port: Callable[[], int]
    ) -> None:
        self.config = config
        self._dialect = dialect
        self._scheduler = scheduler
        self._port = port  # the server's: an ephemeral one is known once it binds
        self._version = Version(config.server_version)
        self._max_total_tokens = config.kv_capacity
        self._created = int(time.time())
        #: Load reads answered: how a client's polling treats a server.
        self.load_reads = 0

    def _record_load(self, idle: int) -> None:
        if self._scheduler.timeline is not None:
            self._scheduler.timeline.load(idle)

    def models(self, request: HttpRequest, conn: HttpConnection) -> None:
        card = self._dialect.model_card(self._created)
        conn.respond(200, dumps({"object": "list", "data": [card]}))

    def vllm_version(self, request: HttpRequest, conn: HttpConnection) -> None:
        conn.respond(200, dumps({"version": self.config.server_version}))

    def _used_tokens(self, now: float) -> int:
        """The KV tokens the running jobs hold: their prompts and the tokens produced so far."""
        ttft, latency = self.config.ttft_s, self.config.token_latency_s
        used = 0
        for job in self._scheduler.running:
            n = job.completion.completion_tokens
            produced = n if latency <= 0 else min(n, max(0, int((now - job.started_at - ttft) / latency)))
            used += job.prompt_tokens + produced
        return used

    def _gen_throughput(self) -> float:
        # Every running request emits one token per token_latency_s.
        latency = self.config.token_latency_s
        return len(self._scheduler.running) / latency if latency > 0 else 0.0

    def server_info(self, request: HttpRequest, conn: HttpConnection) -> None:
        """The server arguments the client may read, the scheduler's figures and one internal state.

        A real body carries every ServerArgs field (hundreds); the simulator sends the ones recorded
        in the contract fixtures, as a server launched with ``--context-length`` and
        ``--max-running-requests`` reports them.
        """
        c = self.config
        share = self._used_tokens(time.monotonic()) / self._max_total_tokens
        state: dict[str, Any] = {"last_gen_throughput": self._gen_throughput()}
        if self._version >= _EFFECTIVE_SLOTS_SINCE:
            state["effective_max_running_requests_per_dp"] = self._scheduler.slots
            state["memory_usage"] = {
                "weight": _WEIGHT_GB,
                "kvcache": round(_KV_CACHE_GB * share, 3),
                "startup_available": _STARTUP_AVAILABLE_GB,
                "token_capacity": self._max_total_tokens,
                "token_capacity_swa": None,
                "graph": dict.fromkeys(_GRAPH_PHASES, 0.0),
            }
        else:
            state["memory_usage"] = {
                "weight": _WEIGHT_GB,
                "kvcache": round(_KV_CACHE_GB * share, 2),
                "token_capacity": self._max_total_tokens,
                "graph": 0.0,
            }
        info = {
            "model_path": c.model_path,
            "tokenizer_path": c.tokenizer,
            "served_model_name": c.model_name,
            "host": c.host,
            "port": self._port(),
            "context_length": c.context_length,
            "max_running_requests": c.max_running_requests,
            "max_queued_requests": c.max_queued_requests,
            "max_total_tokens": c.max_total_tokens,
            "stream_interval": c.stream_interval,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "reasoning_parser": c.reasoning_parser,
            "tool_call_parser": c.tool_call_parser,
            "random_seed": c.seed,
            "weight_version": c.weight_version,
            "schedule_policy": "fcfs",
            # The scheduler's handshake; the HTTP server only starts once it is in.
            "status": "ready",
            "max_total_num_tokens": self._max_total_tokens,
            "max_req_input_len": c.max_req_input_len,
            "internal_states": [state],
            "version": c.server_version,
            "simulator": True,
        }
        conn.respond(200, dumps(info))

    def model_info(self, request: HttpRequest, conn: HttpConnection) -> None:
        c = self.config
        info = {
            "model_path": c.model_path,
            "served_model_name": c.model_name,
            "tokenizer_path": c.tokenizer,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": c.weight_version,
            "reasoning_parser": c.reasoning_parser,
            "model_type": None,
            "architectures": None,
            "simulator": True,
        }
        conn.respond(200, dumps(info))

    def loads(self, request: HttpRequest, conn: HttpConnection) -> None:
        """``/v1/loads`` (0.5.8+): one LoadSnapshot per DP rank, as ``managers/load_snapshot.py``."""
        self.load_reads += 1
        used = self._used_tokens(time.monotonic())
        running = len(self._scheduler.running)
        self._record_load(self._scheduler.slots - running - self._scheduler.num_waiting)
        load = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": self._scheduler.num_waiting,
            "num_waiting_uncached_tokens": self._scheduler.waiting_prompt_tokens,
            "num_used_tokens": used,
            "num_total_tokens": used + self._scheduler.waiting_prompt_tokens,
            "num_active_tokens": used + self._scheduler.waiting_prompt_tokens,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": self._max_total_tokens,
            "max_running_requests": self._scheduler.slots,
            "token_usage": round(used / self._max_total_tokens, 4),
            "gen_throughput": round(self._gen_throughput(), 2),
            "cache_hit_rate": 0.0,
            "utilization": round(running / self._scheduler.slots, 4),
            "total_prefill_uncached_tokens": self._scheduler.prompt_tokens_total,
            "total_prefill_busy_us": 0,
            "decode_moments": None,
            "memory": {
                "weight_gb": _WEIGHT_GB,
                "kv_cache_gb": _KV_CACHE_GB,
                "graph_gb": 0.0,
                "token_capacity": self._max_total_tokens,
            },
            "disaggregation": {
                "mode": "null",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {"waiting": self._scheduler.num_waiting, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0},
        }
        body = {
            "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "version": self.config.server_version,
            "accelerator": "simulated",
            "num_accelerators": 1,
            "loads": [load],
        }
        conn.respond(200, dumps(body))

    def get_load(self, request: HttpRequest, conn: HttpConnection) -> None:
        """``/get_load`` (before 0.5.21): per DP rank, requests running or waiting, and their tokens."""
        self.load_reads += 1
        used = self._used_tokens(time.monotonic())
        self._record_load(self._scheduler.slots - len(self._scheduler.running) - self._scheduler.num_waiting)
        load: dict[str, Any] = {
            "rid": None,
            "http_worker_ipc": None,
            "dp_rank": 0,
            "num_reqs": len(self._scheduler.running) + self._scheduler.num_waiting,
            "num_waiting_reqs": self._scheduler.num_waiting,
            "num_tokens": used + self._scheduler.waiting_prompt_tokens,
        }
        if self._version >= _GET_LOAD_TIC_SINCE:
            load["ts_tic"] = time.perf_counter()
        conn.respond(200, dumps([load]))
