"""Expected answer lengths, learned from completions, to start the long answers first.

A run ends when its longest answer ends, so the queue is ordered longest expected answer first.
The expectation is learned per source and per prompt-length bucket (powers of two of the prompt's
tokens) from completions of the same model and settings, in the store and as they return; the
typed per-source priors are only where the learning starts. Each level shrinks toward the one
above it by ``prior_weight`` pseudo-answers, so one odd answer moves an estimate part of the way.
:class:`WordEffects` adds what the prompt says ("a detailed essay", "in one word"): an online
regression on hashed words of its instruction, whose features travel with the completion record
(``length_features``), so later runs learn without reading prompt texts again.

What is left of a run (``AnswerLengths.survivorship``): the first answers to end are the short
ones, so a mean of ended answers alone is low until the run is nearly over. The answers still
running are at least as long as their tokens so far (right-censored), and a survival curve
(:class:`Survival`: Kaplan-Meier over both, a lognormal past the longest, the prior as
pseudo-answers) is not biased by the order answers end in; it scales a source's estimates and
gives each running answer's expected rest.

Pure: no I/O. ``learn`` takes store records (``CompletionStore.records``) of one identity.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import math
import re
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

#: Prompts shorter than this share the first bucket: below it, length says little about the answer.
_SMALLEST_BUCKET = 64


def prompt_bucket(prompt_tokens: int) -> int:
    """The bucket's lower bound: 0 (under 64 tokens), 64, 128, 256, ... (powers of two)."""
    if prompt_tokens < _SMALLEST_BUCKET:
        return 0
    return 1 << (prompt_tokens.bit_length() - 1)


def bucket_label(bucket: int) -> str:
    return f"<{_SMALLEST_BUCKET}" if bucket == 0 else f"{bucket}-{2 * bucket - 1}"


#: Spread assumed around a typed prior (lognormal sigma of an answer's length): real answer lengths
#: spread about this much (the reference run's sources: 0.8 to 1.3).
PRIOR_SIGMA = 1.0


def _cdf(x: float) -> float:
    """The standard normal's CDF."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _pdf(x: float) -> float:
    return math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


@dataclasses.dataclass
class _Mean:
    n: int = 0
    total: int = 0
    #: Sums of log1p(length) and of its square: a lognormal's sufficient statistics.
    logs: float = 0.0
    squares: float = 0.0
    #: How many answers had each length: the survival curve's steps.
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, value: int) -> None:
        self.n += 1
        self.total += value
        # On a grid 1% apart past 100 tokens: a few hundred steps for the survival curve, not thousands.
        self.counts[value if value <= 100 else round(math.exp(round(math.log(value) * 100) / 100))] += 1
        log = math.log1p(value)
        self.logs += log
        self.squares += log * log

    def shrunk(self, toward: float, weight: float) -> float:
        return (self.total + weight * toward) / (self.n + weight)


@dataclasses.dataclass(frozen=True)
class Estimate:
    tokens: int
    #: Answers the estimate rests on: its bucket's, else its source's (0: the typed prior alone).
    answers: int
    #: "prior", "source" (the source's answers, none of this bucket) or "source+bucket".
    basis: str


_WORD = re.compile(r"[a-z0-9]+")
#: Words of the instruction that make features: the first and the last of the user's text, found
#: in its first and last characters only (a long prompt is not scanned whole for 48 words).
_LEAD_WORDS, _TAIL_WORDS = 32, 16
_LEAD_CHARS, _TAIL_CHARS = 400, 200
_FEATURE_BUCKETS = 1 << 18


def prompt_features(messages: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
    """Hashed words of the last user turn's first and last words, sorted, distinct.

    crc32, not ``hash``: the same prompt must give the same features in every process and night.
    """
    text = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
    if len(text) <= _LEAD_CHARS + _TAIL_CHARS:
        words = _WORD.findall(text.lower())
        picked = words if len(words) <= _LEAD_WORDS + _TAIL_WORDS else words[:_LEAD_WORDS] + words[-_TAIL_WORDS:]
    else:
        # The cut may split a word at either end: the same split every time, so the same features.
        picked = _WORD.findall(text[:_LEAD_CHARS].lower())[:_LEAD_WORDS] + _WORD.findall(text[-_TAIL_CHARS:].lower())[-_TAIL_WORDS:]
    return tuple(sorted({zlib.crc32(word.encode()) % _FEATURE_BUCKETS for word in picked}))


class WordEffects:
    """How much each hashed word moves the log of an answer's length off its source's mean.

    Online least squares with AdaGrad steps (each word learns at its own pace: frequent template
    words settle early, a rare word still moves on its first answers) and a shrink toward zero, so a
    word seen once moves an estimate only part of the way.
    """

    def __init__(self, *, rate: float = 0.5, shrink: float = 1e-3, limit: float = 3.0):
        self._weights: dict[int, float] = {}
        self._squares: dict[int, float] = {}
        self._rate = rate
        self._shrink = shrink
        self._limit = limit
        self.updates = 0

    def residual(self, features: Sequence[int]) -> float:
        """The predicted log-length off the mean, within +-``limit``."""
        if not features:
            return 0.0
        total = sum(map(self._weights.get, features, itertools.repeat(0.0))) / math.sqrt(len(features))
        return max(-self._limit, min(self._limit, total))

    def observe(self, features: Sequence[int], residual: float) -> None:
        if not features:
            return
        scaled_error = (self.residual(features) - residual) / math.sqrt(len(features))
        weights, squares, shrink, rate, sqrt = self._weights, self._squares, self._shrink, self._rate, math.sqrt
        for f in features:
            weight = weights.get(f, 0.0)
            gradient = scaled_error + shrink * weight
            square = squares.get(f, 1.0) + gradient * gradient
            squares[f] = square
            weights[f] = weight - rate * gradient / sqrt(square)
        self.updates += 1


class AnswerLengths:
    """Mean answer length per source and prompt-length bucket, shrunk toward the prior, moved by
    what the prompt's words taught (:class:`WordEffects`)."""

    def __init__(self, *, prior_weight: float = 2.0):
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be positive, got {prior_weight}")
        self._weight = prior_weight
        self._sources: dict[str, _Mean] = {}
        self._cells: dict[tuple[str, int], _Mean] = {}
        self.words = WordEffects()

    @property
    def answers(self) -> int:
        return sum(m.n for m in self._sources.values())

    def observe(
        self, source: str, prompt_tokens: int, output_tokens: int, features: Sequence[int] = (), prior: int | None = None
    ) -> None:
        known = self._sources.get(source)
        if features and known is not None:
            # The words explain what the source and bucket do not: the residual before this answer counts.
            base = self.estimate(source, prompt_tokens, round(known.total / known.n) if prior is None else prior).tokens
            self.words.observe(features, math.log1p(output_tokens) - math.log1p(base))
        self._sources.setdefault(source, _Mean()).add(output_tokens)
        self._cells.setdefault((source, prompt_bucket(prompt_tokens)), _Mean()).add(output_tokens)

    def expect(self, source: str, prompt_tokens: int, prior: int, features: Sequence[int] = ()) -> int:
        """The expected answer length of a prompt, its words considered (tokens)."""
        base = self.estimate(source, prompt_tokens, prior).tokens
        if not features or not self.words.updates:
            return base
        return max(1, round(math.expm1(math.log1p(base) + self.words.residual(features))))

    def source_answers(self, source: str) -> int:
        known = self._sources.get(source)
        return known.n if known is not None else 0

    def survivorship(
        self, source: str, prior: int, running: Sequence[int], cap: int, again: Survival | None = None
    ) -> tuple[float, Survival]:
        """How much to scale ``source``'s estimates, its answers still ``running`` (tokens so far)
        counted as lower bounds, and the survival curve of its lengths that says so. Means are of
        answers cut at ``cap``, as the learned ones are. ``again``: the curve of the same answers
        with another prior, whose answers' part is kept."""
        known = self._sources.get(source) or _Mean()
        own = again.own if again is not None else _ProductLimit(known, running, prior, self._weight)
        curve = Survival(own, prior, self._weight)
        ended = (known.total + self._weight * curve.prior.area(cap)) / (known.n + self._weight)
        return curve.area(cap) / max(ended, 1.0), curve

    def estimate(self, source: str, prompt_tokens: int, prior: int) -> Estimate:
        """The expected answer length of a prompt's source and length bucket; ``prior`` is the typed one for its source."""
        by_source = self._sources.get(source)
        if by_source is None:
            return Estimate(tokens=prior, answers=0, basis="prior")
        source_mean = by_source.shrunk(prior, self._weight)
        cell = self._cells.get((source, prompt_bucket(prompt_tokens)))
        if cell is None:
            return Estimate(tokens=round(source_mean), answers=by_source.n, basis="source")
        return Estimate(tokens=round(cell.shrunk(source_mean, self._weight)), answers=cell.n, basis="source+bucket")


@dataclasses.dataclass(frozen=True)
class _Lognormal:
    mean: float
    sigma: float

    def _z(self, t: float) -> float:
        mu = math.log(max(self.mean, 1.0)) - self.sigma**2 / 2
        return (math.log(t) - mu) / self.sigma

    def survival(self, t: float) -> float:
        return 1.0 if t <= 0 else 1.0 - _cdf(self._z(t))

    def area(self, t: float) -> float:
        """The integral of the survival from 0 to ``t``: E[min(L, t)]."""
        if t <= 0:
            return 0.0
        z = self._z(t)
        return self.mean * _cdf(z - self.sigma) + t * (1.0 - _cdf(z))


class _ProductLimit:
    """The product-limit (Kaplan-Meier) estimate of P(length > t) over ended lengths, running ones'
    tokens so far as lower bounds; past the longest length it knows, a lognormal fitted to both (EM)."""

    def __init__(self, ended: _Mean, bounds: Sequence[int], prior: int, weight: float):
        bounds = sorted(b for b in bounds if b > 0)  # a bound of 0 tokens says nothing
        self.seen = ended.n + len(bounds)
        mu, sigma = _fit(ended, bounds, prior, weight)
        self._tail = _Lognormal(math.exp(mu + sigma * sigma / 2), sigma)
        # The steps: at each ended length, the share still longer, and the area under them from 0.
        self._times, self._levels, self._areas = [0.0], [1.0], [0.0]
        at_risk, level, below = self.seen, 1.0, 0  # below: bounds under the length, out of risk
        for length in sorted(ended.counts):
            while below < len(bounds) and bounds[below] < length:
                below += 1
            risk = at_risk - below
            self._areas.append(self._areas[-1] + level * (length - self._times[-1]))
            level *= 1.0 - ended.counts[length] / risk if risk > 0 else 0.0
            self._times.append(float(length))
            self._levels.append(level)
            at_risk -= ended.counts[length]
        self._last = max(self._times[-1], float(bounds[-1]) if bounds else 0.0)

    def _at(self, t: float) -> tuple[float, float]:
        i = bisect.bisect_right(self._times, t) - 1
        level = self._levels[i]
        if t <= self._last:
            return level, self._areas[i] + level * (t - self._times[i])
        # Past what it knows: the fitted tail, scaled to the level the curve reached.
        known = self._areas[i] + level * (self._last - self._times[i])
        scale = level / max(self._tail.survival(self._last), 1e-12)
        return scale * self._tail.survival(t), known + scale * (self._tail.area(t) - self._tail.area(self._last))

    def survival(self, t: float) -> float:
        return self._at(t)[0]

    def area(self, t: float) -> float:
        return self._at(t)[1]


class Survival:
    """A source's answer lengths as a survival curve, P(length > t): its answers' product-limit
    curve (:class:`_ProductLimit`) as many answers as it rests on, mixed with the typed prior (a
    lognormal, sigma ``PRIOR_SIGMA``) as ``weight`` answers."""

    def __init__(self, own: _ProductLimit, prior: int, weight: float):
        self.own = own
        self.prior = _Lognormal(prior, PRIOR_SIGMA)
        self._parts = [(own.seen, own), (weight, self.prior)]

    def survival(self, t: float) -> float:
        return sum(w * part.survival(t) for w, part in self._parts) / sum(w for w, _ in self._parts)

    def area(self, t: float) -> float:
        """E[min(length, t)]."""
        return sum(w * part.area(t) for w, part in self._parts) / sum(w for w, _ in self._parts)

    def rest(self, so_far: float, cap: int) -> float:
        """Tokens still to come of an answer at ``so_far`` tokens that stops at ``cap`` at the
        latest: E[min(length, cap) | length > so_far] - so_far."""
        longer = self.survival(so_far)
        if so_far >= cap or longer < 1e-9:
            return 0.0
        return (self.area(cap) - self.area(so_far)) / longer


def _fit(ended: _Mean, bounds: Sequence[int], prior: int, weight: float, rounds: int = 40) -> tuple[float, float]:
    """(mu, sigma) of log1p(length) by EM: ``ended`` lengths whole, ``bounds`` lengths at least
    that long, and ``weight`` pseudo-answers of the prior (its mean ``prior``, sigma ``PRIOR_SIGMA``)."""
    prior_mu = math.log1p(prior) - PRIOR_SIGMA**2 / 2
    n = ended.n + weight
    logs = ended.logs + weight * prior_mu
    squares = ended.squares + weight * (PRIOR_SIGMA**2 + prior_mu**2)
    lows = [math.log1p(b) for b in bounds if b > 0]  # a bound of 0 tokens says nothing
    mu = logs / n
    var = max(squares / n - mu * mu, 1e-4)
    for _ in range(rounds if lows else 0):
        sigma = math.sqrt(var)
        sum_y = sum_y2 = 0.0
        for low in lows:
            z = (low - mu) / sigma
            tail = max(1.0 - _cdf(z), 1e-12)
            hazard = _pdf(z) / tail  # E[y | y > low] = mu + sigma * hazard
            sum_y += mu + sigma * hazard
            sum_y2 += mu * mu + var + sigma * (low + mu) * hazard
        total = n + len(lows)
        mu_next = (logs + sum_y) / total
        var = max((squares + sum_y2) / total - mu_next * mu_next, 1e-4)
        done = abs(mu_next - mu) < 1e-6
        mu = mu_next
        if done:
            break
    return mu, math.sqrt(var)


def learn(
    records: Iterable[Mapping[str, Any]],
    owns: Callable[[Mapping[str, Any]], bool],
    lengths: AnswerLengths | None = None,
) -> AnswerLengths:
    """Lengths of the completions among ``records`` that ``owns`` accepts (one identity's).

    A stopped loop (a failure record with ``streamed_tokens``) counts at its streamed length. The
    prompt length is the project's own count (``local_prompt_tokens``), the one the queue's
    prompts carry, falling back to the server's; the words are the record's ``length_features``.
    """
    lengths = lengths or AnswerLengths()
    for record in records:
        if not owns(record):
            continue
        prompt_tokens = record.get("local_prompt_tokens", record.get("prompt_tokens"))
        # A loop stopped early counts at the tokens it streamed: what its slot spent on it.
        output_tokens = record.get("completion_tokens", record.get("streamed_tokens"))
        if isinstance(prompt_tokens, int) and isinstance(output_tokens, int):
            features = record.get("length_features") or ()
            lengths.observe(str(record.get("source")), prompt_tokens, output_tokens, features)
    return lengths


def cell_estimates(
    lengths: AnswerLengths, prompts: Iterable[tuple[str, int, int]]
) -> dict[tuple[str, int], tuple[int, Estimate]]:
    """Per (source, prompt bucket) of ``prompts`` (source, prompt tokens, prior): how many, and the estimate."""
    counts: dict[tuple[str, int], int] = {}
    first: dict[tuple[str, int], tuple[int, int]] = {}
    for source, prompt_tokens, prior in prompts:
        cell = (source, prompt_bucket(prompt_tokens))
        counts[cell] = counts.get(cell, 0) + 1
        first.setdefault(cell, (prompt_tokens, prior))
    return {cell: (n, lengths.estimate(cell[0], *first[cell])) for cell, n in sorted(counts.items())}
