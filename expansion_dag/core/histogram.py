"""A bar chart as a tiny PNG, for pictures in Dagster markdown metadata.

The project has no plotting library, and the Dagster UI shows ``data:image/png`` images in markdown
metadata, so the chart is drawn pixel by pixel and written with zlib and struct. There are no
labels inside the picture: the markdown around it carries the numbers.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Sequence

_BACKGROUND, _BAR, _AXIS = 0, 1, 2
_PALETTE = bytes((255, 255, 255, 70, 110, 200, 90, 90, 90))  # white, blue, grey


def bar_chart_png(counts: Sequence[int], *, bar_width: int = 8, height: int = 120) -> bytes:
    """One bar per count, scaled to the tallest; a non-zero count always shows at least a pixel."""
    if not counts or bar_width < 2 or height < 2:
        raise ValueError("need at least one count, bar_width >= 2 and height >= 2")
    tallest = max(max(counts), 1)
    plot = height - 1  # the bottom row is the axis
    bars = [0 if c <= 0 else max(1, round(plot * c / tallest)) for c in counts]
    width = bar_width * len(counts)
    rows = []
    for y in range(plot):
        top = plot - y  # a bar of height h fills the rows whose distance from the axis is <= h
        # The last column of each bar stays background so neighbouring bars stay apart.
        row = b"".join(
            bytes([_BAR if h >= top else _BACKGROUND]) * (bar_width - 1) + bytes([_BACKGROUND])
            for h in bars
        )
        rows.append(b"\x00" + row)  # filter type 0 for every scanline
    rows.append(b"\x00" + bytes([_AXIS]) * width)
    header = struct.pack(">IIBBBBB", width, height, 8, 3, 0, 0, 0)  # 8-bit palette image
    return b"".join(
        [
            b"\x89PNG\r\n\x1a\n",
            _chunk(b"IHDR", header),
            _chunk(b"PLTE", _PALETTE),
            _chunk(b"IDAT", zlib.compress(b"".join(rows), 9)),
            _chunk(b"IEND", b""),
        ]
    )


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
