"""One accepted chat request on its way through a simulated server.

Its own module because three units share it: the request intake makes it, the scheduler runs it
and the dialects write its answer.
"""

from __future__ import annotations

import array
import asyncio
import time
import uuid

from expansion_dag.sim.generation import Completion
from expansion_dag.sim.http import HttpConnection

WAITING, RUNNING, DONE = 0, 1, 2


class Job:
    """One accepted generation request, waiting for or holding a slot."""

    __slots__ = (
        "conn",
        "request_id",
        "model",
        "prompt_tokens",
        "completion",
        "duration_s",
        "state",
        "started_at",
        "timer",
        "stream_usage",
        "pieces",
        "sent",
        "sent_tokens",
        "continuous_usage",
        "chunk_id",
        "created",
        "trace",
        "prompt_ids",
        "output_ids",
    )

    def __init__(
        self,
        conn: HttpConnection,
        *,
        request_id: str | None,
        model: str,
        prompt_tokens: int,
        completion: Completion,
        duration_s: float | None,
    ) -> None:
        self.conn = conn
        self.request_id = request_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.completion = completion
        self.duration_s = duration_s  # None: a hung request, answered never
        self.state = WAITING
        self.started_at = 0.0
        self.timer: asyncio.TimerHandle | None = None
        #: None: answered in one body; else streamed, with a usage chunk when True.
        self.stream_usage: bool | None = None
        #: A streamed answer's events, (delta, tokens), how many were sent, and their tokens.
        self.pieces: list[tuple[dict, int]] = []
        self.sent = 0
        self.sent_tokens = 0
        #: Every choice chunk carries the usage so far (vLLM's ``continuous_usage_stats``).
        self.continuous_usage = False
        self.chunk_id = uuid.uuid4().hex
        self.created = int(time.time())
        #: Its entry in the server's timeline, when one is kept.
        self.trace: list | None = None
        #: The token ids the request asked for (None: not asked, or a server that returns none).
        self.prompt_ids: list[int] | None = None
        self.output_ids: array.array | None = None
