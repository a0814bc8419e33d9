"""Conversations regenerated turn by turn: every assistant turn asked of the target model.

A conversation source (``conversation: true`` in the catalog) gives each prompt row its
``conversation``: the source's system, user and tool turns, with an ``assistant`` placeholder wherever
the model must answer. Turn 1 is an ordinary budgeted request (the row's ``messages``). When a turn's
answer arrives, :class:`TurnPlanner` builds the next request: the conversation so far, where earlier
assistant turns are the model's own answers and the rest comes from the source, counted with the
tokenizer exactly as the budget counts (the context grows, so every turn gets its own
``max_tokens``). Each turn is its own completion record under the key of ``turn_id(conversation, k)``,
so a turn is durable and resumable like any prompt; a conversation is complete when its last turn is.

A conversation ends early, final and recorded under the key of the turn it could not ask, when a turn
was not finished as the training set needs it (``TURN_UNFINISHED``: a cut answer is a bad context for
the next turn and would leave the conversation out anyway) or when the next turn no longer leaves
``min_output_tokens`` in the context (``CONTEXT_EXHAUSTED``). Both are the content's doing, never a
server's: their records carry the content outcome.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from expansion_dag.core import CONTEXT_EXHAUSTED, OK, TURN_UNFINISHED, Identity, count_prompt_tokens, is_final
from expansion_dag.generation.dispatch import Turn, WorkItem

Message = Mapping[str, Any]


def turn_id(conversation_id: str, turn: int) -> str:
    """The id turn ``turn`` (1-based) of a conversation is stored under."""
    return f"{conversation_id}.t{turn}"


def _is_placeholder(message: Message) -> bool:
    return message.get("role") == "assistant"


def split_at_answer(turns: Sequence[Message]) -> tuple[list[dict[str, Any]], tuple[Message, ...]]:
    """The source turns up to the next assistant placeholder, and what follows it."""
    for index, message in enumerate(turns):
        if _is_placeholder(message):
            return [_source_message(m) for m in turns[:index]], tuple(turns[index + 1 :])
    return [_source_message(m) for m in turns], ()


def _source_message(message: Message) -> dict[str, Any]:
    return {"role": message["role"], "content": message["content"]}


def tools_of(tools_json: str | None) -> list[dict[str, Any]] | None:
    """The tool definitions of a prompt row (its ``tools`` column, JSON text), or None."""
    return json.loads(tools_json) if tools_json else None


def first_turn(conversation_id: str, conversation: Sequence[Message]) -> Turn:
    """Turn 1 of a conversation (its request is the row's ``messages``)."""
    _, rest = split_at_answer(conversation)
    return Turn(conversation_id, 1, sum(map(_is_placeholder, conversation)), rest)


def history_message(content: str, tool_calls: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """An answered turn as the next request carries it: the answer, and the tool calls the server parsed.

    No reasoning: templates such as Qwen3's leave earlier turns' reasoning out of the prompt anyway.
    """
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [dict(call) for call in tool_calls]
    return message


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as the servers hand them to the chat template: earlier tool calls' arguments parsed
    from JSON text into objects (SGLang and vLLM both do), so that they render as they did there."""
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_parsed_arguments(call) for call in calls]}
        rendered.append(dict(message))
    return rendered


def _parsed_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            function["arguments"] = {}  # vLLM's substitute; SGLang refuses such a request
    return {**call, "function": function}


@dataclass(frozen=True)
class Ended:
    """A conversation that stops before its last turn: why, and the turn it could not ask."""

    reason: str
    key: str
    prompt_id: str
    turn: Turn
    detail: str


@dataclass
class TurnPlanner:
    """Builds each next turn of a conversation as a budgeted request."""

    tokenizer: PreTrainedTokenizerBase
    context_length: int
    max_output_tokens: int
    min_output_tokens: int
    margin: int
    #: Each mode's identity, for the next turn's key.
    identities: Mapping[str, Identity]
    #: Finish reasons a turn may end with and its conversation go on.
    continue_on: Collection[str]

    def next_item(self, item: WorkItem, content: str, finish_reason: str,
                  tool_calls: Sequence[Mapping[str, Any]] | None = None) -> WorkItem | Ended | None:
        """The request of the turn after ``item``'s answer; None after the last turn."""
        turn = item.turn
        if turn is None or turn.last:
            return None
        following, rest = split_at_answer(turn.rest)
        next_turn = Turn(
            turn.conversation_id, turn.turn + 1, turn.turns, rest, (*turn.prior_finish_reasons, finish_reason)
        )
        messages = [*item.messages, history_message(content, tool_calls), *following]
        next_id = turn_id(turn.conversation_id, next_turn.turn)
        key = self.identities[item.mode].key(next_id)
        if finish_reason not in self.continue_on:
            return Ended(TURN_UNFINISHED, key, next_id, next_turn,
                         f"turn {turn.turn} ended with finish_reason {finish_reason!r}")
        return self.budgeted(item, messages, next_turn, key, next_id)

    def budgeted(self, item: WorkItem, messages: list[dict[str, Any]], turn: Turn, key: str,
                 prompt_id: str) -> WorkItem | Ended:
        sampling = item.sampling
        kwargs = sampling.chat_template_kwargs if sampling is not None else {}
        tools = [list(item.tools)] if item.tools else None
        (prompt_tokens,) = count_prompt_tokens(self.tokenizer, [template_messages(messages)], kwargs, tools=tools)
        max_tokens = min(self.max_output_tokens, self.context_length - prompt_tokens - self.margin)
        if max_tokens < self.min_output_tokens:
            return Ended(CONTEXT_EXHAUSTED, key, prompt_id, turn,
                         f"turn {turn.turn}: {prompt_tokens} prompt tokens leave {max_tokens} for the answer "
                         f"(< min_output_tokens {self.min_output_tokens}) at context {self.context_length}")
        return replace(item, key=key, prompt_id=prompt_id, messages=messages, prompt_tokens=prompt_tokens,
                       max_tokens=max_tokens, turn=turn)


@dataclass(frozen=True)
class Standing:
    """Where a conversation stands in the store: its furthest turn with a record, and that record."""

    turn: int
    record: Mapping[str, Any]


def standings(
    records: Iterable[Mapping[str, Any]], keys_by_turn: Mapping[str, tuple[str, int]]
) -> dict[str, Standing]:
    """Each conversation's furthest turn with a record, from the store's latest records.

    ``keys_by_turn`` maps every turn key of interest to (conversation id, turn).
    """
    found: dict[str, Standing] = {}
    for record in records:
        where = keys_by_turn.get(str(record.get("key")))
        if where is None:
            continue
        conversation, turn = where
        if conversation not in found or found[conversation].turn < turn:
            found[conversation] = Standing(turn, record)
    return found


def next_request(
    first: WorkItem, standing: Standing | None, retry_outcomes: Collection[str],
    planner: TurnPlanner,
) -> WorkItem | Ended | None:
    """What a run sends for a conversation whose turn 1 is ``first``: None when it is complete or
    ended for good. A turn whose last try failed through a server is asked again; an answered
    turn's successor is built from the answer, as during the run that wrote it."""
    assert first.turn is not None
    if standing is None:
        return first
    record, turns = standing.record, first.turn.turns
    if record.get("status") != OK:
        if is_final(record, retry_outcomes):
            return None
        if standing.turn == 1:
            return first
        # Rebuilt from the request that failed: the same messages, budgeted again.
        turn = replace(first.turn, turn=standing.turn, rest=_rest_after(first.turn.rest, standing.turn - 1),
                       prior_finish_reasons=tuple(record.get("prior_finish_reasons") or ()))
        return planner.budgeted(first, list(record["messages"]), turn, str(record["key"]), str(record["prompt_id"]))
    if standing.turn == turns:
        return None
    answered = replace(
        first,
        key=str(record["key"]),
        prompt_id=str(record["prompt_id"]),
        messages=list(record["messages"]),
        turn=replace(first.turn, turn=standing.turn, rest=_rest_after(first.turn.rest, standing.turn - 1),
                     prior_finish_reasons=tuple(record.get("prior_finish_reasons") or ())),
    )
    return planner.next_item(answered, str(record.get("content") or ""), str(record.get("finish_reason")),
                             record.get("tool_calls"))


def _rest_after(rest: tuple[Message, ...], placeholders: int) -> tuple[Message, ...]:
    """What follows the ``placeholders``-th placeholder of turn 1's ``rest``."""
    for _ in range(placeholders):
        _, rest = split_at_answer(rest)
    return rest
