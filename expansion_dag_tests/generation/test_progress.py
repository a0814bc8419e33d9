"""What a person watching `expansion-dag run` sees: the fleet's progress in one table or line."""

import io

import stamina.instrumentation

from expansion_dag.generation import (
    ObservationThrottle,
    Progress,
    ProgressDisplay,
    ShardProgress,
    quiet_third_party,
    render_table,
    retry_summary,
)

STATES = {"shard-00": "running", "shard-01": "running", "shard-02": "running"}


def figures(done: int, retries: dict[str, int] | None = None) -> ShardProgress:
    engine = Progress(done=done, total=400, elapsed_s=100.0, output_tokens_per_s=1234.5, in_flight={},
                      eta_s=(400 - done) / (done / 100.0), retries=retries or {},
                      answer_yield="rows 96%; truncated 4%")
    return ShardProgress.from_engine(engine)


def test_the_table_shows_done_rate_eta_and_retries_per_shard():
    lines = render_table(STATES, {"shard-00": figures(100, {"transient": 3, "finish_abort": 1}),
                                  "shard-01": figures(300)})
    assert lines[0].split() == ["shard", "state", "done", "rate", "tok/s", "ETA", "failed", "retries", "yield"]
    assert lines[1].split()[:4] == ["shard-00", "running", "100/400", "(25%)"]
    # 300 left at 1/s; 3+1 retries; what the answers so far will give the training set.
    assert "1.00/s" in lines[1] and "5m00s" in lines[1] and lines[1].split()[-5] == "4"
    assert lines[1].endswith("rows 96%; truncated 4%")
    assert "3.00/s" in lines[2] and "0m33s" in lines[2]
    assert lines[3].split()[:3] == ["shard-02", "running", "-"]  # no report yet
    assert lines[0].index("ETA") == lines[1].index("5m00s") == lines[2].index("0m33s")  # aligned columns


def test_the_figures_survive_the_round_trip_through_observation_metadata():
    original = figures(120, {"transient": 2})
    assert ShardProgress.from_metadata(original.as_metadata()) == original


def test_a_terminal_gets_one_table_redrawn_in_place():
    out = io.StringIO()
    display = ProgressDisplay(out, live=True)
    display.update(STATES, {"shard-00": figures(100)})
    first = out.getvalue()
    assert "\x1b[" not in first and first.count("\n") == 4
    display.update(STATES, {"shard-00": figures(200)})
    redraw = out.getvalue()[len(first):]
    assert redraw.startswith("\x1b[4F\x1b[J")  # back to the table's first line, cleared, drawn again
    assert "200/400" in redraw


def test_a_file_gets_one_line_for_the_whole_fleet_per_interval():
    out = io.StringIO()
    display = ProgressDisplay(out, live=False, line_interval_s=3600)
    display.update(STATES, {"shard-00": figures(100)})
    display.update(STATES, {"shard-00": figures(150)})  # within the interval: nothing
    display.update({**STATES, "shard-00": "done"}, {"shard-00": figures(400)}, final=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\x1b" not in out.getvalue()
    assert lines[0].startswith("progress: shard-00 100/400 (25%) 1.00/s ETA 5m00s failed")
    assert "| shard-01 running |" in lines[0]
    assert lines[1].startswith("progress: shard-00 400/400 (100%) 4.00/s done")


def test_retries_are_summed_not_listed():
    assert retry_summary({"shard-00": figures(10, {"transient": 300}), "shard-01": figures(10, {"transient": 12}),
                          "shard-02": None}) == "retries: 312 (shard-00 300, shard-01 12)"
    assert retry_summary({"shard-00": figures(10)}) == "retries: none"


def test_quiet_third_party_silences_per_retry_logging():
    stamina.instrumentation.set_on_retry_hooks(None)  # stamina's defaults, whatever ran before
    default = stamina.instrumentation.get_on_retry_hooks()
    assert default  # stamina logs each retry unless told otherwise
    try:
        quiet_third_party()
        assert list(stamina.instrumentation.get_on_retry_hooks()) == []
    finally:
        stamina.instrumentation.set_on_retry_hooks(None)  # back to stamina's defaults


def test_a_day_long_shard_leaves_a_bounded_number_of_observations_the_last_one_current():
    """A report every 5 s for a day on 24,000 prompts (a reference shard): 17,280 reports."""
    now = [0.0]
    throttle = ObservationThrottle(every_s=60.0, clock=lambda: now[0])
    total, kept, last = 24_000, [], None
    for tick in range(17_280):
        now[0] = 5.0 * tick
        last = ShardProgress(done=min(total - 1, tick * total // 17_280), total=total, failed=0, retries=0,
                             requests_per_s=0.28, output_tokens_per_s=750.0, eta_s=None, elapsed_s=now[0])  # fmt: skip
        if throttle.keep(last):
            kept.append(last)
    kept.append(throttle.last())
    # One a minute and each whole percent: about 1,440 + 100 instead of 17,280.
    assert 1_440 <= len(kept) <= 1_440 + 100 + 1
    assert kept[-1] == last and throttle.last() is None
    # Never more than a minute between two, so the UI is never more than a minute behind.
    assert max(b.elapsed_s - a.elapsed_s for a, b in zip(kept, kept[1:])) <= 60.0


def test_a_short_shard_observes_every_percent_of_its_progress():
    now = [0.0]
    throttle = ObservationThrottle(every_s=60.0, clock=lambda: now[0])
    kept = []
    for i, done in enumerate(range(4, 401, 4)):  # 1% a report, 5 s apart
        now[0] = 5.0 * i
        kept.append(throttle.keep(figures(done)))
    assert all(kept) and throttle.last() is None
