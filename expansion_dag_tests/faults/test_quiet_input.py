"""Input that used to go wrong quietly is an error naming the file and the fix: a catalog's relative
local_path that matches nothing (never the bundled sample of the same name instead), a damaged
identity file in the store (never a bare error that blocks every writer and build), a run
configuration or catalog that is not UTF-8 text."""

from __future__ import annotations

import json

import pytest

from expansion_dag.config import ConfigError, load_config
from expansion_dag.core import Identity
from expansion_dag.prompts import CatalogError, load_catalog
from expansion_dag.store import CompletionStore, RegistryError
from expansion_dag_tests.helpers import default_sampling

#: A production catalog whose relative path names a file the bundled samples also have.
CATALOG = """\
sources:
  - name: metamathqa
    extractor: metamathqa
    local_path: metamathqa/MetaMathQA-395K.json
"""


def test_a_missing_relative_local_path_is_an_error_never_the_bundled_sample(tmp_path):
    catalog = tmp_path / "production.yaml"
    catalog.write_text(CATALOG)
    with pytest.raises(CatalogError) as raised:
        load_catalog(catalog)
    message = str(raised.value)
    assert str(catalog) in message and str(tmp_path / "metamathqa" / "MetaMathQA-395K.json") in message
    assert "fix the path, make it absolute, or set local_root" in message
    # Once the data is where the catalog says, it is read from there.
    (tmp_path / "metamathqa").mkdir()
    (tmp_path / "metamathqa" / "MetaMathQA-395K.json").write_text('[{"query": "What is 2 + 2?"}]')
    assert load_catalog(catalog).source("metamathqa").local_path == str(tmp_path / "metamathqa" / "MetaMathQA-395K.json")


IDENTITY = Identity.of("Qwen/Qwen3-8B", False, default_sampling())
DAMAGE = {
    "not JSON": b'{"model": "Qwen/Qwen3-8B", "simu',
    "not UTF-8": b'{"model": "Qwen\xff"}',
    "not an object": b"[1, 2]",
    "a field missing": json.dumps({"model": "Qwen/Qwen3-8B", "fingerprint": IDENTITY.fingerprint}).encode(),
    "another fingerprint": json.dumps({**IDENTITY.to_dict(), "fingerprint": "0" * 16}).encode(),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_identity_file_is_named_with_what_to_do_by_writers_and_builds(tmp_path, damage):
    store = CompletionStore(tmp_path)
    store.registry.register(IDENTITY)
    entry = tmp_path / "identities" / f"{IDENTITY.fingerprint}.json"
    entry.write_bytes(DAMAGE[damage])
    other = Identity.of("Qwen/Qwen3-8B", False, default_sampling(temperature=0.1))
    # A writer of any identity, and a build reading who wrote the store, meet it the same way.
    for blocked in (lambda: store.writer("shard-00", identities=[other]), store.registry.known):
        with pytest.raises(RegistryError) as raised:
            blocked()
        message = str(raised.value)
        assert message.startswith(f"{entry}: not an identity of this store")
        assert "Restore it from a copy, or remove it" in message


def test_a_run_configuration_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes("catalog: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"{path}: not UTF-8 text \(byte 12 is b'\\xe9'\): save the file as UTF-8"):
        load_config(path, env={})


def test_a_catalog_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_bytes(CATALOG.replace("metamathqa/", "caf\u00e9/").encode("latin-1"))
    with pytest.raises(CatalogError, match=r"catalog '.*catalog\.yaml': not UTF-8 text \(byte \d+\): save the file as UTF-8"):
        load_catalog(path)
