"""Expected answer lengths learned per source and prompt-length bucket, the prior only a start."""

import pytest

from expansion_dag.generation import AnswerLengths, bucket_label, learn, prompt_bucket


def test_prompt_buckets_are_powers_of_two_above_64_tokens():
    assert [prompt_bucket(n) for n in (0, 63, 64, 127, 128, 1000)] == [0, 0, 64, 64, 128, 512]
    assert [bucket_label(b) for b in (0, 64, 512)] == ["<64", "64-127", "512-1023"]


def test_with_nothing_learned_the_typed_prior_is_the_estimate():
    estimate = AnswerLengths().estimate("a", 100, prior=700)
    assert (estimate.tokens, estimate.answers, estimate.basis) == (700, 0, "prior")


def test_many_answers_outweigh_a_wrong_prior_and_buckets_refine_the_source():
    lengths = AnswerLengths(prior_weight=8)
    for _ in range(200):
        lengths.observe("math", 100, 3000)   # short prompts, long answers
        lengths.observe("math", 1000, 1000)  # long prompts, shorter answers
    short = lengths.estimate("math", 90, prior=100)
    long = lengths.estimate("math", 900, prior=100)
    assert short.basis == "source+bucket" and short.answers == 200
    assert short.tokens == pytest.approx(3000, rel=0.05) and long.tokens == pytest.approx(1000, rel=0.05)
    # A bucket never seen takes its source's mean; another source keeps its prior.
    unseen = lengths.estimate("math", 5000, prior=100)
    assert unseen.basis == "source" and unseen.tokens == pytest.approx(2000, rel=0.03)
    assert lengths.estimate("chat", 90, prior=100).tokens == 100


def test_one_answer_moves_an_estimate_part_of_the_way_and_ten_nearly_all_of_it():
    lengths = AnswerLengths(prior_weight=2)
    lengths.observe("chat", 10, 8000)
    assert 2000 < lengths.estimate("chat", 10, prior=200).tokens < 6000
    for _ in range(9):
        lengths.observe("chat", 10, 8000)
    assert lengths.estimate("chat", 10, prior=200).tokens > 7500


def test_learning_from_store_records_keeps_one_identity_and_its_own_prompt_counts():
    records = [
        {"key": "mine", "source": "a", "local_prompt_tokens": 100, "prompt_tokens": 5000, "completion_tokens": 900},
        {"key": "other", "source": "a", "local_prompt_tokens": 100, "completion_tokens": 10},
        {"key": "mine", "source": "b", "prompt_tokens": 20, "completion_tokens": 30},  # older record: server count
    ]
    lengths = learn(records, owns=lambda r: r["key"] == "mine")
    assert lengths.answers == 2
    assert lengths.estimate("a", 100, prior=900).basis == "source+bucket"
    assert lengths.estimate("a", 100, prior=900).tokens == 900
    assert lengths.estimate("b", 20, prior=30).answers == 1


def test_a_loop_stopped_early_counts_at_the_tokens_it_streamed():
    records = [
        {"key": "k1", "source": "a", "local_prompt_tokens": 10, "status": "ok", "completion_tokens": 100},
        {"key": "k2", "source": "a", "local_prompt_tokens": 10, "status": "failed", "error": "degenerate",
         "streamed_tokens": 1900},
        {"key": "k3", "source": "a", "local_prompt_tokens": 10, "status": "failed", "error": "timeout"},
    ]
    lengths = learn(records, owns=lambda r: True)
    # Its slot spent 1,900 tokens on it: the source's answers cost 1,000 on average, not 100.
    assert lengths.answers == 2 and lengths.estimate("a", 10, prior=1000).tokens == 1000
