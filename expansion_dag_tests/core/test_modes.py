"""Mixes of generation modes: the seeded draw, each mode's identity, and a changed mix."""

import collections
import math

import pytest

from expansion_dag.config import ConfigError, parse_config
from expansion_dag.core import (
    DEFAULT_MODE,
    Identity,
    ModeError,
    ModeIdentities,
    ModeMix,
    parse_modes,
)
from expansion_dag_tests.helpers import default_sampling

BASE = default_sampling(temperature=0.7, chat_template_kwargs_json='{"enable_thinking": false}')
THINKING = [
    {"name": "thinking", "weight": 0.6, "chat_template_kwargs": {"enable_thinking": True}},
    {"name": "direct", "weight": 0.4},
]
IDS = [f"prompt-{i:05d}" for i in range(20_000)]


def test_a_run_without_modes_keeps_the_keys_it_always_had():
    mix = ModeMix.of([], BASE)
    identities = ModeIdentities(mix, "Qwen/Qwen3-8B", False)
    assert [m.name for m in mix.modes] == [DEFAULT_MODE]
    assert identities.for_prompt("p1") == Identity.of("Qwen/Qwen3-8B", False, BASE)
    assert identities.for_prompt("p1").key("p1") == BASE.key("p1", "Qwen/Qwen3-8B")


def test_each_prompt_is_drawn_into_one_mode_at_the_configured_shares_the_same_everywhere():
    mix = ModeMix.of(THINKING, BASE, seed=7)
    counts = collections.Counter(mix.names(IDS))
    # Binomial sampling error at n=20,000: sd = sqrt(0.24/20000) ~ 0.35%; allow 4 sd.
    assert abs(counts["thinking"] / len(IDS) - 0.6) < 4 * math.sqrt(0.24 / len(IDS))
    assert ModeMix.of(THINKING, BASE, seed=7).names(IDS) == mix.names(IDS)  # another process, same draw
    assert ModeMix.of(THINKING, BASE, seed=8).names(IDS) != mix.names(IDS)  # the seed is the draw's


def test_a_mode_changes_only_what_it_names_and_is_its_own_identity():
    thinking, direct = parse_modes(THINKING, BASE)
    assert thinking.chat_template_kwargs == {"enable_thinking": True}
    assert direct.sampling == BASE  # a mode naming nothing is the run's settings
    assert thinking.sampling.temperature == BASE.temperature
    identities = ModeIdentities(ModeMix([thinking, direct]), "m", False)
    assert identities.by_mode["thinking"].fingerprint != identities.by_mode["direct"].fingerprint


def test_a_changed_weight_moves_only_the_prompts_between_the_old_and_the_new_boundary():
    before = ModeMix.of(THINKING, BASE).names(IDS)
    after = ModeMix.of([{**THINKING[0], "weight": 0.5}, {**THINKING[1], "weight": 0.5}], BASE).names(IDS)
    moved = [(a, b) for a, b in zip(before, after) if a != b]
    assert set(moved) == {("thinking", "direct")}  # nobody moved the other way
    assert abs(len(moved) / len(IDS) - 0.1) < 0.01  # the 10 points between 0.5 and 0.6


def test_a_record_counts_for_the_mix_only_under_the_mode_its_prompt_is_drawn_into():
    mix = ModeMix.of(THINKING, BASE)
    identities = ModeIdentities(mix, "m", False)
    pid = IDS[0]
    drawn = mix.assign(pid).name
    other = next(name for name in identities.by_mode if name != drawn)
    record = {"prompt_id": pid, "key": identities.by_mode[other].key(pid)}
    assert identities.owns(record) and not identities.assigned(record)
    assert identities.mode_of(record) == other
    record["key"] = identities.by_mode[drawn].key(pid)
    assert identities.assigned(record)
    # A conversation's turns are drawn by their conversation's id.
    turn = {"prompt_id": f"{pid}.t2", "conversation_id": pid, "key": identities.by_mode[drawn].key(f"{pid}.t2")}
    assert identities.assigned(turn)


@pytest.mark.parametrize(
    ("modes", "problem"),
    [
        ([{"name": "a", "weight": 0}], "weight"),
        ([{"name": "A b", "weight": 1}], "name"),
        ([{"name": "a", "weight": 1}, {"name": "a", "weight": 1, "temperature": 0.1}], "names must differ"),
        ([{"name": "a", "weight": 1}, {"name": "b", "weight": 1}], "same settings"),
        ([{"name": "a", "weight": 1, "max_output_tokens": 10}], "unknown field"),
        ([{"name": "a", "weight": 1, "temperature": 9}], "temperature"),
    ],
)
def test_a_bad_mix_is_refused_naming_the_field(modes, problem):
    with pytest.raises(ModeError, match=problem):
        parse_modes(modes, BASE)


def test_the_run_configuration_takes_modes_as_a_list_and_refuses_bad_ones_naming_the_file():
    config = parse_config({"generation": {"modes": THINKING, "mode_seed": 3}}, where="run.yaml", env={})
    mix = config.generation.mix()
    assert [m.name for m in mix.modes] == ["thinking", "direct"] and mix.seed == 3
    assert config.masked()["generation"]["modes"][0]["name"] == "thinking"
    with pytest.raises(ConfigError, match="run.yaml.*weight"):
        parse_config({"generation": {"modes": [{"name": "a", "weight": -1}]}}, where="run.yaml", env={})
