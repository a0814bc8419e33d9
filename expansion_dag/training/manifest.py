"""What a training set folder's ``manifest.json`` holds: read by the dataset card, the checks and
the CLI's summary, written by ``expansion_dag.training.build`` last, so its presence marks a whole set.
And which folder a published set's name stands for (``current_version``: ``training.publish``)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from upath import UPath

from expansion_dag.core import as_upath, is_local, local_path

MANIFEST_NAME = "manifest.json"


def current_version(set_path: str | os.PathLike[str]) -> UPath:
    """The folder of the version ``set_path`` (``<root>/training_set``) names now, read once: its link
    followed on a local root, its pointer (``training_set.json`` beside it) read on an object store.
    A folder that is a set itself (a version, an earlier release's set, a test's) is itself."""
    path = as_upath(set_path)
    if is_local(path):
        return as_upath(os.path.realpath(local_path(path)))
    try:
        named = json.loads((path.parent / f"{path.name}.json").read_text())
    except FileNotFoundError:
        return path
    return path.parent / named["path"]


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` holds; written last, so its presence marks a complete set."""

    samples: int
    tokens: int
    assistant_tokens: int
    tokens_per_sample: dict[str, float]  # mean, p50, p90, p99 (nearest rank), max
    by_source: dict[str, dict[str, int]]  # source -> {samples, tokens}
    left_out: dict[str, int]  # reason -> records
    other_identities: dict[str, int]  # Identity.label (or UNREGISTERED) -> records left out
    identity: dict[str, Any]  # the identity taken (Identity.to_dict); for a mix of modes, one fingerprint of all
    simulated: bool  # built from the simulator's answers, not a model's
    histogram: dict[str, Any]  # tokens per sample: {start, bin_width, counts}
    config: dict[str, Any]
    tokenizer: dict[str, Any]  # {vocab_size, chat_template_sha256}
    files: list[dict[str, Any]]  # {name, rows, sha256}
    # Output tokens of the identity's records (completions, and failures that streamed tokens),
    # those of the records that became rows, and their ratio: how much generation the set kept.
    output_tokens: int = 0
    output_tokens_in_set: int = 0
    useful_token_share: float = 0.0
    outputs: dict[str, list[str]] = field(default_factory=dict)  # format -> its files in the folder
    trainer_files: list[dict[str, Any]] = field(default_factory=list)  # the JSONL files: {name, sha256}
    mask_convention: str = ""
    # Each generation mode: {share (configured), fingerprint, settings, samples, sample_share (of the
    # rows), assistant_tokens}; a run without modes has the one mode "default".
    modes: dict[str, dict[str, Any]] = field(default_factory=dict)
    conversations: int = 0  # rows that are whole regenerated conversations
    conversation_turns_folded: int = 0  # records of their earlier turns: in those rows, not rows themselves
    # Rows cut before a stopped loop (``loop_prefix: keep``; the rows' ``truncated: loop``), by rule.
    loop_rows: dict[str, int] = field(default_factory=dict)
    # Rows by where their ids come from ({"server", "retokenized"}: training_set.FROM_SERVER, RETOKENIZED),
    # and why each re-tokenized row is (training_set.NO_IDS...).
    ids_from: dict[str, int] = field(default_factory=dict)
    retokenized_because: dict[str, int] = field(default_factory=dict)
    ids_text_differs: int = 0  # rows from ids that do not decode to the server's text: the ids won
    # Rows from ids re-tokenized too, on a stated sample: how many, and how many of them differ in
    # their whole ids and in their prompt ids (the client's render against the server's), in tokens.
    retokenization: dict[str, Any] = field(default_factory=dict)
    # A build in parts (``training.parts``): {"parts", "built", "reused", "rebuilt_all_because"}
    # (the reason every part was built again, or null); empty for a set built in one pass.
    parts: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def read(cls, out_dir: str | os.PathLike[str]) -> Manifest:
        """The manifest of the set ``out_dir`` is, or names (``current_version``)."""
        return cls(**json.loads((current_version(out_dir) / MANIFEST_NAME).read_text()))
