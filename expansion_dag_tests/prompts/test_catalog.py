"""The source catalog: YAML validation, loading every bundled sample through ``datasets``, clean
failures that name the source and never the token, and fingerprints."""

import logging
import os
import shutil
import traceback
from pathlib import Path

import datasets
import huggingface_hub
import polars as pl
import pytest

from expansion_dag.prompts import (
    Catalog,
    CatalogError,
    SourceLoadError,
    SourceSpec,
    extract_prompts,
    load_catalog,
    load_source,
    package_dir,
    source_fingerprint,
)

SAMPLE_ROWS = {
    "infinity_instruct": 60,
    "webinstructsub": 40,
    "codefeedback": 38,
    "metamathqa": 37,
    "hermes_fc": 42,
    "agentinstruct": 26,
}
TOKEN = "hf_NotARealTokenButSecret1234567890"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hf-cache")


@pytest.fixture(scope="module")
def samples():
    return load_catalog("samples")


@pytest.fixture(scope="module")
def loaded(samples, cache_dir):
    return {spec.name: load_source(spec, cache_dir=cache_dir) for spec in samples.sources}


def write_catalog(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_every_bundled_sample_loads_in_its_real_schema(loaded):
    assert {name: ds.num_rows for name, ds in loaded.items()} == SAMPLE_ROWS
    columns = {name: set(ds.column_names) for name, ds in loaded.items()}
    assert columns["infinity_instruct"] == {"id", "conversations", "label", "langdetect", "source"}
    assert columns["webinstructsub"] == {
        "orig_question",
        "orig_answer",
        "question",
        "answer",
        "source",
        "index",
    }
    assert columns["codefeedback"] == {"query", "answer", "resource", "lang"}
    assert columns["metamathqa"] == {"type", "query", "original_question", "response"}
    assert columns["hermes_fc"] == {"id", "conversations", "category", "subcategory", "task"}
    assert columns["agentinstruct"] == {"id", "conversations"}
    assert set(loaded["infinity_instruct"].features["label"]) == {
        "ability_en",
        "ability_zh",
        "cate_ability_en",
        "cate_ability_zh",
    }
    assert set(loaded["agentinstruct"].features["conversations"].feature) == {"from", "loss", "value"}


def test_configs_and_splits_are_concatenated_in_catalog_order(loaded, samples):
    configs = samples.source("hermes_fc").configs
    prefixes = [i.rsplit("-", 1)[0] for i in loaded["hermes_fc"]["id"]]
    assert list(dict.fromkeys(p for p in prefixes if p in configs)) == list(configs)
    agent_ids = loaded["agentinstruct"]["id"]
    assert list(dict.fromkeys(i.split("_")[0] for i in agent_ids)) == [
        "os",
        "db",
        "alfworld",
        "webshop",
        "kg",
        "mind2web",
    ]


def test_production_catalog_names_the_real_hub_sources():
    production = load_catalog("production")
    by_name = {s.name: s for s in production.sources}
    assert [(s.hub_id, s.config, s.split) for s in production.sources] == [
        ("BAAI/Infinity-Instruct", "0625", "train"),
        ("TIGER-Lab/WebInstructSub", None, "train"),
        ("m-a-p/CodeFeedback-Filtered-Instruction", None, "train"),
        ("meta-math/MetaMathQA", None, "train"),
        (
            "NousResearch/hermes-function-calling-v1",
            (
                "func_calling_singleturn",
                "func_calling",
                "glaive_func_calling",
                "json_mode_agentic",
                "json_mode_singleturn",
            ),
            "train",
        ),
        ("THUDM/AgentInstruct", None, ("os", "db", "alfworld", "webshop", "kg", "mind2web")),
    ]
    assert all(s.local_path is None and s.revision for s in production.sources)
    assert by_name["infinity_instruct"].filter_map() == {"langdetect": ["en"]}
    assert len(by_name["hermes_fc"].parts()) == 5 and len(by_name["agentinstruct"].parts()) == 6
    # Hermes is regenerated turn by turn; AgentInstruct's later turns need its environment.
    assert [s.name for s in production.sources if s.conversation] == ["hermes_fc"]


def test_samples_catalog_mirrors_production_but_reads_bundled_files(samples):
    def described(catalog):
        return [(s.name, s.hub_id, s.config, s.split, s.extractor, s.conversation) for s in catalog.sources]

    production = load_catalog("production")
    assert described(samples) == described(production)
    samples_dir = str(package_dir("samples"))
    assert all(s.local_path.startswith(samples_dir) for s in samples.sources)


def test_hub_source_fails_cleanly_offline_naming_the_source(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    spec = load_catalog("production").source("infinity_instruct")
    with caplog.at_level(logging.DEBUG), pytest.raises(SourceLoadError) as excinfo:
        load_source(spec, cache_dir=tmp_path)
    message = str(excinfo.value)
    assert "'infinity_instruct'" in message and "BAAI/Infinity-Instruct" in message and "'0625'" in message
    assert TOKEN not in "".join(traceback.format_exception(excinfo.value))
    assert TOKEN not in caplog.text


def test_token_in_a_library_error_is_masked_and_the_chain_dropped(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    def leaky_load(*args, **kwargs):
        raise OSError(f"401 Unauthorized for https://hub.example/api?token={kwargs['token']}")

    monkeypatch.setattr(datasets, "load_dataset", leaky_load)
    spec = load_catalog("production").source("webinstructsub")
    with pytest.raises(SourceLoadError) as excinfo:
        load_source(spec, cache_dir=tmp_path)
    assert "401 Unauthorized" in str(excinfo.value) and "***" in str(excinfo.value)
    assert TOKEN not in "".join(traceback.format_exception(excinfo.value))


def test_missing_and_corrupt_local_files_raise_source_load_error(tmp_path):
    missing = SourceSpec(name="gone", extractor="codefeedback", local_path=str(tmp_path / "nothing-*.jsonl"))
    with pytest.raises(SourceLoadError, match=r"source 'gone'.*no file matches"):
        load_source(missing, cache_dir=tmp_path / "cache")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"query": "fine"}\n{"query": "unterminated\n', encoding="utf-8")
    corrupt = SourceSpec(name="broken", extractor="codefeedback", local_path=str(broken))
    with pytest.raises(SourceLoadError, match=r"source 'broken': cannot load local files .*broken\.jsonl"):
        load_source(corrupt, cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("content", ["", "\n \n"])
def test_an_empty_local_file_is_an_error_naming_it(tmp_path, content):
    (tmp_path / "full.jsonl").write_text('{"query": "fine"}\n', encoding="utf-8")
    (tmp_path / "empty.jsonl").write_text(content, encoding="utf-8")
    spec = SourceSpec(name="mine", extractor="codefeedback", local_path=str(tmp_path / "*.jsonl"))
    with pytest.raises(SourceLoadError) as error:
        load_source(spec, cache_dir=tmp_path / "cache")
    assert str(error.value).endswith(f"ValueError: {tmp_path / 'empty.jsonl'}: empty: give it rows, or remove it")


def two_config_source(tmp_path, a, b):
    """A local source whose configs ``a`` and ``b`` are the given JSON texts."""
    (tmp_path / "a.json").write_text(a)
    (tmp_path / "b.json").write_text(b)
    return SourceSpec(
        name="mixed",
        extractor="hermes_function_calling",
        config=["a", "b"],
        local_path=str(tmp_path / "{config}.json"),
    )


def test_parts_with_different_columns_are_aligned(tmp_path):
    spec = two_config_source(
        tmp_path,
        '[{"id": "a1", "conversations": [{"from": "human", "value": "hi"}], "task": "t"}]',
        '[{"id": "b1", "conversations": [{"from": "human", "value": "yo", "weight": 1}]}]',
    )
    dataset = load_source(spec, cache_dir=tmp_path / "cache")
    assert dataset["id"] == ["a1", "b1"]
    assert dataset["task"] == ["t", None]


def test_a_mistyped_row_in_one_config_does_not_break_the_others(tmp_path):
    spec = two_config_source(
        tmp_path,
        '[{"conversations": [{"from": "human", "value": "fine"}]}]',
        '[{"conversations": [{"from": "human", "value": "also fine"}]}, {"conversations": "oops"}]',
    )
    raw = pl.from_arrow(load_source(spec, cache_dir=tmp_path / "cache").data.table)
    result = extract_prompts(raw, source=spec.name, extractor=spec.extractor)
    assert [m[0]["content"] for m in result.prompts["messages"].to_list()] == ["fine", "also fine"]
    assert result.quarantine.select("row_index", "reason").rows() == [(2, "mistyped_field")]


def test_relative_local_path_is_read_next_to_the_catalog_or_under_its_local_root(tmp_path):
    own = tmp_path / "data" / "mine.jsonl"
    own.parent.mkdir()
    own.write_text('{"query": "What is 2 + 2?"}\n', encoding="utf-8")
    mine = "  - {name: mine, extractor: codefeedback, local_path: mine.jsonl}\n"
    catalog = load_catalog(write_catalog(tmp_path / "cat.yaml", "local_root: data\nsources:\n" + mine))
    assert catalog.source("mine").local_path == str(own) and catalog.source("mine").format == "jsonl"
    # The samples shipped with the package, when the catalog says so.
    bundled = load_catalog(write_catalog(
        tmp_path / "bundled.yaml",
        "local_root: bundled\nsources:\n  - {name: b, extractor: metamathqa, local_path: metamathqa/MetaMathQA-395K.json}\n",
    ))
    assert bundled.source("b").local_path == str(package_dir("samples") / "metamathqa" / "MetaMathQA-395K.json")
    assert bundled.source("b").format == "json"


def test_defaults_apply_unless_a_source_overrides_them(tmp_path):
    path = write_catalog(
        tmp_path / "cat.yaml",
        "seed: 7\n"
        "defaults: {turn: last, max_chars: 5000, revision: abc123}\n"
        "sources:\n"
        "  - {name: a, extractor: metamathqa, hub_id: meta-math/MetaMathQA}\n"
        "  - {name: b, extractor: agentinstruct, hub_id: THUDM/AgentInstruct, turn: 2}\n",
    )
    catalog = load_catalog(path)
    assert catalog.seed == 7 and dict(catalog.defaults) == {
        "turn": "last",
        "max_chars": 5000,
        "revision": "abc123",
    }
    assert [(s.turn, s.max_chars, s.revision) for s in catalog.sources] == [
        ("last", 5000, "abc123"),
        (2, 5000, "abc123"),
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: x/y, qouta: 5}\n",
            r"unknown key 'qouta'; did you mean 'quota'\?",
        ),
        ("sauces: []\n", r"unknown key 'sauces'"),
        ("defaults: {colour: red}\nsources: []\n", r"defaults: unknown key 'colour'"),
        ("sources: []\n", r"sources must be a non-empty list"),
        (
            "sources:\n  - {name: Bad-Name, extractor: codefeedback, hub_id: x/y}\n",
            r"source 'Bad-Name': name: must be 1-32 lowercase",
        ),
        (
            "sources:\n  - {name: a, extractor: alpaca, hub_id: x/y}\n",
            r"extractor: unknown 'alpaca'; known: infinity_instruct",
        ),
        ("sources:\n  - {name: a, extractor: codefeedback}\n", r"hub_id: set hub_id or local_path"),
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: nope}\n",
            r"hub_id: must look like 'owner/name'",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: x/y, quota: 5, weight: 1}\n",
            r"weight: set a quota or a weight, not both",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: x/y, quota: -1}\n",
            r"quota: must be an integer of at least 0",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: x/y, turn: 0}\n",
            r"turn: must be a positive integer or 'last'",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: x/y, format: csv}\n",
            r"format: only applies to a local_path",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, local_path: data.csv}\n",
            r"format: cannot tell it from the extension",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: x/y, split: [a, b], local_path: d.json}\n",
            r"local_path: must contain \{split\}",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, local_path: '{lang}.json'}\n",
            r"local_path: unknown placeholders \['lang'\]",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: x/y, filters: {lang: []}}\n",
            r"filters: lang: must be a value or a non-empty list",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: x/y, weight: 2}\n",
            r"total_prompts: required because a set a weight",
        ),
        (
            "total_prompts: 10\nsources:\n  - {name: a, extractor: codefeedback, hub_id: x/y}\n",
            r"total_prompts: set, but no source has a weight",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: x/y}\n  - {name: a, extractor: metamathqa, hub_id: x/z}\n",
            r"duplicate names a",
        ),
        ("sources:\n  - {extractor: codefeedback, hub_id: x/y}\n", r"sources\[0\]: .*name"),
        (
            "sources:\n  - {name: a, extractor: agentinstruct, hub_id: x/y, conversation: true, turn: 2}\n",
            r"conversation: regenerates every turn, so it cannot be combined with turn 2",
        ),
        (
            "sources:\n  - {name: a, extractor: codefeedback, hub_id: x/y, conversation: true}\n",
            r"conversation: extractor 'codefeedback' reads one text column",
        ),
        (
            "sources:\n  - {name: a, extractor: agentinstruct, hub_id: x/y, conversation: 'yes'}\n",
            r"conversation: must be true or false, got 'yes'",
        ),
    ],
)
def test_invalid_catalogs_name_the_field(tmp_path, text, message):
    with pytest.raises(CatalogError, match=message):
        load_catalog(write_catalog(tmp_path / "cat.yaml", text))


def test_unknown_catalog_name_is_explained():
    with pytest.raises(
        CatalogError, match=r"'staging': no such file, and not a bundled catalog \(samples, production\)"
    ):
        load_catalog("staging")


def test_catalog_built_in_code_is_validated_too():
    spec = SourceSpec(name="a", extractor="codefeedback", hub_id="x/y", weight=1.5)
    assert Catalog(sources=[spec], total_prompts=10).sources == (spec,)
    with pytest.raises(CatalogError, match="seed: must be an integer"):
        Catalog(sources=(spec,), seed="0", total_prompts=10)
    assert SourceSpec(name="b", extractor="codefeedback", hub_id="x/y", filters={"lang": "en"}).filters == (
        ("lang", ("en",)),
    )


def test_fingerprint_follows_local_files_and_hub_revision(tmp_path):
    source = package_dir("samples") / "metamathqa" / "MetaMathQA-395K.json"
    copy = tmp_path / "math.json"
    shutil.copy(source, copy)
    spec = SourceSpec(name="math", extractor="metamathqa", local_path=str(copy))
    first = source_fingerprint(spec)
    assert source_fingerprint(spec) == first
    copy.write_text(copy.read_text(encoding="utf-8").replace("42", "43", 1), encoding="utf-8")
    os.utime(copy, ns=(1, 1))
    assert source_fingerprint(spec) != first

    hub = SourceSpec(name="math", extractor="metamathqa", hub_id="meta-math/MetaMathQA", revision="aaa111")
    assert source_fingerprint(hub) == "hub:meta-math/MetaMathQA|config=default|split=train|revision=aaa111"
    assert source_fingerprint(hub.model_copy(update={"revision": "bbb222"})) != source_fingerprint(hub)
