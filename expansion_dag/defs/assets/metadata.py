"""Small helpers that turn core results into what the Dagster UI shows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import polars as pl


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}"
    return str(value).replace("|", "\\|")


def markdown_table(frame: pl.DataFrame | None = None, *, columns: Sequence[str] = (), rows: Iterable[Sequence[Any]] = ()) -> str:
    """A markdown table from a frame, or from column names and rows."""
    if frame is not None:
        columns, rows = frame.columns, frame.iter_rows()
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
