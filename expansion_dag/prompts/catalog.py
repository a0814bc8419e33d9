"""The source catalog: which datasets the prompts come from, and loading them with ``datasets``.

A catalog is a YAML file (``catalogs/production.yaml`` documents every field) or one of the
bundled names: ``samples`` (small files in the real schemas, shipped in ``expansion_dag/samples``)
and ``production`` (the six public datasets on the Hugging Face hub).
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import importlib.resources
import json
import logging
import os
import re
import string
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import datasets
import pyarrow as pa
import yaml

from expansion_dag.prompts.extractors import (
    DEFAULT_MAX_CHARS,
    DEFAULT_TURN,
    EXTRACTORS,
    Turn,
    conversation_problem,
    turn_problem,
)
from expansion_dag.prompts.selection import DEFAULT_SEED

logger = logging.getLogger(__name__)

BUNDLED_CATALOGS = ("samples", "production")
DEFAULT_CATALOG = "samples"
DEFAULT_SPLIT = "train"
FORMATS = MappingProxyType({"json": "json", "jsonl": "json", "parquet": "parquet"})

_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_SPLIT = re.compile(r"\w+(\.\w+)*")  # the split names datasets accepts
_PLACEHOLDERS = frozenset({"config", "split"})
FilterValue = str | int | float | bool


class CatalogError(ValueError):
    """A catalog or source definition is invalid; the message names the field."""


class SourceLoadError(RuntimeError):
    """A source could not be loaded; the message names the source and the cause."""


def package_dir(name: str) -> Path:
    """A data folder shipped inside the package (``catalogs`` or ``samples``)."""
    return Path(str(importlib.resources.files("expansion_dag") / name))


@dataclass(frozen=True)
class SourceSpec:
    """One source dataset and how to take prompts from it (``catalogs/production.yaml`` explains each field).

    ``config`` and ``split`` may list several values: each combination is loaded and the parts are
    concatenated in order. With ``local_path`` the files are read instead of the hub; the path may
    name ``{config}`` and ``{split}`` and may be a glob.
    """

    name: str
    extractor: str
    hub_id: str | None = None
    config: str | tuple[str, ...] | None = None
    split: str | tuple[str, ...] = DEFAULT_SPLIT
    revision: str | None = None
    local_path: str | None = None
    format: str | None = None
    quota: int | None = None
    weight: float | None = None
    filters: tuple[tuple[str, tuple[FilterValue, ...]], ...] = ()
    turn: Turn = DEFAULT_TURN
    max_chars: int = DEFAULT_MAX_CHARS
    conversation: bool = False

    def __post_init__(self) -> None:
        for name, value in (("config", self.config), ("split", self.split)):
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.filters, Mapping):
            object.__setattr__(
                self,
                "filters",
                tuple(
                    (k, tuple(v) if isinstance(v, list | tuple) else (v,)) for k, v in self.filters.items()
                ),
            )
        if self.local_path is not None and self.format is None:
            object.__setattr__(self, "format", _format_from_extension(self.local_path))
        problems = [f"{name}: {problem}" for name, problem in self._problems() if problem]
        if problems:
            label = self.name if isinstance(self.name, str) else repr(self.name)
            raise CatalogError(f"source {label!r}: " + "; ".join(problems))

    def _problems(self) -> list[tuple[str, str | None]]:
        names_ok = [
            ("config", _check_names(self.config, allow_none=True, pattern=None)),
            ("split", _check_names(self.split, allow_none=False, pattern=_SPLIT)),
        ]
        known = isinstance(self.extractor, str) and self.extractor in EXTRACTORS
        return [
            ("name", _check_name(self.name)),
            ("extractor", None if known else f"unknown {self.extractor!r}; known: {', '.join(EXTRACTORS)}"),
            ("hub_id", _check_hub_id(self.hub_id, self.local_path)),
            *names_ok,
            (
                "revision",
                None
                if self.revision is None or _is_text(self.revision)
                else f"must be text, got {self.revision!r}",
            ),
            # Which placeholders local_path needs depends on config and split being valid lists.
            (
                "local_path",
                None
                if any(p for _, p in names_ok)
                else _check_local_path(self.local_path, self.configs, self.splits),
            ),
            ("format", _check_format(self.format, self.local_path)),
            ("quota", _check_count(self.quota, minimum=0)),
            ("weight", _check_weight(self.weight, self.quota)),
            ("filters", _check_filters(self.filters)),
            ("turn", turn_problem(self.turn)),
            ("max_chars", _check_count(self.max_chars, minimum=1, allow_none=False)),
            # Which turns a conversation may be combined with depends on turn being valid.
            (
                "conversation",
                conversation_problem(self.conversation, extractor=self.extractor, turn=self.turn)
                if turn_problem(self.turn) is None
                else None,
            ),
        ]

    @property
    def configs(self) -> tuple[str | None, ...]:
        return _as_tuple(self.config) or (None,)

    @property
    def splits(self) -> tuple[str, ...]:
        return _as_tuple(self.split)

    def parts(self) -> list[tuple[str | None, str]]:
        """The (config, split) pairs loaded and concatenated, in order."""
        return [(config, split) for config in self.configs for split in self.splits]

    def local_files(self, *, config: str | None, split: str) -> str:
        """The file pattern of one part of a local source."""
        if self.local_path is None:
            raise ValueError(f"source {self.name!r} has no local_path")
        return self.local_path.format(config=config, split=split)

    def filter_map(self) -> dict[str, list[FilterValue]]:
        return {column: list(values) for column, values in self.filters}


@dataclass(frozen=True)
class Catalog:
    """The sources in priority order (earlier wins a duplicate), the sampling seed, and the
    source-field ``defaults`` the file applied to every source.

    ``total_prompts`` is shared among the sources that have a ``weight``.
    """

    sources: tuple[SourceSpec, ...]
    seed: int = DEFAULT_SEED
    total_prompts: int | None = None
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))
        if not self.sources or not all(isinstance(s, SourceSpec) for s in self.sources):
            raise CatalogError(
                f"catalog: sources: must be a non-empty list of SourceSpec, got {self.sources!r}"
            )
        problems = []
        names = [s.name for s in self.sources]
        if duplicated := sorted({n for n in names if names.count(n) > 1}):
            problems.append(f"sources: duplicate names {', '.join(duplicated)}")
        if not _is_int(self.seed):
            problems.append(f"seed: must be an integer, got {self.seed!r}")
        weighted = [s.name for s in self.sources if s.weight is not None]
        if weighted and self.total_prompts is None:
            problems.append(f"total_prompts: required because {', '.join(weighted)} set a weight")
        elif not weighted and self.total_prompts is not None:
            problems.append("total_prompts: set, but no source has a weight to share it")
        elif problem := _check_count(self.total_prompts, minimum=1):
            problems.append(f"total_prompts: {problem}")
        if unknown := sorted(set(self.defaults) - _DEFAULTABLE):
            problems.append(f"defaults: unknown keys {', '.join(unknown)}")
        if problems:
            raise CatalogError("catalog: " + "; ".join(problems))

    def source(self, name: str) -> SourceSpec:
        for spec in self.sources:
            if spec.name == name:
                return spec
        raise KeyError(
            f"no source {name!r} in the catalog (sources: {', '.join(s.name for s in self.sources)})"
        )


_SOURCE_KEYS = frozenset(f.name for f in fields(SourceSpec))
_DEFAULTABLE = _SOURCE_KEYS - {"name"}
_CATALOG_KEYS = frozenset({"seed", "total_prompts", "defaults", "sources", "local_root"})
#: ``local_root``'s value that reads relative local_paths from the samples shipped with the package.
BUNDLED_ROOT = "bundled"


def load_catalog(name_or_path: str | os.PathLike[str] = DEFAULT_CATALOG) -> Catalog:
    """A bundled catalog by name (``samples``, ``production``) or a catalog YAML file.

    A relative ``local_path`` is read from the catalog's ``local_root``: its own folder unless it
    names another (relative to it), or ``bundled``, the package's sample files (as the samples
    catalog does, and a copy of it). One that matches no file there is a ``CatalogError`` naming the
    file and the fix: never another folder's files of the same name.
    """
    path = (
        package_dir("catalogs") / f"{name_or_path}.yaml"
        if name_or_path in BUNDLED_CATALOGS
        else Path(name_or_path)
    )
    if not path.is_file():
        raise CatalogError(
            f"catalog {str(name_or_path)!r}: no such file, and not a bundled catalog ({', '.join(BUNDLED_CATALOGS)})"
        )
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise CatalogError(f"catalog {str(path)!r}: not UTF-8 text (byte {exc.start}): save the file as UTF-8") from None
    except yaml.YAMLError as exc:
        raise CatalogError(f"catalog {str(path)!r}: not valid YAML: {exc}") from exc
    if not isinstance(document, Mapping):
        raise CatalogError(f"catalog {str(path)!r}: must be a mapping with a 'sources' list")
    _reject_unknown(document, _CATALOG_KEYS, where=f"catalog {str(path)!r}")
    defaults = document.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise CatalogError(f"catalog {str(path)!r}: defaults must be a mapping")
    _reject_unknown(defaults, _DEFAULTABLE, where=f"catalog {str(path)!r}: defaults")
    entries = document.get("sources")
    if not isinstance(entries, list) or not entries:
        raise CatalogError(f"catalog {str(path)!r}: sources must be a non-empty list")
    root = _local_root(document.get("local_root"), path)
    sources = []
    for index, entry in enumerate(entries):
        where = f"catalog {str(path)!r}: sources[{index}]"
        if not isinstance(entry, Mapping):
            raise CatalogError(f"{where}: must be a mapping")
        _reject_unknown(entry, _SOURCE_KEYS, where=where)
        settings = {**defaults, **entry}
        relative = _is_text(settings.get("local_path")) and not Path(settings["local_path"]).is_absolute()
        if relative:
            # The root is literal text: escape braces so that only the user's placeholders get filled.
            escaped = str(root).replace("{", "{{").replace("}", "}}")
            settings["local_path"] = escaped + os.sep + settings["local_path"]
        try:
            spec = SourceSpec(**settings)
        except TypeError as exc:  # a required field is missing
            raise CatalogError(f"{where}: {exc}") from None
        if relative:
            _require_files(spec, entry.get("local_path", defaults.get("local_path")), root, where)
        sources.append(spec)
    return Catalog(
        sources=tuple(sources),
        seed=document.get("seed", DEFAULT_SEED),
        total_prompts=document.get("total_prompts"),
        defaults=MappingProxyType(dict(defaults)),
    )


def load_source(spec: SourceSpec, *, cache_dir: str | os.PathLike[str] | None = None) -> datasets.Dataset:
    """The source's rows through ``datasets.load_dataset``, every (config, split) part concatenated.

    Hub sources use ``HF_TOKEN`` from the environment (gated datasets need it); no message this
    raises or logs contains it. Any failure is a ``SourceLoadError`` naming the source.
    """
    token = os.environ.get("HF_TOKEN") or None
    parts = []
    for config, split in spec.parts():
        what = _describe_part(spec, config=config, split=split)
        logger.info("source %s: loading %s", spec.name, what)
        try:
            parts.append(_load_part(spec, config=config, split=split, token=token, cache_dir=cache_dir))
        except Exception as exc:  # noqa: BLE001 -- datasets raises many kinds: OSError, ValueError, HTTP...
            raise _load_error(spec, what, exc, token) from (None if _mentions(exc, token) else exc)
    if len(parts) == 1:
        return parts[0]
    tables = [part.data.table for part in parts]
    try:
        # Configs of one dataset can differ in optional columns; missing ones become nulls.
        table = pa.concat_tables(_json_where_any_part_is_json(tables), promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SourceLoadError(f"source {spec.name!r}: its parts have incompatible columns: {exc}") from exc
    return datasets.Dataset(datasets.table.InMemoryTable(table.replace_schema_metadata(None)))


def _json_where_any_part_is_json(tables: list[pa.Table]) -> list[pa.Table]:
    """The tables with a column as JSON text in all of them where datasets made it so in one.

    datasets keeps a column whose rows disagree on type as JSON text, so one bad row in one config
    would otherwise make its column incompatible with the same column of the other configs.
    """
    json_columns = {f.name for t in tables for f in t.schema if isinstance(f.type, pa.JsonType)}
    encoded = []
    for table in tables:
        for name in json_columns & set(table.column_names):
            column = table[name]
            if not isinstance(column.type, pa.JsonType):
                text = pa.array(
                    [None if v is None else json.dumps(v) for v in column.to_pylist()], pa.string()
                )
                table = table.set_column(
                    table.schema.get_field_index(name), name, pa.ExtensionArray.from_storage(pa.json_(), text)
                )
        encoded.append(table)
    return encoded


def source_fingerprint(spec: SourceSpec) -> str:
    """Changes when what ``load_source`` would return changes, so a scheduler can skip a reload.

    Local files count by path, size and modification time. A hub source is named by id, configs,
    splits and revision: pin a commit as the revision, since a branch moves without the name changing.
    """
    if spec.local_path is None:
        configs = ",".join(c for c in spec.configs if c is not None) or "default"
        return f"hub:{spec.hub_id}|config={configs}|split={','.join(spec.splits)}|revision={spec.revision or 'main'}"
    digest = hashlib.sha256(repr((spec.format, spec.parts())).encode())
    for config, split in spec.parts():
        for file in sorted(glob.glob(spec.local_files(config=config, split=split))):
            stat = os.stat(file)
            digest.update(f"{os.path.abspath(file)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return f"local:{digest.hexdigest()[:32]}"


def _load_part(
    spec: SourceSpec,
    *,
    config: str | None,
    split: str,
    token: str | None,
    cache_dir: str | os.PathLike[str] | None,
) -> datasets.Dataset:
    if spec.local_path is None:
        return datasets.load_dataset(
            spec.hub_id, config, split=split, revision=spec.revision, token=token, cache_dir=cache_dir
        )
    pattern = spec.local_files(config=config, split=split)
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no file matches {pattern}")
    return datasets.load_dataset(
        FORMATS[spec.format], data_files={split: files}, split=split, cache_dir=cache_dir
    )


def _describe_part(spec: SourceSpec, *, config: str | None, split: str) -> str:
    if spec.local_path is not None:
        return f"local files {spec.local_files(config=config, split=split)} ({spec.format})"
    return f"{spec.hub_id} from the hub (config {config!r}, split {split!r}, revision {spec.revision or 'main'!r})"


def _load_error(spec: SourceSpec, what: str, exc: BaseException, token: str | None) -> SourceLoadError:
    cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if token:
        cause = cause.replace(token, "***")
    return SourceLoadError(f"source {spec.name!r}: cannot load {what}: {cause}")


def _mentions(exc: BaseException, token: str | None) -> bool:
    """Whether the token shows anywhere in the exception's chain, which a traceback would print."""
    return bool(token) and token in "".join(traceback.format_exception(exc))


def _local_root(value: Any, catalog: Path) -> Path:
    """The folder a catalog's relative local_paths are read from (see ``load_catalog``)."""
    if value is None:
        return catalog.parent
    if value == BUNDLED_ROOT:
        return package_dir("samples")
    if not _is_text(value) or not value:
        raise CatalogError(f"catalog {str(catalog)!r}: local_root: a folder or {BUNDLED_ROOT!r}, got {value!r}")
    return catalog.parent / Path(value).expanduser()


def _require_files(spec: SourceSpec, written: str, root: Path, where: str) -> None:
    """CatalogError when a part of a relative local_path matches no file under ``root``."""
    for config, split in spec.parts():
        pattern = spec.local_files(config=config, split=split)
        if not glob.glob(pattern):
            raise CatalogError(
                f"{where}: local_path {written!r} matches no file at {pattern}. A relative local_path is read "
                f"from the catalog's local_root ({root}), never from elsewhere: fix the path, make it absolute, "
                f"or set local_root (a folder, or {BUNDLED_ROOT!r} for the sample files shipped with the package)"
            )


def _reject_unknown(mapping: Mapping[str, Any], known: frozenset[str], *, where: str) -> None:
    for key in mapping:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
            raise CatalogError(f"{where}: unknown key {key!r}{hint}")


def _format_from_extension(local_path: Any) -> str | None:
    if not _is_text(local_path):
        return None
    suffix = Path(local_path).suffix.lstrip(".").lower()
    return suffix if suffix in FORMATS else None


def _as_tuple(value: str | tuple[str, ...] | None) -> tuple[Any, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_name(name: Any) -> str | None:
    if isinstance(name, str) and _NAME.fullmatch(name):
        return None
    return f"must be 1-32 lowercase letters, digits or underscores starting with a letter, got {name!r}"


def _check_hub_id(hub_id: Any, local_path: Any) -> str | None:
    if hub_id is None:
        return None if local_path is not None else "set hub_id or local_path"
    if isinstance(hub_id, str) and _HUB_ID.fullmatch(hub_id):
        return None
    return f"must look like 'owner/name', got {hub_id!r}"


def _check_names(value: Any, *, allow_none: bool, pattern: re.Pattern[str] | None) -> str | None:
    if value is None:
        return None if allow_none else "is required"
    values = (value,) if isinstance(value, str) else value
    if not isinstance(values, tuple) or not values:
        return f"must be a name or a non-empty list of names, got {value!r}"
    for item in values:
        if not _is_text(item) or (pattern is not None and not pattern.fullmatch(item)):
            return f"invalid name {item!r}"
    if len(set(values)) != len(values):
        return f"lists a name twice: {list(values)!r}"
    return None


def _check_local_path(
    local_path: Any, configs: tuple[str | None, ...], splits: tuple[str, ...]
) -> str | None:
    if local_path is None:
        return None
    if not _is_text(local_path):
        return f"must be a path, got {local_path!r}"
    try:
        used = {name for _, name, _, _ in string.Formatter().parse(local_path) if name is not None}
    except ValueError as exc:
        return f"has unbalanced braces: {exc}"
    if unknown := used - _PLACEHOLDERS:
        return f"unknown placeholders {sorted(unknown)}; only {{config}} and {{split}} can be used"
    for name, values in (("config", configs), ("split", splits)):
        if len(values) > 1 and name not in used:
            return f"must contain {{{name}}} because several {name}s are listed"
    return None


def _check_format(fmt: Any, local_path: Any) -> str | None:
    if local_path is None:
        return None if fmt is None else "only applies to a local_path"
    if fmt is None:
        return f"cannot tell it from the extension of {local_path!r}; set one of {', '.join(FORMATS)}"
    return None if fmt in FORMATS else f"must be one of {', '.join(FORMATS)}, got {fmt!r}"


def _check_count(value: Any, *, minimum: int, allow_none: bool = True) -> str | None:
    if value is None and allow_none:
        return None
    if _is_int(value) and value >= minimum:
        return None
    return f"must be an integer of at least {minimum}, got {value!r}"


def _check_weight(weight: Any, quota: Any) -> str | None:
    if weight is None:
        return None
    if quota is not None:
        return "set a quota or a weight, not both"
    if isinstance(weight, int | float) and not isinstance(weight, bool) and 0 < weight < float("inf"):
        return None
    return f"must be a positive number, got {weight!r}"


def _check_filters(filters: Any) -> str | None:
    if not isinstance(filters, tuple):
        return f"must map column names to a value or a list of values, got {filters!r}"
    for column, values in filters:
        if not _is_text(column):
            return f"invalid column name {column!r}"
        if not values or not all(isinstance(v, FilterValue) for v in values):
            return f"{column}: must be a value or a non-empty list of values, got {list(values)!r}"
    return None
