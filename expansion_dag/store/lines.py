"""A line of the completion store, checked whole on read: the one rule the writer and every reader
(resume scan, digests, the build) follow, so all agree on which line holds a key's answer.

A line is ``<key>\\t<status>\\t<length>:<crc32>\\t<json>\\n``: ``length`` the bytes of ``json`` in
decimal, ``crc32`` (8 hex digits) that of ``<key>\\t<status>\\t<json>``. The key and status stay
first, so a scan reads them without parsing JSON; the checksum costs one pass of zlib's CRC over
the line. A line is whole when it ends in a newline, its length and checksum match and its JSON has an
object's bounds (``{`` to ``}``: a writer's bug or a forged line, checksummed yet cut, is not read
as an answer); else it is bad, for one of ``BAD_LINE_REASONS``.

Lines of stores written before the checksum (``<key>\\t<status>\\t<json>\\n``, the JSON always an
object, so its field starts with ``{``) are read under the rule they were written under: whole
when the JSON parses as an object. Only those lines pay a JSON parse on a scan.
"""

from __future__ import annotations

import json
import zlib

#: Why a line is not whole: ``unfinished``, no newline (a write cut short: a kill, a full disk);
#: ``fields``, fewer than three fields; ``prefix``, a length and checksum that do not read as such;
#: ``length``, a JSON of another length than its prefix says (bytes lost or joined); ``checksum``,
#: its bytes are not those written; ``json``, a line without a checksum whose JSON does not parse, or
#: a checksummed line whose JSON is not an object's bounds.
BAD_LINE_REASONS = ("unfinished", "fields", "prefix", "length", "checksum", "json")


def encode_line(key: str, status: str, payload: bytes) -> bytes:
    """The line of a record whose JSON is ``payload``."""
    head = b"%s\t%s\t" % (key.encode(), status.encode())
    return b"%s%d:%08x\t%s\n" % (head, len(payload), zlib.crc32(payload, zlib.crc32(head)), payload)


def decode_line(raw: bytes) -> tuple[str, bytes, bytes] | str:
    """``(key, status, json)`` of a whole line (the JSON without the newline), or why it is not whole
    (one of ``BAD_LINE_REASONS``)."""
    if not raw.endswith(b"\n"):
        return "unfinished"
    fields = raw.split(b"\t", 2)
    if len(fields) != 3:
        return "fields"
    key, status, rest = fields
    if rest.startswith(b"{"):  # written before checksums
        try:
            return (key.decode(), status, rest[:-1]) if isinstance(json.loads(rest), dict) else "json"
        except ValueError:  # UnicodeDecodeError included
            return "json"
    check, _, payload = rest.partition(b"\t")
    length, _, crc = check.partition(b":")
    try:
        expected_length, expected_crc = int(length), int(crc, 16)
    except ValueError:
        return "prefix"
    payload = payload[:-1]
    if len(payload) != expected_length:
        return "length"
    if zlib.crc32(payload, zlib.crc32(raw[: len(key) + len(status) + 2])) != expected_crc:
        return "checksum"
    if not (payload.startswith(b"{") and payload.endswith(b"}")):
        return "json"
    return key.decode(), status, payload
