"""A slow disk (issue 45, item 8): the event loop only streams.

The disk here is stuck, not slow (``os.fsync`` on the store's files waits until the test lets it
go), so what the tests assert holds at any speed: while the writer waits on the disk, the answers
keep streaming in; a queue that fills holds the run back at its bound, never past it; a stuck
progress report (a Dagster event log on a slow disk) holds back no stream either. The event loop's
lag under a disk slowed to 200 ms an fsync is a figure: ``bench/bench_loop_lag.py``.
"""

import asyncio
import os
import threading

import pytest

from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore
from expansion_dag_tests.faults.store_faults import SHARD, SIM, Background, HeldRun, in_folder, run_shard
from expansion_dag_tests.generation.test_engine_faults import work
from expansion_dag_tests.helpers import default_engine, wait_for


class StuckDisk:
    """``os.fsync`` on the files (and folders) under ``folder`` waits until :meth:`release`."""

    def __init__(self, monkeypatch, folder):
        self.entered = 0
        self._go = threading.Event()
        real_fsync = os.fsync

        def fsync(fd):
            if in_folder(fd, folder):
                self.entered += 1
                self._go.wait(120)  # a hang only: every test lets it go
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)

    def release(self):
        self._go.set()


def assert_every_answer_once(store, items):
    scan = store.scan(SHARD)
    assert scan.done == {i.key for i in items} and scan.duplicates == 0 and not scan.bad_lines


def test_answers_stream_in_while_the_disk_is_stuck(monkeypatch, tmp_path):
    root, items = tmp_path / "store", work(60)
    disk = StuckDisk(monkeypatch, root)
    with SimulatedFleet([SimServerConfig(**SIM)]) as fleet:
        run = Background(lambda: run_shard(CompletionStore(root), items, fleet.urls[0], fsync_interval_s=0))
        try:
            wait_for(lambda: disk.entered, "the writer's first fsync")
            # Every prompt is sent and answered while the disk still holds the writer's first sync.
            wait_for(lambda: fleet.stats(0)["completed"] == len(items), "every answer, the disk stuck")
            assert disk.entered == 1
        finally:
            disk.release()
        report = run.join()
    assert report.ok == len(items)
    assert_every_answer_once(CompletionStore(root), items)


def test_a_stuck_disk_holds_the_run_back_at_its_queue_never_past_it(monkeypatch, tmp_path):
    root, items = tmp_path / "store", work(60)
    disk = StuckDisk(monkeypatch, root)
    held = 1 + 4 + default_engine().workers_for(8)  # being written, queued, one waiting a worker

    def holding(fleet, run):
        server = fleet.stats(0)
        idle = server["num_running"] + server["num_waiting"] == 0
        return idle and run.queued() == 1 + 4 and server["completed"] == held

    with SimulatedFleet([SimServerConfig(**SIM)]) as fleet:
        run = HeldRun(root, items, fleet.urls[0], write_queue=4)
        try:
            # The run held where its queue is full: the answers being written and queued, one more
            # answer a worker waiting for room, no request on the server; never further.
            wait_for(lambda: holding(fleet, run), "the run held back by the stuck disk, at its bound")
        finally:
            disk.release()
        run.join()
    assert_every_answer_once(CompletionStore(root), items)


def test_a_stuck_progress_report_holds_back_no_stream(tmp_path):
    root, items = tmp_path / "store", work(60)
    reported, go = [], threading.Event()

    def on_progress(progress):
        reported.append(progress)
        go.wait(120)  # an event log that stopped answering; a hang only

    with SimulatedFleet([SimServerConfig(**SIM)]) as fleet:
        run = Background(lambda: run_shard(CompletionStore(root), items, fleet.urls[0], on_progress=on_progress,
                                           config={"progress_interval_s": 0.01}))
        try:
            wait_for(lambda: reported, "the first progress report")
            wait_for(lambda: fleet.stats(0)["completed"] == len(items), "every answer, the report stuck")
        finally:
            go.set()
        run.join()
    assert reported[-1].done == len(items)  # the final figures come last
    assert_every_answer_once(CompletionStore(root), items)


def test_a_cancelled_run_writes_every_answer_it_queued_before_it_ends(monkeypatch, tmp_path):
    root, items = tmp_path / "store", work(60)
    disk = StuckDisk(monkeypatch, root)
    with SimulatedFleet([SimServerConfig(**SIM)]) as fleet:
        run = HeldRun(root, items, fleet.urls[0])
        try:
            wait_for(lambda: run.queued() == len(items), "every answer queued")
            assert disk.entered == 1
            run.cancel()  # the answers it holds not yet written
        finally:
            disk.release()
        with pytest.raises(asyncio.CancelledError):
            run.join()
    assert_every_answer_once(CompletionStore(root), items)
