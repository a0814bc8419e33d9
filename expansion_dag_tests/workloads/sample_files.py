"""The file writers of the sample datasets, in each source's own format, and the turns they hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def text_array(values: list[str | bytes | None]) -> pa.Array:
    """A string array that may hold invalid UTF-8 bytes, which pyarrow would refuse to build."""
    raw = [v.encode() if isinstance(v, str) else v for v in values]
    return pa.array(raw, pa.binary()).view(pa.string())


def conversations_array(rows: list[list[dict[str, Any]] | None], *, with_loss: bool = False) -> pa.Array:
    offsets, roles, values, losses, valid = [0], [], [], [], []
    for turns in rows:
        valid.append(turns is not None)
        for turn in turns or []:
            roles.append(turn["from"])
            values.append(turn["value"])
            losses.append(turn["from"] == "gpt")
        offsets.append(len(roles))
    children = [pa.array(roles, pa.string())]
    names = ["from"]
    if with_loss:
        children.append(pa.array(losses, pa.bool_()))
        names.append("loss")
    children.append(text_array(values))
    names.append("value")
    structs = pa.StructArray.from_arrays(children, names=names)
    mask = pa.array([not v for v in valid])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), structs, mask=mask)


def write_parquet(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="zstd", compression_level=19)


def write_json_array(records: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(json.dumps(r, ensure_ascii=False) for r in records)
    path.write_text(f"[\n{lines}\n]\n", encoding="utf-8")


def write_jsonl(records: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def human(value: str | bytes | None) -> dict[str, Any]:
    return {"from": "human", "value": value}


def gpt(value: str) -> dict[str, Any]:
    return {"from": "gpt", "value": value}
