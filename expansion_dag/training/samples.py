"""Records to samples: the screening shared by the build, its round trip and the yield gate
(``AnswerJudge``).

Which records: exactly those of the run's modes (``ModeIdentities``: each mode is an ``Identity``,
the model as served, simulated or not, the mode's sampling settings and the cap), each prompt's
only under the mode the mix draws it into now (another mode's answer to it is ``other_mode``: a
changed mix leaves out the answers of the prompts whose mode changed), and of those only complete
answers: ``finish_reason`` ``stop`` or ``tool_calls``, or ``length`` unless ``drop_truncated``, the
same for every earlier turn of a conversation. Everything else is counted by reason (and other
identities by name) in the manifest, never merged. The answers themselves pass quality gates, each a counted
reason: an empty answer; a raw ``<think>`` or ``</think>`` left in the content; reasoning missing
while the mode's thinking is on, or present while it is off (``thinking_mode``). Each answer is
rendered with its own mode's ``chat_template_kwargs``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from expansion_dag.core import (
    ENDINGS,
    IDS_LEFT_OUT,
    OK,
    OUTPUT_IDS,
    PROMPT_IDS,
    Identity,
    ModeIdentities,
    base_prompt_id,
    pack,
    unpack,
)
from expansion_dag.training.config import BuildTrace, TrainingSetConfig
from expansion_dag.training.mode_rules import _mode_rules, _ModeRules

LEFT_OUT_REASONS = (
    "other_identity", "other_mode",
    # No answer: the server's or the request's failure; a loop the client stopped (the model's
    # doing, never the server's); a conversation the engine ended before its last turn.
    "failed", "degenerate", "conversation_ended",
    "unfinished", "truncated",
    # The quality gates on the answer itself.
    "empty", "think_tag_in_content", "reasoning_missing", "reasoning_unexpected",
    "render_mismatch", "too_long", "too_short",
)
#: An earlier turn of a conversation: its answer is in the row of the conversation's last turn.
FOLDED = "folded"
#: ``AnswerJudge``'s verdict on an answer that becomes a training row; on a stopped loop whose text
#: before the loop becomes one, cut (``loop_prefix: keep``): counted apart wherever rows are.
ROW = "row"
LOOP_ROW = "row_cut_at_loop"
#: The mark of a row cut before its loop (the Parquet column ``truncated``, beside ``loop_rule``).
TRUNCATED_LOOP = "loop"
THINK_TAGS = ("<think>", "</think>")
#: Answers the model finished (``tool_calls``: it stopped at a tool call the server parsed);
#: anything else (``abort``, ``unknown``...) is left out as unfinished.
FINISHED = ("stop", "length", "tool_calls")
UNREGISTERED = "unregistered identity"  # a record whose key matches no identity in the store's registry
#: Why a row is re-tokenized (``Manifest.retokenized_because``).
NO_IDS = "no_ids"  # the server returned none (an older version)
IDS_INCOMPLETE = "ids_incomplete"  # the record's ids were left out, or fewer than the tokens it counted
REASONING_DROPPED = "reasoning_dropped"  # reasoning="drop": the row without it is no sequence the model sampled
END_OF_TURN_UNKNOWN = "end_of_turn_unknown"  # a template whose turn end could not be found
NOT_BYTE_LEVEL = "not_byte_level"  # a conversation's earlier turns are located by byte offsets
PROMPT_NOT_LOCATED = "prompt_not_located"  # a conversation's server prompt is not the client's render


@dataclass(frozen=True)
class _Sample:
    id: str  # the prompt's, or the conversation's for a conversation's row
    source: str
    mode: str
    prompt: list[dict[str, Any]]  # what precedes the answer: earlier assistant turns with their tool calls
    reasoning: str  # "" when dropped or absent
    answer: str
    tool_calls: list[dict[str, Any]] | None  # the answer's, as the server parsed them
    tools: list[dict[str, Any]] | None  # the tool definitions the template renders
    conversation: bool  # a regenerated conversation's row
    output_tokens: int  # the server's count for the answer
    # The server's ids, packed (``token_ids``), when the row is built from them; otherwise why not.
    prompt_ids: str | None = None
    output_ids: str | None = None
    retokenized: str = ""
    said: str = ""  # the text the server returned, think block inline: what the sampled ids must decode to
    # A stopped loop's text before it (``TRUNCATED_LOOP``) and the rule that stopped it; "" for a whole answer.
    truncated: str = ""
    loop_rule: str = ""


def _split_reasoning(reasoning_content: str | None, content: str | None) -> tuple[str, str]:
    """(reasoning, answer); a server without a reasoning parser leaves the think block inline."""
    reasoning, answer = reasoning_content or "", content or ""
    if not reasoning and "</think>" in answer:
        head, _, answer = answer.partition("</think>")
        reasoning = head.split("<think>")[-1]
    return reasoning, answer


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    # Templates test content as a string; an assistant turn of only tool calls has none.
    out = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = list(message["tool_calls"])
    return out


def _screen(
    record: Mapping[str, Any], config: TrainingSetConfig, identities: ModeIdentities, rules: Mapping[str, _ModeRules]
) -> _Sample | str:
    """The sample a record gives, or the reason it is left out (``FOLDED`` for an earlier turn)."""
    mode = identities.mode_of(record)
    if mode is None:
        return "other_identity"
    if identities.mix.assign(base_prompt_id(record)).name != mode:
        return "other_mode"
    answered = record.get("status") == OK
    if answered and int(record.get("turn") or 1) < int(record.get("turns") or 1):
        return FOLDED
    # A conversation is as finished as its least finished turn; one the engine stopped for such a
    # turn has a failed record for the next, which counts for that reason.
    finishes = [*(record.get("prior_finish_reasons") or ()), *([record.get("finish_reason")] if answered else [])]
    if any(reason not in FINISHED for reason in finishes):
        return "unfinished"
    if config.drop_truncated and "length" in finishes:
        return "truncated"
    if not answered:
        if config.loop_prefix == "keep" and record.get("loop_cut") is not None:
            return _before_loop(record, config, mode, rules[mode])
        return _unanswered(record)
    reasoning, answer = _split_reasoning(record.get("reasoning_content"), record.get("content"))
    tool_calls = list(record.get("tool_calls") or ()) or None
    if not answer.strip() and not tool_calls:
        return "empty"
    failed_gate = _failed_gate(reasoning, answer, rules[mode])
    if failed_gate:
        return failed_gate
    retokenized = _why_retokenized(record, reasoning, config, rules[mode])
    return _Sample(
        id=record.get("conversation_id") or record["prompt_id"],
        source=record["source"],
        mode=mode,
        prompt=[_message(m) for m in record["messages"]],
        reasoning=reasoning if config.reasoning == "keep" else "",
        answer=answer,
        tool_calls=tool_calls,
        tools=list(record.get("tools") or ()) or None,
        conversation=bool(record.get("conversation_id")),
        output_tokens=_output_tokens(record),
        prompt_ids=None if retokenized else record[PROMPT_IDS],
        output_ids=None if retokenized else record[OUTPUT_IDS],
        retokenized=retokenized,
        said="" if retokenized else _said(record),
    )


def _failed_gate(reasoning: str, answer: str, rules: _ModeRules) -> str:
    """The quality gate an answer fails, of those on its reasoning and think tags ("" for none)."""
    if any(tag in answer for tag in THINK_TAGS):
        return "think_tag_in_content"
    if rules.thinking is True and not reasoning.strip():
        return "reasoning_missing"
    if rules.thinking is False and reasoning.strip():
        return "reasoning_unexpected"
    return ""


def _before_loop(record: Mapping[str, Any], config: TrainingSetConfig, mode: str, rules: _ModeRules) -> _Sample | str:
    """The sample of a stopped loop's text before the loop (``loop_cut`` characters of its content):
    the sampled ids up to the last token that ends there, exactly (no end of turn is added: the
    model wrote none), or where the record has no ids, the text to be tokenized again."""
    content, reasoning = record.get("content") or "", record.get("reasoning_content") or ""
    said = _said(record)
    before = said[: len(said) - len(content) + int(record["loop_cut"])]
    retokenized = _why_retokenized(record, reasoning, config, rules) or ("" if rules.token_bytes is not None else NOT_BYTE_LEVEL)
    output_ids, tokens = None, _output_tokens(record) * len(before) // max(len(said), 1)
    if not retokenized:
        ids = unpack(record[OUTPUT_IDS])
        ends = np.cumsum(rules.token_bytes[np.asarray(ids, dtype=np.int64)]) if ids else np.zeros(0, np.int64)
        tokens = int(np.searchsorted(ends, len(before.encode()), side="right"))
        before = before.encode()[: int(ends[tokens - 1]) if tokens else 0].decode(errors="ignore")
        output_ids = pack(ids[:tokens])
    answer = before[len(said) - len(content) :]
    if not answer.strip() or _failed_gate(reasoning, answer, rules):
        # Nothing before the loop, or no answer a row may hold (reasoning missing while thinking is
        # on...): the loop is what happened.
        return "degenerate"
    return _Sample(
        id=record["prompt_id"],
        source=record["source"],
        mode=mode,
        prompt=[_message(m) for m in record["messages"]],
        reasoning=reasoning if config.reasoning == "keep" else "",
        answer=answer,
        tool_calls=None,
        tools=list(record.get("tools") or ()) or None,
        conversation=False,
        output_tokens=tokens,
        prompt_ids=None if retokenized else record[PROMPT_IDS],
        output_ids=output_ids,
        retokenized=retokenized,
        said="" if retokenized else before,
        truncated=TRUNCATED_LOOP,
        loop_rule=record.get("loop_rule") or "",
    )


def _why_retokenized(record: Mapping[str, Any], reasoning: str, config: TrainingSetConfig, rules: _ModeRules) -> str:
    """Why an answer's row cannot be its server's ids ("" when it is).

    The rule for ids that disagree with the text: ids that are not whole (the client left them out,
    or ``_prepared`` counts fewer or more than ``completion_tokens``) are never trained, and the row
    falls back to the text; whole ids win over the text they should decode to, and the row says
    whether they do (``ids_match_text``).
    """
    if record.get(PROMPT_IDS) is None or record.get(OUTPUT_IDS) is None:
        return IDS_INCOMPLETE if record.get(IDS_LEFT_OUT) else NO_IDS
    if config.reasoning == "drop" and reasoning.strip():
        return REASONING_DROPPED
    if rules.end_of_turn is None:
        return END_OF_TURN_UNKNOWN
    if record.get("conversation_id") and rules.token_bytes is None:
        return NOT_BYTE_LEVEL
    return ""


def _said(record: Mapping[str, Any]) -> str:
    """The answer as the server returned it, its reasoning inline as Qwen3 writes it."""
    reasoning, content = record.get("reasoning_content"), record.get("content") or ""
    return f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content


def _unanswered(record: Mapping[str, Any]) -> str:
    """Why a failure record is no row, named for what happened (a loop is not a server's failure)."""
    if record.get("error") == "degenerate":
        return "degenerate"
    if record.get("error") in ENDINGS:
        return "conversation_ended"
    return "failed"


class AnswerJudge:
    """The training set's rules on one answer of the run's modes, as it arrives: ``ROW``, ``FOLDED``
    (an earlier turn of a conversation, in its last turn's row) or the reason it is left out.

    The same function the build screens each record with (``_screen``); what only the build can see
    (the render splitting, the row's token length) is not judged here.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: TrainingSetConfig, identities: ModeIdentities):
        self._config = config
        self._identities = identities
        self._rules = _mode_rules(tokenizer, identities)

    def __call__(self, record: Mapping[str, Any]) -> str:
        screened = _screen(record, self._config, self._identities, self._rules)
        if isinstance(screened, str):
            return screened
        return LOOP_ROW if screened.truncated else ROW

    def kept_tokens(self, record: Mapping[str, Any]) -> int:
        """The output tokens of ``record`` its row holds (0 for none): a row cut before a loop, its part."""
        screened = _screen(record, self._config, self._identities, self._rules)
        return 0 if isinstance(screened, str) else screened.output_tokens


@dataclass
class _Tally:
    """Records left out: by reason, and those of other identities by identity; the mix's output tokens."""

    identities: ModeIdentities
    known: Mapping[str, Identity]  # fingerprint -> identity, to name the other identities
    trace: BuildTrace | None = None
    reasons: Counter[str] = field(default_factory=Counter)
    others: Counter[str] = field(default_factory=Counter)
    output_tokens: int = 0
    folded: int = 0  # records of earlier turns of a conversation
    folded_tokens: Counter[str] = field(default_factory=Counter)  # conversation_id -> its earlier turns' tokens

    def own(self, record: Mapping[str, Any]) -> None:
        """A record of a prompt's current mode: its tokens were generated, whatever becomes of it."""
        tokens = _output_tokens(record)
        self.output_tokens += tokens
        if self.trace is not None:
            # By prompt: a conversation's turns add up under its id, the one a night takes.
            prompt = base_prompt_id(record)
            if record.get("status") == OK:
                self.trace.completion_tokens[prompt] = self.trace.completion_tokens.get(prompt, 0) + tokens
            else:
                self.trace.failed.add(prompt)

    def fold(self, record: Mapping[str, Any]) -> None:
        self.folded += 1
        self.folded_tokens[base_prompt_id(record)] += _output_tokens(record)

    def other_identity(self, record: Mapping[str, Any]) -> None:
        self.reasons["other_identity"] += 1
        label = next((i.label for i in self.known.values() if i.owns(record)), UNREGISTERED)
        self.others[label] += 1

    def left_out(self) -> dict[str, int]:
        return {reason: self.reasons[reason] for reason in LEFT_OUT_REASONS}

    def to_dict(self) -> dict[str, Any]:
        """What was counted, as JSON keeps it with a part (``training.parts``), the trace's share too."""
        trace = self.trace
        return {
            "reasons": dict(self.reasons), "others": dict(self.others), "output_tokens": self.output_tokens,
            "folded": self.folded, "folded_tokens": dict(self.folded_tokens),
            "renders": {} if trace is None else {i: [d.hex() for d in ds] for i, ds in trace.renders.items()},
            "completion_tokens": {} if trace is None else trace.completion_tokens,
            "failed": [] if trace is None else sorted(trace.failed),
        }

    def add_part(self, part: Mapping[str, Any]) -> None:
        """Another part's counts (``to_dict``) added to these, as one pass over both would count."""
        self.reasons.update(part["reasons"])
        self.others.update(part["others"])
        self.output_tokens += part["output_tokens"]
        self.folded += part["folded"]
        self.folded_tokens.update(part["folded_tokens"])
        if self.trace is not None:
            for row, digests in part["renders"].items():
                self.trace.renders.setdefault(row, []).extend(bytes.fromhex(d) for d in digests)
            for prompt, tokens in part["completion_tokens"].items():
                self.trace.completion_tokens[prompt] = self.trace.completion_tokens.get(prompt, 0) + tokens
            self.trace.failed.update(part["failed"])


def _output_tokens(record: Mapping[str, Any]) -> int:
    # A failure stopped mid-stream (a degenerate loop) records the tokens it streamed (stores
    # written before stream intervals have only the chunks, one token each).
    return int(record.get("completion_tokens") or record.get("streamed_tokens") or record.get("streamed_chunks") or 0)


def _screened_chunks(
    records: Iterable[Mapping[str, Any]], config: TrainingSetConfig, tally: _Tally, rules: Mapping[str, _ModeRules]
) -> Iterator[list[_Sample]]:
    """Samples of at most ``chunk_rows`` records at a time; the records themselves are let go."""
    it = iter(records)
    while True:
        chunk = list(itertools.islice(it, config.chunk_rows))
        if not chunk:
            return
        samples = []
        for record in chunk:
            screened = _screen(record, config, tally.identities, rules)
            if screened == "other_identity":
                tally.other_identity(record)
            elif screened == "other_mode":  # not this mix's work: the prompt is drawn into another mode
                tally.reasons[screened] += 1
            else:
                tally.own(record)
                if screened == FOLDED:
                    tally.fold(record)
                elif isinstance(screened, str):
                    tally.reasons[screened] += 1
                else:
                    samples.append(screened)
        del chunk, record  # so that the next chunk is read with no record of this one alive
        yield samples
