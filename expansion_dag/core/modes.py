"""Mixes of generation modes: several sampling settings in one run, each prompt drawn into one.

A drafter serves the modes its target model is run in (thinking on and off, say), and one trained
on a single mode accepts poorly in the other, so a run may name several modes with weights. Each
prompt's mode is a seeded draw from its id: the same id, seed and weights give the same mode on
every machine and every night, with no table to keep. The draw is a point in [0, 1) that falls into
one mode's slice of the cumulative weights, in the order the modes are listed; changing a weight
moves only the prompts whose point lies between the old and the new boundary, so a changed mix
regenerates only the prompts whose mode changed.

Each mode is its own ``Identity`` (its settings hash differently), so its completions have their
own keys, and the training set takes each prompt's answer only under the mode the mix gives it.
A run without modes has the one mode ``default``: the base settings, keys as before.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from expansion_dag.core.records import Identity, WeightsProbe
from expansion_dag.core.sampling import SamplingSettings

DEFAULT_MODE = "default"
#: What a mode may set; everything else is the run's.
MODE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "chat_template_kwargs")
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


class ModeError(ValueError):
    """A mode or mix is invalid; the message names the field."""


@dataclass(frozen=True)
class Mode:
    name: str
    weight: float
    sampling: SamplingSettings

    @property
    def chat_template_kwargs(self) -> dict[str, Any]:
        return self.sampling.chat_template_kwargs


def parse_modes(spec: Sequence[Mapping[str, Any]], base: SamplingSettings) -> list[Mode]:
    """Modes from the run configuration's ``generation.modes``: ``name``, ``weight`` and the
    ``MODE_FIELDS`` that differ from the run's settings (``base``)."""
    modes: list[Mode] = []
    for index, entry in enumerate(spec):
        where = f"modes[{index}]"
        if not isinstance(entry, Mapping):
            raise ModeError(f"{where}: must be a mapping with name and weight, got {entry!r}")
        unknown = sorted(set(entry) - {"name", "weight", *MODE_FIELDS})
        if unknown:
            raise ModeError(f"{where}: unknown field(s) {unknown}; a mode sets name, weight and {list(MODE_FIELDS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ModeError(f"{where}.name: lowercase letters, digits, '_' or '-' (up to 32), got {name!r}")
        weight = entry.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise ModeError(f"{where}.weight: a positive number, got {weight!r}")
        changes: dict[str, Any] = {k: v for k, v in entry.items() if k in MODE_FIELDS}
        if "chat_template_kwargs" in changes:
            kwargs = changes.pop("chat_template_kwargs")
            if not isinstance(kwargs, Mapping):
                raise ModeError(f"{where}.chat_template_kwargs: a mapping, got {kwargs!r}")
            # Merged over the run's: a mode names only what it changes.
            merged = {**base.chat_template_kwargs, **kwargs}
            changes["chat_template_kwargs_json"] = json.dumps(merged, sort_keys=True)
        try:
            sampling = dataclasses.replace(base, **changes)
        except (TypeError, ValueError) as exc:
            raise ModeError(f"{where}: {exc}") from None
        modes.append(Mode(name=name, weight=float(weight), sampling=sampling))
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise ModeError(f"modes: names must differ, got {names}")
    fingerprints = {m.sampling.fingerprint(""): m.name for m in modes}
    if len(fingerprints) != len(modes):
        raise ModeError("modes: two modes have the same settings; a mode must differ from the others")
    return modes


class ModeMix:
    """The run's modes and each prompt's draw among them."""

    def __init__(self, modes: Sequence[Mode], seed: int = 0):
        if not modes:
            raise ModeError("a mix needs at least one mode")
        self.modes = tuple(modes)
        self.seed = seed
        self.by_name = {m.name: m for m in self.modes}
        total = sum(m.weight for m in self.modes)
        self.shares = {m.name: m.weight / total for m in self.modes}
        cumulative, running = [], 0.0
        for mode in self.modes[:-1]:
            running += mode.weight / total
            cumulative.append(running)
        self._bounds = cumulative

    @classmethod
    def single(cls, sampling: SamplingSettings) -> ModeMix:
        """The mix of a run without modes: every prompt under the run's settings."""
        return cls([Mode(name=DEFAULT_MODE, weight=1.0, sampling=sampling)])

    @classmethod
    def of(cls, spec: Sequence[Mapping[str, Any]], base: SamplingSettings, seed: int = 0) -> ModeMix:
        return cls(parse_modes(spec, base), seed) if spec else cls.single(base)

    def point(self, prompt_id: str) -> float:
        """The prompt's seeded point in [0, 1)."""
        digest = hashlib.sha256(f"{self.seed}\0{prompt_id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    def assign(self, prompt_id: str) -> Mode:
        return self.modes[bisect.bisect_right(self._bounds, self.point(prompt_id))]

    def names(self, prompt_ids: Sequence[str]) -> list[str]:
        return [self.assign(p).name for p in prompt_ids]

    def describe(self) -> list[dict[str, Any]]:
        """Each mode with its share and its settings, for metadata and the manifest."""
        return [
            {"name": m.name, "share": round(self.shares[m.name], 6), "settings": dataclasses.asdict(m.sampling)}
            for m in self.modes
        ]


def base_prompt_id(record: Mapping[str, Any]) -> str:
    """The id a record's mode is drawn from: its conversation's, for a turn of one."""
    return str(record.get("conversation_id") or record.get("prompt_id", ""))


class ModeIdentities:
    """The identity of each mode of a mix, for one served model (simulated or not); ``probe``: what
    its weights answered the fleet's probe, for the store to compare before anything is sent."""

    def __init__(self, mix: ModeMix, model: str, simulated: bool, probe: WeightsProbe | None = None):
        self.mix = mix
        self.by_mode = {m.name: Identity.of(model, simulated, m.sampling, probe) for m in mix.modes}

    @property
    def identities(self) -> list[Identity]:
        return list(self.by_mode.values())

    def for_prompt(self, prompt_id: str) -> Identity:
        """The identity a prompt's answers are written and taken under: its mode's."""
        return self.by_mode[self.mix.assign(prompt_id).name]

    def owns(self, record: Mapping[str, Any]) -> bool:
        """Whether a record was written under one of the mix's identities (any mode)."""
        return any(identity.owns(record) for identity in self.by_mode.values())

    def assigned(self, record: Mapping[str, Any]) -> bool:
        """Whether a record was written under the identity of the mode its prompt is drawn into now."""
        return self.for_prompt(base_prompt_id(record)).owns(record)

    def mode_of(self, record: Mapping[str, Any]) -> str | None:
        """The mode whose identity wrote a record, or None for another identity."""
        return next((name for name, identity in self.by_mode.items() if identity.owns(record)), None)
