"""Naming the weights a launched fleet serves: a hub snapshot's commit, else a digest of the folder's
weight files that changes with any tensor's bytes and not with where the folder is."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from expansion_dag.config import SGLANG_LAUNCH_COMMAND, SIMULATOR_LAUNCH_COMMAND
from expansion_dag.defs.resources import FleetResource
from expansion_dag.servers import folder_weights, hub_commit, probe_fleet
from expansion_dag.servers.probing import weights as weights_module
from expansion_dag.sim import SimServerConfig, SimulatedFleet

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def model_folder(path: Path, seed: int = 0) -> Path:
    """A model folder as ``save_pretrained`` writes one: a config and a safetensors file of two
    layers' tensors of one shape."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    save_file({f"model.layers.{i}.mlp.weight": rng.standard_normal((64, 256)).astype(np.float32) for i in range(2)},
              str(path / "model.safetensors"))
    return path


def test_a_folders_weights_are_named_by_what_is_in_them_not_by_where_it_is(tmp_path):
    folder = model_folder(tmp_path / "target")
    label = folder_weights(str(folder))
    assert label is not None and label.startswith("files ")
    shutil.copytree(folder, tmp_path / "elsewhere")
    assert folder_weights(str(tmp_path / "elsewhere")) == label
    (folder / "notes.txt").write_text("not a weight file")
    assert folder_weights(str(folder)) == label


@pytest.mark.parametrize("change", ["fine-tune", "swapped layers", "config"])
def test_new_weights_copied_over_a_folder_are_named_otherwise(tmp_path, change):
    folder = model_folder(tmp_path / "target")
    before = folder_weights(str(folder))
    tensors = load_file(str(folder / "model.safetensors"))
    if change == "fine-tune":  # the same names, shapes and sizes, other values
        tensors = {name: t + np.float32(1e-3) for name, t in tensors.items()}
    elif change == "swapped layers":
        a, b = sorted(tensors)
        tensors = {a: tensors[b], b: tensors[a]}
    if change == "config":
        (folder / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 3}')
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    assert folder_weights(str(folder)) != before


def test_a_hub_snapshot_is_named_by_its_commit_from_its_folder_or_the_hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = cache / "models--Qwen--Qwen3-8B" / "snapshots" / COMMIT
    model_folder(snapshot)
    (cache / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (cache / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(weights_module, "HF_HUB_CACHE", str(cache))
    assert folder_weights(str(snapshot)) == f"commit {COMMIT}"
    assert folder_weights("Qwen/Qwen3-8B") == f"commit {COMMIT}"
    assert hub_commit("Qwen/Qwen3-8B", COMMIT) == COMMIT
    assert hub_commit("Qwen/Qwen3-8B", "v2") is None and folder_weights("Qwen/Qwen3-14B") is None


def test_a_launched_fleets_identity_names_its_folders_weights_and_the_revision(tmp_path):
    folder = model_folder(tmp_path / "target")
    with SimulatedFleet([SimServerConfig(port=0)]) as fleet:
        info = probe_fleet(fleet.urls, backend="sglang", stream_interval=1)
    launched = FleetResource(mode="launch", launch_command=SGLANG_LAUNCH_COMMAND, model_path=str(folder),
                             model_revision="sft-3")
    assert launched.weights(info) == f"{folder_weights(str(folder))}, revision sft-3"
    # A simulator serves no weights; attached servers name none of their own (vLLM, SGLang unset).
    simulated = FleetResource(mode="launch", launch_command=SIMULATOR_LAUNCH_COMMAND, model_path=str(folder))
    assert simulated.weights(info) == ""
    assert FleetResource(mode="attach", urls=fleet.urls, model_revision="sft-3").weights(info) == "revision sft-3"


def test_a_single_weight_file_is_named_by_its_samples(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(bytes(range(256)) * 4096)  # 1 MiB: 64 samples of 4 KiB, 16 KiB apart
    before = folder_weights(str(gguf))
    assert before is not None and before.startswith("files ")
    with open(gguf, "r+b") as fh:  # a tensor of 32 KiB changed, as a fine-tune changes every one
        fh.seek(500_000)
        fh.write(b"\xff" * 32768)
    assert folder_weights(str(gguf)) != before
