"""Deterministic simulated completions whose token counts are exact under the real tokenizer.

The text is cut from one long fixed stream of common English words, each chosen because it is a
single token both with and without a leading space. The byte-level pre-tokenizer splits text at
word boundaries, so a run of ``k`` such words is exactly ``k`` tokens: ``completion_tokens`` is
the real token count of the returned text, and building a completion is one string slice.

A thinking model's raw output is ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``: five tokens of
structure around the words (``<think>``, ``\\n``, ``\\n``, ``</think>``, ``\\n\\n``).
"""

from __future__ import annotations

import array
import dataclasses
import functools
import hashlib
import math
import random
import re
import statistics
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from expansion_dag.core import count_tokens, load_tokenizer

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
THINKING_OVERHEAD_TOKENS = 5

# Starts of completions are spread over this many words of the stream.
_STREAM_PERIOD_WORDS = 4096
# Fixed so that the stream, and so every answer, is the same across runs and machines.
_STREAM_SEED = 20240601
_NORMAL = statistics.NormalDist()
_INSTRUCTION_WORD = re.compile(r"[a-z0-9]+")
#: Share of words whose presence changes answer lengths, and the most they change the log-median.
_WORDS_WITH_EFFECT = 0.1
_WORD_EFFECT_LIMIT = 2.5
#: The prompt length at which ``prompt_exponent`` leaves the median unchanged.
PROMPT_REFERENCE_TOKENS = 64

_CANDIDATE_WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which but
have an had they you were their one all we can her has there been if more when will would who so
no out up into do time only its about than also may other first new some could these two what
them any after most made over such where like well years many then between must through way back
because people even still same here both under last being those while much another good make
world great state each part since three long should before might own just used day work year life
down right take place show government number come point small large order high find group give
present old case end form fact open public follow during without again change system possible
however among set hand local course problem little general member early far report keep power
line person within bring level
""".split()


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    content: str
    reasoning_content: str | None
    completion_tokens: int
    reasoning_tokens: int
    finish_reason: str  # "stop" or "length"; the server may turn it into "abort" or "tool_calls"
    #: Calls a tool-call parser took out of the text, as the dialect's ``message.tool_calls``; None: none.
    tool_calls: tuple[dict, ...] | None = None
    #: The raw text of those calls, as the model wrote it before the parser took it out of ``content``.
    call_text: str = ""


#: The pieces of a raw answer that are each one token of the model's tokenizer when the answer is
#: the simulator's own words (``_piece_ids``): a think tag, a run of newlines, a word with its
#: leading space (or none, first in a line). The tokenizer's pre-tokenizer splits the text at the
#: same places (an added token first, a word with the one space before it, newlines apart), so
#: the pieces' ids are its encoding of the whole text.
_PIECES = re.compile(r"</?think>|\n+|\s*[^\s<]+|\s+|<")
#: Where the simulator's count and the tokenizer's differ, the count wins, as a real server returns
#: ``completion_tokens`` ids: ids past it are dropped (the closing structure that a cut answer never
#: wrote but :func:`raw_output` puts back around its parsed-out thinking, the tags around a looping
#: answer's thinking, which it counts without them, the text a defect adds, ``answer_defect``), and
#: an answer the tokenizer counts shorter is padded with this id, id 0 of the vocabulary (``!`` in
#: Qwen's); no answer the simulator makes today needs it.
_FILLER_ID = 0


@functools.lru_cache(maxsize=8)
def _piece_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """The tokenizer's id of every piece of the simulator's answers that is one token: each
    candidate word bare and with its leading space, the think tags, one and two newlines."""
    pieces = [THINK_OPEN, THINK_CLOSE, "\n", "\n\n", *_CANDIDATE_WORDS, *(" " + w for w in _CANDIDATE_WORDS)]
    encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"]
    return {piece: ids[0] for piece, ids in zip(pieces, encoded, strict=True) if len(ids) == 1}


def raw_output(completion: Completion) -> str:
    """The text the model wrote for ``completion``, as a server detokenizes its sampled ids before
    any parser: the thinking (where a reasoning parser took it out) before the answer, then the
    calls a tool-call parser took out."""
    raw = completion.content + completion.call_text
    if completion.reasoning_content is None:
        return raw
    return f"{THINK_OPEN}\n{completion.reasoning_content}\n{THINK_CLOSE}\n\n{raw}"


def sim_output_ids(completion: Completion, tokenizer: PreTrainedTokenizerBase) -> array.array:
    """The ids the simulated model "sampled" for ``completion``: the model tokenizer's ids of the
    raw answer (:func:`raw_output`), as a real server's sampled ids are the ones it detokenized into
    the text, so a training set built from a simulated fleet decodes to the answers (the README's
    demo). Exactly ``completion_tokens`` of them, as a real server returns: cut, or padded with
    ``_FILLER_ID``, where the simulator's count and the tokenizer's differ (see there).

    That a client keeps the server's ids rather than tokenizing the text again is not proved here,
    where both are the same ids: ``test_training_set_ids.py`` proves it with non-canonical ids on the
    real tokenizer, and the real-engine tests on a real server.

    The simulator's words, think tags and newlines are looked up (``_piece_ids``); any other text
    (a tool call's JSON, a defect's) is encoded whole by the tokenizer."""
    raw = raw_output(completion)
    table = _piece_ids(tokenizer)
    try:
        ids = array.array("I", [table[piece] for piece in _PIECES.findall(raw)])
    except KeyError:
        ids = array.array("I", tokenizer(raw, add_special_tokens=False)["input_ids"])
    n = completion.completion_tokens
    del ids[n:]
    ids.extend([_FILLER_ID] * (n - len(ids)))
    return ids


class WordStream:
    """A fixed text of single-token words, sliced by word index."""

    def __init__(self, words: list[str], n_words: int) -> None:
        rng = random.Random(_STREAM_SEED)
        chosen = [rng.choice(words) for _ in range(n_words)]
        self._text = "".join(" " + w for w in chosen)
        offsets = array.array("q", [0])
        position = 0
        for word in chosen:
            position += len(word) + 1
            offsets.append(position)
        self._offsets = offsets
        self.n_words = n_words

    def words(self, start: int, count: int) -> str:
        """``count`` words from word ``start``, single-spaced, no leading space."""
        return self._text[self._offsets[start] + 1 : self._offsets[start + count]]


@functools.lru_cache(maxsize=8)
def word_stream(tokenizer_spec: str, n_words: int) -> WordStream:
    tokenizer = load_tokenizer(tokenizer_spec)
    spaced = count_tokens(tokenizer, [" " + w for w in _CANDIDATE_WORDS])
    bare = count_tokens(tokenizer, _CANDIDATE_WORDS)
    words = [w for w, a, b in zip(_CANDIDATE_WORDS, spaced, bare, strict=True) if a == 1 and b == 1]
    if len(words) < 16:
        raise ValueError(
            f"tokenizer {tokenizer_spec!r} has too few single-token English words ({len(words)}) "
            "to build simulated completions"
        )
    return WordStream(words, n_words)


def supports_thinking(tokenizer: PreTrainedTokenizerBase) -> bool:
    """A model thinks when its vocabulary has ``<think>`` (Qwen3 does, Qwen2.5 does not)."""
    token_id = tokenizer.convert_tokens_to_ids(THINK_OPEN)
    return token_id is not None and token_id != tokenizer.unk_token_id


class OutputModel:
    """Draws an output length per request and renders the completion, both deterministic."""

    def __init__(
        self,
        *,
        tokenizer_spec: str,
        max_length: int,
        median_tokens: int,
        sigma: float,
        reasoning_share: float,
        seed: int,
        median_by_marker: Sequence[tuple[str, int]] = (),
        prompt_exponent: float = 0.0,
        word_sigma: float = 0.0,
        phrase_sigma: float = 0.0,
    ) -> None:
        self._stream = word_stream(tokenizer_spec, _STREAM_PERIOD_WORDS + max_length)
        self._max_length = max_length
        self._log_median = math.log(median_tokens)
        self._log_medians = [(marker, math.log(tokens)) for marker, tokens in median_by_marker]
        self._prompt_exponent = prompt_exponent
        self._sigma = sigma
        self._reasoning_share = reasoning_share
        self._key = seed.to_bytes(16, "little", signed=True)
        self._word_sigma = word_sigma
        self._phrase_sigma = phrase_sigma

    def _uniform(self, *parts: str) -> float:
        """A number in (0, 1) drawn from ``parts`` and the seed: the same every time they are the same."""
        digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=8, key=self._key).digest()
        return (int.from_bytes(digest, "little") + 0.5) / 2.0**64

    def loops(self, instruction: str, share: float) -> bool:
        """Whether this prompt is one of the ``share`` that loop every time they are asked."""
        return share > 0 and self._uniform("loop", instruction) < share

    def word_effect(self, instruction: str) -> float:
        """How far the instruction's words move the log-median: a tenth of all words carry an effect
        (normal, ``word_sigma``), read from the first and last words, where instructions sit."""
        if not self._word_sigma:
            return 0.0
        words = _INSTRUCTION_WORD.findall(instruction.lower())
        words = words if len(words) <= 48 else words[:32] + words[-16:]
        effect = 0.0
        for word in set(words):
            if self._uniform("carries", word) < _WORDS_WITH_EFFECT:
                effect += self._word_sigma * _NORMAL.inv_cdf(self._uniform("effect", word))
        return max(-_WORD_EFFECT_LIMIT, min(_WORD_EFFECT_LIMIT, effect))

    def phrase_effect(self, instruction: str) -> float:
        """How far the instruction's phrases move the log-median: a tenth of all pairs of adjacent
        words carry an effect (normal, ``phrase_sigma``), anywhere in the text. "one word" is not
        "one" and "word": a client that learns from single words (``answer_lengths.prompt_features``)
        sees only what a phrase's words tell on average, so this rule does not mirror it."""
        if not self._phrase_sigma:
            return 0.0
        words = _INSTRUCTION_WORD.findall(instruction.lower())
        effect = 0.0
        for pair in {f"{a} {b}" for a, b in zip(words, words[1:])}:
            if self._uniform("phrase", pair) < _WORDS_WITH_EFFECT:
                effect += self._phrase_sigma * _NORMAL.inv_cdf(self._uniform("phrase effect", pair))
        return max(-_WORD_EFFECT_LIMIT, min(_WORD_EFFECT_LIMIT, effect))

    def generate(
        self,
        rendered_prompt: str,
        *,
        request_seed: int | None,
        cap: int,
        thinking: bool,
        split_reasoning: bool,
        prompt_tokens: int = PROMPT_REFERENCE_TOKENS,
        instruction: str = "",
    ) -> Completion:
        """The completion for a prompt, cut at ``cap`` tokens if it does not end before.

        Its length is lognormal around a median that depends on the prompt, as real answers do:
        the median of the first marker of ``median_by_marker`` found in the prompt (e.g. a
        source's instruction), else ``median_tokens``, scaled by ``(prompt_tokens / 64) **
        prompt_exponent``, moved by the instruction's words (:meth:`word_effect`) and phrases
        (:meth:`phrase_effect`).

        An answer of ``cap`` tokens or more finishes with ``length``: its end-of-sequence token
        would be one more. ``split_reasoning`` is the reasoning parser at work: thinking goes to
        ``reasoning_content`` and only the answer stays in ``content``.
        """
        digest = hashlib.blake2b(
            f"{request_seed}\x00{rendered_prompt}".encode(), digest_size=16, key=self._key
        ).digest()
        uniform = (int.from_bytes(digest[:8], "little") + 0.5) / 2.0**64
        start = int.from_bytes(digest[8:], "little") % _STREAM_PERIOD_WORDS
        z = _NORMAL.inv_cdf(uniform)
        log_median = next((m for marker, m in self._log_medians if marker in rendered_prompt), self._log_median)
        if self._prompt_exponent:
            log_median += self._prompt_exponent * math.log(max(1, prompt_tokens) / PROMPT_REFERENCE_TOKENS)
        log_median += self.word_effect(instruction) + self.phrase_effect(instruction)
        length = min(self._max_length, max(1, round(math.exp(log_median + self._sigma * z))))
        if not thinking:
            n = min(length, cap)
            return Completion(
                content=self._stream.words(start, n),
                reasoning_content=None,
                completion_tokens=n,
                reasoning_tokens=0,
                finish_reason="length" if length >= cap else "stop",
            )
        return self._thinking(length, start, cap, split_reasoning)

    def _thinking(self, length: int, start: int, cap: int, split_reasoning: bool) -> Completion:
        words = max(2, length - THINKING_OVERHEAD_TOKENS)
        n_reason = max(1, round(words * self._reasoning_share))
        n_answer = max(1, words - n_reason)
        full = n_reason + n_answer + THINKING_OVERHEAD_TOKENS
        n = min(full, cap)
        finish_reason = "length" if full >= cap else "stop"
        # Token positions: 0 <think>, 1 \n, 2.. reasoning words, then \n, </think>, \n\n, answer.
        reason_words = min(n_reason, max(0, n - 2))
        answer_words = max(0, n - n_reason - THINKING_OVERHEAD_TOKENS)
        reasoning = self._stream.words(start, reason_words)
        answer = self._stream.words(start + n_reason, answer_words)
        if split_reasoning:
            return Completion(
                content=answer,
                reasoning_content=reasoning,
                completion_tokens=n,
                reasoning_tokens=min(n, n_reason + 4),
                finish_reason=finish_reason,
            )
        raw = "".join(
            (
                THINK_OPEN if n >= 1 else "",
                "\n" if n >= 2 else "",
                reasoning,
                "\n" if n >= n_reason + 3 else "",
                THINK_CLOSE if n >= n_reason + 4 else "",
                "\n\n" if n >= n_reason + 5 else "",
                answer,
            )
        )
        return Completion(
            content=raw,
            reasoning_content=None,
            completion_tokens=n,
            reasoning_tokens=0,
            finish_reason=finish_reason,
        )
