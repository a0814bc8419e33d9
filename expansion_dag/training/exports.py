"""The trainers' JSONL files, written beside the Parquet set from the same pass: the conversations
SpecForge-style trainers render themselves, and the pre-tokenized rows they read unchanged."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from expansion_dag.training.config import CONVERSATIONS_NAME, FORMATS, PRETOKENIZED_NAME
from expansion_dag.training.parquet import _sha256
from expansion_dag.training.samples import _Sample

#: How Qwen3 (and DeepSeek-R1) write reasoning inline; Qwen3's template turns it back into the same
#: render as ``reasoning_content``. Used for the conversations JSONL.
INLINE_REASONING = "<think>\n{reasoning}\n</think>\n\n{answer}"


class _JsonlOutputs:
    """The trainers' JSONL files of a build, each opened only when its format is asked for."""

    def __init__(self, directory: Path, formats: Collection[str]):
        names = {FORMATS[f].file for f in formats if f != "parquet"}
        self._files = {name: open(directory / name, "wb") for name in sorted(names)}

    def write(self, samples: Sequence[_Sample], table: pa.Table) -> None:
        if CONVERSATIONS_NAME in self._files:
            self._files[CONVERSATIONS_NAME].write("".join(map(_conversation_line, samples)).encode())
        if PRETOKENIZED_NAME in self._files:
            # polars writes the int lists in Rust: JSON for hundreds of millions of tokens.
            pl.from_arrow(table.select(["id", "input_ids", "loss_mask"])).write_ndjson(
                self._files[PRETOKENIZED_NAME]
            )

    def close(self) -> list[dict[str, Any]]:
        for fh in self._files.values():
            fh.close()
        return [{"name": name, "sha256": _sha256(Path(fh.name))} for name, fh in self._files.items()]


def _conversation_line(sample: _Sample) -> str:
    answer = sample.answer
    if sample.reasoning:
        # Stripped as Qwen3's template strips them, so both routes render the same text.
        answer = INLINE_REASONING.format(
            reasoning=sample.reasoning.strip("\n"), answer=answer.lstrip("\n")
        )
    final: dict[str, Any] = {"role": "assistant", "content": answer}
    if sample.tool_calls:
        final["tool_calls"] = sample.tool_calls
    line: dict[str, Any] = {"id": sample.id, "conversations": [*sample.prompt, final]}
    if sample.tools:
        # As text, as SpecForge takes it: tools differ in shape, and a JSON reader inferring one
        # schema for the column would fill each tool with the others' fields.
        line["tools"] = json.dumps(sample.tools, ensure_ascii=False)
    return json.dumps(line, ensure_ascii=False) + "\n"
