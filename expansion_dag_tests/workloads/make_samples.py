"""Writes the bundled sample datasets: small files in the real layouts and schemas of the six sources.

    .venv/bin/python -m expansion_dag_tests.workloads.make_samples    # from the repository root

All text is written here (no real dataset rows). Besides ordinary prompts of many lengths, the
samples hold on purpose: rows each quarantine reason catches, non-English Infinity-Instruct rows
for the ``langdetect`` filter, duplicates within and across sources, one prompt of more than
9,000 tokens (set aside by the token budget at an 8,192 context) and one of more than 200,000
characters (quarantined as ``too_long_chars``). The output is deterministic: a fixed seed, sorted
keys, and no timestamps.
"""

from __future__ import annotations

import random
from pathlib import Path

from expansion_dag.prompts import package_dir

from expansion_dag_tests.workloads.chat_sources import (
    write_codefeedback,
    write_infinity_instruct,
    write_metamathqa,
    write_webinstructsub,
)
from expansion_dag_tests.workloads.tool_sources import write_agentinstruct, write_hermes

SEED = 20240625


def main(out_dir: Path = package_dir("samples")) -> None:
    rng = random.Random(SEED)
    for write in (
        write_infinity_instruct,
        write_webinstructsub,
        write_codefeedback,
        write_metamathqa,
        write_hermes,
        write_agentinstruct,
    ):
        write(rng, out_dir)


if __name__ == "__main__":
    main()
