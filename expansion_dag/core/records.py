"""A completion record's identity and status: what every layer names a record by.

A record's key is its prompt and the identity (model, sampling settings) that answered it; its
status says whether it holds an answer (``OK``) or the reason there is none (``FAILED``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FAILED", "OK", "Identity", "completion_key"]

OK = "ok"
FAILED = "failed"


def completion_key(prompt_id: str, settings_fingerprint: str) -> str:
    """Identity of a completion: which prompt, answered under which model and sampling settings."""
    return hashlib.sha256(f"{prompt_id}:{settings_fingerprint}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Identity:
    """What answered and how, the part of a completion's key that is not the prompt.

    ``model`` is the served model as the fleet reports it, ending in " (simulator)" for simulated
    answers (``FleetInfo.identity``); ``fingerprint`` hashes it with the sampling settings and the
    ``max_tokens`` cap (``SamplingSettings.fingerprint``); ``settings`` are those settings, kept for
    people reading the store.
    """

    model: str
    simulated: bool
    fingerprint: str
    settings: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def kind(self) -> str:
        return "simulated" if self.simulated else "real"

    @property
    def label(self) -> str:
        return f"{self.model} [settings {self.fingerprint}]"

    def key(self, prompt_id: str) -> str:
        return completion_key(prompt_id, self.fingerprint)

    def owns(self, record: Mapping[str, Any]) -> bool:
        """Whether a record was written under this identity (its key is this identity's key)."""
        return record.get("key") == self.key(str(record.get("prompt_id", "")))

    @classmethod
    def of(cls, model: str, simulated: bool, sampling: Any) -> Identity:
        """The identity of answers from ``model`` under ``sampling`` (a ``SamplingSettings``)."""
        return cls(model=model, simulated=simulated, fingerprint=sampling.fingerprint(model),
                   settings=dataclasses.asdict(sampling))

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "simulated": self.simulated, "fingerprint": self.fingerprint,
                "settings": dict(self.settings)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Identity:
        return cls(model=data["model"], simulated=bool(data["simulated"]), fingerprint=data["fingerprint"],
                   settings=dict(data.get("settings") or {}))
