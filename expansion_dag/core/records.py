"""A completion record's identity and status: what every layer names a record by.

A record's key is its prompt and the identity (model, weights, sampling settings) that answered
it; its status says whether it holds an answer (``OK``) or the reason there is none (``FAILED``).
What the weights do is pinned by a ``WeightsProbe``: a fixed prompt's greedy answer, kept in the
store beside the identity and compared by every later run.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FAILED", "OK", "Identity", "WeightsProbe", "completion_key"]

OK = "ok"
FAILED = "failed"


def completion_key(prompt_id: str, settings_fingerprint: str) -> str:
    """Identity of a completion: which prompt, answered under which model and sampling settings."""
    return hashlib.sha256(f"{prompt_id}:{settings_fingerprint}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class WeightsProbe:
    """A fixed prompt's greedy answer (temperature 0, a few dozen tokens, sent alone): what the
    weights behind a path do, whatever the path or the server says.

    Greedy decoding of one request is repeatable on one engine build; across builds (another
    version, other kernels) the float sums change and a near-tie between two tokens can flip, so a
    difference there says nothing about the weights. Two probes are compared only when ``engine``
    (the backend and version the server reports) is the same: the sampled ids where both have
    them, else the text.
    """

    engine: str
    text: str
    ids: tuple[int, ...] | None = None

    def difference(self, other: WeightsProbe) -> str | None:
        """Where ``other`` answers otherwise, in words; None when the same or not comparable."""
        if other.engine != self.engine:
            return None
        if self.ids is not None and other.ids is not None:
            mine, theirs, unit = self.ids, other.ids, "token"
        else:
            mine, theirs, unit = self.text, other.text, "character"  # type: ignore[assignment]
        if mine == theirs:
            return None
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        return f"{unit} {at} of {len(mine)} differs ({self.text[:60]!r} against {other.text[:60]!r})"

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "text": self.text, "ids": None if self.ids is None else list(self.ids)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WeightsProbe:
        """A stored probe; ValueError when it is not one."""
        engine, text, ids = data.get("engine"), data.get("text"), data.get("ids")
        if not isinstance(engine, str) or not isinstance(text, str):
            raise ValueError("a probe needs engine and text strings")
        if ids is not None and not (isinstance(ids, list) and all(type(i) is int for i in ids)):
            raise ValueError("a probe's ids must be a list of integers")
        return cls(engine=engine, text=text, ids=None if ids is None else tuple(ids))


@dataclass(frozen=True)
class Identity:
    """What answered and how, the part of a completion's key that is not the prompt.

    ``model`` is the served model as the fleet reports it, with the weights named where they are
    known ("<path> [weights ...]") and ending in " (simulator)" for simulated answers
    (``FleetInfo.identity``); ``fingerprint`` hashes it with the sampling settings and the
    ``max_tokens`` cap (``SamplingSettings.fingerprint``); ``settings`` are those settings, kept for
    people reading the store. ``probe``: what the weights answered the fleet's probe this run, for
    the store to compare with what they answered before (``IdentityRegistry.register``).
    """

    model: str
    simulated: bool
    fingerprint: str
    settings: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    probe: WeightsProbe | None = field(default=None, compare=False, hash=False)

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
    def of(cls, model: str, simulated: bool, sampling: Any, probe: WeightsProbe | None = None) -> Identity:
        """The identity of answers from ``model`` under ``sampling`` (a ``SamplingSettings``)."""
        return cls(model=model, simulated=simulated, fingerprint=sampling.fingerprint(model),
                   settings=dataclasses.asdict(sampling), probe=probe)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "simulated": self.simulated, "fingerprint": self.fingerprint,
                "settings": dict(self.settings)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Identity:
        """A stored identity; ValueError when it is not one."""
        model, simulated, fingerprint = data.get("model"), data.get("simulated"), data.get("fingerprint")
        settings = data.get("settings") or {}
        if not (isinstance(model, str) and isinstance(simulated, bool) and isinstance(fingerprint, str)):
            raise ValueError("an identity needs model (text), simulated (true or false) and fingerprint (text)")
        if not isinstance(settings, Mapping):
            raise ValueError("an identity's settings must be a mapping")
        return cls(model=model, simulated=simulated, fingerprint=fingerprint, settings=dict(settings))
