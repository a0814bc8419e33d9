"""The loop rules on worked arithmetic (issue 51): false stops and the detector's CPU, for the tree
on ``PYTHONPATH``.

Feeds the tests' corpus of legitimate repetitive answers (``repetitive_answers.jsonl.gz``, its
``derivation`` kind: worked arithmetic of several thousand tokens) and the real model's answers
(``real_model_answers.jsonl.gz``) to the loop detector in events of ``--event-chars`` (about the
fleet's 256 tokens), as a stream arrives. Reports the answers stopped by kind and rule, and the
detector's CPU per answer and per 1,000 characters fed (the best of ``--repeat`` passes). To compare
two trees, run it once with each on ``PYTHONPATH`` (the data files are this tree's).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import time
from typing import Any

from harness import ROOT, header, write_result

from expansion_dag.config import GenerationConfig, engine_config
from expansion_dag.servers import LoopDetector

DATA = ROOT / "expansion_dag_tests" / "data"


def _read(name: str) -> list[dict[str, Any]]:
    with gzip.open(DATA / name, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--event-chars", type=int, default=768)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    thresholds = engine_config(GenerationConfig()).loop  # as a run configures them
    corpus = _read("repetitive_answers.jsonl.gz")
    real = _read("real_model_answers.jsonl.gz")
    sets = {
        "derivations (legitimate)": [a["text"] for a in corpus if a["kind"] == "derivation"],
        "other legitimate kinds": [a["text"] for a in corpus if a["kind"] != "derivation"],
        "real model, legitimate": [a["content"] for a in real if a["label"] == "legitimate"],
        "real model, loops": [a["content"] for a in real if a["label"] == "loop"],
    }
    document = header("loop_rules", simulator=False) | {"settings": vars(args), "sets": {}}
    for name, texts in sets.items():
        best, stopped = None, collections.Counter()
        for _ in range(args.repeat):
            stopped.clear()
            fed, started = 0, time.process_time()
            for text in texts:
                detector = LoopDetector(thresholds)
                for i in range(0, len(text), args.event_chars):
                    fed += min(args.event_chars, len(text) - i)
                    if (loop := detector.feed(text[i : i + args.event_chars])) is not None:
                        stopped[loop.rule] += 1
                        break
            cpu = time.process_time() - started
            best = cpu if best is None else min(best, cpu)
        document["sets"][name] = {
            "answers": len(texts), "stopped": sum(stopped.values()), "stopped_by_rule": dict(stopped),
            "cpu_ms_per_answer": round(1000 * best / len(texts), 3),
            "cpu_us_per_1000_chars_fed": round(1e9 * best / fed, 1), "chars_fed": fed,
        }  # fmt: skip
    write_result("loop_rules", document)
    print(json.dumps(document["sets"], indent=2))


if __name__ == "__main__":
    main()
