"""The dataset card (``README.md``) a training set folder carries: what a trainer needs to know.

Its identity (model, settings, simulated or not), its generation modes (each one's configured
share beside the share of the rows it got), its counts (by source, whole conversations, and what
was left out and why), the mask convention, each output's file, and how each trainer loads it,
with the command to run from the folder. Written from the manifest alone, by the build that
writes the manifest; ``manifest_markdown`` is the manifest's summary for the Dagster UI.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from expansion_dag.core import bar_chart_png, png_data_uri
from expansion_dag.training.config import FORMATS
from expansion_dag.training.manifest import Manifest

_MIXED_THINKING = (
    " This set mixes modes with thinking on and off, and SpecForge renders every conversation with "
    "the one template named: the other mode's rows come out differently masked. For exact masks "
    "train from the pre-tokenized rows (`specforge-pretokenized`)."
)


def specforge_template(thinking: bool | None) -> str:
    """SpecForge's registered template for Qwen3 answers with thinking on or off."""
    return "qwen3-instruct" if thinking is False else "qwen3-thinking"


def _kwargs(mode: dict[str, Any]) -> dict[str, Any]:
    return json.loads(mode["settings"].get("chat_template_kwargs_json") or "{}")


def mode_table(manifest: Manifest) -> list[str]:
    """Each generation mode's configured share beside the share of the rows it got."""
    lines = [
        "| mode | share configured | share of samples | samples | trained tokens | chat template kwargs "
        "| settings fingerprint |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, mode in manifest.modes.items():
        lines.append(
            f"| {name} | {mode['share']:.3f} | {mode['sample_share']:.3f} | {mode['samples']:,} | "
            f"{mode['assistant_tokens']:,} | `{json.dumps(_kwargs(mode), sort_keys=True)}` | `{mode['fingerprint']}` |"
        )
    return lines


#: What the measured difference means, where no source says how often a real model's ids differ.
DIFFERENCE_MEANING = (
    "A random model (CI's) samples far from the tokenizer's canonical split of its own text, so there "
    "the difference is large. How often a real model's sampled ids differ from re-tokenizing its text "
    "is not known from any source this project has: these counts are how a run finds out."
)


def token_ids_lines(manifest: Manifest) -> list[str]:
    """Where the rows' ids come from, and the difference re-tokenizing them would have made."""
    server, retokenized = manifest.ids_from.get("server", 0), manifest.ids_from.get("retokenized", 0)
    measured = manifest.retokenization
    why = ", ".join(f"`{reason}` {count:,}" for reason, count in manifest.retokenized_because.items())
    lines = [
        f"{server:,} of {server + retokenized:,} rows are the ids the server ran and sampled (`ids_from: server`): "
        "its prompt ids, then the sampled ids closed by the end-of-turn token (the template's, where the "
        f"answer was cut before one). {manifest.ids_text_differs:,} of them do not decode to the text the "
        "server returned (compared without whitespace and think tags, which reasoning parsers move): the ids "
        "win, and the row says so (`ids_match_text: false`).",
        f"{retokenized:,} rows are the text rendered with the chat template and tokenized again "
        f"(`ids_from: retokenized`){': ' + why if why else ''}. A record whose ids are not whole is never "
        "trained from them.",
    ]
    if measured.get("rows_measured"):
        lines.append(
            f"Measured on {measured['sample']}: {measured['rows_differing']:,} of {measured['rows_measured']:,} "
            f"rows differ from their re-tokenization, by {measured['tokens_differing_sum']:,} tokens in all "
            f"(at most {measured['tokens_differing_max']:,} in a row); the prompt ids of "
            f"{measured['prompt_rows_differing']:,} differ from the client's own render of the prompt "
            f"({measured['prompt_tokens_differing_sum']:,} tokens, at most {measured['prompt_tokens_differing_max']:,}). "
            + DIFFERENCE_MEANING
        )
    if "specforge-conversations" in manifest.outputs:
        lines.append(
            "`conversations.jsonl` is text: a trainer that renders it tokenizes the text again and does not "
            "get the sampled ids, which `pretokenized.jsonl` and the Parquet rows carry."
        )
    return lines


def dataset_card(manifest: Manifest) -> str:
    identity, config = manifest.identity, manifest.config
    thinking = {_kwargs(mode).get("enable_thinking") for mode in manifest.modes.values()}
    values: dict[str, Any] = {
        "model": shlex.quote(identity["model"]),
        "max_length": config["max_length"],
        "specforge_template": specforge_template(next(iter(thinking)) if len(thinking) == 1 else None),
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
        f"- Settings fingerprint: `{identity['fingerprint']}` ("
        + ("model, every mode's settings and share, the draw's seed)" if len(manifest.modes) > 1
           else "model, sampling settings, output cap)"),
        *(
            [f"- Sampling settings: `{json.dumps(identity.get('settings', {}), sort_keys=True)}`"]
            if len(manifest.modes) <= 1
            else []
        ),
        f"- Reasoning `{config['reasoning']}`; truncated answers "
        f"{'left out' if config['drop_truncated'] else 'kept'}; samples of {config['min_length']:,} "
        f"to {config['max_length']:,} tokens",
        f"- Tokenizer: {manifest.tokenizer['vocab_size']:,} tokens, chat template sha256 "
        f"`{manifest.tokenizer['chat_template_sha256']}`",
        "",
        "## Generation modes",
        "",
        "Each prompt's mode is a seeded draw from its id; each mode's answers are rendered with its own "
        "chat template kwargs."
        if len(manifest.modes) > 1
        else "One mode: every prompt under the run's settings.",
        "",
        *mode_table(manifest),
        "",
        "## Counts",
        "",
        f"{manifest.samples:,} samples, {manifest.tokens:,} tokens, {manifest.assistant_tokens:,} of "
        f"them trained (loss_mask 1).",
        *(
            [f"{manifest.conversations:,} samples are whole regenerated conversations, every assistant turn "
             f"trained ({manifest.conversation_turns_folded:,} records of earlier turns are in them)."]
            if manifest.conversations or manifest.conversation_turns_folded
            else []
        ),
        *([loop_rows_line(manifest)] if manifest.loop_rows else []),
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
        "## Token ids",
        "",
        *(line + "\n" for line in token_ids_lines(manifest)),
        "## Files and how to load them",
        "",
        "Run the commands from this folder. A build of the set that the pipeline publishes is a version of "
        "its own (`training_set_versions/<version>/`) that no later build changes; `training_set` names the "
        "newest, and a later build switches it: `cd \"$(realpath training_set)\"` reads one version "
        "however long the training takes.",
        "",
    ]
    digests = {f["name"]: f["sha256"] for f in [*manifest.files, *manifest.trainer_files]}
    for output, names in manifest.outputs.items():
        what, command = FORMATS[output].what, FORMATS[output].command
        if output == "specforge-conversations" and len(thinking) > 1:
            what += _MIXED_THINKING
        files = ", ".join(f"`{n}` (sha256 `{digests[n][:16]}`)" for n in names)
        lines += [f"### {output}", "", f"{files}. {what.format(**values)}", "", "```sh", command.format(**values), "```", ""]
    return "\n".join(lines)


def loop_rows_line(manifest: Manifest) -> str:
    """How many samples are answers cut before a loop the client stopped, by the rule that stopped it."""
    rows = sum(manifest.loop_rows.values())
    rules = ", ".join(f"{rule} {n:,}" for rule, n in manifest.loop_rows.items())
    return (
        f"{rows:,} of the samples ({rows / max(manifest.samples, 1):.1%}) are answers cut before a loop the client "
        f"stopped (`truncated: loop`; by rule: {rules}): the text the model wrote before it, its sampled ids as "
        "they are, with no end of turn."
    )


def manifest_markdown(manifest: Manifest) -> str:
    """Totals, a histogram of tokens per sample (an embedded PNG), tables by source and reason."""
    per = manifest.tokens_per_sample
    model = manifest.identity["model"]
    lines = [
        f"**Built from SIMULATED completions** ({model}): simulator answers, not a model's; for "
        "trying the pipeline, never for training a drafter."
        if manifest.simulated
        else f"Completions of **{model}**.",
        f"Settings fingerprint `{manifest.identity['fingerprint']}` (model, sampling settings, cap).",
        "",
        f"**{manifest.samples:,} samples**, {manifest.tokens:,} tokens "
        f"({manifest.assistant_tokens:,} written by the assistant). Tokens per sample: "
        f"mean {per['mean']:,}, p50 {per['p50']:,}, p90 {per['p90']:,}, p99 {per['p99']:,}, "
        f"max {per['max']:,}.",
        "",
    ]
    histogram = manifest.histogram
    if histogram["counts"]:
        start, width = histogram["start"], histogram["bin_width"]
        end = start + width * len(histogram["counts"]) - 1
        uri = png_data_uri(bar_chart_png(histogram["counts"]))
        lines += [
            f"![tokens per sample]({uri})",
            "",
            f"*Tokens per sample from {start:,} to {end:,}, bins of {width:,}.*",
            "",
        ]
    lines += ["| source | samples | tokens |", "|---|---:|---:|"]
    lines += [
        f"| {source} | {entry['samples']:,} | {entry['tokens']:,} |"
        for source, entry in manifest.by_source.items()
    ]
    lines += ["", *mode_table(manifest)]
    if manifest.conversations or manifest.conversation_turns_folded:
        lines += ["", f"{manifest.conversations:,} of the samples are whole conversations (every assistant "
                  f"turn trained), holding {manifest.conversation_turns_folded:,} records of earlier turns."]
    if manifest.loop_rows:
        lines += ["", loop_rows_line(manifest)]
    lines += ["", *token_ids_lines(manifest)[:3]]
    lines += ["", "| left out | records |", "|---|---:|"]
    lines += [f"| {reason} | {count:,} |" for reason, count in manifest.left_out.items()]
    if manifest.other_identities:
        lines += ["", "| left out: other identity | records |", "|---|---:|"]
        lines += [f"| {label} | {count:,} |" for label, count in manifest.other_identities.items()]
    return "\n".join(lines) + "\n"
