"""The synthetic completions: token counts exact under the real Qwen3 tokenizer, deterministic."""

import statistics

import pytest

from expansion_dag.core import DEFAULT_TOKENIZER, count_tokens
from expansion_dag.generation import prompt_features
from expansion_dag.sim import OutputModel, SimServerConfig


def model(**changes):
    params = dict(
        tokenizer_spec=DEFAULT_TOKENIZER,
        max_length=4096,
        median_tokens=60,
        sigma=0.0,
        reasoning_share=0.5,
        seed=0,
    )
    return OutputModel(**{**params, **changes})


def test_plain_completions_have_exactly_the_reported_token_count(tokenizer):
    m = model(sigma=1.0)
    completions = [
        m.generate(f"prompt {i}", request_seed=None, cap=4096, thinking=False, split_reasoning=False)
        for i in range(40)
    ]
    counts = count_tokens(tokenizer, [c.content for c in completions])
    assert counts == [c.completion_tokens for c in completions]
    assert len({c.completion_tokens for c in completions}) > 10  # lengths really vary


def test_a_thinking_answer_is_exact_at_every_cut(tokenizer):
    m = model()
    full = m.generate("p", request_seed=None, cap=4096, thinking=True, split_reasoning=False)
    assert full.content.startswith("<think>\n") and "\n</think>\n\n" in full.content
    cuts = [
        m.generate("p", request_seed=None, cap=k, thinking=True, split_reasoning=False)
        for k in range(full.completion_tokens + 2)
    ]
    assert [c.completion_tokens for c in cuts] == [*range(full.completion_tokens + 1), full.completion_tokens]
    assert count_tokens(tokenizer, [c.content for c in cuts]) == [c.completion_tokens for c in cuts]
    # an answer that fills max_tokens exactly has no room left for its end-of-sequence token
    assert [c.finish_reason for c in cuts][-3:] == ["length", "length", "stop"]


def test_the_reasoning_parser_split_is_the_raw_text_without_tags():
    m = model()
    raw = m.generate("p", request_seed=None, cap=4096, thinking=True, split_reasoning=False)
    split = m.generate("p", request_seed=None, cap=4096, thinking=True, split_reasoning=True)
    assert raw.content == f"<think>\n{split.reasoning_content}\n</think>\n\n{split.content}"
    assert split.reasoning_tokens == len(split.reasoning_content.split()) + 4  # <think> \n ... \n </think>
    inside = m.generate("p", request_seed=None, cap=10, thinking=True, split_reasoning=True)
    assert (inside.content, inside.finish_reason, len(inside.reasoning_content.split())) == ("", "length", 8)


def test_same_prompt_same_answer_and_seeds_change_it():
    m = model(sigma=1.0)
    first = m.generate("same", request_seed=None, cap=4096, thinking=False, split_reasoning=False)
    assert m.generate("same", request_seed=None, cap=4096, thinking=False, split_reasoning=False) == first
    assert (
        model(sigma=1.0).generate("same", request_seed=None, cap=4096, thinking=False, split_reasoning=False)
        == first
    )
    assert m.generate("same", request_seed=7, cap=4096, thinking=False, split_reasoning=False) != first
    assert (
        model(sigma=1.0, seed=1).generate(
            "same", request_seed=None, cap=4096, thinking=False, split_reasoning=False
        )
        != first
    )


def test_lengths_are_lognormal_around_the_median():
    m = model(median_tokens=200, sigma=1.0, max_length=100_000)
    lengths = [
        m.generate(
            f"p{i}", request_seed=None, cap=100_000, thinking=False, split_reasoning=False
        ).completion_tokens
        for i in range(2000)
    ]
    assert statistics.median(lengths) == pytest.approx(200, rel=0.1)
    assert max(lengths) > 10 * 200  # the long tail is there


def test_answer_lengths_depend_on_the_source_marker_and_the_prompt_length():
    m = model(median_tokens=100, sigma=0.3, max_length=100_000,
              median_by_marker=(("[proof]", 1600), ("[chat]", 50)), prompt_exponent=1.0)

    def median(prefix, prompt_tokens=64):
        return statistics.median(
            m.generate(f"{prefix} question {i}", request_seed=None, cap=100_000, thinking=False,
                       split_reasoning=False, prompt_tokens=prompt_tokens).completion_tokens
            for i in range(400)
        )

    assert median("[proof]") == pytest.approx(1600, rel=0.1)
    assert median("[chat]") == pytest.approx(50, rel=0.1)
    assert median("[other]") == pytest.approx(100, rel=0.1)
    # Twice the prompt, twice the answer at exponent 1.
    assert median("[chat]", prompt_tokens=128) == pytest.approx(100, rel=0.1)


def test_phrase_effects_move_lengths_that_the_clients_word_features_cannot_tell_apart():
    """The same words in another order: the client's length features are the same, the answer
    lengths are not (phrases carry them); with word effects alone the order changes nothing."""
    words = [f"w{i}" for i in range(40)]
    by_phrases, by_words = model(phrase_sigma=0.8), model(word_sigma=0.8)
    moved = 0
    for i in range(0, 40, 4):
        text = " ".join(words[i:i + 4] + words[(i + 20) % 40:(i + 20) % 40 + 4])
        reordered = " ".join(reversed(text.split()))
        assert prompt_features([{"role": "user", "content": text}]) == prompt_features(
            [{"role": "user", "content": reordered}])

        def length(m, instruction):
            return m.generate(instruction, request_seed=None, cap=4096, thinking=False, split_reasoning=False,
                              instruction=instruction).completion_tokens

        assert length(by_words, text) == length(by_words, reordered)
        moved += length(by_phrases, text) != length(by_phrases, reordered)
    assert moved >= 5


def test_a_bad_output_bound_is_refused():
    with pytest.raises(ValueError, match="output_max_tokens must be None or >= 1, got 0"):
        SimServerConfig(output_max_tokens=0)


def test_a_bad_marker_median_is_refused():
    with pytest.raises(ValueError, match="output_median_by_marker"):
        SimServerConfig(output_median_by_marker=(("", 10),))
    assert SimServerConfig(output_median_by_marker=(("[a]", 10),)).output_median_by_marker == (("[a]", 10),)
