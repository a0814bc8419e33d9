"""What differs between the simulated SGLang and vLLM servers: error bodies, context rules, answer
shapes and which paths need the API key.

Apart from the server so that the request intake, the scheduler and the endpoints can all speak
through a dialect without importing the server that wires them together.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from packaging.version import Version

from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.job import Job

#: ``ChatCompletionRequest.return_input_ids_in_sglext`` and ``return_output_ids_in_sglext``: in the
#: 0.5.20 wheel's ``entrypoints/openai/protocol.py``, not in 0.5.19's.
_SGLEXT_IDS_SINCE = Version("0.5.20")


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()



class RequestError(Exception):
    """A request rejected before it reaches a slot: the HTTP status and the JSON body."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body


class Dialect:
    """What differs between the SGLang and the vLLM server: errors, context rules, answers, auth.

    The texts and shapes are SGLang 0.5.23's (``entrypoints/openai/protocol.py``,
    ``serving_chat.py``, ``managers/tokenizer_manager.py``, ``managers/scheduler.py``); the
    contract suite compares them with the fixtures recorded from that source.
    """

    owned_by = "sglang"
    #: Where a streamed chunk carries the thinking.
    reasoning_delta = "reasoning_content"
    #: Honours ``stream_options.continuous_usage_stats``. SGLang from 0.5.5 does too, but not the
    #: 0.5.4 surface emulated here as well, and the client asks only vLLM for it.
    continuous_usage = False

    def __init__(self, config: SimServerConfig) -> None:
        self.config = config
        self._returns_ids = config.token_ids and Version(config.server_version) >= _SGLEXT_IDS_SINCE

    def asks_token_ids(self, body: dict[str, Any]) -> tuple[bool, bool]:
        """Whether the request gets the prompt's ids and the answer's (``_should_return_input_ids``,
        ``_should_return_output_ids``): each has its own field."""
        return (
            self._returns_ids and body.get("return_input_ids_in_sglext") is True,
            self._returns_ids and body.get("return_output_ids_in_sglext") is True,
        )

    def _sglext(self, job: Job) -> dict[str, Any]:
        """The response-level ``sglext`` with the ids asked for (``SglExt`` drops null fields)."""
        sglext: dict[str, Any] = {}
        if job.prompt_ids is not None:
            sglext["input_ids"] = job.prompt_ids
        if job.output_ids is not None:
            sglext["output_ids"] = [job.output_ids.tolist()]  # one list a choice
        return sglext

    def stream_ids_event(self, job: Job) -> bytes:
        """SGLang sends a streamed answer's ids once, in a chunk of no choices before the usage."""
        sglext = self._sglext(job)
        if not sglext:
            return b""
        chunk = {
            "id": job.chunk_id,
            "object": "chat.completion.chunk",
            "created": job.created,
            "model": job.model,
            "choices": [],
            "usage": None,
            "sglext": sglext,
        }
        return b"data: " + dumps(chunk) + b"\n\n"

    def stream_interval(self, body: dict[str, Any]) -> int:
        """SGLang streams at its launch setting: its chat API has no per-request interval."""
        return self.config.stream_interval

    def stream_event(
        self,
        job: Job,
        delta: dict[str, Any] | None,
        finish_reason: str | None = None,
        usage: dict | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> bytes:
        """One ``data:`` event of a streamed answer: a delta, the finish, or (no choices) the usage;
        ``token_ids``: the delta's ids, where the dialect streams them (vLLM's ``token_ids``)."""
        choices = []
        if delta is not None:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if self.owned_by == "sglang":
                choice["matched_stop"] = None
            elif token_ids is not None:
                choice["token_ids"] = list(token_ids)
            choices.append(choice)
        chunk: dict[str, Any] = {
            "id": job.chunk_id,
            "object": "chat.completion.chunk",
            "created": job.created,
            "model": job.model if self.owned_by == "sglang" else self.config.model_name,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        if self.owned_by == "vllm" and job.prompt_ids is not None and delta is not None and delta.get("role"):
            chunk["prompt_token_ids"] = job.prompt_ids  # only the first chunk carries them
        return b"data: " + dumps(chunk) + b"\n\n"

    def error(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> RequestError:
        body = {"object": "error", "message": message, "type": err_type, "param": param, "code": status}
        return RequestError(status, dumps(body))

    def validation_error(self, loc: tuple[str | int, ...], message: str) -> RequestError:
        """A malformed request, as SGLang's handler turns FastAPI's RequestValidationError into a 400."""
        errors = [{"loc": list(loc), "msg": message, "type": "value_error"}]
        return self.error(f"1 validation error:\n  {errors[0]} {errors}", err_type="Bad Request")

    def content_type_error(self) -> RequestError:
        return self.validation_error(
            ("header", "content-type"), "Unsupported Media Type: Only 'application/json' is allowed"
        )

    def requires_key(self, path: str) -> bool:
        """SGLang guards every path but health, readiness and metrics (``utils/auth.py``)."""
        return not path.startswith(("/health", "/ready", "/metrics"))

    def check_model(self, model: object) -> None:
        """SGLang does not check the requested model against the served one."""

    def max_tokens(self, max_tokens: int | None, max_completion_tokens: int | None) -> tuple[str, int | None]:
        # SGLang takes `max_completion_tokens or max_tokens`: a 0 falls back to the other field.
        return "max_completion_tokens", max_completion_tokens or max_tokens

    def completion_cap(self, prompt_tokens: int, field: str, max_tokens: int | None) -> int:
        """How many tokens the request may generate, or the error SGLang answers, in its order."""
        c = self.config
        context = c.context_length
        if max_tokens and max_tokens > context:  # serving_chat._validate_request
            raise self.error(
                f"max_completion_tokens is too large: {max_tokens}."
                f"This model supports at most {context} completion tokens."
            )
        if prompt_tokens >= context:  # tokenizer_manager._validate_one_request
            raise self.error(
                f"The input ({prompt_tokens} tokens) is longer than the "
                f"model's context length ({context} tokens)."
            )
        if max_tokens is not None and prompt_tokens + max_tokens > context:
            raise self.error(
                "Requested token count exceeds the model's maximum context length "
                f"of {context} tokens. You requested a total of {prompt_tokens + max_tokens} "
                f"tokens: {prompt_tokens} tokens from the input messages and "
                f"{max_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )
        if prompt_tokens >= c.max_req_input_len:  # the scheduler: managers/utils.validate_input_length
            raise self.error(
                f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length "
                f"({c.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
            )
        # The scheduler silently lowers max_new_tokens to fit (scheduler.init_req_max_new_tokens).
        room = c.max_req_len - prompt_tokens - 1
        return max(0, room if max_tokens is None else min(max_tokens, room))

    def model_card(self, created: int) -> dict[str, Any]:
        name = self.config.model_name
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.config.context_length,
        }

    def completion_body(self, job: Job, eos_token_id: int | None) -> dict[str, Any]:
        c = job.completion
        reasoning_tokens = c.reasoning_tokens
        return {
            "id": job.request_id or uuid.uuid4().hex,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": job.model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": c.content,
                        "reasoning_content": c.reasoning_content,
                        # ChatMessage's serializer drops a null tool_calls.
                        **({"tool_calls": list(c.tool_calls)} if c.tool_calls else {}),
                    },
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    # The end-of-sequence token a stop matched; a length or an abort matched none.
                    "matched_stop": eos_token_id if c.finish_reason == "stop" else None,
                }
            ],
            "usage": {
                "prompt_tokens": job.prompt_tokens,
                "total_tokens": job.prompt_tokens + c.completion_tokens,
                "completion_tokens": c.completion_tokens,
                "prompt_tokens_details": None,
                "reasoning_tokens": reasoning_tokens,
                "completion_tokens_details": {"reasoning_tokens": reasoning_tokens} if reasoning_tokens else None,
            },
            # The output tokens each weight version wrote (one version: all of them), as a real
            # 0.5.23 server sends it (seen in real_engine/test_sglang_contract.py).
            "metadata": {
                "weight_version": self.config.weight_version,
                "weight_versions": [{"version": self.config.weight_version, "start": 0, "end": c.completion_tokens}],
            },
            **({"sglext": sglext} if (sglext := self._sglext(job)) else {}),
        }


class VllmDialect(Dialect):
    """vLLM 0.33.0: ``entrypoints/openai/chat_completion``, ``renderers/params.py``,
    ``entrypoints/serve/exception_handling``, ``entrypoints/serve/middleware/authenticate.py``."""

    owned_by = "vllm"
    reasoning_delta = "reasoning"
    continuous_usage = True
    #: Paths the API key guards; /health, /version, /tokenize are open.
    _GUARDED = ("/v1", "/v2", "/inference", "/cohere")

    def error(
        self, message: str, *, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
    ) -> RequestError:
        body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
        return RequestError(status, dumps(body))

    def validation_failed(self, message: str, param: str, value: int) -> RequestError:
        """A VLLMValidationError: its text ends with the parameter and value it names."""
        return self.error(f"{message} (parameter={param}, value={value})", param=param)

    def validation_error(self, loc: tuple[str | int, ...], message: str) -> RequestError:
        return self.error(f"{loc[-1]}: {message}", param=str(loc[-1]))

    def requires_key(self, path: str) -> bool:
        return path.startswith(self._GUARDED)

    def asks_token_ids(self, body: dict[str, Any]) -> tuple[bool, bool]:
        """``return_token_ids`` asks for both; any vLLM the simulator emulates has it."""
        asked = self.config.token_ids and bool(body.get("return_token_ids"))
        return asked, asked

    def stream_ids_event(self, job: Job) -> bytes:
        """vLLM streams the ids with the deltas: nothing comes at the end."""
        return b""

    def stream_interval(self, body: dict[str, Any]) -> int:
        """A request's ``stream_interval`` raises the server's, never lowers it (``RequestState``)."""
        asked = body.get("stream_interval")
        valid = isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1
        return max(self.config.stream_interval, asked if valid else 1)

    def check_model(self, model: object) -> None:
        if model and model != self.config.model_name:
            raise self.error(
                f"The model `{model}` does not exist.", status=404, err_type="NotFoundError", param="model"
            )

    def max_tokens(self, max_tokens: int | None, max_completion_tokens: int | None) -> tuple[str, int | None]:
        if max_completion_tokens is not None:
            return "max_completion_tokens", max_completion_tokens
        return "max_tokens", max_tokens

    def completion_cap(self, prompt_tokens: int, field: str, max_tokens: int | None) -> int:
        context = self.config.context_length
        if max_tokens is not None and max_tokens > context:  # TokenizeParams.__post_init__
            raise self.validation_failed(
                f"{field}={max_tokens} cannot be greater than max_model_len={context}. "
                "Please request fewer output tokens.",
                field,
                max_tokens,
            )
        if prompt_tokens > context:  # TokenizeParams._token_len_check
            qualifier = "at least " if prompt_tokens == context + 1 else ""
            raise self.validation_failed(
                f"This model's maximum context length is {context} tokens. However, your prompt "
                f"contains {qualifier}{prompt_tokens} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
                prompt_tokens,
            )
        # get_max_tokens: prompt + max_tokens may run past the context; the output stops at the edge.
        room = context - prompt_tokens
        cap = room if max_tokens is None else min(max_tokens, room)
        if cap < 1:  # SamplingParams._verify_args
            raise self.validation_failed(f"max_tokens must be at least 1, got {cap}.", "max_tokens", cap)
        return cap

    def model_card(self, created: int) -> dict[str, Any]:
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": self.config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": self.config.model_path,
            "parent": None,
            "max_model_len": self.config.context_length,
            "permission": [permission],
        }

    def completion_body(self, job: Job, eos_token_id: int | None) -> dict[str, Any]:
        c = job.completion
        parsed = self.config.reasoning_parser is not None
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.config.model_name,  # vLLM names the served model, not the requested one
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        # vLLM's reasoning parser leaves no content (null) when the answer never started.
                        # ... and its tool parser none when only calls were written.
                        "content": c.content if c.content or (c.reasoning_content is None and not c.tool_calls) else None,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        **({"tool_calls": list(c.tool_calls)} if c.tool_calls else {}),  # dropped when empty
                        "reasoning": c.reasoning_content,
                    },
                    "logprobs": None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": None,
                    "token_ids": None if job.output_ids is None else job.output_ids.tolist(),
                    "routed_experts": None,
                    "weight_versions": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": job.prompt_tokens,
                "total_tokens": job.prompt_tokens + c.completion_tokens,
                "completion_tokens": c.completion_tokens,
                "prompt_tokens_details": None,
                # Present, even at 0, whenever the server runs a reasoning parser.
                "completion_tokens_details": {"reasoning_tokens": c.reasoning_tokens} if parsed else None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": job.prompt_ids,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }


DIALECTS: dict[str, type[Dialect]] = {"sglang": Dialect, "vllm": VllmDialect}
