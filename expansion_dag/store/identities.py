"""The identity registry: who wrote a store's completions.

``<root>/identities/<fingerprint>.json``, one ``Identity`` per model-and-settings that wrote
completions, registered by the writer before its first line. It names the identities that a key (a
hash) cannot, and it keeps simulated and real completions apart: a writer whose answers are
simulated is refused in a store that holds real ones, and the other way round. An entry is created
exclusively (``expansion_dag.store.conditional``) and the refusal checked again after, so two runs
of different kinds starting together cannot both pass it.

Beside the entries, ``identities/probes/<hash>.json`` keeps what an identity's weights answered the
fleet's probe, one per engine build (``WeightsProbe``): a writer whose weights answer otherwise is
refused (``WeightsChangedError``) before it sends anything. A registry file that is not what it
should be is an error naming it and what to do (``RegistryError``), never skipped.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from expansion_dag.core import Identity, WeightsProbe
from expansion_dag.store.conditional import conditional_file

IDENTITIES = "identities"  # the registry's folder under the root; every other folder is a shard
PROBES = "probes"  # under IDENTITIES: what each identity's weights answered the probe


class MixedStoreError(ValueError):
    """Simulated and real completions would share one store."""


class WeightsChangedError(ValueError):
    """The weights behind an identity answer the probe otherwise than when the store's answers of
    that identity were written."""


class RegistryError(ValueError):
    """A file of the identity registry cannot be read as what it should be."""


class IdentityRegistry:
    """Which identities (model and settings, simulated or real) a store's completions were written
    under: one small JSON file each, under the store's ``identities/`` folder. Simulated and real
    completions never share a store: registering the other kind is refused."""

    def __init__(self, root: Any):
        self._folder = root / IDENTITIES

    def known(self) -> dict[str, Identity]:
        """Every registered identity by fingerprint; RegistryError naming a file that is not one."""
        folder = self._folder
        if not folder.exists():
            return {}
        found = {}
        for path in sorted(folder.glob("*.json"), key=lambda p: p.name):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue  # withdrawn since the listing: a registration refused (``register``)
            try:
                identity = Identity.from_dict(_json_object(data))
                if identity.fingerprint != path.stem:
                    raise ValueError(f"it names fingerprint {identity.fingerprint!r}, not its own name")
            except ValueError as exc:
                raise RegistryError(
                    f"{path}: not an identity of this store ({exc}). It names the model and settings of the "
                    f"completions keyed under fingerprint {path.stem}, written once by their first run. Restore "
                    "it from a copy, or remove it: the next run of that identity writes it again, and until "
                    "then the training set counts those completions as unregistered (and nothing keeps a run "
                    "of the other kind, simulated or real, out of this store)."
                ) from None
            found[identity.fingerprint] = identity
        return found

    def refuse_other_kind(self, identity: Identity) -> None:
        """Raise ``MixedStoreError`` when the store holds completions of the other kind."""
        others = sorted({i.model for i in self.known().values() if i.simulated != identity.simulated})
        if not others:
            return
        other_kind = "real" if identity.simulated else "simulated"
        hint = (
            "Give simulated runs (the local profile, the simulator) a storage root of their own, e.g. "
            "EXPANSION_STORAGE=./storage-sim"
            if identity.simulated
            else "Give the production run a storage root of its own (EXPANSION_STORAGE=/path/to/storage), "
            "or remove this root if its simulated completions are not wanted"
        )
        raise MixedStoreError(
            f"the completion store {self._folder.parent} holds {other_kind} completions ({', '.join(others)}); this run's "
            f"completions would be {identity.kind} ({identity.model}). Simulated and real completions never "
            f"share a store. {hint}."
        )

    def check_probe(self, model: str, probe: WeightsProbe) -> None:
        """Keep what ``model``'s weights answered the probe, the first time on this engine build;
        after, raise ``WeightsChangedError`` when they answer otherwise."""
        name = hashlib.sha256(f"{model}\0{probe.engine}".encode()).hexdigest()[:16]
        path = self._folder / PROBES / f"{name}.json"
        entry = conditional_file(path)
        body = json.dumps({"model": model, **probe.to_dict()}, indent=2, sort_keys=True) + "\n"
        if entry.create(body.encode()) is not None:
            return
        stored = entry.read()
        try:
            recorded = WeightsProbe.from_dict(_json_object(stored.data if stored is not None else b""))
        except ValueError as exc:
            raise RegistryError(
                f"{path}: not a weights probe ({exc}). Remove it: the next run records the probe of the "
                "weights it finds."
            ) from None
        difference = recorded.difference(probe)
        if difference is not None:
            raise WeightsChangedError(
                f"the weights served as {model} answer the weights probe (a fixed prompt, greedy, on "
                f"{probe.engine}) otherwise than when this store's answers of that identity were written: "
                f"{difference}. They are other weights behind the same path, and nothing was sent. If the "
                "weights changed, name them: set model.revision (a commit, a tag, the fine-tune's name; env "
                "EXPANSION_MODEL_REVISION), and their answers get keys of their own while the old ones stay "
                "in the store, counted and left out of the training set; or give the run a new storage root. "
                f"If they did not (the same files, on other GPUs), remove {path} to record the probe anew."
            )

    def register(self, identity: Identity) -> None:
        """Record that completions of ``identity`` are written here; refused for the other kind, and
        for weights that answer its probe otherwise than before (``check_probe``)."""
        self.refuse_other_kind(identity)
        if identity.probe is not None:
            self.check_probe(identity.model, identity.probe)
        entry = conditional_file(self._folder / f"{identity.fingerprint}.json")
        body = json.dumps(identity.to_dict(), indent=2, sort_keys=True, default=str) + "\n"
        created = entry.create(body.encode())  # None: registered already
        # A run of the other kind may have registered between the check and the create: look
        # again, and withdraw this registration if so (both may withdraw; neither writes).
        try:
            self.refuse_other_kind(identity)
        except MixedStoreError:
            if created is not None:
                entry.delete(created)
            raise


def _json_object(data: bytes) -> dict[str, Any]:
    """A registry file's JSON object; ValueError (a UnicodeDecodeError is one) when it is not one."""
    value = json.loads(data.decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value
