"""What the store's fault tests share: a shard run (the prompts of ``test_engine_faults.work``, whose
text names their key), in a thread of its own where a test holds the disk while the run goes on; the
disk's faults on the files of one folder alone (the rest of the process writes as usual); and what
the simulator was asked, by key."""

import asyncio
import collections
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from expansion_dag.generation import Server, ShardRun, WorkItem, generate_shard
from expansion_dag.store import CompletionStore
from expansion_dag_tests.helpers import default_sampling, default_engine

SHARD = "shard-00"
#: Answers of a few milliseconds on 8 slots: a shard of dozens of prompts in about a second.
SIM = dict(port=0, max_running_requests=8, ttft_s=0.001, token_latency_s=0.0002, output_median_tokens=60,
           keep_timeline=True)
FAST = dict(backoff_initial_s=0.01, progress_interval_s=3600, canary=False)
_FACT = re.compile(r"Tell me fact number (\d+)\.")


def run_shard(store: CompletionStore, items: list[WorkItem], url: str, *, fsync_interval_s: float = 2.0,
              **kwargs: Any) -> Any:
    """One run of the shard, to its end: its report."""
    config = default_engine(**{**FAST, **kwargs.pop("config", {})})
    with store.writer(SHARD, fsync_interval_s=fsync_interval_s) as writer:
        return generate_shard(items, [Server(url, 8)], writer=writer, model="m", sampling=default_sampling(),
                              config=config, **kwargs)


class Background:
    """A shard run in a thread: the test holds the disk meanwhile, then waits for its end."""

    def __init__(self, run: Callable[[], Any]):
        self.result: Any = None
        self.error: BaseException | None = None

        def target() -> None:
            try:
                self.result = run()
            except BaseException as exc:
                self.error = exc

        self._thread = threading.Thread(target=target, daemon=True)
        self._thread.start()

    def join(self) -> Any:
        self._thread.join(120)  # a hang only: a shard here ends in seconds
        assert not self._thread.is_alive(), "the shard run did not end"
        if self.error is not None:
            raise self.error
        return self.result


class HeldRun(Background):
    """A ``ShardRun`` on a loop of its own in a thread, its store's segments synced at every line: the
    test reads its report (an answer is counted once queued for the writer) and may cancel it."""

    def __init__(self, root: Path, items: list[WorkItem], url: str, **kwargs: Any):
        self.shard: ShardRun | None = None

        async def main() -> Any:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            with CompletionStore(root).writer(SHARD, fsync_interval_s=0) as writer:
                self.shard = ShardRun(items, [Server(url, 8)], writer=writer, model="m", sampling=default_sampling(),
                                      config=default_engine(**FAST), **kwargs)
                return await self.shard.run()

        super().__init__(lambda: asyncio.run(main()))

    def queued(self) -> int:
        """Answers the run has queued for its writer so far."""
        return self.shard.report.ok if self.shard is not None else 0

    def cancel(self) -> None:
        """As Ctrl-C stops a run: its task cancelled."""
        self._loop.call_soon_threadsafe(self._task.cancel)


def in_folder(fd: int, folder: Path) -> bool:
    """Whether ``fd`` is a file (or the folder) under ``folder``: the store's, not pytest's or a socket."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder))
    except OSError:
        return False


def asked(fleet: Any, since: int = 0) -> collections.Counter[str]:
    """How many requests the simulator took for each key (``work``'s), from its ``since``-th on."""
    requests = fleet.stats(0)["timeline"]["requests"][since:]
    found = (_FACT.search(r["instruction"] or "") for r in requests)
    return collections.Counter(f"k{int(m.group(1)):04d}" for m in found if m)


def requests_so_far(fleet: Any) -> int:
    return len(fleet.stats(0)["timeline"]["requests"])

