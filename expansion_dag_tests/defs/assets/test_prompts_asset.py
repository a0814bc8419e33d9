"""The prompts asset reads each source in batches of rows: the same prompts and quarantine as whole."""

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from expansion_dag.defs.assets import prompts as prompts_module
from expansion_dag.defs.resources import StorageResource
from expansion_dag.prompts import SourceSchemaError, SourceSpec, extract_prompts

TURNS = [
    [{"from": "human", "value": "What is 2 + 2?"}, {"from": "gpt", "value": "4"}],
    [{"from": "gpt", "value": "no question here"}],  # quarantined: no user turn
    [{"from": "human", "value": "   "}],  # quarantined: empty
    [{"from": "human", "value": "Name a prime."}],
    [{"from": "human", "value": "Bonjour ?"}],  # filtered out: not English
    [{"from": "human", "value": "What is 2 + 2?"}],
    [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "Why is the sky blue?"}],
]
LANGUAGES = ["en", "en", "en", "en", "fr", "en", "en"]


def spec() -> SourceSpec:
    return SourceSpec(name="infinity_instruct", extractor="infinity_instruct", local_path="unused.parquet",
                      filters={"langdetect": "en"})  # fmt: skip


def write_raw(root, frame: pl.DataFrame) -> StorageResource:
    (root / "assets").mkdir(parents=True)
    frame.write_parquet(root / "assets" / "raw_infinity_instruct.parquet")
    return StorageResource(root=str(root))


def test_batches_give_what_the_whole_table_gives(tmp_path, monkeypatch):
    raw = pl.DataFrame({"id": list(range(len(TURNS))), "conversations": TURNS, "langdetect": LANGUAGES,
                        "label": ["unread"] * len(TURNS)})  # fmt: skip
    storage = write_raw(tmp_path, raw)
    source = spec()
    whole = extract_prompts(raw, source=source.name, extractor=source.extractor, filters=source.filter_map())
    monkeypatch.setattr(prompts_module, "EXTRACT_BATCH_ROWS", 2)
    batched = prompts_module._extract(storage, source)
    assert_frame_equal(batched.prompts, whole.prompts)
    assert_frame_equal(batched.quarantine, whole.quarantine)
    assert (batched.rows_read, batched.filtered) == (whole.rows_read, whole.filtered) == (7, 1)
    assert set(batched.quarantine["row_index"]) == {1, 2}


def test_an_empty_source_and_a_missing_column(tmp_path):
    empty = pl.DataFrame(schema={"conversations": pl.List(pl.Struct({"from": pl.String, "value": pl.String})),
                                 "langdetect": pl.String})  # fmt: skip
    result = prompts_module._extract(write_raw(tmp_path / "a", empty), spec())
    assert (result.rows_read, result.prompts.height, result.quarantine.height) == (0, 0, 0)
    storage = write_raw(tmp_path / "b", pl.DataFrame({"text": ["hi"], "langdetect": ["en"]}))
    with pytest.raises(SourceSchemaError, match="conversations"):
        prompts_module._extract(storage, spec())
