"""An SGLang-compatible fleet simulator: the HTTP surface of real servers, without a model.

Faithful to SGLang 0.5.23 (and, with ``version``, to older SGLang back to 0.5.4) and to vLLM 0.33.0:
the same endpoints, JSON shapes, status codes and error texts, so that the client, the fleet
manager and the tests meet the same behaviour they will meet on GPUs. The contract suite
(``expansion_dag_tests/contract``) holds the simulator to fixtures recorded from those servers'
source and fails when one of its response shapes or error texts drifts. Prompt tokens are counted
with the model's chat template through :mod:`expansion_dag.core.tokenizer`, exactly as the server counts
them; completions are synthetic text whose ``completion_tokens`` is the real token count of the
returned text.

Endpoints: ``GET /health``, ``/health_generate``, ``/ready`` (503 until warmed up, then 200 with
an empty body), ``GET /v1/models`` (200 during warmup too), ``GET /server_info`` and
``/get_server_info`` (with ``"simulator": true``), ``GET /model_info`` and ``/get_model_info``,
``GET /v1/loads`` (live running and waiting counts), ``GET /get_load``, ``POST
/v1/chat/completions``. An emulated older SGLang serves only the paths it had: ``/server_info`` and
``/model_info`` from 0.5.6, ``/v1/loads`` (and the effective slots in ``internal_states``) from
0.5.8, ``/get_load`` until 0.5.20, ``/ready`` from 0.5.21.

Context rules are SGLang's, in its order: ``max_completion_tokens`` over the context; a prompt of
the context or more; prompt + max tokens over the context; then the scheduler's
``max_req_input_len = min(context - 1, KV capacity - 1) - 5`` (a prompt of that many tokens or more
is refused); and the scheduler silently lowers the output cap to ``max_req_len - prompt - 1``.
An API key comes only from ``api_key`` (``--api-key``): like SGLang, no environment variable is
read.

``GET /sim/stats`` exists only in the simulator: cumulative request counts by status, completed
requests, requests whose client went away (``aborted``) and answers ending in ``abort``, the busy
slot-seconds integral with a monotonic timestamp (utilization over a window is
``Δbusy_slot_seconds / (slots * Δmonotonic_s)``), the largest prompt + max_tokens ever requested
and how many requests exceeded the context.

With ``backend="vllm"`` the server behaves as vLLM 0.33's OpenAI server does where the two differ:
no ``/server_info``, ``/model_info``, ``/v1/loads``, ``/get_load`` (404); ``GET /version`` and
``POST /tokenize``; thinking in ``message.reasoning``; the requested ``model`` must be the served
one (404 otherwise); only paths under ``/v1`` need the key; prompt + ``max_tokens`` over the
context answers 200 cut short with ``finish_reason: "length"``; ``max_tokens`` over the context, a
prompt over it, and a prompt of exactly the context answer vLLM's nested 400 bodies, whose texts
end with ``(parameter=..., value=...)``.

Requests may carry ``tools`` and ``tool_choice``: each dialect accepts, refuses and renders them as
its server does (the tools in the prompt count as there), and ``tool_call_share`` of the answers to
prompts with tools call one of them, as raw ``<tool_call>`` text or, on a server started with a
tool-call parser, as ``message.tool_calls`` (:mod:`expansion_dag.sim.tools`).

Deliberate differences from a real server:

- ``n`` other than 1 is refused with a 400 saying so (``stream=true`` is served as server-sent
  events, as both servers do).
- ``completion_tokens`` equals the token count of the returned text; a real server also counts
  the end-of-sequence token of a ``stop`` answer.
- ``/health`` answers at once (a real one runs a one-token generation, ~1 s, and can fail under
  load); ``/metrics`` is not simulated (404), as on a server launched without ``--enable-metrics``.
- The server behaves as if launched with ``--context-length``: ``max_completion_tokens`` above the
  context is refused, and ``/server_info`` reports ``context_length``.
- ``max_total_num_tokens`` is ``max_total_tokens`` or ``slots * context_length``; it bounds
  ``max_req_input_len`` and each output, but never runs out under load, so no request is ever
  retracted; ``/model_info`` reports no ``architectures``.
- A model thinks (``<think>...</think>`` before the answer) when its tokenizer has a ``<think>``
  token and the request does not set ``enable_thinking: false``; ``reasoning_tokens`` counts the
  tokens up to and including ``</think>`` when a reasoning parser separates them, else 0.
- Generation requests are accepted during warmup, as on a real server; only probes tell the phase.
- Sampling fields (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
  ``stop``) are accepted and have no effect; ``seed`` changes the answer, as a new sample would.
  The answer to a prompt follows the simulated model (its ``seed``): the same model answers a
  greedy request (temperature 0) the same way every time, and ``loop_rate``'s unlucky samples
  strike only sampled requests; another seed is another model behind the same path.
- Fault injection (``fail_rate``, ``hang_rate``, ``abort_rate``, ``die_after_requests``,
  ``prompt_token_skew``) is simulator-only; a killed server drops its connections and frees its port
  at once. ``abort_rate`` answers as SGLang answers an aborted request (``/abort_request``,
  ``abort_all``): HTTP 200, the first half of the text, ``finish_reason: "abort"``.
- Token ids come back where asked as the real servers send them (SGLang's ``sglext``, vLLM's
  ``prompt_token_ids`` and ``token_ids``, plain and streamed): the prompt's from the model's
  tokenizer, as a server runs it; the answer's the tokenizer's ids of the raw answer (thinking and
  parsed calls included), as the ids a real server sampled are those it detokenized into the text,
  always ``completion_tokens`` of them (``generation.sim_output_ids``): a training set built from a
  simulated fleet decodes to its answers. Being canonical, they cannot tell a client that keeps the
  server's ids from one that tokenizes the text again: ``test_training_set_ids.py`` and the
  real-engine tests do.
  ``token_ids=False`` (``--no-token-ids``) is a server that ignores the request, as SGLang before
  0.5.20 does.
- ``/server_info`` carries only the recorded subset of the server arguments (a real one has them
  all) and reports ``max_running_requests`` as if launched with ``--max-running-requests``; versions
  between the recorded ones (0.5.4, 0.5.7, 0.5.23) take the shapes of the nearest recorded one.

Several servers share one process and one event loop, each on its own port with its own state:
:class:`SimulatedFleet` for tests, ``expansion-sim --ports 30000-30007`` on the command line.
A fleet in the test's own process shares its GIL with the client; benchmarks start one in a process
of its own (:class:`FleetProcess`), and share their simulated workloads with the tests
(:mod:`expansion_dag.sim.workloads`).

Cost, measured on this project's 2-core machine (server and a raw-socket client pinned to one
core each, 8 servers x 72 slots): about 0.28 ms of server CPU per request plus 1.2 us per prompt
token (the chat template and the tokenizer), so 0.31 s per 1,000 requests with 28-token prompts
(3,100 requests/s at 98% of a core), 0.36 s with 91-token prompts (2,700/s), 0.70 s with 371-token
prompts. The HTTP layer (h11 on asyncio transports, ``http.py``) costs 0.074 s per 1,000 requests,
half of uvicorn + starlette on h11 (0.144 s) and level with uvicorn's optional httptools parser,
which is not a dependency of this project.
"""

from expansion_dag.sim.cli import main
from expansion_dag.sim.config import DEFAULT_REASONING_SHARE, SimServerConfig
from expansion_dag.sim.dialects import VllmDialect
from expansion_dag.sim.fleet import SimulatedFleet
from expansion_dag.sim.generation import OutputModel
from expansion_dag.sim.process import FleetProcess
from expansion_dag.sim.server import READY_LINE, SimServer
from expansion_dag.sim.workloads import (
    BORROWING_SERVER,
    BORROWING_SHARDS,
    borrowing_prompt,
    most_borrowed_at_once,
    refusals_by_phase,
    shard_of,
)

__all__ = [
    "BORROWING_SERVER", "BORROWING_SHARDS", "DEFAULT_REASONING_SHARE", "FleetProcess", "OutputModel", "READY_LINE",
    "SimServer", "SimServerConfig", "SimulatedFleet", "VllmDialect", "borrowing_prompt", "main",
    "most_borrowed_at_once", "refusals_by_phase", "shard_of"
]
