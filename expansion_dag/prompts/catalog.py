"""The source catalog: which datasets the prompts come from, and loading them with ``datasets``.

A catalog is a YAML file (``catalogs/production.yaml`` documents every field) or one of the
bundled names: ``samples`` (small files in the real schemas, shipped in ``expansion_dag/samples``)
and ``production`` (the six public datasets on the Hugging Face hub). The file is one pydantic
model (``Catalog``, its ``sources`` each a ``SourceSpec``): unknown keys, missing fields and every
field's rule are reported together, each naming its source and field; a catalog built in code is
held to the same rules.
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
import tempfile
import traceback
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Optional, Union

import datasets
import pyarrow as pa
import pydantic
import yaml
from pydantic import BaseModel, ConfigDict

from expansion_dag.prompts.extractors import (
    DEFAULT_MAX_CHARS,
    DEFAULT_TURN,
    EXTRACTORS,
    Turn,
    conversation_problem,
    turn_problem,
)
from expansion_dag.prompts.local_files import blank_files, surrogate_error, surrogates_as_bytes
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
FilterValue = Union[str, bool, int, float]
#: ``local_root``'s value that reads relative local_paths from the samples shipped with the package.
BUNDLED_ROOT = "bundled"


class CatalogError(ValueError):
    """A catalog or source definition is invalid; the message names the field."""


class SourceLoadError(RuntimeError):
    """A source could not be loaded; the message names the source and the cause."""


def package_dir(name: str) -> Path:
    """A data folder shipped inside the package (``catalogs`` or ``samples``)."""
    return Path(str(importlib.resources.files("expansion_dag") / name))


def _valid(problem: str | None, value: Any) -> Any:
    """``value``, or the ValueError that pydantic reports as the field's problem."""
    if problem:
        raise ValueError(problem)
    return value


class _Validated(BaseModel):
    """Frozen, no unknown key; a bad value is a ``CatalogError`` naming the field, in code as in a file.

    (pydantic calls an ``__init__`` of the model's own for a nested one too: a catalog's report
    takes its sources' reports as they are.)"""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as exc:
            raise CatalogError(_report(exc, data, known=self._keys)) from None

    _keys: ClassVar[frozenset[str]] = frozenset()


def _same(value: Any) -> Any:
    return value


#: What a source field may be, in the user's words (None: it may): each field's own rule; the rules
#: across fields are ``SourceSpec._fields_agree``'s.
_SOURCE_RULES = {
    "name": lambda v: _check_name(v),
    "extractor": lambda v: None if v in EXTRACTORS else f"unknown {v!r}; known: {', '.join(EXTRACTORS)}",
    "hub_id": lambda v: _check_hub_id(v),
    "config": lambda v: _check_names(v, allow_none=True, pattern=None),
    "split": lambda v: _check_names(v, allow_none=False, pattern=_SPLIT),
    "revision": lambda v: None if v is None or _is_text(v) else f"must be text, got {v!r}",
    "local_path": lambda v: None if v is None or _is_text(v) else f"must be a path, got {v!r}",
    "quota": lambda v: _check_count(v, minimum=0),
    "weight": lambda v: None if v is None or _is_positive(v) else f"must be a positive number, got {v!r}",
    "filters": lambda v: _check_filters(v),
    "turn": turn_problem,
    "max_chars": lambda v: _check_count(v, minimum=1, allow_none=False),
    "conversation": lambda v: None if isinstance(v, bool) else f"must be true or false, got {v!r}",
}
#: How a file writes what a source keeps otherwise: lists as tuples, filters as a mapping.
_AS_GIVEN = {
    "config": lambda v: tuple(v) if isinstance(v, list) else v,
    "split": lambda v: tuple(v) if isinstance(v, list) else v,
    "filters": lambda v: tuple((k, tuple(f) if isinstance(f, list | tuple) else (f,)) for k, f in v.items())
    if isinstance(v, Mapping) else v,
}


class SourceSpec(_Validated):
    """One source dataset and how to take prompts from it (``catalogs/production.yaml`` explains each field).

    ``config`` and ``split`` may list several values: each combination is loaded and the parts are
    concatenated in order. With ``local_path`` the files are read instead of the hub; the path may
    name ``{config}`` and ``{split}`` and may be a glob.
    """

    name: str
    extractor: str
    hub_id: Optional[str] = None
    config: Union[str, tuple[str, ...], None] = None
    split: Union[str, tuple[str, ...]] = DEFAULT_SPLIT
    revision: Optional[str] = None
    local_path: Optional[str] = None
    format: Optional[str] = None
    quota: Optional[int] = None
    weight: Optional[float] = None
    filters: tuple[tuple[str, tuple[FilterValue, ...]], ...] = ()
    turn: Turn = DEFAULT_TURN
    max_chars: int = DEFAULT_MAX_CHARS
    conversation: bool = False

    @pydantic.field_validator(*_SOURCE_RULES, mode="before")
    @classmethod
    def _rule(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        """Each field's rule, in the user's words; the field's type then holds what passed."""
        value = _AS_GIVEN.get(info.field_name, _same)(value)
        return _valid(_SOURCE_RULES[info.field_name](value), value)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _format_from_extension(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("format") is None and _is_text(data.get("local_path")):
            suffix = Path(data["local_path"]).suffix.lstrip(".").lower()
            data = {**data, "format": suffix if suffix in FORMATS else None}
        return data

    @pydantic.model_validator(mode="after")
    def _fields_agree(self) -> SourceSpec:
        """The rules across fields, once each field is valid."""
        problems = [
            ("hub_id", "set hub_id or local_path" if self.hub_id is None and self.local_path is None else None),
            ("local_path", _check_local_path(self.local_path, self.configs, self.splits)),
            ("format", _check_format(self.format, self.local_path)),
            ("weight", "set a quota or a weight, not both" if self.weight is not None and self.quota is not None else None),
            ("conversation", conversation_problem(self.conversation, extractor=self.extractor, turn=self.turn)),
        ]
        return _valid("; ".join(f"{name}: {problem}" for name, problem in problems if problem), self)

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


_SOURCE_KEYS = SourceSpec._keys = frozenset(SourceSpec.model_fields)
_DEFAULTABLE = _SOURCE_KEYS - {"name"}


class Catalog(_Validated):
    """The sources in priority order (earlier wins a duplicate), the sampling seed, and the
    source-field ``defaults`` the file applied to every source.

    ``total_prompts`` is shared among the sources that have a ``weight``. Read from a file
    (``load_catalog``), the file's ``local_root`` says where its relative local_paths are.
    """

    sources: tuple[SourceSpec, ...]
    seed: int = DEFAULT_SEED
    total_prompts: Optional[int] = None
    defaults: Mapping[str, Any] = pydantic.Field(default_factory=lambda: MappingProxyType({}))

    @pydantic.field_validator("sources", mode="before")
    @classmethod
    def _listed(cls, value: Any) -> Any:
        return _valid(None if isinstance(value, list | tuple) and value else "sources must be a non-empty list", value)

    @pydantic.field_validator("seed", mode="before")
    @classmethod
    def _integer(cls, value: Any) -> Any:
        return _valid(None if _is_int(value) else f"must be an integer, got {value!r}", value)

    @pydantic.field_validator("total_prompts", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        return _valid(_check_count(value, minimum=1), value)

    @pydantic.field_validator("defaults", mode="before")
    @classmethod
    def _defaultable(cls, value: Any) -> Any:
        value = {} if value is None else value
        if not isinstance(value, Mapping):
            raise ValueError(f"must be a mapping of source fields, got {value!r}")
        unknown = [key for key in value if key not in _DEFAULTABLE]
        return _valid(_unknown_key(unknown[0], _DEFAULTABLE) if unknown else None, MappingProxyType(dict(value)))

    @pydantic.model_validator(mode="after")
    def _sources_agree(self) -> Catalog:
        problems = []
        names = [s.name for s in self.sources]
        if duplicated := sorted({n for n in names if names.count(n) > 1}):
            problems.append(f"sources: duplicate names {', '.join(duplicated)}")
        weighted = [s.name for s in self.sources if s.weight is not None]
        if weighted and self.total_prompts is None:
            problems.append(f"total_prompts: required because {', '.join(weighted)} set a weight")
        elif not weighted and self.total_prompts is not None:
            problems.append("total_prompts: set, but no source has a weight to share it")
        return _valid("; ".join(problems), self)

    def source(self, name: str) -> SourceSpec:
        for spec in self.sources:
            if spec.name == name:
                return spec
        raise KeyError(
            f"no source {name!r} in the catalog (sources: {', '.join(s.name for s in self.sources)})"
        )


#: The keys of a catalog file.
Catalog._keys = frozenset(Catalog.model_fields) | {"local_root"}


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
    where = f"catalog {str(path)!r}"
    if not path.is_file():
        raise CatalogError(
            f"catalog {str(name_or_path)!r}: no such file, and not a bundled catalog ({', '.join(BUNDLED_CATALOGS)})"
        )
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise CatalogError(f"{where}: not UTF-8 text (byte {exc.start}): save the file as UTF-8") from None
    except yaml.YAMLError as exc:
        raise CatalogError(f"{where}: not valid YAML: {exc}") from exc
    if not isinstance(document, Mapping):
        raise CatalogError(f"{where}: must be a mapping with a 'sources' list")
    root = _local_root(document.get("local_root"), path)
    fields = {str(key): value for key, value in document.items() if key != "local_root"}
    defaults, entries = fields.get("defaults") or {}, fields.get("sources")
    if isinstance(defaults, Mapping) and isinstance(entries, list):
        # Each source with the file's defaults under it (an unknown one is the defaults' problem, said
        # once), a relative local_path read from the root.
        under = {key: value for key, value in defaults.items() if key in _DEFAULTABLE}
        fields["sources"] = [_under_root({**under, **e}, root) if isinstance(e, Mapping) else e for e in entries]
    try:
        catalog = Catalog(**fields)
    except CatalogError as exc:
        raise CatalogError("\n".join(f"{where}: {line}" for line in str(exc).splitlines())) from None
    for index, (spec, entry) in enumerate(zip(catalog.sources, entries)):
        written = {**catalog.defaults, **entry}.get("local_path")
        if _relative(written):
            _require_files(spec, written, root, f"{where}: sources[{index}]")
    return catalog


def _relative(local_path: Any) -> bool:
    return _is_text(local_path) and not Path(local_path).is_absolute()


def _under_root(settings: dict[str, Any], root: Path) -> dict[str, Any]:
    """A source's settings with a relative local_path read from ``root``."""
    if _relative(settings.get("local_path")):
        # The root is literal text: escape braces so that only the user's placeholders get filled.
        escaped = str(root).replace("{", "{{").replace("}", "}}")
        settings["local_path"] = escaped + os.sep + settings["local_path"]
    return settings


def _report(exc: pydantic.ValidationError, data: Mapping[str, Any], *, known: frozenset[str]) -> str:
    """Each problem in the user's words, naming its field: a source's together, after its name
    (``source 'a': quota: ...; weight: ...``); a catalog's sources' as their own reports say them."""
    name = data.get("name")
    label = f"source {name!r}: " if known is _SOURCE_KEYS and isinstance(name, str) else ""
    entries = data.get("sources") if isinstance(data.get("sources"), list | tuple) else ()
    own, lines = [], []
    for error in exc.errors():
        loc = tuple(error["loc"])
        nested = error.get("ctx", {}).get("error")
        if isinstance(nested, CatalogError):  # a source's own report
            entry = entries[loc[1]] if len(loc) > 1 and loc[1] < len(entries) else None
            named = isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
            lines += [line if named else f"sources[{loc[1]}]: {line}" for line in str(nested).splitlines()]
        elif loc[:1] == ("sources",) and len(loc) > 1:
            lines.append(f"sources[{loc[1]}]: {_problem(error, None, known)}")
        else:
            own.append(_problem(error, loc[0] if loc else None, known))
    return "\n".join(([label + "; ".join(own)] if own else []) + lines)


def _problem(error: Mapping[str, Any], field: Any, known: frozenset[str]) -> str:
    """One problem in the user's words: the rules' own, pydantic's for the rest."""
    if error["type"] == "extra_forbidden":
        return _unknown_key(field, known)
    if error["type"] == "missing":
        message = "is required"
    elif error["type"] in ("model_type", "dict_type", "model_attributes_type"):
        message = f"must be a mapping, got {error['input']!r}"
    else:
        message = error["msg"].removeprefix("Value error, ")
    # A message that names its field itself ("sources must be ...") says it once.
    return message if field is None or message.startswith(str(field)) else f"{field}: {message}"


def _unknown_key(key: Any, known: frozenset[str]) -> str:
    close = difflib.get_close_matches(str(key), sorted(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
    return f"unknown key {key!r}{hint}"


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
    if blank := blank_files(files):
        raise ValueError(f"{', '.join(blank)}: empty: give it rows, or remove it")
    try:
        return datasets.load_dataset(FORMATS[spec.format], data_files={split: files}, split=split, cache_dir=cache_dir)
    except datasets.exceptions.DatasetGenerationError as exc:
        if FORMATS[spec.format] != "json" or not surrogate_error(exc):
            raise
    with tempfile.TemporaryDirectory(prefix="expansion-source-") as folder:
        copies = surrogates_as_bytes(files, Path(folder))
        return datasets.load_dataset("json", data_files={split: copies}, split=split, cache_dir=cache_dir)


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


def _as_tuple(value: str | tuple[str, ...] | None) -> tuple[Any, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf")


def _check_name(name: Any) -> str | None:
    if isinstance(name, str) and _NAME.fullmatch(name):
        return None
    return f"must be 1-32 lowercase letters, digits or underscores starting with a letter, got {name!r}"


def _check_hub_id(hub_id: Any) -> str | None:
    if hub_id is None or (isinstance(hub_id, str) and _HUB_ID.fullmatch(hub_id)):
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


def _check_filters(filters: Any) -> str | None:
    if not isinstance(filters, tuple):
        return f"must map column names to a value or a list of values, got {filters!r}"
    for column, values in filters:
        if not _is_text(column):
            return f"invalid column name {column!r}"
        if not values or not all(isinstance(v, FilterValue) for v in values):
            return f"{column}: must be a value or a non-empty list of values, got {list(values)!r}"
    return None
