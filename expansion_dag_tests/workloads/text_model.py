"""Random English-like text for generated datasets of any size (the rehearsal's sources, the
benchmarks' data), fast enough to write gigabytes in a minute on one core: Zipf-weighted English
words from the tokenizer's own vocabulary, punctuation, sentence capitals, newlines and list items,
some numbers and code, a little non-ASCII. Everything is numpy over whole batches: no Python per
word or per text.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_SHORT_WORDS = frozenset("a to of in is it on be as at by or an we he if do no so up my me us".split())
_ASCII_EXTRA = (
    "42", "2023", "3.14", "100", "1", "0", "x", "y", "f(x)", "=", "+", "def", "return", "print()",
    "i++", "{", "}", "[1, 2, 3]", "I", "The", "It", "This", "SQL", "API", "JSON", "Python",
)  # fmt: skip
_NON_ASCII = ("café", "naïve", "résumé", "über", "façade", "—", "“", "”", "→", "°C", "π", "±", "é", "’s")
_SEPARATORS = (
    (" ", 0.80), (", ", 0.06), (". ", 0.07), (".\n", 0.015), (".\n\n", 0.015), ("? ", 0.005),
    (": ", 0.01), ("\n- ", 0.01), (" (", 0.0075), (") ", 0.0075),
)  # fmt: skip
_TABLE_BITS = 20  # inverse-CDF lookup tables of 2**20 entries: sampling is one gather


class TextModel:
    """Random English-like text, fast enough to write gigabytes in a minute on one core.

    About 6 characters and 1.27 Qwen3 tokens per word (4.8 characters per token); about one text in
    seven of 100 words holds a non-ASCII character, so Unicode normalization has work to do.
    """

    def __init__(self, vocab: dict[str, int], seed: int):
        words = sorted(
            (index, token[1:])
            for token, index in vocab.items()
            if token.startswith("Ġ")
            and token[1:].isascii()
            and token[1:].isalpha()
            and token[1:].islower()
            and (len(token) > 3 or token[1:] in _SHORT_WORDS)
        )
        # BPE merges come roughly in frequency order: the token id serves as a frequency rank.
        zipf = 1.0 / (np.arange(len(words)) + 10.0)
        weights = np.concatenate(
            [
                zipf / zipf.sum() * 0.9835,
                np.full(len(_ASCII_EXTRA), 0.015 / len(_ASCII_EXTRA)),
                np.full(len(_NON_ASCII), 0.0015 / len(_NON_ASCII)),
            ]
        )
        separators = [s for s, _ in _SEPARATORS]
        pieces = [w.encode() for _, w in words] + [w.encode() for w in (*_ASCII_EXTRA, *_NON_ASCII)]
        self._n_words = len(pieces)
        pieces += [s.encode() for s in separators]
        self._len = np.array([len(p) for p in pieces], np.int64)
        self._start = np.concatenate([[0], np.cumsum(self._len)[:-1]])
        self._bytes = np.frombuffer(b"".join(pieces), np.uint8)
        self._word_table = _inverse_cdf(weights)
        self._sep_table = _inverse_cdf(np.array([p for _, p in _SEPARATORS])) + self._n_words
        self._period = self._n_words + separators.index(". ")
        self._capitalizes = np.zeros(len(pieces), bool)
        for k, sep in enumerate(separators):
            self._capitalizes[self._n_words + k] = sep.endswith((". ", "\n", "? ", "- "))
        self.rng = np.random.default_rng(seed)

    def texts(self, n_words: np.ndarray) -> pa.Array:
        """One text per entry of ``n_words`` (0 gives an empty text), as an Arrow string array."""
        n_words = np.asarray(n_words, np.int64)
        count, total_words = len(n_words), int(n_words.sum())
        table_size = 1 << _TABLE_BITS
        pieces = np.empty(2 * total_words, np.int64)  # word, separator, word, separator...
        pieces[0::2] = self._word_table[self.rng.integers(0, table_size, total_words)]
        pieces[1::2] = self._sep_table[self.rng.integers(0, table_size, total_words)]
        word_end = np.cumsum(n_words)
        nonempty = n_words > 0
        last_sep = 2 * word_end[nonempty] - 1
        pieces[last_sep] = self._period
        lengths = self._len[pieces]
        lengths[last_sep] = 1  # a text ends with "." and no space
        out = np.concatenate([[0], np.cumsum(lengths)])
        size = int(out[-1])
        data = self._bytes[np.repeat(self._start[pieces] - out[:-1], lengths) + np.arange(size)]
        # Capitals: each text's first word and every word after a sentence end or a list dash.
        capital = np.zeros(total_words, bool)
        capital[1:] = self._capitalizes[pieces[1:-1:2]]
        capital[(word_end - n_words)[nonempty]] = True
        at = out[0:-1:2][capital]
        first = data[at]
        data[at] = np.where((first >= 97) & (first <= 122), first - 32, first)
        offsets = out[2 * np.concatenate([[0], word_end])]
        large = size >= 2**31
        return pa.Array.from_buffers(
            pa.large_string() if large else pa.string(),
            count,
            [None, pa.py_buffer(offsets.astype(np.int64 if large else np.int32)), pa.py_buffer(data)],
        )


def _inverse_cdf(weights: np.ndarray) -> np.ndarray:
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    grid = (np.arange(1 << _TABLE_BITS) + 0.5) / (1 << _TABLE_BITS)
    return np.minimum(np.searchsorted(cdf, grid), len(weights) - 1).astype(np.int64)


def lognormal_ints(rng: np.random.Generator, n: int, *, median: float, sigma: float, low: int, high: int) -> np.ndarray:
    """``n`` lognormal draws around ``median``, rounded and clipped to [``low``, ``high``]."""
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), low, high).astype(np.int64)
