"""Every asset check reads the data as stored, so corrupting what was stored makes it fail."""

import shutil

import dagster as dg
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from expansion_dag.core import FAILED, Identity, ModeIdentities, load_tokenizer, local_path
from expansion_dag.defs import SHARD_KEYS
from expansion_dag.defs.assets import (
    CHECK_CONTEXT_REJECTIONS,
    CHECK_DRIFT,
    CHECK_FAILURE_RATE,
    CHECK_FITS,
    CHECK_IDS_UNIQUE,
    CHECK_LENGTH,
    CHECK_LOSS_MASK,
    CHECK_NO_EMPTY,
    CHECK_NOT_EMPTY,
    CHECK_ROUND_TRIP,
    CHECK_TRUNCATION,
    budgeted_prompts,
    completions,
    shard_prompts,
    stored_checks,
    stored_figures,
    training_set_checks,
)
from expansion_dag.defs.resources import ParquetIOManager
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import SEGMENT_GLOB
from expansion_dag.training import SCHEMA, Manifest, data_files, expected_renders
from expansion_dag_tests.defs.assets.test_completions import (
    FAST_SIM,
    prompts_asset,
    run_pipeline,
    small_frame,
)
from expansion_dag_tests.helpers import resources

SHARD = SHARD_KEYS[0]


def _first_message_blank(frame: pl.DataFrame) -> pl.DataFrame:
    blank = [[{"role": "user", "content": "   "}]] + frame["messages"].to_list()[1:]
    return frame.with_columns(pl.Series("messages", blank, dtype=frame.schema["messages"]))


#: What a faulty disk, a bad copy or a stale writer could leave in a shard's file, and which check sees it.
SHARD_CORRUPTIONS = {
    "a row stored twice": (lambda f: pl.concat([f, f.head(1)]), {CHECK_IDS_UNIQUE}),
    "a prompt's text lost": (_first_message_blank, {CHECK_NO_EMPTY, CHECK_FITS}),
    "a token count understated": (
        lambda f: f.with_columns(
            pl.when(pl.int_range(pl.len()) == 0).then(pl.col("prompt_tokens") - 7).otherwise(pl.col("prompt_tokens"))
            .alias("prompt_tokens")
        ),
        {CHECK_FITS},
    ),
    "a budget past the context": (
        lambda f: f.with_columns(
            pl.when(pl.int_range(pl.len()) == 1).then(pl.col("context_length")).otherwise(pl.col("max_tokens"))
            .alias("max_tokens")
        ),
        {CHECK_FITS},
    ),
}


class CorruptingParquetIO(ParquetIOManager):
    """The project's IO manager, except that the shard's file is stored damaged."""

    corruption: str = ""

    def create_io_manager(self, context):
        manager = super().create_io_manager(context)
        dump = manager.dump_to_path
        corrupt = SHARD_CORRUPTIONS[self.corruption][0] if self.corruption else None

        def dump_damaged(context, obj, path):
            damaged = corrupt and context.asset_key == dg.AssetKey("shard_prompts")
            dump(context, corrupt(obj) if damaged else obj, path)

        manager.dump_to_path = dump_damaged
        return manager


def failing_checks(result) -> set[str]:
    return {e.check_name for e in result.get_asset_check_evaluations() if not e.passed}


def test_shard_checks_fail_on_what_was_stored_not_on_what_was_computed(tmp_path, instance):
    assets = [prompts_asset(small_frame()), budgeted_prompts, shard_prompts]
    with SimulatedFleet([SimServerConfig(**FAST_SIM)] * len(SHARD_KEYS)) as fleet:
        res = resources(fleet.urls, tmp_path)
        assert dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"]).success
        failed = {}
        for name in ["", *SHARD_CORRUPTIONS]:
            res["parquet_io"] = CorruptingParquetIO(root=str(tmp_path), corruption=name)
            result = dg.materialize(assets, resources=res, instance=instance, partition_key=SHARD,
                                    selection=["shard_prompts"])
            assert len(result.get_asset_check_evaluations()) == 3
            failed[name] = failing_checks(result)
    assert failed.pop("") == set()
    assert failed == {name: expected for name, (_, expected) in SHARD_CORRUPTIONS.items()}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A training set built through Dagster on simulated completions (once for this module)."""
    root = tmp_path_factory.mktemp("pipeline")
    (root / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(root / "home")) as instance:
        with SimulatedFleet([SimServerConfig(**FAST_SIM)] * len(SHARD_KEYS)) as fleet:
            results, res = run_pipeline(small_frame(), fleet.urls, root, instance, training=True)
    assert all(r.success for r in results.values())
    assert failing_checks(results["training_set"]) == set()
    return res


@pytest.fixture
def built_set(pipeline, tmp_path):
    """A copy of the set to damage, and its checks (over the copy and the shared store)."""
    out_dir = tmp_path / "training_set"
    shutil.copytree(pipeline["storage"].path("training_set"), out_dir)
    settings = pipeline["settings"]
    manifest = Manifest.read(out_dir)
    context_length = manifest.config["max_length"]
    identities = ModeIdentities(settings.mix(), manifest.identity["model"], manifest.simulated)

    def checks() -> set[str]:
        store = pipeline["storage"].completion_store()
        config, tokenizer = settings.training_set_config(context_length), load_tokenizer()
        # Renders from the store afresh, not the build's own trace: the damage is in the files.
        expected = expected_renders(store.latest_records(), tokenizer, config, identities=identities)
        results = training_set_checks(out_dir, expected, tokenizer, config)
        assert len(results) == 4
        return {r.check_name for r in results if not r.passed}

    assert checks() == set()
    return out_dir, context_length, checks


def rewrite_rows(out_dir, change) -> None:
    """Rewrite the set's first file with ``change`` applied to its rows, as damaged storage would hold it."""
    path = data_files(out_dir)[0]
    rows = pq.read_table(path).to_pylist()
    pq.write_table(pa.Table.from_pylist(change(rows), schema=SCHEMA), path)


def test_a_row_that_trains_on_nothing_fails_loss_mask_not_empty(built_set):
    out_dir, _, checks = built_set
    rewrite_rows(out_dir, lambda rows: [{**rows[0], "loss_mask": [0] * len(rows[0]["loss_mask"])}, *rows[1:]])
    assert CHECK_LOSS_MASK in checks()


def test_a_row_over_the_context_fails_within_context_length(built_set):
    out_dir, context_length, checks = built_set
    times = context_length // len(pq.read_table(data_files(out_dir)[0])["input_ids"][0]) + 1
    long = lambda r: {**r, "input_ids": r["input_ids"] * times, "loss_mask": r["loss_mask"] * times,
                      "length": r["length"] * times}  # noqa: E731
    rewrite_rows(out_dir, lambda rows: [long(rows[0]), *rows[1:]])
    assert CHECK_LENGTH in checks()


def test_a_length_that_disagrees_with_the_ids_fails_within_context_length(built_set):
    out_dir, _, checks = built_set
    rewrite_rows(out_dir, lambda rows: [{**rows[0], "length": rows[0]["length"] - 1}, *rows[1:]])
    assert checks() == {CHECK_LENGTH, CHECK_ROUND_TRIP}


def test_a_changed_token_fails_round_trip(built_set):
    out_dir, _, checks = built_set
    swapped = lambda r: {**r, "input_ids": [r["input_ids"][0] + 1, *r["input_ids"][1:]]}  # noqa: E731
    rewrite_rows(out_dir, lambda rows: [swapped(rows[0]), *rows[1:]])
    assert checks() == {CHECK_ROUND_TRIP}


def test_a_set_whose_rows_are_lost_fails_has_samples(built_set):
    out_dir, _, checks = built_set
    for path in data_files(out_dir):
        pq.write_table(SCHEMA.empty_table(), path)
    assert checks() == {CHECK_NOT_EMPTY, CHECK_ROUND_TRIP}


def test_an_empty_training_set_fails_and_says_what_was_left_out(tmp_path, instance):
    """Every answer cut at its budget: 0 samples is a failure naming the reasons, not a success."""
    config = SimServerConfig(**{**FAST_SIM, "output_median_tokens": 400, "output_sigma": 0.1})
    with SimulatedFleet([config] * len(SHARD_KEYS)) as fleet:
        results, _ = run_pipeline(small_frame(), fleet.urls, tmp_path, instance, training=True,
                                  max_output_tokens=32, min_output_tokens=16)
    result = results.pop("training_set")
    assert all(r.success for r in results.values())
    assert not result.success
    [failure] = [e for e in result.all_events if e.is_step_failure]
    description = failure.event_specific_data.user_failure_data.description
    assert "no samples" in description and "truncated 24" in description
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert not evaluations[CHECK_NOT_EMPTY].passed
    assert evaluations[CHECK_NOT_EMPTY].metadata["left_out"].value["truncated"] == 24


@pytest.fixture
def generated_shard(tmp_path, instance):
    """One shard generated through Dagster on the simulator, every check passing; and a way to re-run it."""
    assets = [prompts_asset(small_frame(8)), budgeted_prompts, shard_prompts, completions]
    with SimulatedFleet([SimServerConfig(**FAST_SIM)] * len(SHARD_KEYS)) as fleet:
        res = resources(fleet.urls, tmp_path)
        assert dg.materialize(assets, resources=res, instance=instance, selection=["prompts", "budgeted_prompts"]).success

        def materialize() -> set[str]:
            result = dg.materialize(assets, resources=res, instance=instance, partition_key=SHARD,
                                    selection=["shard_prompts", "completions"], raise_on_error=False)
            evaluations = [e for e in result.get_asset_check_evaluations() if e.asset_key == completions.key]
            assert sorted(e.check_name for e in evaluations) == sorted(k.name for k in completions.check_keys)
            return {e.check_name for e in evaluations if not e.passed}

        assert materialize() == set()
        yield res, materialize


def stored(res) -> tuple[list[dict], Identity]:
    """The shard's records as stored, and the identity that wrote them."""
    store = res["storage"].completion_store()
    [identity] = store.registry.known().values()
    return list(store.latest_records(shards=[SHARD])), identity


def replace_records(res, changed: list[dict]) -> None:
    """Store ``changed`` in place of the shard's lines of the same keys, as a faulty disk or a stray writer would."""
    store = res["storage"].completion_store()
    keys = {r["key"].encode() for r in changed}
    segments = sorted(local_path(store.root / SHARD).glob(SEGMENT_GLOB))
    assert segments
    for path in segments:
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(line for line in lines if line.split(b"\t", 1)[0] not in keys))
    with store.writer(SHARD) as writer:
        for record in changed:
            writer.append(record)


def rerun_checks(res) -> set[str]:
    """The four data checks over the store as it is now, as the asset runs them."""
    records, identity = stored(res)
    keys = {identity.key(r["prompt_id"]) for r in records}
    figures = stored_figures(res["storage"].completion_store(), SHARD, keys, identity.owns)
    return {r.check_name for r in stored_checks(figures, res["settings"]) if not r.passed}


def test_a_stored_answer_cut_at_its_budget_fails_truncation_rate(generated_shard):
    res, materialize = generated_shard
    records, _ = stored(res)
    replace_records(res, [{**r, "finish_reason": "length"} for r in records[:2]])
    # Re-materializing sends nothing (every prompt has an answer); the check reads what is stored.
    assert materialize() == {CHECK_TRUNCATION}


def test_a_stored_prompt_count_unlike_the_local_one_fails_budget_drift(generated_shard):
    res, materialize = generated_shard
    records, _ = stored(res)
    replace_records(res, [{**records[0], "prompt_tokens": records[0]["local_prompt_tokens"] + 3}])
    assert materialize() == {CHECK_DRIFT}


def failure_of(record: dict, error: str) -> dict:
    return {"key": record["key"], "status": FAILED, "prompt_id": record["prompt_id"], "source": record["source"],
            "error": error, "http_status": 400, "message": "stored by the test", "attempts": 1,
            "server": record["server"], "max_tokens": record["max_tokens"]}


def test_stored_failures_fail_failure_rate(generated_shard):
    res, _ = generated_shard
    records, _ = stored(res)
    replace_records(res, [failure_of(records[0], "rejected")])
    assert rerun_checks(res) == {CHECK_FAILURE_RATE}


def test_a_stored_context_length_failure_fails_no_context_length_rejections(generated_shard):
    res, materialize = generated_shard
    records, _ = stored(res)
    assert rerun_checks(res) == set()
    replace_records(res, [failure_of(records[0], "context_length")])
    assert rerun_checks(res) == {CHECK_FAILURE_RATE, CHECK_CONTEXT_REJECTIONS}
    # A run sends the failed prompt again; its answer replaces the failure, and the checks pass.
    assert materialize() == set()


def test_stored_loops_fail_no_shard(generated_shard):
    res, _ = generated_shard
    records, _ = stored(res)
    replace_records(res, [failure_of(records[0], "degenerate")])
    assert rerun_checks(res) == set()
