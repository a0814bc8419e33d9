"""A simulated server's scheduler: its slots, the FIFO queue behind them, each job's timer or
streamed ticks, aborts, and the busy-slot accounting that ``/sim/stats`` reports.

Apart from the request intake and the HTTP surface so that when a request waits, runs and ends
(what a fleet's throughput comes from) reads in one place.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

from expansion_dag.sim.config import SimServerConfig
from expansion_dag.sim.dialects import Dialect, RequestError, dumps
from expansion_dag.sim.http import HttpConnection
from expansion_dag.sim.job import DONE, RUNNING, WAITING, Job
from expansion_dag.sim.timeline import Timeline

#: Tokens a streamed answer sends per timer tick: the events the stream interval makes, written in
#: batches so that a simulated fleet costs few timers.
_STREAM_TICK_TOKENS = 16


def _usage_so_far(job: Job) -> dict[str, int] | None:
    """A choice chunk's usage when the request asked for it in every chunk, else None."""
    if not job.continuous_usage:
        return None
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.sent_tokens,
        "total_tokens": job.prompt_tokens + job.sent_tokens,
    }


class Scheduler:
    """Runs accepted jobs on ``max_running_requests`` slots, first come first served; the rest wait.

    No task per request: a running job holds one timer on the server's loop, armed for
    ``ttft_s + completion_tokens * token_latency_s`` or, when streamed, for its next tick.
    """

    def __init__(
        self, config: SimServerConfig, dialect: Dialect, eos_token_id: int | None, on_limit: Callable[[str], None]
    ) -> None:
        self.config = config
        self._dialect = dialect
        self._eos_token_id = eos_token_id
        #: Called with a reason once ``die_after_requests`` requests have completed.
        self._on_limit = on_limit
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it starts
        self.slots = config.max_running_requests
        self.running: set[Job] = set()
        self._waiting: collections.deque[Job] = collections.deque()
        self.num_waiting = 0  # aborted jobs stay in the deque until popped
        self.waiting_prompt_tokens = 0
        # the busy integral restarts when the server becomes ready
        self._ready_at: float | None = None
        self._busy_slot_s = 0.0
        self._busy_since = time.monotonic()
        #: The last moment every slot was busy, and the longest a completed request held its slot:
        #: a benchmark's tail is the time from the fleet's last full moment to its end.
        self._last_full_at: float | None = None
        self._longest_request_s = 0.0
        self.by_status: collections.Counter[int] = collections.Counter()
        self.completed = 0
        self.aborted = 0
        self.abort_finishes = 0
        self.hung = 0
        self.prompt_tokens_total = 0
        self.completion_tokens_total = 0
        self.timeline = Timeline() if config.keep_timeline else None

    @property
    def full(self) -> bool:
        return len(self.running) >= self.slots

    def start_clock(self) -> None:
        """Restart the busy integral: utilization counts from the moment the server is ready."""
        now = time.monotonic()
        self._ready_at = now
        self._busy_slot_s = 0.0
        self._busy_since = now

    def busy(self, now: float) -> dict[str, float | None]:
        """The busy integral, the last full moment and the longest request, as ``/sim/stats`` has them."""
        busy = self._busy_slot_s + len(self.running) * (now - self._busy_since)
        elapsed = None if self._ready_at is None else now - self._ready_at
        return {
            "last_full_at_monotonic_s": now if self.full else self._last_full_at,
            "longest_request_s": self._longest_request_s,
            "elapsed_since_ready_s": elapsed,
            "busy_slot_seconds": busy,
            "utilization_since_ready": busy / (self.slots * elapsed) if elapsed else None,
        }

    def reject(self, conn: HttpConnection, error: RequestError) -> None:
        """Answer a request refused before it was queued, counted with the other answers."""
        self.by_status[error.status] += 1
        if self.timeline is not None:
            self.timeline.refused(error.status)
        conn.respond(error.status, error.body)

    def submit(self, job: Job) -> None:
        """Run an accepted job on a free slot, or queue it."""
        job.conn.on_abort = lambda: self._abort(job)
        if len(self.running) < self.slots:
            self._run(job)
        else:
            self._waiting.append(job)
            self.num_waiting += 1
            self.waiting_prompt_tokens += job.prompt_tokens

    def drop_all(self) -> None:
        """Forget every job, running or waiting, unanswered: the server vanished."""
        for job in self.running:
            if job.timer is not None:
                job.timer.cancel()
            self._end(job, "dropped")
        for job in self._waiting:
            self._end(job, "dropped")
        self.running.clear()
        self._waiting.clear()
        self.num_waiting = 0
        self.waiting_prompt_tokens = 0

    def _account_busy(self, now: float) -> None:
        self._busy_slot_s += len(self.running) * (now - self._busy_since)
        self._busy_since = now
        if self.full:
            self._last_full_at = now

    def _run(self, job: Job) -> None:
        now = time.monotonic()
        self._account_busy(now)
        self.running.add(job)
        job.state = RUNNING
        job.started_at = now
        if job.duration_s is None:
            self.hung += 1
        elif job.stream_usage is not None:
            job.timer = self.loop.call_later(self.config.ttft_s, self._stream_tick, job)
        else:
            job.timer = self.loop.call_later(job.duration_s, self._finish, job)

    def _stream_tick(self, job: Job) -> None:
        """Send the next tokens of a streamed answer; finish once all are sent."""
        d = self._dialect
        if job.sent == 0:
            job.conn.start_stream()
            job.conn.send_event(d.stream_event(job, {"role": "assistant", "content": ""}, usage=_usage_so_far(job)))
        events, tokens = [], 0
        ids = job.output_ids
        while job.sent < len(job.pieces) and tokens < _STREAM_TICK_TOKENS:
            delta, n = job.pieces[job.sent]
            job.sent += 1
            job.sent_tokens += n
            delta_ids = None if ids is None else ids[job.sent_tokens - n : job.sent_tokens]
            events.append(d.stream_event(job, delta, usage=_usage_so_far(job), token_ids=delta_ids))
            tokens += n
        if events:
            job.conn.send_event(b"".join(events))
        delay = max(tokens, 1) * self.config.token_latency_s
        then = self._stream_tick if job.sent < len(job.pieces) else self._finish
        job.timer = self.loop.call_later(delay, then, job)

    @staticmethod
    def _end(job: Job, status: int | str) -> None:
        job.state = DONE
        if job.trace is not None:
            Timeline.ended(job.trace, status)

    def _release(self, job: Job, status: int | str) -> None:
        """Free the job's slot and hand it to the next waiting request."""
        self._account_busy(time.monotonic())
        self.running.discard(job)
        self._end(job, status)
        while self._waiting and len(self.running) < self.slots:
            nxt = self._waiting.popleft()
            if nxt.state == WAITING:
                self.num_waiting -= 1
                self.waiting_prompt_tokens -= nxt.prompt_tokens
                self._run(nxt)

    def _finish(self, job: Job) -> None:
        self._longest_request_s = max(self._longest_request_s, time.monotonic() - job.started_at)
        self._release(job, 200)
        self.completed += 1
        self.by_status[200] += 1
        if job.completion.finish_reason == "abort":
            self.abort_finishes += 1
        self.prompt_tokens_total += job.prompt_tokens
        self.completion_tokens_total += job.completion.completion_tokens
        body = self._dialect.completion_body(job, self._eos_token_id)
        if job.stream_usage is None:
            job.conn.respond(200, dumps(body))
        else:
            d = self._dialect
            # The ids the deltas' words did not carry (the thinking's structure) come with the finish.
            rest = None if job.output_ids is None else job.output_ids[job.sent_tokens :]
            events = d.stream_event(
                job, {}, finish_reason=job.completion.finish_reason, usage=_usage_so_far(job), token_ids=rest
            )
            events += d.stream_ids_event(job)
            if job.stream_usage:
                events += d.stream_event(job, None, usage=body["usage"])
            job.conn.send_event(events + b"data: [DONE]\n\n")
            job.conn.end_stream()
        limit = self.config.die_after_requests
        if limit is not None and self.completed >= limit:
            self._on_limit(f"died after {limit} completed requests (die_after_requests)")

    def _abort(self, job: Job) -> None:
        """The client went away before its answer: drop the request and free its slot."""
        if job.state == DONE:
            return
        self.aborted += 1
        if job.state == WAITING:
            self._end(job, "aborted")
            self.num_waiting -= 1
            self.waiting_prompt_tokens -= job.prompt_tokens
            return
        if job.timer is not None:
            job.timer.cancel()
        self._release(job, "aborted")
