"""Each prompt's outcome, handed to the completion store's writer the moment it is known, and counted.

The writer runs off the event loop (``off_loop.OffLoop``): a record is
queued here and written there, in the order queued; ``engine`` says what is durable when.

A completion record carries everything a trainer and a reader need (the answer, the counts, the
server (its URL without credentials), the budget); a failure record says what failed and whose
fault it was (``outcome``, see ``expansion_dag.core.outcomes``), and a stopped loop keeps its text
for inspection, and where its loop began (``loop_cut``): the training set may keep the text before
it (``generation.loop_prefix``), never the loop.
Token ids the server returned are kept packed, by ``expansion_dag.core.token_ids``' rule.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from expansion_dag.core import (
    CONTENT,
    FAILED,
    OK,
    OUTPUT_IDS,
    PROMPT_IDS,
    RequestError,
    SamplingSettings,
    pack,
    record_fields,
    without_credentials,
)
from expansion_dag.generation.conversations import Ended
from expansion_dag.generation.dispatch import WorkItem
from expansion_dag.generation.shard_report import ShardReport
from expansion_dag.generation.off_loop import OffLoop
from expansion_dag.servers import Answer, DegenerateError, Exchange, loop_cut
from expansion_dag.store import SegmentWriter

#: The training set's verdict on a record (``training_set.AnswerJudge``): ``row`` or why not.
Judge = Callable[[Mapping[str, Any]], str]


@dataclass(frozen=True)
class LoopRetry:
    """A prompt asked once more after its answer was stopped as a loop (``generation.loop_retries``):
    the first stop's rule and tokens, and the settings of the second try."""

    rule: str
    tokens: int
    sampling: SamplingSettings

    @classmethod
    def after(cls, error: DegenerateError, sampling: SamplingSettings, key: str) -> LoopRetry:
        """Another seed than the first try's: the next one, or where that had none (the server drew
        one), one of the prompt's own, so that a re-run asks the same."""
        seed = ((sampling.seed if sampling.seed is not None else zlib.crc32(key.encode())) + 1) % 2**31
        return cls(error.rule, error.tokens, dataclasses.replace(sampling, seed=seed))

    def record_fields(self) -> dict[str, Any]:
        return {"loop_retry": {"first_rule": self.rule, "first_tokens": self.tokens, "seed": self.sampling.seed}}


class Recorder:
    """Writes one shard run's records (through ``off_loop``) and keeps its report; ``judge`` counts
    what answers will yield."""

    def __init__(self, writer: SegmentWriter, off_loop: OffLoop, report: ShardReport, judge: Judge | None = None):
        self._writer = writer
        self._off_loop = off_loop
        self.report = report
        self._judge = judge

    async def _write(self, record: dict[str, Any]) -> None:
        await self._off_loop.submit(self._writer.append, record)
        # Only answers are judged (a loop and an ended conversation included): a server's or a
        # request's failure says nothing of what the model writes.
        if self._judge is not None and (record["status"] == OK or record.get("outcome") == CONTENT):
            self.report.answer_yield.count(self._judge(record))

    async def answer(
        self,
        item: WorkItem,
        server_url: str,
        answer: Answer,
        exchange: Exchange,
        latency: float,
        *,
        expected: int,
        features: Sequence[int],
        loop_retry: LoopRetry | None = None,
    ) -> None:
        finish = answer.finish_reason
        await self._write(
            {
                "key": item.key,
                "status": OK,
                "prompt_id": item.prompt_id,
                "source": item.source,
                **_request_fields(item),
                "messages": list(item.messages),
                "content": answer.content,
                "reasoning_content": answer.reasoning,
                **({"tool_calls": answer.tool_calls} if answer.tool_calls else {}),
                "finish_reason": finish,
                "prompt_tokens": answer.prompt_tokens,
                "completion_tokens": answer.completion_tokens,
                "local_prompt_tokens": item.prompt_tokens,
                "max_tokens": exchange.max_tokens,
                "server": without_credentials(server_url),  # a record is read by many: no password
                "latency_s": round(latency, 4),
                "attempts": exchange.attempts,
                "length_features": list(features),
                **record_fields(answer.prompt_ids, answer.output_ids, answer.completion_tokens),
                **(loop_retry.record_fields() if loop_retry else {}),
            }
        )
        report = self.report
        report.ok += 1
        report.finish_reasons[finish] += 1
        report.requests_by_source[item.source] += 1
        if finish == "length":
            report.truncated_by_source[item.source] += 1
        report.output_tokens += answer.completion_tokens
        report.output_tokens_by_outcome[finish] += answer.completion_tokens
        report.slot_seconds_by_outcome[finish] += latency
        report.answers.append((expected, answer.completion_tokens, latency))
        if answer.prompt_tokens is not None:
            report.prompt_token_drift[answer.prompt_tokens - item.prompt_tokens] += 1
        stats = self._stats(server_url)
        stats.requests += 1
        stats.output_tokens += answer.completion_tokens

    async def failure(
        self, item: WorkItem, server_url: str, error: RequestError, exchange: Exchange, latency: float,
        loop_retry: LoopRetry | None = None,
    ) -> None:
        record = {
            "key": item.key,
            "status": FAILED,
            "prompt_id": item.prompt_id,
            "source": item.source,
            **_request_fields(item),
            # A conversation's turn is asked again from the messages it was sent.
            **({"messages": list(item.messages)} if item.turn is not None else {}),
            "error": error.kind,
            "outcome": error.outcome,
            "http_status": error.status,
            "message": error.message,
            "attempts": exchange.attempts,
            "server": without_credentials(server_url),
            "max_tokens": exchange.max_tokens,
            **(loop_retry.record_fields() if loop_retry else {}),
        }
        if isinstance(error, DegenerateError):
            # Kept for inspection: of a failure record, only the text before a loop is ever trained.
            record |= {
                "content": error.content,
                "reasoning_content": error.reasoning,
                "loop_rule": error.rule,
                "loop_span": error.loop.span,
                "loop_repeats": error.loop.repeats,
                "streamed_chunks": error.chunks,
                "streamed_tokens": error.tokens,
            }
            if not error.in_reasoning and item.turn is None:
                # Where the answer's text before its loop ends, for a row of it (``loop_prefix``), and
                # the prompt that row needs.
                record |= {"loop_cut": loop_cut(error.content, error.loop), "messages": list(item.messages)}
            if error.prompt_ids is not None:
                record[PROMPT_IDS] = pack(error.prompt_ids)
            if error.output_ids is not None:
                record[OUTPUT_IDS] = pack(error.output_ids)
            self.report.output_tokens_by_outcome[error.kind] += error.tokens
            self.report.degenerate_by_rule[error.rule] += 1
        await self._write(record)
        self.report.failed += 1
        self.report.failures_by_kind[error.kind] += 1
        self.report.slot_seconds_by_outcome[error.kind] += latency
        self._stats(server_url).requests += 1

    async def ended(self, ended: Ended, item: WorkItem, server_url: str) -> None:
        """A conversation stopped before its last turn: final, under the key of the turn not asked."""
        await self._write(ended_record(ended, item, server_url))
        self.report.failures_by_kind[ended.reason] += 1

    def _stats(self, url: str):
        return self.report.servers.get(url) or self.report.helpers[url]


def ended_record(ended: Ended, item: WorkItem, server_url: str) -> dict[str, Any]:
    """The record of a conversation that stops before the turn ``ended`` names: a final content outcome."""
    return {
        "key": ended.key,
        "status": FAILED,
        "prompt_id": ended.prompt_id,
        "source": item.source,
        "mode": item.mode,
        "tools": list(item.tools) if item.tools else None,
        **ended.turn.record_fields(),
        "error": ended.reason,
        "outcome": CONTENT,
        "message": ended.detail,
        "attempts": 0,
        "server": without_credentials(server_url),
    }


def _request_fields(item: WorkItem) -> dict[str, Any]:
    """What a record says of the request beyond the prompt: its mode, and for a conversation's turn
    where it stands and its tools."""
    fields: dict[str, Any] = {"mode": item.mode}
    if item.turn is not None:
        fields |= item.turn.record_fields() | {"tools": list(item.tools) if item.tools else None}
    return fields
