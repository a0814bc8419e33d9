"""Token ids as a record keeps them: little-endian uint32, base64 in one JSON string.

A JSON list of ids costs about 7 bytes a token and a slow parse; this costs 5.3 bytes a token and
one ``array`` copy, and keeps the store one JSON line a record.

The fields a record holds (absent when the server returned no ids, e.g. an older version):
``prompt_ids``, the ids the server ran the prompt as, and ``output_ids``, the ids it sampled.

The rule for ids that disagree with the text (:func:`record_fields`): an ``ok`` record keeps the
ids only whole, both of them and ``len(output_ids) == completion_tokens`` (the server's own count
of what it sampled, which both servers' ids match: proved in ``real_engine/``). Otherwise neither
is kept and ``ids_left_out`` says why, so the row falls back to the text as for a server without
ids, never a row of partial ids. A stopped loop's failure record (``degenerate``) keeps the ids
received before the stop as they are, for inspection only: its status already says the answer was
cut, and a failure never reaches the training set.

Whole ids may still decode to more than the text: an answer cut at ``max_tokens`` in the middle of
a character's bytes decodes to the text and then its last tokens, ending in U+FFFD, which vLLM's
incremental detokenizer holds back and never sends (seen on CI's real vLLM,
``real_engine/test_pipeline.py``). The record keeps them as they are: they are what was sampled.
"""

from __future__ import annotations

import array
import base64
import sys
from collections.abc import Sequence

__all__ = ["IDS_LEFT_OUT", "OUTPUT_IDS", "PROMPT_IDS", "pack", "record_fields", "unpack"]

PROMPT_IDS = "prompt_ids"
OUTPUT_IDS = "output_ids"
#: Why a record that had ids keeps none (see the module's rule).
IDS_LEFT_OUT = "ids_left_out"


def pack(ids: Sequence[int]) -> str:
    """The ids as one base64 string (a vocabulary fits in 32 bits)."""
    values = array.array("I", ids)
    if sys.byteorder != "little":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def unpack(text: str) -> list[int]:
    """The ids :func:`pack` wrote; ValueError on a string it did not write."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 4:
        raise ValueError(f"packed token ids of {len(raw)} bytes: not a whole number of uint32")
    values = array.array("I")
    values.frombytes(raw)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def record_fields(
    prompt_ids: Sequence[int] | None, output_ids: Sequence[int] | None, completion_tokens: int
) -> dict[str, str]:
    """An answer's ids as an ``ok`` record keeps them, by the module's rule: both packed, nothing
    when the server returned none, or only why they were left out."""
    if prompt_ids is None and output_ids is None:
        return {}
    if prompt_ids is None or output_ids is None:
        missing = PROMPT_IDS if prompt_ids is None else OUTPUT_IDS
        return {IDS_LEFT_OUT: f"the server returned no {missing}"}
    if len(output_ids) != completion_tokens:
        return {IDS_LEFT_OUT: f"{len(output_ids)} output ids for {completion_tokens} completion tokens"}
    return {PROMPT_IDS: pack(prompt_ids), OUTPUT_IDS: pack(output_ids)}
