"""The run configuration file: the bundled default, validation naming key and file, overrides."""

import importlib.metadata
import re
from pathlib import Path

import pytest
import yaml

from expansion_dag.config import ConfigError, bundled_config_path, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path, document) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_the_bundled_file_reproduces_the_demo():
    config = load_config(bundled_config_path(), env={})
    assert (config.fleet.mode, config.fleet.shards, config.catalog) == ("simulate", 2, "samples")
    assert config.storage_root() == str(Path.cwd() / "storage")
    assert config.model.tokenizer == "qwen3-bundled"
    assert (config.schedule.cron, config.schedule.timezone, config.schedule.quota) == ("0 2 * * *", "UTC", 1000)


def keys(data, prefix="", *, sections=True):
    """The dotted keys of a configuration (``sections``: the sections' own too); the two fields
    that are mappings are keys, not sections."""
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("expected_output_by_source", "chat_template_kwargs"):
            if sections:
                yield prefix + key
            yield from keys(value, prefix + key + ".", sections=sections)
        else:
            yield prefix + key


def test_the_bundled_file_documents_every_key():
    text = bundled_config_path().read_text()
    config = load_config(bundled_config_path(), env={})

    # "A key left out takes the default shown here": the file shows exactly the defaults.
    assert config.masked() == parse_config({}, where="empty.yaml", env={}).masked()
    for dotted in keys(config.masked()):
        # Each key is written out (with its default) in the file a user copies.
        assert re.search(rf"^\s*{re.escape(dotted.rsplit('.', 1)[-1])}:", text, re.M), dotted


def test_a_file_sets_the_generation_settings_and_the_fleet(tmp_path):
    path = write(tmp_path, {
        "fleet": {"urls": ["http://a:1", "http://b:2/"], "mode": "attach"},
        "generation": {"temperature": 0.3, "max_output_tokens": 300, "chat_template_kwargs": {"enable_thinking": False},
                       "expected_output_by_source": {"metamathqa": 400}, "reasoning": "drop"},
    })
    config = load_config(path, env={})
    assert config.fleet.urls == ["http://a:1", "http://b:2"]
    assert config.generation.temperature == 0.3 and config.generation.max_output_tokens == 300
    assert config.generation.chat_template_kwargs == '{"enable_thinking": false}'
    assert config.masked()["generation"]["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize(
    "document, expected",
    [
        ({"generation": {"temprature": 0.5}}, r"generation\.temprature: unknown key \(did you mean 'temperature'\?\)"),
        ({"fleet": {"launch": {"port": 1}}}, r"fleet\.launch\.port: unknown key"),
        ({"storage": "/data"}, r"storage: Input should be a valid dictionary"),
        ({"generation": {"temperature": 3}}, r"generation\.temperature: Input should be less than or equal to 2"),
        ({"generation": {"chat_template_kwargs": [1]}}, r"generation\.chat_template_kwargs: must be a mapping"),
        ({"generation": {"reasoning": "hide"}}, r"generation\.reasoning: Input should be 'keep' or 'drop'"),
        ({"fleet": {"mode": "attach", "urls": ["http://a:1"]}}, r"fleet: attach mode needs one URL per shard: 1 URL"),
        ({"fleet": {"urls": ["gpu-node:30000"]}}, r"fleet\.urls: 'gpu-node:30000' is not an http\(s\) URL"),
        ({"schedule": {"timezone": "Mars/Olympus"}}, r"schedule\.timezone: unknown time zone"),
        ({"schedule": {"cron": "every night"}}, r"schedule\.cron: must be a cron expression"),
        ({"storage": {"lease_timeout_s": 0.1}}, r"storage\.lease_timeout_s: Input should be greater than or equal to 1"),
        ({"storage": {"when_shard_busy": "skip"}}, r"storage\.when_shard_busy: Input should be 'wait' or 'fail'"),
    ],
)
def test_a_bad_file_is_an_error_naming_the_key_and_the_file(tmp_path, document, expected):
    path = write(tmp_path, document)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(path) in str(info.value)
    assert re.search(expected, str(info.value)), str(info.value)


def test_a_missing_file_is_an_error_not_a_default(tmp_path):
    with pytest.raises(ConfigError, match=r"run configuration '.*nowhere\.yaml': no such file"):
        load_config(tmp_path / "nowhere.yaml", env={})


def test_variables_override_single_fields_and_name_themselves_when_bad(tmp_path):
    path = write(tmp_path, {"generation": {"temperature": 0.2}, "fleet": {"shards": 2}})
    config = load_config(path, env={"EXPANSION_FLEET_URLS": "http://a:1,http://b:2", "EXPANSION_NIGHTLY_QUOTA": "7"})
    assert (config.fleet.mode, config.fleet.urls, config.schedule.quota) == ("attach", ["http://a:1", "http://b:2"], 7)
    assert config.generation.temperature == 0.2  # the rest of the file holds
    assert load_config(path, env={"EXPANSION_PROFILE": "local"}).fleet.mode == "simulate"
    assert load_config(path, env={"EXPANSION_PROFILE": "production"}).fleet.mode == "launch"
    with pytest.raises(ConfigError, match=r"\$EXPANSION_SHARDS \(overrides fleet\.shards of .*run\.yaml\): .*greater than or equal to 1"):
        load_config(path, env={"EXPANSION_SHARDS": "0"})
    with pytest.raises(ConfigError, match=r"\$EXPANSION_FLEET_FALLBACK \(overrides fleet\.fallback_to_healthy\)"):
        load_config(path, env={"EXPANSION_FLEET_FALLBACK": "maybe"})


def test_the_slots_variable_sets_fleet_slots_and_names_itself_when_bad(tmp_path):
    # The variable the fleet's error names where a server reports no slots (servers/test_fleet.py).
    path = write(tmp_path, {"fleet": {"backend": "vllm"}})
    assert load_config(path, env={}).fleet.slots is None
    assert load_config(path, env={"EXPANSION_SLOTS": "48"}).fleet.slots == 48
    with pytest.raises(ConfigError, match=r"\$EXPANSION_SLOTS \(overrides fleet\.slots of .*run\.yaml\): .*greater than or equal to 1"):
        load_config(path, env={"EXPANSION_SLOTS": "0"})


def test_the_recorded_configuration_masks_secrets(tmp_path):
    config = parse_config(
        {"fleet": {"mode": "attach", "shards": 1, "urls": ["https://user:hunter2@gpu-node:30000"]},
         "storage": {"root": "s3://key:secret@bucket/prefix"}},
        where="run.yaml", env={},
    )
    recorded = str(config.masked())
    assert "hunter2" not in recorded and "secret" not in recorded
    assert config.masked()["fleet"]["urls"] == ["https://user:***@gpu-node:30000"]
    # The digest follows the values that matter.
    changed = parse_config({"generation": {"temperature": 0.1}}, where="run.yaml", env={})
    assert changed.digest() != parse_config({}, where="run.yaml", env={}).digest()


def test_the_quick_start_installs_no_test_only_package():
    # What pip installs for `pip install -e .` versus `.[test]`, as the installed metadata says.
    requirements = importlib.metadata.requires("expansion_dag") or []
    name = lambda req: re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower()  # noqa: E731
    base = {name(r) for r in requirements if "extra ==" not in r}
    test_only = {name(r) for r in requirements if re.search(r"extra\s*==\s*['\"]test['\"]", r)}
    assert {"pytest", "playwright", "moto", "dagster-k8s"} <= test_only
    assert not base & test_only
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):readme.index("**(2)**")]
    assert "pip install -e . &&" in quick_start and "[test]" not in quick_start


def test_the_configuration_docs_table_names_every_key_and_no_other():
    """docs/configuration.md's table is the third place a field is described (beside the schema and
    the bundled file's comments): it must not drift from them."""
    config = load_config(bundled_config_path(), env={})
    documented = set()
    for row in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        if not row.startswith("| `"):
            continue
        first, *others = re.findall(r"`([^`]+)`", row.split("|")[1])
        documented.add(first)  # `section.key`, then `key`s of the same section
        documented |= {f"{first.rsplit('.', 1)[0]}.{name}" for name in others}
    assert documented == set(keys(config.masked(), sections=False))
