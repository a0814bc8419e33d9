"""The training set: records to samples, the Parquet set and the trainers' JSONL files, the round
trip that checks a built set against its records, its manifest and its card, and its versions,
published whole.
"""

from expansion_dag.training.build import build_training_set, data_files
from expansion_dag.training.config import DEFAULT_MAX_LENGTH, FORMATS, BuildTrace, TrainingSetConfig
from expansion_dag.training.dataset_card import dataset_card, manifest_markdown, specforge_template
from expansion_dag.training.manifest import Manifest, current_version
from expansion_dag.training.parquet import SCHEMA
from expansion_dag.training.parts import PART_DONE, build_parts, build_training_set_in_parts, part_names
from expansion_dag.training.publish import POINTER, VERSIONS, Version, publishing
from expansion_dag.training.round_trip import check_round_trip, expected_renders, sample_rows
from expansion_dag.training.samples import FOLDED, LEFT_OUT_REASONS, LOOP_ROW, ROW, AnswerJudge

__all__ = [
    "AnswerJudge", "BuildTrace", "DEFAULT_MAX_LENGTH", "FOLDED", "FORMATS", "LEFT_OUT_REASONS", "LOOP_ROW", "Manifest",
    "PART_DONE", "POINTER", "ROW", "SCHEMA", "TrainingSetConfig", "VERSIONS", "Version", "build_parts",
    "build_training_set", "build_training_set_in_parts", "check_round_trip", "current_version", "data_files",
    "dataset_card", "expected_renders", "manifest_markdown", "part_names", "publishing", "sample_rows",
    "specforge_template",
]
