"""The extractors and the prompt records' vocabulary.

``EXTRACTORS`` says where each source schema keeps its prompt; ``PROMPT_SCHEMA`` and
``QUARANTINE_SCHEMA`` are the records extraction gives (docs/CONTRACTS.md), with ``REASONS`` the
stable codes of a quarantined row; ``turn_problem`` and ``conversation_problem`` check a source's
settings, for the catalog as for ``extract_prompts``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import polars as pl

# Stable reason codes. A row is checked in this order and gets the first reason that applies.
MISTYPED_FIELD = "mistyped_field"
INVALID_UNICODE = "invalid_unicode"
MISSING_FIELD = "missing_field"
UNKNOWN_ROLE = "unknown_role"
NO_USER_TURN = "no_user_turn"
EMPTY_PROMPT = "empty_prompt"
TOO_LONG_CHARS = "too_long_chars"
#: Conversation sources only: a ``<tools>`` block in a system turn is not a list of tool definitions.
INVALID_TOOLS = "invalid_tools"
REASONS = (
    MISTYPED_FIELD,
    INVALID_UNICODE,
    MISSING_FIELD,
    UNKNOWN_ROLE,
    NO_USER_TURN,
    EMPTY_PROMPT,
    TOO_LONG_CHARS,
    INVALID_TOOLS,
)

#: The prompt ends at this user turn (1-based), or at the last one with ``LAST_TURN``. The default
#: keeps no assistant text of the dataset: the drafter must learn the target model's answers only.
DEFAULT_TURN = 1
LAST_TURN = "last"
Turn = int | Literal["last"]
#: A sanity limit on a prompt's characters; the token budget, not this, decides what fits a context.
DEFAULT_MAX_CHARS = 200_000
DETAIL_CHARS = 160

MESSAGE_DTYPE = pl.Struct({"role": pl.String, "content": pl.String})
#: ``conversation`` (every turn, null content where the target model answers) and ``tools`` (a JSON
#: array of OpenAI-form tool definitions) are set for sources regenerated as whole conversations,
#: null for the others.
PROMPT_SCHEMA = pl.Schema(
    {
        "prompt_id": pl.String,
        "source": pl.String,
        "messages": pl.List(MESSAGE_DTYPE),
        "row_index": pl.Int64,
        "conversation": pl.List(MESSAGE_DTYPE),
        "tools": pl.String,
    }
)
QUARANTINE_SCHEMA = pl.Schema(
    {"source": pl.String, "row_index": pl.Int64, "reason": pl.String, "detail": pl.String}
)


class SourceSchemaError(ValueError):
    """The source's table lacks a column the extractor needs, or holds it in an unusable type."""


@dataclass(frozen=True)
class Extractor:
    """Where a schema keeps its prompt.

    With ``roles`` the column is a conversation of ``{from, value}`` turns and ``roles`` maps the
    dataset's ``from`` values to chat roles; without it the column is the user's message itself.
    ``conversation_roles`` replaces ``roles`` when whole conversations are regenerated, and
    ``tools_in_system`` says that system turns hold tool definitions in a ``<tools>`` block.
    """

    column: str
    roles: Mapping[str, str] | None = None
    conversation_roles: Mapping[str, str] | None = None
    tools_in_system: bool = False

    def roles_for(self, conversation: bool) -> Mapping[str, str] | None:
        return (self.conversation_roles or self.roles) if conversation else self.roles


_SHAREGPT_ROLES = MappingProxyType({"system": "system", "human": "user", "gpt": "assistant"})
# Tool results go back to the model in a user turn; Qwen-style chat templates render them so.
_HERMES_ROLES = MappingProxyType({**_SHAREGPT_ROLES, "tool": "user"})
# A regenerated conversation keeps them as tool messages: the template wraps them itself, and the
# training row must render exactly as the server rendered each request.
_HERMES_CONVERSATION_ROLES = MappingProxyType({**_SHAREGPT_ROLES, "tool": "tool"})

EXTRACTORS: Mapping[str, Extractor] = MappingProxyType(
    {
        "infinity_instruct": Extractor(column="conversations", roles=_SHAREGPT_ROLES),
        "webinstructsub": Extractor(column="question"),
        "codefeedback": Extractor(column="query"),
        "metamathqa": Extractor(column="query"),
        "hermes_function_calling": Extractor(
            column="conversations",
            roles=_HERMES_ROLES,
            conversation_roles=_HERMES_CONVERSATION_ROLES,
            tools_in_system=True,
        ),
        "agentinstruct": Extractor(column="conversations", roles=_SHAREGPT_ROLES),
    }
)


def turn_problem(turn: Any) -> str | None:
    """Why ``turn`` is not a valid turn setting, or None when it is."""
    if turn == LAST_TURN or (isinstance(turn, int) and not isinstance(turn, bool) and turn >= 1):
        return None
    return f"must be a positive integer or {LAST_TURN!r}, got {turn!r}"


def conversation_problem(conversation: Any, *, extractor: str, turn: Any) -> str | None:
    """Why ``conversation`` cannot be set with this extractor and turn, or None when it can."""
    if not isinstance(conversation, bool):
        return f"must be true or false, got {conversation!r}"
    if not conversation:
        return None
    if extractor in EXTRACTORS and EXTRACTORS[extractor].roles is None:
        return f"extractor {extractor!r} reads one text column: there is no conversation to regenerate"
    if turn != DEFAULT_TURN:
        return f"regenerates every turn, so it cannot be combined with turn {turn!r}"
    return None

