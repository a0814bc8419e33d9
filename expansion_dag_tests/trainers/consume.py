"""Feeds training-set outputs to the trainers' own data-loading code; run by the trainers' interpreter.

``.venv-trainers/bin/python consume.py JOBS.json`` (``.ci/trainers-env`` installs it). Each job
names a consumer, the file to load and where to write what the consumer made of it, one
``{"input_ids", "loss_mask"}`` line per row, in the consumer's own order:

* ``specforge``: ``specforge.data.prompt_builder.prepare_prompt_tasks``, what ``specforge train``
  calls on ``data.prompts_path`` or ``data.train_data_path`` (the latter rendered and masked by
  ``build_eagle3_dataset`` with the job's ``chat_template``).
* ``speculators``: the ``speculators prepare-data`` command's own function (rendering through the
  job's ``render_endpoint`` when given), its saved dataset read back as ``speculators train`` does.

One process for every job, so that torch, transformers and both trainers are imported once.
"""

import json
import sys
from pathlib import Path

from datasets import load_from_disk
from transformers import AutoTokenizer


def specforge(job: dict, tokenizer) -> list[dict]:
    from specforge.data.prompt_builder import prepare_prompt_tasks

    tasks = prepare_prompt_tasks(
        job["data"], tokenizer, chat_template=job.get("chat_template"), max_length=job["max_length"],
        is_preformatted=False, train_only_last_turn=False, cache_dir=None, cache_key=None, num_proc=1,
    )
    return [{k: [int(x) for x in task["payload"][k]] for k in ("input_ids", "loss_mask")} for task in tasks]


def speculators(job: dict, tokenizer) -> list[dict]:
    from speculators.cli.prepare_data import prepare_data

    prepare_data(
        model=job["tokenizer"], data=[job["data"]], output=job["work_dir"], seq_length=job["max_length"],
        num_preprocessing_workers=1, render_endpoint=job.get("render_endpoint"),
    )
    dataset = load_from_disk(job["work_dir"]).with_format(None)
    return [{"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]} for row in dataset]


def main(jobs_file: str) -> None:
    consumers = {"specforge": specforge, "speculators": speculators}
    for job in json.loads(Path(jobs_file).read_text()):
        tokenizer = AutoTokenizer.from_pretrained(job["tokenizer"])
        rows = consumers[job["consumer"]](job, tokenizer)
        Path(job["out"]).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main(sys.argv[1])
