"""Reading the contract fixtures, and comparing a response with one: shapes and error texts.

A fixture (``fixtures/<backend>/<name>.json``) records one response a real server gives: its
``status`` and ``body``, the ``nullable`` paths where the server may send null or a value, and for
an error the ``message`` format string as the server's source writes it, with the ``values`` used
for the body and ``patterns`` for its placeholders that are not numbers. ``_source`` names the
wheel and the functions it was read from.

Paths are written ``$.choices[].message.content``: ``[]`` stands for every element of a list.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures"
_NUMBER = r"-?\d+"


@dataclass(frozen=True)
class Fixture:
    backend: str
    name: str
    status: int
    body: Any
    nullable: frozenset[str]
    request_path: str
    version: str
    message: dict[str, Any] | None

    @property
    def id(self) -> str:
        return f"{self.backend}/{self.name}"

    def message_pattern(self) -> re.Pattern[str]:
        """The error text as a regex: the format's literal text, its placeholders as named groups."""
        assert self.message is not None, f"{self.id} records no error text"
        return format_pattern(self.message["format"], self.message.get("patterns", {}))


def load_fixture(backend: str, name: str) -> Fixture:
    raw = json.loads((FIXTURES / backend / f"{name}.json").read_text())
    return Fixture(
        backend=backend,
        name=name,
        status=raw["status"],
        body=raw["body"],
        nullable=frozenset(raw["nullable"]),
        request_path=raw["request"]["path"],
        version=raw["_source"]["version"],
        message=raw.get("message"),
    )


def all_fixtures() -> list[Fixture]:
    return [load_fixture(path.parent.name, path.stem) for path in sorted(FIXTURES.glob("*/*.json"))]


def format_pattern(fmt: str, patterns: dict[str, str]) -> re.Pattern[str]:
    """``str.format`` text -> a full-match regex; a placeholder met again must repeat its value."""
    parts: list[str] = []
    seen: set[str] = set()
    for literal, field, _spec, _conversion in string.Formatter().parse(fmt):
        parts.append(re.escape(literal))
        if field is None:
            continue
        if field in seen:
            parts.append(f"(?P={field})")
        else:
            seen.add(field)
            parts.append(f"(?P<{field}>{patterns.get(field, _NUMBER)})")
    return re.compile("".join(parts))


# bool before int: bool is a subclass of int, so the first match must be the narrower type.
_JSON_KINDS: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    for python_type, name in _JSON_KINDS:
        if isinstance(value, python_type):
            return name
    raise TypeError(f"not a JSON value: {value!r}")


def shape_differences(
    expected: Any,
    actual: Any,
    *,
    nullable: frozenset[str] = frozenset(),
    extra_allowed: frozenset[str] = frozenset(),
    path: str = "$",
) -> list[str]:
    """Where ``actual`` differs in shape from ``expected``: keys and JSON types, recursively.

    Values may differ; types may not, except null against a value at a ``nullable`` path. Every
    element of an ``actual`` list is compared with the first element of the ``expected`` one.
    ``extra_allowed`` names the paths of keys ``actual`` may have that ``expected`` lacks.
    """
    kind, actual_kind = _kind(expected), _kind(actual)
    if kind != actual_kind:
        if path in nullable and "null" in (kind, actual_kind):
            return []
        return [f"{path}: {actual_kind} where the real server sends {kind}"]
    if kind == "object":
        problems = [f"{path}: no {key!r}" for key in expected if key not in actual]
        problems += [
            f"{path}: {key!r} is not in the real server's response"
            for key in actual
            if key not in expected and f"{path}.{key}" not in extra_allowed
        ]
        for key in expected.keys() & actual.keys():
            problems += shape_differences(
                expected[key], actual[key], nullable=nullable, extra_allowed=extra_allowed, path=f"{path}.{key}"
            )
        return problems
    if kind == "array" and expected:
        problems = []
        for item in actual:
            for problem in shape_differences(
                expected[0], item, nullable=nullable, extra_allowed=extra_allowed, path=f"{path}[]"
            ):
                if problem not in problems:
                    problems.append(problem)
        return problems
    return []
