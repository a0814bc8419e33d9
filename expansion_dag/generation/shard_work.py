"""What a shard run sends: each prompt under its mode's key, and each conversation's next turn.

A prompt is sent when the store has no record of its key, or its last record failed through a
server (``outcomes.is_final``). A conversation is asked from where the store says it stands: its
furthest turn with a record (``conversations.standings``). The store is read as digests once, the
pass that also teaches answer lengths; whole records are read only for the few conversations a
run resumes mid-way, whose next request is built from their last answer.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

import polars as pl

from expansion_dag.core import DEFAULT_MODE, OK, ModeIdentities, is_final
from expansion_dag.generation.conversations import (
    Ended,
    Standing,
    TurnPlanner,
    first_turn,
    next_request,
    standings,
    tools_of,
    turn_id,
)
from expansion_dag.generation.dispatch import WorkItem

Record = Mapping[str, Any]


def first_request_id(prompt_id: str, conversation: bool) -> str:
    """The id a prompt's first request is stored under: its own, or its conversation's turn 1."""
    return turn_id(prompt_id, 1) if conversation else prompt_id


def prompt_keys(prompts: pl.DataFrame, identities: ModeIdentities) -> pl.Series:
    """Each prompt's first request's key, under the mode the mix draws it into."""
    conversations = prompts["conversation"].is_not_null().to_list() if "conversation" in prompts.columns else None
    return pl.Series(
        [
            identities.for_prompt(pid).key(first_request_id(pid, bool(conversations and conversations[i])))
            for i, pid in enumerate(prompts["prompt_id"].to_list())
        ],
        dtype=pl.String,
    )


class ShardWork:
    """One shard's prompts under the run's modes, and what of them the store still lacks."""

    def __init__(
        self,
        prompts: pl.DataFrame,
        identities: ModeIdentities,
        *,
        retry_outcomes: Collection[str],
        planner: TurnPlanner | None = None,
    ):
        self.identities = identities
        self._retry = retry_outcomes
        #: Builds each conversation's next turn, during the run too.
        self.planner = planner
        self.firsts = [self._first_item(row) for row in _rows(prompts)]
        #: Every turn key of every conversation: (conversation id, turn).
        self._turn_keys: dict[str, tuple[str, int]] = {}
        for item in self.firsts:
            if item.turn is not None:
                identity = identities.by_mode[item.mode]
                for k in range(1, item.turn.turns + 1):
                    self._turn_keys[identity.key(turn_id(item.turn.conversation_id, k))] = (item.turn.conversation_id, k)
        self.done: set[str] = set()
        self.final: set[str] = set()
        self._digests: list[Record] = []

    def _first_item(self, row: Mapping[str, Any]) -> WorkItem:
        mode = row.get("mode") or DEFAULT_MODE
        conversation = row.get("conversation")
        pid = row["prompt_id"]
        turn = first_turn(pid, conversation) if conversation is not None else None
        request_id = first_request_id(pid, turn is not None)
        return WorkItem(
            key=self.identities.by_mode[mode].key(request_id),
            prompt_id=request_id,
            source=row["source"],
            messages=row["messages"],
            prompt_tokens=row["prompt_tokens"],
            max_tokens=row["max_tokens"],
            expected_output_tokens=row["expected_tokens"] - row["prompt_tokens"],
            mode=mode,
            sampling=self.identities.mix.by_name[mode].sampling,
            tools=tools_of(row.get("tools")),
            turn=turn,
        )

    def reading(self, digests: Iterable[Record]) -> Iterator[Record]:
        """The store's digests passed through, noting what is done, what is final, and where each
        conversation of the shard stands."""
        for record in digests:
            key = record["key"]
            if record.get("status") == OK:
                self.done.add(key)
            if is_final(record, self._retry):
                self.final.add(key)
            if key in self._turn_keys:
                self._digests.append(record)
            yield record

    def items(self, fetch: Callable[[set[str]], Mapping[str, Record]]) -> tuple[list[WorkItem], list[tuple[Ended, WorkItem]]]:
        """The requests to send (after ``reading`` has seen the store), and the conversations that end
        before their next turn (to record). ``fetch`` reads whole records by key."""
        standing = standings(self._digests, self._turn_keys)
        turns = {item.turn.conversation_id: item.turn.turns for item in self.firsts if item.turn is not None}
        wanted = {
            str(s.record["key"]) for cid, s in standing.items()
            if self._needs_whole(s.turn, s.record, turns[cid])
        }
        whole = fetch(wanted) if wanted else {}
        todo: list[WorkItem] = []
        ended: list[tuple[Ended, WorkItem]] = []
        for item in self.firsts:
            if item.turn is None:
                if item.key not in self.done and item.key not in self.final:
                    todo.append(item)
                continue
            found = standing.get(item.turn.conversation_id)
            if found is not None and str(found.record["key"]) in whole:
                found = Standing(found.turn, whole[str(found.record["key"])])
            assert self.planner is not None, "a conversation needs a TurnPlanner"
            planned = next_request(item, found, self._retry, self.planner)
            if isinstance(planned, Ended):
                ended.append((planned, item))
            elif planned is not None:
                todo.append(planned)
        return todo, ended

    def frontier_keys(self, digests: Iterable[Record]) -> set[str]:
        """The keys that say where each prompt stands now: its own, or for a conversation its
        furthest turn's with a record (complete, failed or ended), else the turn it waits for."""
        keys = {item.key for item in self.firsts if item.turn is None}
        standing = standings((r for r in digests if r["key"] in self._turn_keys), self._turn_keys)
        for item in self.firsts:
            if item.turn is None:
                continue
            found = standing.get(item.turn.conversation_id)
            identity = self.identities.by_mode[item.mode]
            if found is None:
                keys.add(item.key)
            elif found.record.get("status") == OK and found.turn < item.turn.turns:
                keys.add(identity.key(turn_id(item.turn.conversation_id, found.turn + 1)))
            else:
                keys.add(str(found.record["key"]))
        return keys

    def _needs_whole(self, turn: int, record: Record, turns: int) -> bool:
        """Whether the next request is built from the record's text: an answered turn before the last,
        or a failed turn after the first that is asked again (with the messages it was sent)."""
        if record.get("status") == OK:
            return turn < turns
        return turn > 1 and not is_final(record, self._retry)

    @property
    def conversations(self) -> int:
        return sum(item.turn is not None for item in self.firsts)


def _rows(prompts: pl.DataFrame) -> Iterator[dict[str, Any]]:
    wanted = [c for c in ("prompt_id", "source", "messages", "prompt_tokens", "max_tokens", "expected_tokens",
                          "mode", "conversation", "tools") if c in prompts.columns]
    return prompts.select(wanted).iter_rows(named=True)
