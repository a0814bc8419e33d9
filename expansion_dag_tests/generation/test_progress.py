"""What a person watching `expansion-dag run` sees: the fleet's progress in one table or line."""

import io

import pytest
import stamina.instrumentation

from expansion_dag.generation import (
    MIN_ANSWERS,
    ObservationThrottle,
    Progress,
    ProgressDisplay,
    ShardPlan,
    ShardProgress,
    Speed,
    WorkLeft,
    quiet_third_party,
    render_line,
    render_table,
    retry_summary,
    speed_line,
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


def test_a_shard_waiting_for_another_runs_lease_says_for_whom_and_until_when():
    # 2026-12-07 14:03:10 UTC
    waiting = ShardProgress.waiting_for("run 1c2f on host gpu-a", 1796652190.0)
    waiting = ShardProgress.from_metadata(waiting.as_metadata())  # as the CLI reads it back
    said = "waiting for run 1c2f on host gpu-a; gives up at 14:03:10 UTC (storage.shard_busy_wait_s)"
    line = render_line(STATES, {"shard-00": waiting, "shard-01": figures(300)})
    assert line.startswith(f"progress: shard-00 {said} | ")
    row = render_table(STATES, {"shard-00": waiting})[1]
    assert row.split()[:2] == ["shard-00", "waiting"] and said.removeprefix("waiting ") in row
    # Once it ended (here: gave up), its state is what the table shows.
    assert "waiting" not in render_line({"shard-00": "FAILED"}, {"shard-00": waiting})


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


def measured(done: int, *, elapsed: float = 60.0, speed: Speed | None = None, plan_rate: float | None = None,
             simulated: bool = False) -> ShardProgress:
    """A shard 60 s in whose plan expects 400 answers of 1,000 tokens; ``speed``: what it measured."""
    engine = Progress(done=done, total=400, elapsed_s=elapsed, output_tokens_per_s=900.0, in_flight={}, eta_s=30.0,
                      speed=speed, answered_tokens=done * 500)
    return ShardProgress.from_engine(engine, ShardPlan(400_000.0, plan_rate, simulated))


SPEED = Speed(tokens_per_s=2000.0, servers=1, answers=40, window_s=50.0, streams=70.0, in_flight_tokens=30_000.0)


def test_a_shard_reports_its_time_to_finish_and_gpu_hours_at_its_measured_speed():
    p = measured(40, speed=SPEED)
    # 400,000 planned less 20,000 answered and 30,000 still decoding, at 2,000 tokens/s.
    assert p.speed_tokens_per_s == 2000.0 and p.finish_s == 175.0
    assert p.gpu_hours == round(400_000 / 2000 / 3600, 4)
    assert p.speed_basis == "40 answers and 70.0 streams decoding a server over 50 s with its slots full"
    assert ShardProgress.from_metadata(p.as_metadata()) == p
    # The ETA column says the time to finish, not the rate of the short first answers (30 s).
    assert render_table({"shard-00": "running"}, {"shard-00": p})[1].split()[6] == "2m55s"


def test_the_time_to_finish_and_gpu_hours_rest_on_the_work_left_the_answers_taught_not_on_the_plan():
    # The plan said 400,000 tokens; the answers so far say 150,000 are left (20,000 of them the rest
    # of the answers running).
    work = WorkLeft(tokens=150_000.0, running_tokens=20_000.0, drain_tokens=2_100.0, queued=290, running=70,
                    learned=1_930)
    engine = Progress(done=40, total=400, elapsed_s=60.0, output_tokens_per_s=900.0, in_flight={}, eta_s=30.0,
                      speed=SPEED, answered_tokens=20_000, work=work)
    p = ShardProgress.from_engine(engine, ShardPlan(400_000.0, None, False))
    assert p.finish_s == 75.0  # 150,000 tokens at 2,000 tokens/s
    # This run's prompts: 20,000 answered, 30,000 decoding, 150,000 left.
    assert p.gpu_hours == round(200_000 / 2000 / 3600, 4)
    assert p.tokens_left == 150_000
    assert p.tokens_left_basis == "learned from 1,930 answers; 290 queued, 70 running at least their tokens so far"
    assert ShardProgress.from_metadata(p.as_metadata()) == p


def test_once_fewer_answers_are_left_than_slots_the_time_to_finish_is_the_longest_ones_at_a_streams_speed():
    # 70 streams at 2,000 tokens/s in all: 28.6 tokens/s each. Left: 10 answers running, one of
    # them 4,000 tokens from its end: it ends alone, 140 s from now, whatever the 12,000 tokens left
    # would take at the speed of 70 streams (6 s).
    work = WorkLeft(tokens=12_000.0, running_tokens=12_000.0, drain_tokens=4_000.0, queued=0, running=10, learned=390)
    engine = Progress(done=390, total=400, elapsed_s=600.0, output_tokens_per_s=900.0, in_flight={}, eta_s=15.0,
                      speed=SPEED, answered_tokens=380_000, work=work)
    assert ShardProgress.from_engine(engine, ShardPlan(400_000.0, None, False)).finish_s == 140.0


def test_an_eta_the_prompts_rate_contradicts_by_over_twice_is_shown_beside_it():
    # 16 prompts left at 0.46 prompts/s: 35 s by the rate; the tokens left say 28 minutes.
    p = ShardProgress(done=256, total=272, failed=0, retries=0, requests_per_s=0.46, output_tokens_per_s=125.0,
                      eta_s=35.0, elapsed_s=560.0, finish_s=1705.0)
    assert render_table({"shard-00": "running"}, {"shard-00": p})[1].split()[6:9] == ["28m25s", "(prompts'", "rate:"]
    agreeing = ShardProgress(**{**p.as_metadata(), "finish_s": 50.0})
    assert render_table({"shard-00": "running"}, {"shard-00": agreeing})[1].split()[6:8] == ["0m50s", "0"]


def test_until_the_speed_is_defensible_the_shard_says_what_it_waits_for():
    assert measured(0).speed_basis == "measuring: slots not full yet" and measured(0).finish_s is None
    early = Speed(tokens_per_s=2000.0, servers=1, answers=3, window_s=4.0, streams=70.0, in_flight_tokens=0.0)
    assert measured(3, speed=early).speed_basis == f"measuring: 3 of {MIN_ANSWERS} answers since the slots filled"
    line = speed_line({"shard-00": measured(40, speed=SPEED), "shard-01": measured(3, speed=early)})
    assert line == f"speed: shard-01 measuring: 3 of {MIN_ANSWERS} answers since the slots filled"


@pytest.mark.parametrize(
    ("plan_rate", "said"),
    [
        (None, "the plan had no throughput"),
        (1600.0, "the plan's 1,600 tokens/s holds (within 25%)"),
        (5000.0, "the plan's 5,000 tokens/s is off by -67%"),
    ],
)
def test_the_fleets_speed_line_gives_time_to_finish_gpu_hours_and_checks_the_plans_throughput(plan_rate, said):
    slower = Speed(tokens_per_s=1000.0, servers=1, answers=20, window_s=40.0, streams=70.0, in_flight_tokens=0.0)
    figures = {"shard-00": measured(40, speed=SPEED, plan_rate=plan_rate, simulated=True),
               "shard-01": measured(40, speed=slower, plan_rate=plan_rate, simulated=True), "shard-02": None}
    assert speed_line(figures) == "speed: shard-02 no report yet"  # the fleet waits for its every shard
    line = speed_line({**figures, "shard-02": measured(400, speed=SPEED, simulated=True)})  # done: nothing left
    # The mean of 2,000, 1,000 and 2,000 a server; the slower shard's 380,000 tokens left at 1,000/s end the run.
    assert line.startswith("speed: 1,667 output tokens/s per server (simulator: not a GPU figure) measured on 3 "
                           "server(s) [shard-00: 40 answers and 70.0 streams decoding a server over 50 s with its slots full]")
    assert ": time to finish 6m20s, 0.22 GPU-hours for this run's prompts; " in line
    assert line.endswith(said)


def test_a_file_gets_the_speed_at_once_when_first_measured_and_the_first_estimate_against_the_end():
    out = io.StringIO()
    display = ProgressDisplay(out, live=False, line_interval_s=3600)
    states = {"shard-00": "running"}
    display.update(states, {"shard-00": measured(3)})
    display.update(states, {"shard-00": measured(40, speed=SPEED)})  # within the interval, but the first speed
    display.update(states, {"shard-00": measured(60, speed=SPEED)})  # within the interval: nothing
    done = measured(400, elapsed=250.0, speed=SPEED)
    display.update({"shard-00": "done"}, {"shard-00": done}, final=True)
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == ["progress", "speed", "progress", "speed", "progress", "speed", "speed"]
    assert lines[1] == "speed: shard-00 measuring: slots not full yet"
    assert lines[3].startswith("speed: 2,000 output tokens/s per server measured on 1 server(s)")
    # Said 60 s in, 175 s to go: 3m55s; it ended at 4m10s.
    assert lines[-1] == "speed: said at 1m00s, the shards would end at 3m55s; they ended at 4m10s (estimate -6%)"


def test_a_terminal_gets_the_speed_under_the_table():
    out = io.StringIO()
    ProgressDisplay(out, live=True).update({"shard-00": "running"}, {"shard-00": measured(40, speed=SPEED)})
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("shard") and lines[2].startswith("speed: 2,000 output tokens/s")


def test_the_first_measured_speed_is_observed_at_once():
    now = [0.0]
    throttle = ObservationThrottle(every_s=60.0, clock=lambda: now[0])
    assert throttle.keep(measured(1))
    now[0] = 5.0
    assert not throttle.keep(measured(2))  # within the minute and the same percent
    now[0] = 10.0
    assert throttle.keep(measured(3, speed=SPEED))  # the first speed: the UI and the CLI see it now
    now[0] = 15.0
    assert not throttle.keep(measured(3, speed=SPEED))
