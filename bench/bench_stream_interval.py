"""What the stream interval buys (issue 51, item 2): tokens a stopped loop runs past where its row is
cut, by events of 256, 128, 64, 32 and 16 tokens, replayed on the real model's answers.

A loop is seen only as an event arrives, so every stop waits for the event after the copies a rule
needs. Live runs of the real model do not compare intervals cleanly: its sampled answers differ
from run to run on a CPU engine (batching), so two runs stop different loops. This replays the same
answers instead: the 240 recorded answers of SmolLM2-135M-Instruct
(``expansion_dag_tests/data/real_model_answers.jsonl.gz``: 89 labelled loops, run to their end or
the cap, and 151 legitimate answers), each cut as a server's stream cuts it (the first token alone,
then ``interval`` tokens an event, by the model's own tokenizer), fed to the loop detector as a run
configures it. For each loop: the tokens streamed when it was stopped and the tokens past the cut
its row keeps (``loop_cut``): what the GPU made and no row holds. The legitimate answers must be left
alone at every interval. The client's CPU for the extra events is not here: ``bench_generation.py
--stream-interval N`` and ``bench_stream_read.py`` measure it.

    .venv/bin/python bench/bench_stream_interval.py    # ~1 min; needs .models/ (CI's .ci/real-model)
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
import time

from bench_real_model import FIXTURE, MODEL_DIR, stream_events  # (bench/ is on sys.path when run as a script)
from harness import header, write_result

from expansion_dag.config import GenerationConfig, engine_config
from expansion_dag.core import load_tokenizer
from expansion_dag.servers import LoopDetector, loop_cut

INTERVALS = (256, 128, 64, 32, 16)


def replay(tokenizer, text: str, interval: int, thresholds) -> dict | None:
    """The stop of ``text`` streamed in events of ``interval`` tokens (None: never stopped)."""
    detector, fed = LoopDetector(thresholds), ""
    ends = [end for _, end in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    for delta in stream_events(tokenizer, text, interval):
        fed += delta
        if (loop := detector.feed(delta)) is not None:
            streamed = bisect.bisect_right(ends, len(fed))
            kept = bisect.bisect_right(ends, loop_cut(fed, loop))  # whole tokens before the cut
            return {"rule": loop.rule, "streamed": streamed, "past_cut": streamed - kept}
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(MODEL_DIR))
    args = parser.parse_args()
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as f:
        answers = [json.loads(line) for line in f]
    tokenizer = load_tokenizer(args.model_dir)
    thresholds = engine_config(GenerationConfig()).loop
    loops = [a["content"] for a in answers if a["label"] == "loop"]
    legitimate = [a["content"] for a in answers if a["label"] != "loop"]
    result = header("stream_interval", "transformers", simulator=False) | {
        "loops": len(loops), "legitimate": len(legitimate), "by_interval": {}}
    print(f"{'interval':>8} {'stopped':>8} {'median at stop':>15} {'mean past cut':>14} {'median past cut':>16} "
          f"{'sum past cut':>13} {'legit stopped':>14} {'detector ms/answer':>19}")  # fmt: skip
    for interval in INTERVALS:
        started = time.process_time()
        stops = [s for text in loops if (s := replay(tokenizer, text, interval, thresholds)) is not None]
        cpu = time.process_time() - started
        false = sum(replay(tokenizer, text, interval, thresholds) is not None for text in legitimate)
        past = [s["past_cut"] for s in stops]
        row = {
            "stopped": len(stops),
            "median_tokens_at_stop": statistics.median(s["streamed"] for s in stops),
            "mean_tokens_past_cut": round(statistics.mean(past), 1),
            "median_tokens_past_cut": statistics.median(past),
            "tokens_past_cut": sum(past),
            "legitimate_stopped": false,
            # The replay's own tokenizing included: an upper bound on the detector's share.
            "replay_cpu_ms_per_loop": round(1000 * cpu / len(loops), 2),
        }
        result["by_interval"][interval] = row
        print(f"{interval:>8} {row['stopped']:>8} {row['median_tokens_at_stop']:>15} {row['mean_tokens_past_cut']:>14} "
              f"{row['median_tokens_past_cut']:>16} {row['tokens_past_cut']:>13} {false:>14} {row['replay_cpu_ms_per_loop']:>19}")  # fmt: skip
    print(f"written to {write_result('stream_interval', result)}")


if __name__ == "__main__":
    main()
