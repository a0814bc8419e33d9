"""A line damaged anywhere in a finished segment (issue 49, item 1): its prompt is due again in the
same run, the shard finishes, and the training set has every row again, once.

The store is a finished one (every prompt answered, the training set built); then each way of
damage is done to a line of shard-00's segment, from its first line to well before its end, as a
bad sector, a stray write or a bad copy leaves them. What a user counts: the run asks those prompts (and only those) once, the
shard and the training set succeed, every prompt is a row once, and the bad lines are quarantined
with why.
"""

import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq

from expansion_dag.defs import SHARD_KEYS
from expansion_dag.sim import SimServerConfig, SimulatedFleet
from expansion_dag.store import CompletionStore, encode_line
from expansion_dag.training import data_files
from expansion_dag_tests.cli.test_cli import EXPANSION_DAG, clean_env, sent, write_config
from expansion_dag_tests.defs.assets.test_completions import run_pipeline
from expansion_dag_tests.helpers import prompt_frame

SHARD = "shard-00"
FAST = SimServerConfig(port=0, max_running_requests=16, ttft_s=0.0, token_latency_s=0.0002, output_median_tokens=60)


def nuls(lines, at):
    """The second half of the line's bytes overwritten with NULs (its key and status intact)."""
    line = lines[at]
    half = len(line) // 2
    lines[at] = line[:half] + b"\0" * (len(line) - half - 1) + b"\n"
    return [at]


def cut_short(lines, at):
    """The line's last 40 bytes lost, its newline kept: the next line follows at once."""
    lines[at] = lines[at][:-41] + b"\n"
    return [at]


def flipped(lines, at):
    """Three bytes of the JSON flipped, the length unchanged."""
    line = bytearray(lines[at])
    for i in (len(line) // 2, len(line) // 2 + 7, len(line) - 5):
        line[i] ^= 0x20
    lines[at] = bytes(line)
    return [at]


def run_together(lines, at):
    """The newline between two lines lost: one line holding two answers, neither whole."""
    lines[at : at + 2] = [lines[at][:-1] + lines[at + 1]]
    return [at, at + 1]


def broken_json(lines, at):
    """A line whose checksum is right for its bytes but whose JSON is cut (a writer's bug, a forgery)."""
    key, status, rest = lines[at].split(b"\t", 2)
    payload = rest.split(b"\t", 1)[1][:-1]
    lines[at] = encode_line(key.decode(), status.decode(), payload[: len(payload) // 2])
    return [at]


DAMAGES = {"nuls": nuls, "cut_short": cut_short, "flipped": flipped, "run_together": run_together,
           "broken_json": broken_json}  # fmt: skip
#: What each damage's line is quarantined as (``lines.BAD_LINE_REASONS``).
REASONS = {"nuls": "checksum", "cut_short": "length", "flipped": "checksum", "run_together": "length",
           "broken_json": "json"}  # fmt: skip


def segment_lines(store_dir: Path) -> tuple[Path, list[bytes]]:
    (segment,) = sorted((store_dir / SHARD).glob("seg-*.jsonl"))
    return segment, segment.read_bytes().splitlines(keepends=True)


def prompt_of(line: bytes) -> str:
    return json.loads(line.split(b"\t", 3)[3])["prompt_id"]


def damage(store_dir: Path, name: str, at: int) -> set[str]:
    """Damage the ``at``-th line of the shard's one segment (and the next, run together) far from
    its end, so the damage is mid-file; the prompt ids whose answer it took."""
    segment, lines = segment_lines(store_dir)
    assert len(lines) > at + 3, "too few lines: the damage would not be mid-file"
    written = list(lines)
    hit = {prompt_of(written[i]) for i in DAMAGES[name](lines, at)}
    segment.write_bytes(b"".join(lines))
    return hit


def quarantined(store_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((store_dir / SHARD).glob("*.quarantine"))
            for line in path.read_text().splitlines()]


def rows(storage: Path) -> list[str]:
    return pq.read_table(data_files(storage / "training_set"), columns=["id"])["id"].to_pylist()


def damage_each_way(store_dir: Path) -> set[str]:
    """Every kind of damage in shard-00's one segment, from its first line on, each on a prompt's only
    request (a conversation's turns are asked from where it stands: not this case); the prompt ids
    whose answer it took."""
    _, lines = segment_lines(store_dir)
    single = [i for i in range(len(lines) - 4) if ".t" not in prompt_of(lines[i]) + prompt_of(lines[i + 1])]
    places = [single[len(single) * k // 5] for k in range(5)]
    assert len(set(places)) == 5 and all(b - a > 1 for a, b in zip(places, places[1:]))
    lost = set()
    for name, at in zip(sorted(DAMAGES), places):  # run_together is last: no later line moves
        lost |= damage(store_dir, name, at)
    assert len(lost) == 6
    return lost


def test_lines_damaged_anywhere_in_a_segment_are_asked_again_in_the_same_materialization(tmp_path, instance):
    frame = prompt_frame([f"Question {i}: describe item {i} in a sentence or two." for i in range(60)])
    with SimulatedFleet([FAST] * len(SHARD_KEYS)) as fleet:
        results, _ = run_pipeline(frame, fleet.urls, tmp_path, instance, training=True, drop_truncated=False)
        assert all(r.success for r in results.values())
        assert sorted(rows(tmp_path)) == frame["prompt_id"].to_list()
        lost = damage_each_way(tmp_path / "completions")
        requests_before = sent(fleet)[0]
        again, _ = run_pipeline(frame, fleet.urls, tmp_path, instance, training=True, drop_truncated=False)
        requests_after = sent(fleet)[0]
    assert all(r.success for r in again.values()), {k: r.success for k, r in again.items()}
    # Only the damaged lines' prompts were asked, once each; nothing else was sent again.
    assert requests_after - requests_before == len(lost)
    # Every prompt is a row once again (no duplicate from the part built before the damage).
    assert sorted(rows(tmp_path)) == frame["prompt_id"].to_list()
    assert sorted(b["reason"] for b in quarantined(tmp_path / "completions")) == sorted(REASONS.values())
    store = CompletionStore(tmp_path / "completions")
    assert store.scan().duplicates == 0 and not store.scan().failed


def test_expansion_dag_run_asks_again_every_line_damaged_anywhere_and_rebuilds_every_row(tmp_path):
    with SimulatedFleet([FAST] * len(SHARD_KEYS)) as fleet:
        config = write_config(tmp_path / "run.yaml", {
            "fleet": {"mode": "attach", "urls": fleet.urls},
            "generation": {"backoff_initial_s": 0.01, "progress_interval_s": 0.5, "drop_truncated": False},
        })

        def run():
            result = subprocess.run([EXPANSION_DAG, "run", "--config", str(config)], cwd=tmp_path, env=clean_env(),
                                    capture_output=True, text=True, timeout=540)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

        run()
        storage = tmp_path / "storage"
        first_rows = rows(storage)
        lost = damage_each_way(storage / "completions")
        before = sent(fleet)[0]
        run()
        asked = sent(fleet)[0] - before
    assert asked == len(lost)
    assert sorted(rows(storage)) == sorted(first_rows) and len(set(first_rows)) == len(first_rows)
    reasons = sorted(b["reason"] for b in quarantined(storage / "completions"))
    assert reasons == sorted(REASONS.values())
