"""Reading the run configuration: the file, the environment's overrides, validation.

``load_config`` reads a file (UTF-8 YAML), applies the environment overrides (``ENV_OVERRIDES``:
the ``EXPANSION_*`` variables of earlier versions, for deployments) and validates everything
together: an unknown key, a bad value or a file that is not UTF-8 text is a ``ConfigError`` naming
the key and the file (or the variable). ``current_config`` is the one the code location and
``expansion-dag run`` use: the file named by ``$EXPANSION_CONFIG``, else the bundled default,
which reproduces the demo.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pydantic
import yaml
from pydantic import BaseModel

from expansion_dag.config.schema import CONFIG_ENV, ConfigError, RunConfig, bundled_config_path, mask_urls


def _flag(value: str) -> bool:
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 1 or 0, got {value!r}")


def _csv(value: str) -> list[str]:
    return [u.strip() for u in value.split(",") if u.strip()]


#: Variables that override single fields: variable -> (dotted key, parser). Documented in the file.
#: A table, not pydantic-settings: its variables are named after a nested model's path
#: (EXPANSION_FLEET__SHARDS, with a delimiter) or one alias each, and its errors name the field, not
#: the variable; users' variables (EXPANSION_SHARDS, ...) and errors ("$VAR (overrides key): ...")
#: stay as docs/configuration.md says them.
ENV_OVERRIDES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "EXPANSION_SHARDS": ("fleet.shards", int),
    "EXPANSION_FLEET_URLS": ("fleet.urls", _csv),
    "EXPANSION_BACKEND": ("fleet.backend", str),
    "EXPANSION_SLOTS": ("fleet.slots", int),
    "EXPANSION_FLEET_FALLBACK": ("fleet.fallback_to_healthy", _flag),
    "EXPANSION_LAUNCH_SCOPE": ("fleet.launch.scope", str),
    "EXPANSION_LAUNCH_COMMAND": ("fleet.launch.command", str),
    "EXPANSION_GPU_RUN_TAGS": ("fleet.launch.run_tags_file", str),
    "EXPANSION_SIM_BASE_PORT": ("fleet.launch.base_port", int),
    "EXPANSION_SIM_CONTEXT_LENGTH": ("fleet.launch.context_length", int),
    "EXPANSION_SIM_SLOTS": ("fleet.launch.max_running_requests", int),
    "EXPANSION_MODEL_PATH": ("model.path", str),
    "EXPANSION_SIM_MODEL_PATH": ("model.path", str),
    "EXPANSION_MODEL_REVISION": ("model.revision", str),
    "EXPANSION_TOKENIZER": ("model.tokenizer", str),
    "EXPANSION_CATALOG": ("catalog", str),
    "EXPANSION_STORAGE": ("storage.root", str),
    "EXPANSION_LOCAL_DIR": ("storage.local_dir", str),
    "EXPANSION_NIGHTLY_CRON": ("schedule.cron", str),
    "EXPANSION_NIGHTLY_TIMEZONE": ("schedule.timezone", str),
    "EXPANSION_NIGHTLY_QUOTA": ("schedule.quota", int),
    "EXPANSION_RETRY_OUTCOMES": ("generation.retry_outcomes", _csv),
    "EXPANSION_TOOL_CALL_PARSER": ("fleet.tool_call_parser", str),
}
#: ``local``: a simulated fleet; ``production``: real servers, attached when URLs are known, else launched.
PROFILE_ENV = "EXPANSION_PROFILE"
PROFILES = ("local", "production")


def _set(document: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = document
    for part in parents:
        child = node.get(part)
        node[part] = child = dict(child) if isinstance(child, Mapping) else {}
        node = child
    node[leaf] = value


def _get(document: Mapping[str, Any], dotted: str) -> Any:
    node: Any = document
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _apply_environment(document: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """Apply the override variables that are set (and not empty); returns key -> variable."""
    applied: dict[str, str] = {}
    for variable, (key, parse) in ENV_OVERRIDES.items():
        raw = env.get(variable, "")
        if not raw.strip():
            continue
        try:
            value = parse(raw)
        except ValueError as exc:
            raise ConfigError(f"${variable} (overrides {key}): {exc}") from None
        _set(document, key, value)
        applied[key] = variable
    profile = env.get(PROFILE_ENV, "").strip()
    if profile:
        if profile not in PROFILES:
            raise ConfigError(f"${PROFILE_ENV} must be one of {PROFILES}, got {profile!r}")
        mode = _get(document, "fleet.mode") or "simulate"
        if profile == "local":
            mode = "simulate"
        elif mode == "simulate":
            mode = "attach" if _get(document, "fleet.urls") else "launch"
        _set(document, "fleet.mode", mode)
        applied["fleet.mode"] = PROFILE_ENV
    if "fleet.urls" in applied:
        # Servers named by URL are attached, whatever the file's mode.
        _set(document, "fleet.mode", "attach")
        applied["fleet.mode"] = applied["fleet.urls"]
    return applied


def _unknown_key_message(key: str, known: list[str]) -> str:
    hint = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    return "unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else f"; known keys: {', '.join(known)}")


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys allowed where ``loc`` points (for the message on an unknown key)."""
    for part in loc[:-1]:
        annotation = model.model_fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else model
    return [name for name, f in model.model_fields.items() if not f.exclude]


def _describe(error: Any, where: str, applied: Mapping[str, str]) -> str:
    loc = tuple(error["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{where}: {key}: {_unknown_key_message(key, _known_keys(RunConfig, loc))}"
    source = f"${applied[key]} (overrides {key} of {where})" if key in applied else f"{where}: {key}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{source}: {message}"
    # What the user wrote, repeated: a URL's password in it is masked, as everywhere it is shown.
    return mask_urls(f"{source}: {message} (got {error['input']!r})")


def parse_config(document: Any, *, where: str, env: Mapping[str, str] | None = None) -> RunConfig:
    """Validate a parsed YAML document (with the environment's overrides) into a ``RunConfig``."""
    if document is None:
        document = {}
    if not isinstance(document, Mapping):
        raise ConfigError(f"{where}: must be a mapping of sections (fleet, model, catalog, ...), got {document!r:.80}")
    resolved = json.loads(json.dumps(document, default=str))  # a deep, plain copy
    applied = _apply_environment(resolved, os.environ if env is None else env)
    try:
        return RunConfig.model_validate({**resolved, "source": where})
    except pydantic.ValidationError as exc:
        problems = [_describe(e, where, applied) for e in exc.errors()]
        raise ConfigError("invalid run configuration:\n  " + "\n  ".join(problems)) from None


def load_config(path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None) -> RunConfig:
    """Read, override from the environment and validate one run configuration file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"run configuration {str(path)!r}: no such file")
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start:exc.start + 1]!r}): save the "
            "file as UTF-8"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(document, where=str(path.resolve()), env=env)


def config_path(env: Mapping[str, str] | None = None) -> Path:
    """``$EXPANSION_CONFIG``, else the bundled default file."""
    named = (os.environ if env is None else env).get(CONFIG_ENV, "").strip()
    return Path(named).expanduser().resolve() if named else bundled_config_path()


@functools.lru_cache(maxsize=4)
def _cached(path: Path, overrides: tuple[tuple[str, str], ...]) -> RunConfig:
    return load_config(path, env=dict(overrides))


def current_config() -> RunConfig:
    """The configuration of this process: read once per file and set of overriding variables."""
    names = {*ENV_OVERRIDES, PROFILE_ENV}
    overrides = tuple(sorted((k, v) for k, v in os.environ.items() if k in names))
    return _cached(config_path(), overrides)
