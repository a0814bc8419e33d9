"""Other weights behind the same path: never mixed with the old ones' answers.

A simulated model's answers are its own (they follow its seed, ``expansion_dag.sim.generation``):
restarted with another seed at the same path and the same version, it is another model that names
itself as the first did, which is what a fine-tune copied over a model folder looks like to the
client. The weights probe catches it before any prompt is sent; naming the new weights
(``model.revision``) gives their answers an identity of their own, and the training set takes only
those. Servers of one fleet that answer the probe differently, or report different weight versions,
are refused. (On a real engine: ``real_engine/test_weights_change.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest

from expansion_dag.core import FleetMismatchError, Identity, WeightsProbe
from expansion_dag.defs import SHARD_KEYS
from expansion_dag.defs.assets import budgeted_prompts, completions, shard_prompts, training_set
from expansion_dag.servers import probe_fleet
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore, RegistryError, WeightsChangedError
from expansion_dag.training import data_files
from expansion_dag_tests.helpers import default_sampling, prompt_frame, prompts_answered, prompts_asset, resources

SIM = dict(port=0, max_running_requests=4, ttft_s=0.0, token_latency_s=0.0001, output_median_tokens=40,
           output_sigma=0.3)
#: The same model at the same path, answering otherwise: "new weights".
RETRAINED = dict(SIM, seed=7)


def materialize(frame, res, instance, selection, partition=None):
    assets = [prompts_asset(frame), budgeted_prompts, shard_prompts, completions, training_set]
    return dg.materialize(assets, resources=res, instance=instance, selection=selection, partition_key=partition,
                          raise_on_error=False)


def night(frame, res, instance) -> list[dg.ExecuteInProcessResult]:
    """Prepare, every shard and the training set, as a nightly run does."""
    results = [materialize(frame, res, instance, ["prompts", "budgeted_prompts"])]
    results += [materialize(frame, res, instance, ["shard_prompts", "completions"], key) for key in SHARD_KEYS]
    return [*results, materialize(frame, res, instance, ["training_set"])]


def stored(res) -> list[tuple[str, str]]:
    store = res["storage"].completion_store()
    return sorted((r["key"], r["status"]) for key in SHARD_KEYS for r in store.records(key))


def test_new_weights_at_the_same_path_stop_the_run_before_a_prompt_is_sent_until_they_are_named(tmp_path, instance):
    frame = prompt_frame([f"Explain idea number {i} in a few words." for i in range(12)])
    with SimulatedFleet([SimServerConfig(**SIM)] * len(SHARD_KEYS)) as fleet:
        res = resources(fleet.urls, tmp_path)
        assert all(r.success for r in night(frame, res, instance))
        before = stored(res)
        assert len(before) == frame.height
        for index in range(len(SHARD_KEYS)):
            fleet.restart(index, config=SimServerConfig(**RETRAINED))
        refused = materialize(frame, res, instance, ["shard_prompts", "completions"], SHARD_KEYS[0])
        # The probe of the shard's own server, and nothing else.
        sent = [(s["completed"], s["greedy_requests"]) for s in map(fleet.stats, range(len(SHARD_KEYS)))]

        assert not refused.success and sent == [(1, 1)] + [(0, 0)] * (len(SHARD_KEYS) - 1)
        [failure] = [e for e in refused.all_events if e.is_step_failure]
        error = failure.event_specific_data.error.cause
        assert error.cls_name == "WeightsChangedError"
        probes = list((tmp_path / "completions" / "identities" / "probes").glob("*.json"))
        assert len(probes) == 1 and str(probes[0]) in error.message
        assert "set model.revision" in error.message and "a new storage root" in error.message
        assert stored(res) == before  # 0 answers written, none lost

        # Named, the new weights are a new identity: every prompt is asked again, once.
        named = resources(fleet.urls, tmp_path, fleet={"model_revision": "retrained-7"})
        results = night(frame, named, instance)
        sent = sum(prompts_answered(fleet.stats(i)) for i in range(len(SHARD_KEYS)))

    assert all(r.success for r in results)
    assert sent == frame.height  # each prompt once
    after = stored(named)
    assert set(before) < set(after) and len(after) == 2 * frame.height  # the old answers stay
    out_dir = named["storage"].path("training_set")
    ids = pq.read_table(data_files(out_dir), columns=["id"])["id"].to_pylist()
    assert sorted(ids) == frame["prompt_id"].to_list()  # each prompt once: 0 rows of the old weights
    manifest = json.loads((Path(out_dir) / "manifest.json").read_text())
    assert manifest["identity"]["model"] == "Qwen/Qwen3-8B [weights revision retrained-7] (simulator)"
    [(label, count)] = manifest["other_identities"].items()
    assert count == frame.height and label.startswith("Qwen/Qwen3-8B (simulator) [settings ")


def test_a_fleet_whose_servers_have_other_weights_behind_one_path_stops_the_night_at_its_budget(tmp_path, instance):
    frame = prompt_frame([f"Explain idea number {i} in a few words." for i in range(4)])
    with SimulatedFleet([SimServerConfig(**SIM), SimServerConfig(**RETRAINED)]) as fleet:
        info = probe_fleet(fleet.urls, backend="sglang", stream_interval=1)
        assert info.servers[0].model_path == info.servers[1].model_path  # nothing else tells them apart
        prepared = materialize(frame, resources(fleet.urls, tmp_path), instance, ["prompts", "budgeted_prompts"])
        sent = [(s["completed"], s["greedy_requests"]) for s in map(fleet.stats, range(2))]
    assert not prepared.success and sent == [(1, 1), (1, 1)]  # the probes, nothing else
    [failure] = [e for e in prepared.all_events if e.is_step_failure]
    error = failure.event_specific_data.error.cause
    assert error.cls_name == "FleetMismatchError"
    assert f"{fleet.urls[0]} and {fleet.urls[1]} serve Qwen/Qwen3-8B with different weights" in error.message
    assert "Serve the same weights on every server" in error.message


def test_the_weight_version_sglang_reports_is_part_of_the_identity_and_must_agree():
    with SimulatedFleet([SimServerConfig(**SIM, weight_version="v3")] * 2) as fleet:
        info = probe_fleet(fleet.urls, backend="sglang", stream_interval=1)
    assert [s.weight_version for s in info.servers] == ["v3", "v3"]
    with SimulatedFleet([SimServerConfig(**SIM, weight_version="v3"), SimServerConfig(**SIM)]) as fleet:
        with pytest.raises(FleetMismatchError, match="servers disagree on weight_version: 'v3' on .*; None on"):
            probe_fleet(fleet.urls, backend="sglang", stream_interval=1)


def probe(text: str, engine: str = "sglang 0.5.23", ids=(1, 2, 3)) -> WeightsProbe:
    return WeightsProbe(engine=engine, text=text, ids=ids)


def identity(model: str, probe_: WeightsProbe | None) -> Identity:
    return Identity.of(model, False, default_sampling(), probe_)


def test_an_identity_registered_before_the_probe_keeps_its_answers_and_its_first_probe_is_kept(tmp_path):
    store = CompletionStore(tmp_path)
    # A store written before identities named the weights: the same path and settings, no probe.
    old = Identity.of("/models/target", False, default_sampling())
    (tmp_path / "identities").mkdir()
    (tmp_path / "identities" / f"{old.fingerprint}.json").write_text(json.dumps(old.to_dict()))
    now = identity("/models/target", probe("The keeper counts"))
    assert now.fingerprint == old.fingerprint  # nothing more is known of its weights: the same keys
    store.registry.register(now)
    store.registry.register(now)  # the same weights again
    # Another engine build may answer otherwise without the weights changing: recorded beside.
    store.registry.register(identity("/models/target", probe("The keeper", engine="sglang 0.5.24")))
    with pytest.raises(WeightsChangedError, match="token 2 of 3 differs"):
        store.registry.register(identity("/models/target", probe("The keeper sleeps", ids=(1, 2, 9))))


def test_a_damaged_registry_file_is_named_with_what_to_do(tmp_path):
    store = CompletionStore(tmp_path)
    store.registry.register(identity("/models/target", probe("The keeper counts")))
    [probe_file] = (tmp_path / "identities" / "probes").glob("*.json")
    probe_file.write_text("{not json")
    with pytest.raises(RegistryError, match=f"{probe_file}: not a weights probe .* Remove it"):
        store.registry.register(identity("/models/target", probe("The keeper counts")))
