"""The sampling settings: everything sent with a request that shapes the answer.

Apart from the engine and the server API, which both read them, so that neither imports the other.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from expansion_dag.core.records import completion_key


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """Everything sent with a request that shapes the answer; part of each completion's identity.

    The values are the run configuration's (``generation.*``, where their defaults are said).
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    seed: int | None = None
    stop: tuple[str, ...] = ()
    #: JSON object text, e.g. ``{"enable_thinking": false}``: kept as text so the settings hash.
    chat_template_kwargs_json: str = "{}"
    #: The ``max_tokens`` cap: a higher cap changes which answers are cut, so it is identity too.
    max_output_tokens: int

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be within [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be positive, got {self.max_output_tokens}")
        if not isinstance(self.chat_template_kwargs, dict):
            raise ValueError("chat_template_kwargs_json must be a JSON object")

    @functools.cached_property
    def chat_template_kwargs(self) -> dict[str, Any]:
        # Cached: every request carries it, and parsing it per request costs CPU the fleet needs.
        return json.loads(self.chat_template_kwargs_json)

    def fingerprint(self, model: str) -> str:
        """Hash of the model and settings: changing either gives new completion keys."""
        canonical = json.dumps({"model": model, **asdict(self)}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def key(self, prompt_id: str, model: str) -> str:
        return completion_key(prompt_id, self.fingerprint(model))
