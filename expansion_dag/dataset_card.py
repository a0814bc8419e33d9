"""The dataset card (``README.md``) a training set folder carries: what a trainer needs to know.

Its identity (model, settings, simulated or not), its counts (by source, and what was left out and
why), the mask convention, each output's file, and how each trainer loads it, with the command to
run from the folder. Written from the manifest alone, by the build that writes the manifest.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from expansion_dag.manifest import Manifest

#: How each trainer's own renderer differs from the set's rows when it reads the conversations
#: (pre-tokenized rows it takes unchanged). expansion_dag_tests/trainers/ proves these, row by row.
CONSUMER_NOTES = {
    "specforge-conversations": (
        "SpecForge renders and masks the conversations itself. It adds its template's default "
        "system prompt (`You are a helpful assistant.`, mask 0) to a conversation that has none, "
        "and trains the newline after the end-of-turn token. Otherwise it masks as this set does: "
        "`qwen3-thinking` (thinking on) trains the reasoning with its think tags, `qwen3-instruct` "
        "(thinking off) leaves the empty think block untrained (its `ignore_token`)."
    ),
    "speculators-conversations": (
        "speculators renders conversations through vLLM's `/v1/chat/completions/render` without "
        "chat_template_kwargs: it always trains the newline after the end-of-turn token and, with "
        "thinking off, also the empty think block the template adds (its generation prompt has "
        "none). Hence the pre-tokenized rows for it, which it keeps as they are."
    ),
}

_LOADING = {
    "parquet": (
        "The tokenized set, Parquet shards of `id`, `source`, `input_ids`, `loss_mask`, `length`.",
        'python -c \'import datasets; print(datasets.load_dataset("parquet", data_files="part-*.parquet", '
        'split="train"))\'\n'
        "python -c 'import polars as pl; print(pl.read_parquet(\"part-*.parquet\"))'",
    ),
    "specforge-pretokenized": (
        "SpecForge 0.2 (`data.prompts_path`): one `{{id, input_ids, loss_mask}}` line per row, taken as "
        "it is (only cut to `data.max_length`).",
        "specforge train -c YOUR_SPECFORGE_CONFIG.yaml data.prompts_path=$PWD/pretokenized.jsonl "
        "data.max_length={max_length}",
    ),
    "specforge-conversations": (
        "SpecForge 0.2 (`data.train_data_path`): `{{id, conversations}}` with the reasoning inline as "
        "`<think>...</think>` before the answer, which Qwen3's template (run by its ThinkingParser) "
        "reads back as the model's reasoning. " + CONSUMER_NOTES["specforge-conversations"],
        "specforge train -c YOUR_SPECFORGE_CONFIG.yaml data.train_data_path=$PWD/conversations.jsonl "
        "data.chat_template={specforge_template} data.max_length={max_length}",
    ),
    "speculators-pretokenized": (
        "vLLM's speculators 0.9 (`prepare-data`, then `train --data-path`): the same "
        "`{{id, input_ids, loss_mask}}` lines, passed through without rendering. "
        + CONSUMER_NOTES["speculators-conversations"],
        "speculators prepare-data --model {model} --data $PWD/pretokenized.jsonl --output ./speculators-data "
        "--seq-length {max_length}",
    ),
}


def specforge_template(thinking: bool | None) -> str:
    """SpecForge's registered template for Qwen3 answers with thinking on or off."""
    return "qwen3-instruct" if thinking is False else "qwen3-thinking"


def dataset_card(manifest: Manifest) -> str:
    identity, config = manifest.identity, manifest.config
    thinking = config.get("chat_template_kwargs", {}).get("enable_thinking")
    values: dict[str, Any] = {
        "model": shlex.quote(identity["model"]),
        "max_length": config["max_length"],
        "specforge_template": specforge_template(thinking),
    }
    lines = [f"# Drafter training set: {identity['model']}", ""]
    if manifest.simulated:
        lines += [
            "**SIMULATED**: built from the simulator's answers, not a model's. For trying the "
            "pipeline; never train a drafter on it.",
            "",
        ]
    lines += [
        "## Identity",
        "",
        f"- Model: `{identity['model']}` ({'simulated' if manifest.simulated else 'real'} answers)",
        f"- Settings fingerprint: `{identity['fingerprint']}` (model, sampling settings, output cap)",
        f"- Sampling settings: `{json.dumps(identity.get('settings', {}), sort_keys=True)}`",
        f"- Chat template kwargs: `{json.dumps(config.get('chat_template_kwargs', {}), sort_keys=True)}`; "
        f"reasoning `{config['reasoning']}`; truncated answers "
        f"{'left out' if config['drop_truncated'] else 'kept'}; samples of {config['min_length']:,} "
        f"to {config['max_length']:,} tokens",
        f"- Tokenizer: {manifest.tokenizer['vocab_size']:,} tokens, chat template sha256 "
        f"`{manifest.tokenizer['chat_template_sha256']}`",
        "",
        "## Counts",
        "",
        f"{manifest.samples:,} samples, {manifest.tokens:,} tokens, {manifest.assistant_tokens:,} of "
        f"them trained (loss_mask 1).",
        "",
        "| source | samples | tokens |",
        "|---|---:|---:|",
        *(f"| {s} | {e['samples']:,} | {e['tokens']:,} |" for s, e in manifest.by_source.items()),
        "",
        "Left out, never merged:",
        "",
        "| reason | records |",
        "|---|---:|",
        *(f"| {reason} | {count:,} |" for reason, count in manifest.left_out.items()),
        *(f"| other identity: {label} | {count:,} |" for label, count in manifest.other_identities.items()),
        "",
        "## Mask convention",
        "",
        manifest.mask_convention,
        "",
        "## Files and how to load them",
        "",
        "Run the commands from this folder.",
        "",
    ]
    digests = {f["name"]: f["sha256"] for f in [*manifest.files, *manifest.trainer_files]}
    for output, names in manifest.outputs.items():
        what, command = _LOADING[output]
        files = ", ".join(f"`{n}` (sha256 `{digests[n][:16]}`)" for n in names)
        lines += [f"### {output}", "", f"{files}. {what.format(**values)}", "", "```sh", command.format(**values), "```", ""]
    return "\n".join(lines)
