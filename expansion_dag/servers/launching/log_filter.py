"""A launched server's log with its API key masked from the first byte.

The launcher runs this file as a script, ``python log_filter.py LOG``, with the server's output on
its standard input and the key in ``$EXPANSION_LOG_SECRET`` (the environment of a process is
readable by its user alone, its command line by every user): it appends what it reads to LOG,
each occurrence of the key replaced by ``***``, and ends when the server and every process it
forked have closed their output. Run as a script, not as a module of the package: it needs only
the standard library, so it starts at once and holds a few MB beside each server.
"""

from __future__ import annotations

import os
import sys
from typing import BinaryIO

SECRET_ENV = "EXPANSION_LOG_SECRET"
MASK = b"***"


def copy_masked(source: int, target: BinaryIO, secret: bytes, *, chunk: int = 65536) -> None:
    """Copy the file descriptor ``source`` to ``target`` until its end, ``secret`` masked.

    Written as it comes (a server's progress lines have no newline), but for an end that begins
    the key: a read may have cut the key there, so it waits for the next read.
    """
    pending = b""
    while data := os.read(source, chunk):
        pending = (pending + data).replace(secret, MASK)
        held = next((n for n in range(min(len(secret) - 1, len(pending)), 0, -1) if pending.endswith(secret[:n])), 0)
        target.write(pending[: len(pending) - held])
        target.flush()
        pending = pending[len(pending) - held :]
    target.write(pending)
    target.flush()


def main() -> None:
    secret = os.environ.pop(SECRET_ENV, "").encode()
    if not secret:
        raise SystemExit(f"{SECRET_ENV} is not set: nothing to mask")
    with open(sys.argv[1], "ab") as log:
        copy_masked(sys.stdin.fileno(), log, secret)


if __name__ == "__main__":
    main()
