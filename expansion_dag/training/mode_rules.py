"""What each mode's chat template and the tokenizer give the build: how the mode's answers are
gated (its thinking switch) and closed (its end-of-turn text and ids), and the render and batch
encoding every step from records to rows goes through.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from expansion_dag.core import ModeIdentities

#: Stands in for an earlier assistant turn's content, to find that turn in the render.
_MARKER = "\ue000expansion-dag-turn\ue000"


@dataclass(frozen=True)
class _ModeRules:
    """How one mode's answers are gated and rendered."""

    kwargs: Mapping[str, Any]  # chat_template_kwargs, as at generation
    thinking: bool | None  # thinking_mode
    end_of_turn: str | None  # what the template closes an assistant turn with; None if unknown
    # For rows from ids: the end of turn's ids, the whitespace after it (Qwen3's newline) as ids,
    # the special tokens (a sampled one ends the turn itself), each token's bytes (None unless byte-level).
    end_of_turn_ids: list[int] = field(default_factory=list)
    trailer_ids: list[int] = field(default_factory=list)
    special_ids: frozenset[int] = frozenset()
    token_bytes: np.ndarray | None = None


def _mode_rules(tokenizer: PreTrainedTokenizerBase, identities: ModeIdentities) -> dict[str, _ModeRules]:
    rules = {}
    for mode in identities.mix.modes:
        tail = _turn_tail(tokenizer, mode.chat_template_kwargs)
        end_of_turn = tail.rstrip() or None
        ids = _encode([end_of_turn or "", tail[len(end_of_turn or "") :]], tokenizer)
        rules[mode.name] = _ModeRules(
            kwargs=mode.chat_template_kwargs,
            thinking=thinking_mode(tokenizer, mode.chat_template_kwargs),
            end_of_turn=end_of_turn,
            end_of_turn_ids=ids[0],
            trailer_ids=ids[1],
            special_ids=frozenset(tokenizer.all_special_ids),
            token_bytes=_token_bytes(tokenizer),
        )
    return rules


def _turn_tail(tokenizer: PreTrainedTokenizerBase, kwargs: Mapping[str, Any]) -> str:
    """The text after the last assistant's content (Qwen3's ``<|im_end|>\\n``); "" if not found."""
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARKER}]
    try:
        [text] = _render(tokenizer, [probe], kwargs)
    except TemplateError:
        return ""
    return text.partition(_MARKER)[2] if text.count(_MARKER) == 1 else ""


@functools.lru_cache(maxsize=4)
def _token_bytes(tokenizer: PreTrainedTokenizerBase) -> np.ndarray | None:
    """Each token id's length in bytes, for a byte-level tokenizer (Qwen's, Llama 3's); else None."""
    backend = tokenizer.backend_tokenizer
    if type(backend.decoder).__name__ != "ByteLevel":
        return None
    added = backend.get_added_tokens_decoder()
    vocab = backend.get_vocab(with_added_tokens=True)
    lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
    for token, index in vocab.items():
        # A byte-level token spells one byte a character; an added token is its own text.
        lengths[index] = len(added[index].content.encode()) if index in added else len(token)
    return lengths


def thinking_mode(tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: Mapping[str, Any]) -> bool | None:
    """Whether every answer must carry reasoning (True), none may (False), or either (None).

    A template with a thinking switch (Qwen3's ``enable_thinking``, on unless the kwargs turn it
    off) says which; one without it (Qwen2.5's ChatML, a thinking-only model's) sets no rule.
    """
    template = tokenizer.chat_template
    if "enable_thinking" not in json.dumps(template):
        return None
    return bool(chat_template_kwargs.get("enable_thinking", True))


def _render(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    kwargs: Mapping[str, Any],
    tools: list[dict[str, Any]] | None = None,
) -> list[str]:
    """Whole conversations, as a trainer renders them (no generation prompt)."""
    return list(tokenizer.apply_chat_template(list(map(list, conversations)), tools=tools, tokenize=False, **kwargs))


def _encode(segments: Sequence[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of every segment, in one parallel batch."""
    # The Rust backend tokenizes the batch on all cores; encode_batch_fast skips the offsets.
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(list(segments), add_special_tokens=False)
    return [e.ids for e in encodings]
