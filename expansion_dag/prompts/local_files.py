"""A local source's files as ``datasets`` reads them, where it fails on a whole file for one fault.

- An empty file: ``datasets`` ends in a bare ``StopIteration``; :func:`blank_files` names them first.
- A JSON Lines row holding a lone surrogate (``"\\ud800"``, which Python writes and Arrow refuses):
  the whole file fails. :func:`surrogates_as_bytes` gives ``datasets`` a copy with such text as the
  bytes Python's ``surrogatepass`` gives, invalid UTF-8, which extraction quarantines in that row
  alone (``invalid_unicode``), as it does invalid text of a parquet file.
"""

from __future__ import annotations

import json
from pathlib import Path

#: What ``blank_files`` reads of a file at most: one longer than this is not blank.
_HEAD = 65536


def blank_files(files: list[str]) -> list[str]:
    """The files that hold nothing but whitespace."""
    blank = []
    for file in files:
        with open(file, "rb") as fh:
            head = fh.read(_HEAD)
        if len(head) < _HEAD and not head.strip():
            blank.append(file)
    return blank


def surrogate_error(exc: BaseException) -> bool:
    """Whether loading failed on a lone surrogate (Arrow's words, somewhere in the chain)."""
    seen: BaseException | None = exc
    while seen is not None:
        if "surrogate" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def surrogates_as_bytes(files: list[str], folder: Path) -> list[str]:
    """Copies of the JSON Lines ``files`` in ``folder``, row for row, with lone surrogates written
    as bytes that are not UTF-8 (see the module's docstring)."""
    copies = []
    for i, file in enumerate(files):
        with open(file, encoding="utf-8") as lines:
            rows = [json.loads(line) for line in lines if line.strip()]
        copy = folder / f"{i}-{Path(file).name}"
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        copy.write_bytes(text.encode("utf-8", "surrogatepass"))
        copies.append(str(copy))
    return copies
