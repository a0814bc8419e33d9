"""An SGLang-compatible fleet simulator: the HTTP surface of real servers, without a model.

Faithful to /work/shared/reference/sglang-api.md (SGLang 0.5.23): the same endpoints, JSON shapes,
status codes and error texts, so that the client, the fleet manager and the tests meet the same
behaviour they will meet on GPUs. Prompt tokens are counted with the model's chat template through
:mod:`expansion_dag.tokenizer`, exactly as the server counts them; completions are synthetic text
whose ``completion_tokens`` is the real token count of the returned text.

Endpoints: ``GET /health``, ``/health_generate``, ``/ready`` (503 until warmed up, then 200 with
an empty body), ``GET /v1/models`` (200 during warmup too), ``GET /server_info`` and
``/get_server_info`` (with ``"simulator": true``), ``GET /model_info`` and ``/get_model_info``,
``GET /v1/loads`` (live running and waiting counts), ``POST /v1/chat/completions``.
``GET /sim/stats`` exists only in the simulator: cumulative request counts by status, completed
and aborted requests, the busy slot-seconds integral with a monotonic timestamp (utilization over a
window is ``Δbusy_slot_seconds / (slots * Δmonotonic_s)``), the largest prompt + max_tokens ever
requested and how many requests exceeded the context.

With ``backend="vllm"`` the server behaves as vLLM's OpenAI server does where the two differ:
no ``/server_info``, ``/model_info``, ``/v1/loads`` (404); ``POST /tokenize``; prompt +
``max_tokens`` over the context answers 200 cut short with ``finish_reason: "length"``;
``max_tokens`` over the context and a prompt alone over it answer vLLM's 400 bodies.

Deliberate differences from a real server:

- ``stream=true`` and ``n`` other than 1 are refused with a 400 saying so.
- ``completion_tokens`` equals the token count of the returned text; a real server also counts
  the end-of-sequence token of a ``stop`` answer.
- ``/health`` answers at once (a real one runs a one-token generation, ~1 s, and can fail under
  load); ``/metrics`` is not simulated (404), as on a server launched without ``--enable-metrics``.
- The server behaves as if launched with ``--context-length``: ``max_completion_tokens`` above the
  context is refused, and ``/server_info`` reports ``context_length``.
- ``max_total_num_tokens`` is ``slots * context_length``: the KV cache never runs out, so no
  request is ever retracted; ``/model_info`` reports no ``architectures``.
- A model thinks (``<think>...</think>`` before the answer) when its tokenizer has a ``<think>``
  token and the request does not set ``enable_thinking: false``; ``reasoning_tokens`` counts the
  tokens up to and including ``</think>`` when a reasoning parser separates them, else 0.
- Generation requests are accepted during warmup, as on a real server; only probes tell the phase.
- Sampling fields (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
  ``stop``) are accepted and have no effect; ``seed`` changes the answer, as a new sample would.
- Fault injection (``fail_rate``, ``hang_rate``, ``die_after_requests``, ``prompt_token_skew``)
  is simulator-only; a killed server drops its connections and frees its port at once.

Several servers share one process and one event loop, each on its own port with its own state:
:class:`SimulatedFleet` for tests, ``expansion-sim --ports 30000-30007`` on the command line.
A fleet in the test's own process shares its GIL with the client; benchmarks run the command.

Cost, measured on this project's 2-core machine (server and a raw-socket client pinned to one
core each, 8 servers x 72 slots): about 0.28 ms of server CPU per request plus 1.2 us per prompt
token (the chat template and the tokenizer), so 0.31 s per 1,000 requests with 28-token prompts
(3,100 requests/s at 98% of a core), 0.36 s with 91-token prompts (2,700/s), 0.70 s with 371-token
prompts. The HTTP layer (h11 on asyncio transports, ``http.py``) costs 0.074 s per 1,000 requests,
half of uvicorn + starlette on h11 (0.144 s) and level with uvicorn's optional httptools parser,
which is not a dependency of this project.
"""

from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.fleet import SimulatedFleet
from expansion_dag.sim.server import READY_LINE, SimServer

__all__ = ["READY_LINE", "SimServer", "SimServerConfig", "SimulatedFleet"]
