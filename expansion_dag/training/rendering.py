"""A sample's render, split into the texts that are tokenized apart.

Templates such as Qwen3's have no ``{% generation %}`` markers, so the assistant's part of a sample
is found in its rendered text:

* The prompt is rendered as the server rendered it (``add_generation_prompt=True``, the same
  ``chat_template_kwargs``) and must be a prefix of the conversation's render; what follows, up to
  the end-of-turn token, is the assistant's. So the generation prompt (``<|im_start|>assistant\\n``;
  Qwen3's empty think block when ``enable_thinking=False``) is prompt (mask 0), and the think tags
  around kept reasoning are the assistant's (mask 1): in thinking mode Qwen3 writes them itself.
* The whitespace after the end-of-turn token (ChatML's ``\\n``) stays in ``input_ids`` with mask 0
  by default: the model never writes it. ``train_newline_after_end_of_turn=True`` follows SpecForge
  and speculators, which train it (``MASK_CONVENTION``; ``config.SPECFORGE_RENDERS``, ``config.SPECULATORS_RENDERS``).
* An earlier assistant turn is found by rendering the conversation again with that turn replaced by
  a marker: the renders agree before and after it, so what differs is the turn as the template
  renders it there (Qwen3 drops earlier turns' think blocks). A conversation that does not split so
  is left out (``render_mismatch``), never guessed at.
* Each turn gives three texts (what precedes it, its own part, the trailer), tokenized apart and
  concatenated: tokenized whole, a render can merge characters across a boundary into one token
  (Qwen's vocabulary turns ``assistant\\n`` + ``" \\n"`` into ``"\\n \\n"``). Apart, the prompt's ids
  are exactly those the server fed the model.
* With ``reasoning="drop"`` Qwen3 still renders an empty think block on the final turn: prompt for
  a mode with ``enable_thinking: False`` (as the server renders it), else the assistant's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from expansion_dag.core import render_prompts
from expansion_dag.training.mode_rules import _MARKER, _ModeRules, _render
from expansion_dag.training.samples import _Sample


def _assistant_message(sample: _Sample) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": sample.answer}
    if sample.reasoning:
        message["reasoning_content"] = sample.reasoning
    if sample.tool_calls:
        message["tool_calls"] = sample.tool_calls
    return message


def _segments(
    samples: Sequence[_Sample], tokenizer: PreTrainedTokenizerBase, rules: Mapping[str, _ModeRules]
) -> list[list[str] | None]:
    """Each sample's texts, three per assistant turn (what precedes it, the turn, its trailer),
    together the full render; None where the render does not split."""
    texts: list[list[str] | None] = [None] * len(samples)
    batches: dict[str, list[int]] = {}  # samples of one answer, by mode: rendered in one batch each
    for i, sample in enumerate(samples):
        if not sample.conversation:
            batches.setdefault(sample.mode, []).append(i)
        else:
            texts[i] = _conversation_segments(sample, tokenizer, rules[sample.mode])
    for mode, indices in batches.items():
        group = [samples[i] for i in indices]
        kwargs = rules[mode].kwargs
        prompts = render_prompts(tokenizer, [s.prompt for s in group], kwargs)
        fulls = _render(tokenizer, [[*s.prompt, _assistant_message(s)] for s in group], kwargs)
        for i, sample, prompt, full in zip(indices, group, prompts, fulls):
            texts[i] = _split_render(sample, prompt, full, tokenizer, rules[mode])
    return texts


def _conversation_segments(
    sample: _Sample, tokenizer: PreTrainedTokenizerBase, rules: _ModeRules
) -> list[str] | None:
    # Rendered alone: a batch takes one list of tools for all. A template that refuses a
    # conversation (its roles out of order, say) leaves out that one.
    try:
        [prompt] = render_prompts(tokenizer, [sample.prompt], rules.kwargs, tools=[sample.tools])
        [full] = _render(tokenizer, [[*sample.prompt, _assistant_message(sample)]], rules.kwargs, sample.tools)
        return _split_render(sample, prompt, full, tokenizer, rules)
    except TemplateError:
        return None


def _split_render(
    sample: _Sample, prompt: str, full: str, tokenizer: PreTrainedTokenizerBase, rules: _ModeRules
) -> list[str] | None:
    if not full.startswith(prompt):
        return None  # the generation prompt is not how the template renders the turn
    end = len(full.rstrip())
    assistant = full[len(prompt) : end]
    for name, text in (("content", sample.answer), ("reasoning_content", sample.reasoning)):
        if text.strip() and text.strip() not in assistant:
            raise ValueError(
                f"record {sample.id}: the chat template does not render the assistant's {name}"
                + ("; use reasoning='drop'" if name == "reasoning_content" else "")
            )
    spans = []  # (start, end of turn, end of trailer) of each regenerated assistant turn in ``full``
    for index, message in enumerate(sample.prompt):
        # A prompt's own assistant turns (a source read up to a later user turn) are the dataset's
        # text, never trained; a conversation's are the model's.
        if sample.conversation and message["role"] == "assistant":
            span = _turn_span(sample, index, full, tokenizer, rules)
            if span is None:
                return None
            spans.append(span)
    spans.append((len(prompt), end, len(full)))
    texts, position = [], 0
    for start, stop, trail in spans:
        if not position <= start <= stop <= trail:
            return None
        texts += [full[position:start], full[start:stop], full[stop:trail]]
        position = trail
    return texts


def _turn_span(
    sample: _Sample, index: int, full: str, tokenizer: PreTrainedTokenizerBase, rules: _ModeRules
) -> tuple[int, int, int] | None:
    """Where the earlier assistant turn ``sample.prompt[index]`` lies in ``full``: from its content
    to the end of its end-of-turn text, and to the end of the whitespace after it."""
    if rules.end_of_turn is None:
        return None
    marked = [*sample.prompt[:index], {"role": "assistant", "content": _MARKER}, *sample.prompt[index + 1 :]]
    [render] = _render(tokenizer, [[*marked, _assistant_message(sample)]], rules.kwargs, sample.tools)
    start = render.find(_MARKER)
    tail = render[start + len(_MARKER) :]
    if (
        render.count(_MARKER) != 1
        or render[:start] != full[:start]
        or not full.endswith(tail)
        or len(full) - len(tail) < start
        or not tail.startswith(rules.end_of_turn)
    ):
        return None
    stop = len(full) - len(tail) + len(rules.end_of_turn)
    after = tail[len(rules.end_of_turn) :]
    return start, stop, stop + len(after) - len(after.lstrip())
