"""Topology loading: defaults, --set overrides, unknown keys, stage switching, start-up refusals."""

from __future__ import annotations

import pytest

from expstream.errors import ConfigError
from expstream.topology import STAGE_ORDER, load_topology


def test_default_topology_links_the_enabled_stages_in_order():
    topo = load_topology()
    names = [s.name for s in topo.enabled_stages()]
    # group_norm needs no critic (the seed forces critic_pretrain=None unless gae)
    assert names == [n for n in STAGE_ORDER if n != "critic"]
    assert topo.stages["generate"].input == "prompts"
    assert topo.stages["reward"].input == "reference"  # re-linked around the critic
    assert topo.output_topic == "experiences"
    assert set(topo.all_topics()) == {"prompts", "rollouts", "batches", "actor", "reference", "rewarded",
                                      "scored", "experiences"}


def test_gae_keeps_the_critic_and_zero_kl_drops_the_reference():
    topo = load_topology(overrides=["algo.advantage_estimator=gae", "algo.init_kl_coef=0"])
    names = [s.name for s in topo.enabled_stages()]
    assert "critic" in names and "reference" not in names
    assert topo.stages["critic"].input == "actor"


def test_set_parses_yaml_values():
    topo = load_topology(overrides=["algo.gamma=0.9", "stages.advantage.replicas=2", "algo.kl_target=null",
                                    "generate.skip_special_tokens=true"])
    assert topo.algo.gamma == 0.9
    assert topo.stages["advantage"].replicas == 2
    assert topo.algo.kl_target is None
    assert topo.generate.skip_special_tokens is True


@pytest.mark.parametrize("item, expected", [
    ("algo.gamam=0.9", "algo.gamma"),
    ("algoo.gamma=0.9", "algo"),
    ("stages.advantge.replicas=2", "stages.advantage"),
    ("kafka.session_timeout=10", "kafka.session_timeout_ms"),
])
def test_unknown_keys_name_the_closest_valid_one(item, expected):
    with pytest.raises(ConfigError) as err:
        load_topology(overrides=[item])
    assert expected in str(err.value)


def test_unknown_key_in_a_file_is_named(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("algo:\n  advantage_estimatr: gae\n")
    with pytest.raises(ConfigError, match=r"algo\.advantage_estimatr.*algo\.advantage_estimator"):
        load_topology(path)


@pytest.mark.parametrize("est", ["rloo", "group_norm", "grpo", "reinforce_baseline"])
def test_group_estimators_refuse_one_sample_per_prompt(est):
    with pytest.raises(ConfigError, match="n_samples_per_prompt") as err:
        load_topology(overrides=[f"algo.advantage_estimator={est}", "generate.n_samples_per_prompt=1"])
    assert "at least 2" in str(err.value)


def test_gae_without_critic_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="models.critic"):
        load_topology(overrides=["algo.advantage_estimator=gae", "models.critic=null"])


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match="algo.kl_estimator"):
        load_topology(overrides=["algo.kl_estimator=k4"])
    with pytest.raises(ConfigError, match="set dotted.key=value|dotted.key=value"):
        load_topology(overrides=["algo.gamma"])
