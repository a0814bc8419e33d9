"""The errors a user can cause, told as one line, and what ``expansion-dag`` checks before it starts.

Each check stands for an error a run would otherwise meet later, in a step or a resource, after
servers were launched and under Dagster's stack traces: a storage root that cannot be written, an
attached fleet that does not answer, a shard being generated elsewhere while the configuration
says not to wait (``storage.when_shard_busy: fail``). The run configuration, its ``EXPANSION_*``
overrides and the catalog are checked as they are loaded (``ConfigError``, ``CatalogError``). Each
of these errors ends the command as one ``expansion-dag: ...`` line, exit 2 (``main``).

A step that fails all the same is summarized by its cause (``step_cause``), and Dagster's console
lines of it keep the error's messages without their stack frames (``hide_stack_traces``): the
frames stay in the run's events, in the UI. ``--debug`` or ``$EXPANSION_DEBUG=1`` keeps them all.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any, Protocol

from expansion_dag.config import ConfigError
from expansion_dag.core import FleetError, as_upath, is_local, local_path
from expansion_dag.prompts import CatalogError
from expansion_dag.store import ShardBusy

if TYPE_CHECKING:
    from expansion_dag.defs.resources import FleetResource, StorageResource

#: Set to 1, an error a user can cause shows its traceback (as ``--debug``).
DEBUG_ENV = "EXPANSION_DEBUG"


class StepError(Protocol):
    """An error as a Dagster step failure records it (its ``SerializableErrorInfo``)."""

    message: str
    cls_name: str | None
    cause: StepError | None


class UsageError(Exception):
    """Something the user can fix before anything runs (the storage root, say)."""


#: The errors a user can cause: told as one line, without a traceback.
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CatalogError, FleetError, ShardBusy, UsageError)


def one_line(message: str) -> str:
    """A message on one line: the lines after its first (a configuration's problems) follow it, "; " apart."""
    first, *rest = [line.strip() for line in message.splitlines() if line.strip()] or [""]
    return " ".join([first, "; ".join(rest)]) if rest else first


def step_cause(error: StepError) -> str:
    """What a failed Dagster step raised, on one line: Dagster wraps the error of the step's code in
    its own (``Error occurred while executing op ...``), whose cause names what went wrong."""
    while error.cause is not None and (error.cls_name or "").startswith("Dagster"):
        error = error.cause
    name = error.cls_name or ""
    qualified, said, text = error.message.partition(": ")
    if not (said and name and qualified.endswith(name)):
        text = error.message
    # A step's own ``Failure`` says everything in its description; another error is named.
    return one_line(text if name in ("Failure", "") else f"{name}: {text}")


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def hide_stack_traces() -> None:
    """Dagster's console lines of a failure in this process without stack frames, unless debugging.

    Dagster makes its console logger of the current logger class, for each run: the class is where a
    filter reaches it.
    """
    if debugging():
        return
    base = logging.getLoggerClass()

    class WithoutStacks(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.addFilter(_without_stacks)

    logging.setLoggerClass(WithoutStacks)


def _without_stacks(record: logging.LogRecord) -> bool:
    if isinstance(record.msg, str) and f"\n{_STACK}\n" in record.msg:
        lines, skipping = [], False
        for line in record.msg.splitlines():
            if line == _STACK:
                skipping = True
            elif not (skipping and (line.startswith(" ") or not line)):
                skipping = False
                lines.append(line)
        record.msg = "\n".join([*lines, "(stack traces: this run's events in the Dagster UI, or --debug)"])
    return True


_STACK = "Stack Trace:"  # how Dagster heads an error's frames


def check_before_run(storage: StorageResource, fleet: FleetResource, shards: list[str]) -> None:
    """Everything ``expansion-dag run`` can know is wrong before it starts a run or a server."""
    check_storage(storage.root)
    if storage.when_shard_busy == "fail":
        log = logging.getLogger(__name__)
        for shard in shards:
            busy = storage.shard_lease(shard, run_id="expansion-dag", log=log).busy()
            if busy is not None:
                raise busy
    if fleet.mode == "attach":
        fleet.probe()  # as the run's resource would, at once: a fleet that does not answer raises FleetError


def check_storage(root: str) -> None:
    """A local storage root must take a file (an object store's errors name their bucket as they come)."""
    path = as_upath(root)
    if not is_local(path):
        return
    folder = local_path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(
            f"the storage root {folder} cannot be written ({exc.strerror or exc}): make it writable, or name "
            "another in storage.root (or $EXPANSION_STORAGE)"
        ) from exc
