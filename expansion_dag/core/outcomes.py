"""What a request's outcome says, and about whom: the one taxonomy every decision reads.

- ``server``: a refused connection, a timeout, a 5xx, an answer cut by the server (``abort``), a
  malformed body, a refused key. It says the server is in trouble: retried there with backoff,
  counted by the circuit breaker, it fails a canary and makes a borrowed server's shard stop
  borrowing it; a re-run asks again.
- ``request``: the server refused this request (a context-length 400, bad input). It says nothing
  about the server, only that this prompt cannot be sent as it is. A re-run asks again (it costs no
  decode, and a fleet relaunched with a larger context may take it).
- ``content``: the model answered: ``stop``, ``length``, or ``degenerate`` (a loop stopped by the
  client). Whatever the answer is worth, the server did its job: a canary passes, the breaker counts
  a success, a borrowed server stays in use. It is *final* for the prompt under this identity: a
  re-run does not ask again, unless the user names the outcome in ``generation.retry_outcomes``.
- ``backpressure``: the server's queue is full (503 "The request queue is full.", 429). The sender
  slows down and sends again; it is no failure and never uses up an attempt.

Pure: the engine (``expansion_dag.generation.engine``), the completions asset and the store's readers use it.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping
from typing import Any, Literal

from expansion_dag.core.errors import RequestError
from expansion_dag.core.records import FAILED, OK

SERVER = "server"
REQUEST = "request"
CONTENT = "content"
BACKPRESSURE = "backpressure"

#: Content outcomes a failure record can hold (a complete answer is an ``ok`` record), and so the
#: values ``generation.retry_outcomes`` takes.
RETRYABLE_CONTENT = ("degenerate",)
#: How a conversation ends short of its sources' turns, by the content's doing: the context filled
#: (``CONTEXT_EXHAUSTED``) or an earlier turn's answer did not finish (``TURN_UNFINISHED``). Each is
#: recorded as the final failure of the turn not asked.
CONTEXT_EXHAUSTED = "context_exhausted"
TURN_UNFINISHED = "turn_unfinished"
ENDINGS = (CONTEXT_EXHAUSTED, TURN_UNFINISHED)

#: Failure kinds of records written before records carried their outcome.
_OUTCOME_OF_KIND = {"degenerate": CONTENT, "context_length": REQUEST, "rejected": REQUEST}


def of_error(error: RequestError | None) -> str:
    """The outcome of one attempt's error (None: a complete answer, a content outcome)."""
    return CONTENT if error is None else error.outcome


def of_record(record: Mapping[str, Any]) -> str:
    """The outcome of a stored record: a completion is content; a failure says its own, or its kind's."""
    if record.get("status") == OK:
        return CONTENT
    return str(record.get("outcome") or _OUTCOME_OF_KIND.get(str(record.get("error")), SERVER))


def is_final(record: Mapping[str, Any], retry_outcomes: Collection[str]) -> bool:
    """Whether a re-run leaves the record's prompt alone: a content outcome the user did not ask again."""
    if record.get("status") == OK:
        return True
    return record.get("status") == FAILED and of_record(record) == CONTENT and record.get("error") not in retry_outcomes


class Breaker:
    """Opens when most of the last ``window`` outcomes are failures of one kind and status.

    A content outcome is a success here: a model that loops is no reason to stop the fleet.
    """

    def __init__(self, window: int, fraction: float):
        self._outcomes: collections.deque[RequestError | None] = collections.deque(maxlen=window)
        self._fraction = fraction

    def record(self, error: RequestError | None) -> str | None:
        """Counts one prompt's outcome; the reason to stop the shard, once the breaker opens."""
        self._outcomes.append(None if of_error(error) == CONTENT else error)
        if len(self._outcomes) < (self._outcomes.maxlen or 0):
            return None
        failures = [e for e in self._outcomes if e is not None]
        if len(failures) < self._fraction * len(self._outcomes):
            return None
        signature, count = collections.Counter(e.signature for e in failures).most_common(1)[0]
        if count < self._fraction * len(self._outcomes):
            return None
        example = next(e for e in reversed(failures) if e.signature == signature)
        return f"circuit breaker: {count} of the last {len(self._outcomes)} requests failed with {describe(example)}"


def describe(error: RequestError) -> str:
    status = f" HTTP {error.status}" if error.status else ""
    return f"{error.kind}{status}: {error.message}"


#: A canary whose request the server refused tries another prompt, this many in all: one bad prompt
#: says nothing about the fleet, the same refusal of each says the fleet refuses everything.
CANARY_PROMPTS = 3

CanaryVerdict = Literal["passed", "try_another", "failed"]


def canary_verdict(error: RequestError | None, tried: int) -> CanaryVerdict:
    """A canary judges the server: any answer, a loop included, proves it works."""
    outcome = of_error(error)
    if outcome == CONTENT:
        return "passed"
    if outcome == REQUEST and tried < CANARY_PROMPTS:
        return "try_another"
    return "failed"


BorrowedVerdict = Literal["recorded", "give_back_and_requeue", "send_home", "bench_and_send_home"]


def borrowed_verdict(error: RequestError | None) -> BorrowedVerdict:
    """What a prompt's outcome on another shard's idle server means for it and for that server.

    ``recorded``: an answer, a loop included (content is final wherever it came from).
    ``give_back_and_requeue``: the server is busy again (backpressure): one slot less is claimed
    there, and the prompt is first in the queue again. ``send_home``: the request's own
    trouble, tried again on the shard's server with its whole retry policy. ``bench_and_send_home``:
    the server's trouble; it is not borrowed again in this run.
    """
    outcome = of_error(error)
    if outcome == CONTENT:
        return "recorded"
    if outcome == BACKPRESSURE:
        return "give_back_and_requeue"
    if outcome == REQUEST:
        return "send_home"
    return "bench_and_send_home"
