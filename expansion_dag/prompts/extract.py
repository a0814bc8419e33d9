"""Prompt extraction and quarantine.

``extract_prompts`` turns one source's raw rows into prompt records (docs/CONTRACTS.md) and sets
aside every row it cannot use, with a stable reason code.

Everything runs as polars expressions over whole columns. The one step that reaches Python is
SHA-256: polars and pyarrow ship no stable hash, so each prompt's canonical bytes go to hashlib
through C-level ``map`` calls (no Python frame per row). Sources kept as whole conversations
(``conversation``) are the exception: their turns are checked the same way, then each row's
conversation is put together in Python, which their few thousand rows allow.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import methodcaller
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from expansion_dag.prompts.extractors import (
    DEFAULT_MAX_CHARS,
    DEFAULT_TURN,
    DETAIL_CHARS,
    EMPTY_PROMPT,
    EXTRACTORS,
    INVALID_TOOLS,
    INVALID_UNICODE,
    LAST_TURN,
    MISSING_FIELD,
    MISTYPED_FIELD,
    NO_USER_TURN,
    PROMPT_SCHEMA,
    QUARANTINE_SCHEMA,
    TOO_LONG_CHARS,
    UNKNOWN_ROLE,
    Extractor,
    SourceSchemaError,
    Turn,
    conversation_problem,
    turn_problem,
)
from expansion_dag.prompts.hermes_tools import ToolsError, take_tools, tool_results

_CONVERSATION_DTYPE = pl.List(pl.Struct({"from": pl.String, "value": pl.String}))

# Whitespace to rewrite: a run of two or more, or a single character that is not a plain space.
# Matching every single space too would rewrite nearly every word and cost three times as much.
_WHITESPACE = r"\s\s+|[^\S ]"
_ASCII_WHITESPACE = r"[\t\n\r\x0b\x0c]"
# datasets stores a JSON field whose rows disagree on type as JSON text in this extension type.
_JSON_EXTENSION = "arrow.json"


@dataclass(frozen=True)
class ExtractResult:
    """One source's prompts (``PROMPT_SCHEMA``) and quarantined rows (``QUARANTINE_SCHEMA``).

    ``rows_read`` counts the raw table and ``filtered`` the rows the source's filters excluded;
    every other row is either a prompt or quarantined.
    """

    source: str
    prompts: pl.DataFrame
    quarantine: pl.DataFrame
    rows_read: int
    filtered: int

    @property
    def rows_in(self) -> int:
        return self.rows_read - self.filtered

    def __post_init__(self) -> None:
        if self.prompts.height + self.quarantine.height != self.rows_in:
            raise AssertionError(
                f"source {self.source!r}: {self.prompts.height} prompts + {self.quarantine.height} "
                f"quarantined != {self.rows_in} rows after filters"
            )


def extract_prompts(
    raw: pl.DataFrame,
    *,
    source: str,
    extractor: str,
    turn: Turn = DEFAULT_TURN,
    max_chars: int = DEFAULT_MAX_CHARS,
    filters: Mapping[str, Sequence[Any]] | None = None,
    conversation: bool = False,
) -> ExtractResult:
    """Prompt records from one source's raw rows, as ``pl.from_arrow(dataset.data.table)`` gives them.

    ``filters`` keeps only the rows whose column holds one of the listed values. The prompt is the
    system turns before the first user turn, then everything up to and including user turn
    ``turn`` (or the last user turn, when a row has fewer). With ``conversation`` the whole
    conversation is kept for regeneration turn by turn (``_conversations``); ``messages`` is then
    its first request. A row that cannot give a prompt is quarantined with one of ``REASONS``; only
    a table without the needed column raises.
    """
    if extractor not in EXTRACTORS:
        raise ValueError(f"unknown extractor {extractor!r}; known: {', '.join(EXTRACTORS)}")
    if (problem := turn_problem(turn)) is not None:
        raise ValueError(f"turn {problem}")
    if (problem := conversation_problem(conversation, extractor=extractor, turn=turn)) is not None:
        raise ValueError(f"conversation {problem}")
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    spec = EXTRACTORS[extractor]
    if spec.column not in raw.columns:
        raise SourceSchemaError(
            f"source {source!r}: column {spec.column!r} not found, and extractor {extractor!r} "
            f"reads its prompts from it (columns: {', '.join(raw.columns)})"
        )
    frame = raw.select(row_index=pl.int_range(pl.len(), dtype=pl.Int64), target=pl.col(spec.column))
    if filters:
        frame = frame.filter(_filter_mask(raw, source=source, filters=filters))
    target, mistyped = _coerce(frame["target"], source=source, spec=spec)
    frame = frame.with_columns(target=target, mistyped=mistyped)

    expected = "a list of {from, value} text turns" if spec.roles is not None else "text"
    row_checks = [
        (
            pl.col("mistyped").is_not_null(),
            MISTYPED_FIELD,
            pl.concat_str(pl.lit(f"{spec.column} is not {expected}: "), pl.col("mistyped")),
        )
    ]
    if spec.roles is not None:
        row_checks += [
            (pl.col("target").is_null(), MISSING_FIELD, pl.lit(f"{spec.column} is null")),
            (pl.col("target").list.len() == 0, NO_USER_TURN, pl.lit(f"{spec.column} is empty")),
        ]
    frame = frame.with_columns(_first_match(row_checks))
    turns = _turns(frame.filter(pl.col("reason").is_null()), spec.roles_for(conversation))
    per_row = _check_turns(turns, spec=spec, turn=turn, max_chars=max_chars, conversation=conversation)

    accepted = per_row.filter(pl.col("reason").is_null())
    if conversation:
        prompts, rejected = _conversations(accepted, source=source, spec=spec)
        failed = per_row.filter(pl.col("reason").is_not_null()).select(rejected.columns)
        per_row = pl.concat([failed, rejected])
    else:
        prompts = accepted.select(
            prompt_id=_sha256_hex32(accepted["canonical"]),
            source=pl.lit(source, pl.String),
            messages=_owned(accepted["messages"]),
            row_index="row_index",
            conversation=pl.lit(None, PROMPT_SCHEMA["conversation"]),
            tools=pl.lit(None, pl.String),
        )
    quarantine = (
        pl.concat(
            [
                frame.filter(pl.col("reason").is_not_null()).select("row_index", "reason", "detail"),
                per_row.filter(pl.col("reason").is_not_null()).select("row_index", "reason", "detail"),
            ]
        )
        .sort("row_index")
        .select(
            source=pl.lit(source, pl.String),
            row_index="row_index",
            reason="reason",
            detail=pl.col("detail").str.head(DETAIL_CHARS),
        )
    )
    return ExtractResult(
        source=source,
        prompts=prompts.match_to_schema(PROMPT_SCHEMA),
        quarantine=quarantine.match_to_schema(QUARANTINE_SCHEMA),
        rows_read=raw.height,
        filtered=raw.height - frame.height,
    )


def _filter_mask(raw: pl.DataFrame, *, source: str, filters: Mapping[str, Sequence[Any]]) -> pl.Series:
    conditions = []
    for column, allowed in filters.items():
        if column not in raw.columns:
            raise SourceSchemaError(f"source {source!r}: filter column {column!r} not found")
        conditions.append(pl.col(column).is_in(list(allowed)).fill_null(False))
    try:
        return raw.select(pl.all_horizontal(conditions)).to_series()
    except pl.exceptions.PolarsError as exc:
        raise SourceSchemaError(f"source {source!r}: cannot apply filters {dict(filters)!r}: {exc}") from exc


def _coerce(values: pl.Series, *, source: str, spec: Extractor) -> tuple[pl.Series, pl.Series]:
    """The target column in the type the extractor reads, and the JSON text of rows of the wrong type."""
    dtype = values.dtype
    if isinstance(dtype, pl.Extension) and dtype.ext_name() == _JSON_EXTENSION:
        text = values.ext.storage()
        return _decode_conversations(text) if spec.roles is not None else _decode_text(text)
    fine = pl.Series("mistyped", [None] * len(values), dtype=pl.String)
    if dtype == pl.Null:
        return values.cast(_CONVERSATION_DTYPE if spec.roles is not None else pl.String), fine
    if spec.roles is None:
        if dtype != pl.String:
            raise SourceSchemaError(f"source {source!r}: column {spec.column!r} is {dtype}, expected text")
        return values, fine
    inner = dtype.inner if isinstance(dtype, pl.List) else None
    fields = {f.name: f.dtype for f in inner.fields} if isinstance(inner, pl.Struct) else {}
    if not all(fields.get(name) in (pl.String, pl.Null) for name in ("from", "value")):
        raise SourceSchemaError(
            f"source {source!r}: column {spec.column!r} is {dtype}, expected a list of {{from, value}} turns"
        )
    return values, fine


def _decode_text(text: pl.Series) -> tuple[pl.Series, pl.Series]:
    is_string = text.str.starts_with('"')
    decoded = pl.select(pl.when(is_string).then(text).str.json_decode(pl.String)).to_series()
    mistyped = pl.select(pl.when(~is_string).then(text)).to_series()
    return decoded, mistyped


def _decode_conversations(text: pl.Series) -> tuple[pl.Series, pl.Series]:
    # Only reached when datasets had to JSON-encode the column; it parsed every row in Python already.
    turns = [None if value is None else _as_turns(json.loads(value)) for value in text.to_list()]
    mistyped = [raw if parsed is None else None for raw, parsed in zip(text.to_list(), turns, strict=True)]
    return pl.Series(turns, dtype=_CONVERSATION_DTYPE), pl.Series("mistyped", mistyped, dtype=pl.String)


def _as_turns(value: Any) -> list[dict[str, str | None] | None] | None:
    """The turns of a decoded conversation, or None when it is not a list of {from, value} text turns."""
    if not isinstance(value, list):
        return None
    turns: list[dict[str, str | None] | None] = []
    for turn in value:
        if turn is not None and not (
            isinstance(turn, dict) and all(isinstance(turn.get(k), str | None) for k in ("from", "value"))
        ):
            return None
        turns.append(None if turn is None else {"from": turn.get("from"), "value": turn.get("value")})
    return turns


def _turns(frame: pl.DataFrame, roles: Mapping[str, str] | None) -> pl.DataFrame:
    """One row per turn: row_index, pos, n_turns, source_role, role, value, bad_role."""
    if roles is None:
        return frame.select(
            "row_index",
            pos=pl.lit(0, pl.Int64),
            n_turns=pl.lit(1, pl.Int64),
            source_role=pl.lit(None, pl.String),
            role=pl.lit("user", pl.String),
            value="target",
            bad_role=pl.lit(False),
        )
    turns = (
        frame.select(
            "row_index",
            "target",
            pos=pl.int_ranges(0, pl.col("target").list.len(), dtype=pl.Int64),
            n_turns=pl.col("target").list.len().cast(pl.Int64),
        )
        .explode(["target", "pos"], empty_as_null=False, keep_nulls=False)
        .select(
            "row_index",
            "pos",
            "n_turns",
            source_role=pl.col("target").struct.field("from").cast(pl.String),
            value=pl.col("target").struct.field("value").cast(pl.String),
        )
    )
    bad_role = _invalid_utf8(turns["source_role"])
    return turns.with_columns(
        source_role=pl.when(~bad_role).then("source_role"), bad_role=bad_role
    ).with_columns(
        role=pl.col("source_role").replace_strict(dict(roles), default=None, return_dtype=pl.String)
    )


def _check_turns(
    turns: pl.DataFrame, *, spec: Extractor, turn: Turn, max_chars: int, conversation: bool = False
) -> pl.DataFrame:
    """Per row: row_index, reason, detail, messages and the canonical text its prompt_id hashes.

    A whole ``conversation`` keeps every turn from the first user turn on but the assistant's,
    whose places come in ``answer_at`` (with ``at``, the kept turns' places).
    """
    is_user = pl.col("role") == "user"
    users = is_user.cast(pl.Int64).cum_sum()
    # Rows are contiguous, so a row's running count of user turns is the global running count
    # minus the count before its first turn; the count at its last turn is the row's total.
    turns = turns.with_columns(
        user_turn=users - pl.when(pl.col("pos") == 0).then(users - is_user.cast(pl.Int64)).forward_fill()
    ).with_columns(
        row_users=pl.when(pl.col("pos") == pl.col("n_turns") - 1).then("user_turn").backward_fill()
    )
    end = pl.col("row_users") if turn == LAST_TURN else pl.min_horizontal("row_users", pl.lit(turn, pl.Int64))
    opening = (pl.col("user_turn") == 0) & (pl.col("role") == "system")
    if conversation:
        is_answer = (pl.col("user_turn") > 0) & (pl.col("role") == "assistant")
        turns = turns.with_columns(kept=opening | ((pl.col("user_turn") > 0) & ~is_answer.fill_null(False)))
    else:
        turns = turns.with_columns(
            kept=opening
            | ((pl.col("user_turn") > 0) & (pl.col("user_turn") < end))
            | (is_user & (pl.col("user_turn") == end))
        )

    # Text work runs on the kept turns only: the dataset's answers are most of the bytes.
    kept = turns.filter("kept").select("row_index", "pos", "role", "value")
    bad_value = _invalid_utf8(kept["value"])
    kept = kept.with_columns(bad_value=bad_value, text=pl.when(~bad_value).then("value"))
    kept = kept.with_columns(chars=pl.col("text").str.len_chars())
    kept = kept.with_columns(normalized=_normalized(pl.col("text"), pl.col("chars")))
    prompts = kept.group_by("row_index", maintain_order=True).agg(
        chars=pl.col("chars").sum(),
        messages=pl.struct(role="role", content="value"),
        # Normalized text has no newline left, so newlines delimit roles and contents unambiguously.
        canonical=pl.concat_str("role", pl.lit("\n"), "normalized", pl.lit("\n")),
        **({"at": pl.col("pos")} if conversation else {}),
    )
    # Problems are rare: find them on the few turns that have one, not with a pass over all rows.
    role_problems = (
        turns.filter(pl.col("bad_role") | pl.col("role").is_null())
        .group_by("row_index")
        .agg(
            bad_role_at=pl.col("pos").filter("bad_role").first(),
            no_role_at=pl.col("pos").filter(pl.col("source_role").is_null()).first(),
            unknown_at=pl.col("pos").first(),
            unknown=pl.col("source_role").first(),
        )
    )
    value_problems = (
        kept.filter(pl.col("bad_value") | pl.col("value").is_null() | (pl.col("normalized") == ""))
        .group_by("row_index")
        .agg(
            bad_value_at=pl.col("pos").filter("bad_value").first(),
            no_value_at=pl.col("pos").filter(pl.col("value").is_null()).first(),
            blank_at=pl.col("pos").filter(pl.col("normalized") == "").first(),
        )
    )
    per_row = (
        turns.filter(pl.col("pos") == 0)
        .select("row_index", users="row_users")
        .join(prompts, on="row_index", how="left", maintain_order="left")
        .join(role_problems, on="row_index", how="left", maintain_order="left")
        .join(value_problems, on="row_index", how="left", maintain_order="left")
        .with_columns(canonical=pl.col("canonical").list.join(""))
    )
    if conversation:
        answers = turns.filter(is_answer).group_by("row_index").agg(answer_at=pl.col("pos"))
        per_row = per_row.join(answers, on="row_index", how="left", maintain_order="left")

    at = _position_label(spec)
    roles = spec.roles_for(conversation) or {}
    user_names = " or ".join(repr(name) for name, role in roles.items() if role == "user")

    def found_at(column: str, reason: str, field: str, says: str) -> tuple[pl.Expr, str, pl.Expr]:
        """The check that ``column`` holds a turn's position, named with what it ``says`` of it."""
        return pl.col(column).is_not_null(), reason, pl.concat_str(at(pl.col(column), field), pl.lit(says))

    checks = [
        found_at("bad_role_at", INVALID_UNICODE, "from", " is not valid UTF-8"),
        found_at("bad_value_at", INVALID_UNICODE, "value", " is not valid UTF-8"),
        found_at("no_role_at", MISSING_FIELD, "from", " is null"),
        (
            pl.col("unknown_at").is_not_null(),
            UNKNOWN_ROLE,
            pl.concat_str(
                at(pl.col("unknown_at"), "from"), pl.lit(" is '"), pl.col("unknown").str.head(40), pl.lit("'")
            ),
        ),
        (pl.col("users") == 0, NO_USER_TURN, pl.lit(f"no {user_names} turn in {spec.column}")),
        found_at("no_value_at", MISSING_FIELD, "value", " is null"),
        found_at("blank_at", EMPTY_PROMPT, "value", " is blank"),
        (
            pl.col("chars") > max_chars,
            TOO_LONG_CHARS,
            pl.format("{} characters, more than max_chars {}", "chars", pl.lit(max_chars)),
        ),
    ]
    extra = ["at", "answer_at"] if conversation else []
    return per_row.select("row_index", "messages", "canonical", *extra, *_first_match(checks))


def _conversations(
    accepted: pl.DataFrame, *, source: str, spec: Extractor
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Conversation prompts from the rows that passed the turn checks, and those quarantined here.

    Plain Python per row: conversation sources have thousands of rows, not hundreds of thousands.
    The id hashes every turn but the assistant's, as the turn checks normalize them, then the tools.
    """
    built, rejected = [], []
    rows = accepted.select("row_index", "messages", "at", "answer_at").iter_rows()
    for row_index, messages, at, answer_at in rows:
        try:
            conversation, tools = _conversation(messages, at, answer_at or [], spec=spec)
        except ToolsError as exc:
            rejected.append((row_index, INVALID_TOOLS, f"{spec.column}[{exc.pos}].value: <tools> {exc}"))
            continue
        first_answer = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
        built.append((row_index, conversation[:first_answer], conversation, tools))
    prompts = pl.DataFrame(
        built,
        schema={
            "row_index": pl.Int64,
            "messages": PROMPT_SCHEMA["messages"],
            "conversation": PROMPT_SCHEMA["conversation"],
            "tools": pl.String,
        },
        orient="row",
    )
    content = pl.col("content")
    canonical = (
        prompts.select("row_index", turn="conversation")
        .explode("turn")
        .unnest("turn")
        .filter(content.is_not_null())
        .group_by("row_index", maintain_order=True)
        .agg(
            canonical=pl.concat_str(
                "role", pl.lit("\n"), _normalized(content, content.str.len_chars()), pl.lit("\n")
            ).str.join("")
        )
    )
    prompts = prompts.join(canonical, on="row_index", how="left", maintain_order="left").with_columns(
        canonical=pl.concat_str("canonical", pl.format("tools\n{}\n", "tools").fill_null(""))
    )
    prompts = prompts.select(
        prompt_id=_sha256_hex32(prompts["canonical"]),
        source=pl.lit(source, pl.String),
        messages="messages",
        row_index="row_index",
        conversation="conversation",
        tools="tools",
    )
    schema = {"row_index": pl.Int64, "reason": pl.String, "detail": pl.String}
    return prompts, pl.DataFrame(rejected, schema=schema, orient="row")


def _conversation(
    messages: list[dict[str, str]], at: list[int], answer_at: list[int], *, spec: Extractor
) -> tuple[list[dict[str, str | None]], str | None]:
    """The turns in order with an empty assistant turn wherever the target model answers, and the
    tools as JSON text (None without any). The dataset's answers in a row make one place to answer,
    and a conversation that does not end with one gets it: the last answer is the target's too."""
    turns = sorted([*zip(at, messages, strict=True), *((pos, None) for pos in answer_at)], key=lambda t: t[0])
    conversation: list[dict[str, str | None]] = []
    tools: list[dict[str, Any]] = []
    for pos, message in turns:
        if message is None:
            if conversation[-1]["role"] != "assistant":
                conversation.append({"role": "assistant", "content": None})
        elif message["role"] == "system" and spec.tools_in_system:
            text = take_tools(message["content"], tools, pos)
            if text.strip():
                conversation.append({"role": "system", "content": text})
        elif message["role"] == "tool":
            conversation += [{"role": "tool", "content": c} for c in tool_results(message["content"])]
        else:
            conversation.append(dict(message))
    if conversation[-1]["role"] != "assistant":
        conversation.append({"role": "assistant", "content": None})
    return conversation, json.dumps(tools, ensure_ascii=False) if tools else None


def _position_label(spec: Extractor) -> Callable[..., pl.Expr]:
    """How a detail names a field: ``conversations[2].value`` for a turn, ``query`` for a text column."""

    def label(pos: pl.Expr, field: str | None = None) -> pl.Expr:
        if spec.roles is None:
            return pl.lit(spec.column)
        suffix = f"].{field}" if field else "]"
        return pl.concat_str(pl.lit(f"{spec.column}["), pos.cast(pl.String), pl.lit(suffix))

    return label


def _first_match(checks: Sequence[tuple[pl.Expr, str, pl.Expr]]) -> list[pl.Expr]:
    """``reason`` and ``detail`` columns: those of the first check whose condition holds, else null."""
    (condition, reason, detail), *rest = checks
    reasons, details = pl.when(condition).then(pl.lit(reason)), pl.when(condition).then(detail)
    for condition, reason, detail in rest:
        reasons, details = reasons.when(condition).then(pl.lit(reason)), details.when(condition).then(detail)
    return [reasons.alias("reason"), details.alias("detail")]


def _normalized(text: pl.Expr, chars: pl.Expr) -> pl.Expr:
    """The form two texts must share to count as duplicates: NFC, whitespace runs as one space, stripped."""
    # A byte class and a literal-led pattern let the regex engine skip ahead: cheaper than one \s pattern.
    ascii_spaced = text.str.replace_all(_ASCII_WHITESPACE, " ").str.replace_all("  +", " ")
    # Only rows with multi-byte characters can hold Unicode spaces or be other than NFC already.
    unicode_spaced = (
        pl.when(text.str.len_bytes() != chars)
        .then(text)
        .str.normalize("NFC")
        .str.replace_all(_WHITESPACE, " ")
    )
    return pl.coalesce(unicode_spaced, ascii_spaced).str.strip_chars(" ")


def _invalid_utf8(texts: pl.Series) -> pl.Series:
    """Which values are not valid UTF-8: parquet can hold such bytes and polars does not check them.

    Arrow validates a whole column at SIMD speed; only a column that fails is bisected down to its
    bad rows, so clean data costs one pass.
    """
    array = texts.to_arrow(compat_level=pl.CompatLevel.newest())  # string views: no copy
    bad: list[int] = []
    pending = [(0, len(array))]
    while pending:
        start, stop = pending.pop()
        try:
            array.slice(start, stop - start).validate(full=True)
        except pa.ArrowInvalid:
            if stop - start == 1:
                bad.append(start)
            else:
                middle = (start + stop) // 2
                pending += [(start, middle), (middle, stop)]
    mask = np.zeros(len(array), dtype=bool)
    mask[bad] = True
    return pl.Series("invalid_utf8", mask)


def _owned(values: pl.Series) -> pl.Series:
    """``values`` in buffers of their own, holding only the text they use.

    Polars strings are views into shared buffers: the messages would otherwise keep the input's
    whole column alive, every turn and answer of every row (five times the prompts' own text on
    Infinity-Instruct), for as long as the prompts live. A round trip through Arrow's offset
    strings copies just the text used.
    """
    return pl.from_arrow(values.to_arrow(compat_level=pl.CompatLevel.oldest()))


def _sha256_hex32(texts: pl.Series) -> pl.Series:
    """The first 32 hex characters of each text's SHA-256, the same on every machine and version."""
    digests = map(methodcaller("digest"), map(hashlib.sha256, texts.cast(pl.Binary).to_list()))
    return pl.Series("prompt_id", list(digests), dtype=pl.Binary).bin.encode("hex").str.head(32)
